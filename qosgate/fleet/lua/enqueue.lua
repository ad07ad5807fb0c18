-- ARGV: id, tier, tenant, arrival, payload, attempt, max_queued (0: no
-- cap), wake channel, affinity key ('' for none), charge, lane member, work,
-- refused by admission (1/0: the caller's prediction), the id of the queued
-- item whose place it takes at its tier's door ('' for none: the caller's
-- choice, WorkQueue._place_for), the channel ('' for none) and message to
-- tell that one's gateway, its prompt's tokens, then the tier args.
-- Returns 1, 0 (duplicate), -1 (full), -2 (refused by admission) or -3 (the
-- item whose place it was to take is no longer queued as it was chosen).
local id = ARGV[1]
tier_args(18)
if redis.call('HEXISTS', KEYS[K_TIER], id) == 1
    or redis.call('ZSCORE', KEYS[K_DONE], id) then
  return 0
end
local cap = tonumber(ARGV[7])
if cap > 0 and redis.call('ZCARD', T.q[ARGV[2]]) >= cap then
  return -1
end
if ARGV[13] == '1' then return -2 end
local taken = ARGV[14]
if taken ~= '' then
  -- Chosen from a read a moment ago: only if it is still queued there, and
  -- has not run since (a re-queued item keeps its place).
  if not redis.call('ZSCORE', T.q[ARGV[2]], taken)
      or tonumber(redis.call('HGET', KEYS[K_ATTEMPT], taken)) ~= 0 then
    return -3
  end
  unqueue(taken, ARGV[2])
  forget(taken)
  redis.call('ZADD', KEYS[K_DONE], ARGV[4], taken)
  if ARGV[15] ~= '' then redis.call('PUBLISH', ARGV[15], ARGV[16]) end
end
redis.call('HSET', KEYS[K_TIER], id, ARGV[2])
redis.call('HSET', KEYS[K_TENANT], id, ARGV[3])
redis.call('HSET', KEYS[K_ARRIVAL], id, ARGV[4])
redis.call('HSET', KEYS[K_PAYLOAD], id, ARGV[5])
redis.call('HSET', KEYS[K_ATTEMPT], id, ARGV[6])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[K_AFFKEY], id, ARGV[9]) end
redis.call('HSET', KEYS[K_CHARGE], id, ARGV[10])
redis.call('HSET', KEYS[K_LANE], id, ARGV[11])
redis.call('HSET', KEYS[K_WORK], id, ARGV[12])
redis.call('HSET', KEYS[K_PROMPT], id, ARGV[17])
push(id)
inflow_add(ARGV[2], tonumber(ARGV[12]), ARGV[4])
-- Names the tier, so that a full node can tell whether to preempt for it.
redis.call('PUBLISH', ARGV[8], 'q:' .. ARGV[2])
return 1
