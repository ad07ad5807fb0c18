-- ARGV: id, now, only_queued (1/0), then the tier args. Returns 1 (was
-- queued), 2 (leased), 3 (completed) or 0 (unknown).
local id = ARGV[1]
tier_args(4)
local tier = redis.call('HGET', KEYS[K_TIER], id)
if tier then
  local was = 1
  if redis.call('HEXISTS', KEYS[K_HOLDER], id) == 1 then
    if ARGV[3] == '1' then return 2 end
    was = 2
  else
    unqueue(id, tier)
  end
  forget(id)
  redis.call('ZADD', KEYS[K_DONE], ARGV[2], id)
  return was
end
if redis.call('ZSCORE', KEYS[K_DONE], id) then return 3 end
return 0
