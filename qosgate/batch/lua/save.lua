-- KEYS: (the lease), the batch hash, the counts by status, the active set.
-- ARGV: (the token), status, doc, whether the status is active, the batch id.
if lease_lost() then return -1 end
local before = redis.call('HGET', KEYS[2], 'status')
if before ~= ARGV[2] then
  if before then redis.call('HINCRBY', KEYS[3], before, -1) end
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
end
redis.call('HSET', KEYS[2], 'status', ARGV[2], 'doc', ARGV[3])
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[4], redis.call('HGET', KEYS[2], 'seq'), ARGV[5])
else
  redis.call('ZREM', KEYS[4], ARGV[5])
end
return 1
