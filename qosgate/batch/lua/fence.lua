-- Prepended to the writes a job's driver makes (qosgate/batch/redis_store.py):
-- KEYS[1] is the job's lease and ARGV[1] the driver's token ('' for a write
-- made outside any lease, as when the job is created). The write lands only
-- while the lease is still that driver's; otherwise the script returns -1:
-- another replica drives the job now, and a stale driver must not move it.
local function lease_lost()
  return ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1]
end
