-- ARGV: id, token, now, then the tier args. As MemoryWorkQueue.preempt; it
-- restates core.ordering.preemption_needed, atomic with the requeue
-- (tests/test_fleet_rules_differential.py).
local id = ARGV[1]
tier_args(4)
if not holds(id, ARGV[2]) then return 0 end
local mine = T.prio[redis.call('HGET', KEYS[K_TIER], id)]
local urgent = 0
for i = 1, T.n do
  if T.prio[T.names[i]] < mine then urgent = urgent + redis.call('ZCARD', T.q[T.names[i]]) end
end
local room = 0
for _, node in ipairs(redis.call('ZRANGEBYSCORE', KEYS[K_SEEN], '(' .. ARGV[3], '+inf')) do
  room = room + tonumber(redis.call('HGET', KEYS[K_ROOM], node) or '0')
end
if not (urgent > room) then return 0 end
local holder = redis.call('HGET', KEYS[K_NODE], id)
requeue(id)
give_slot_back(holder)
return 1
