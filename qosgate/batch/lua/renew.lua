-- KEYS: per job held, its lease and its batch hash.
-- ARGV: the lease's length in ms, then per job its driver's token.
-- Per job: -1 when its lease is no longer this driver's (it must stop), else
-- the lease is extended and the answer is when a cancel was asked (0: none).
local out = {}
for i = 1, #KEYS / 2 do
  local lease, batch, token = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i + 1]
  if redis.call('GET', lease) == token then
    redis.call('PEXPIRE', lease, ARGV[1])
    out[i] = tonumber(redis.call('HGET', batch, 'cancel_at') or '0')
  else
    out[i] = -1
  end
end
return out
