-- KEYS: (the lease), the job's journal of sent tries.
-- ARGV: (the token), the try's request id, its line and tenant (JSON).
if lease_lost() then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
