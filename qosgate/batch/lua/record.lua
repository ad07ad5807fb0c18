-- KEYS: (the lease), the batch hash, the results hash, the results index.
-- ARGV: (the token), line number, the result (JSON), "completed" or "failed".
-- A line's first result counts: its counter moves with it; a second is ignored.
if lease_lost() then return -1 end
if redis.call('HSETNX', KEYS[3], ARGV[2], ARGV[3]) == 1 then
  redis.call('ZADD', KEYS[4], ARGV[2], ARGV[2])
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
end
return 1
