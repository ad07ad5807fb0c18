-- KEYS: the batch hash. ARGV: when the cancel was asked.
-- Noted for the job's driver (it reads it at its next renewal, or when it
-- takes the job over) while the job has not begun to end; 0 once it has.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'validating' and status ~= 'in_progress' then return 0 end
redis.call('HSETNX', KEYS[1], 'cancel_at', ARGV[1])
return 1
