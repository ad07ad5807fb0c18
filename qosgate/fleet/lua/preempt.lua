-- ARGV: id, token, now, then the tier args. As MemoryWorkQueue.preempt.
local id = ARGV[1]
tier_args(4)
if not holds(id, ARGV[2]) then return 0 end
local mine = T.prio[redis.call('HGET', KEYS[K_TIER], id)]
local urgent = 0
for i = 1, T.n do
  if T.prio[T.names[i]] < mine then urgent = urgent + redis.call('ZCARD', T.q[T.names[i]]) end
end
local _, room = live_load(ARGV[3])
if urgent <= room then return 0 end
local holder = redis.call('HGET', KEYS[K_NODE], id)
requeue(id)
give_slot_back(holder)
return 1
