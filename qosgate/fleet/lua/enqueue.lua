-- ARGV: id, tier, tenant, arrival, payload, attempt, max_queued (0: no
-- cap), wake channel, affinity key ('' for none), charge, lane member, work,
-- refused by admission (1/0: the caller's prediction), then the tier args.
-- Returns 1, 0 (duplicate), -1 (full) or -2 (refused by admission).
local id = ARGV[1]
tier_args(14)
if redis.call('HEXISTS', KEYS[K_TIER], id) == 1
    or redis.call('ZSCORE', KEYS[K_DONE], id) then
  return 0
end
local cap = tonumber(ARGV[7])
if cap > 0 and redis.call('ZCARD', T.q[ARGV[2]]) >= cap then
  return -1
end
if ARGV[13] == '1' then return -2 end
redis.call('HSET', KEYS[K_TIER], id, ARGV[2])
redis.call('HSET', KEYS[K_TENANT], id, ARGV[3])
redis.call('HSET', KEYS[K_ARRIVAL], id, ARGV[4])
redis.call('HSET', KEYS[K_PAYLOAD], id, ARGV[5])
redis.call('HSET', KEYS[K_ATTEMPT], id, ARGV[6])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[K_AFFKEY], id, ARGV[9]) end
redis.call('HSET', KEYS[K_CHARGE], id, ARGV[10])
redis.call('HSET', KEYS[K_LANE], id, ARGV[11])
redis.call('HSET', KEYS[K_WORK], id, ARGV[12])
push(id)
inflow_add(ARGV[2], tonumber(ARGV[12]), ARGV[4])
-- Names the tier, so that a full node can tell whether to preempt for it.
redis.call('PUBLISH', ARGV[8], 'q:' .. ARGV[2])
return 1
