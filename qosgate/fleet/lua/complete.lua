-- ARGV: id, token, reply channel ('' for none), reply message, correction
-- of the tenant's counter ('' for none), then the tier args.
local id = ARGV[1]
tier_args(6)
if not holds(id, ARGV[2]) then return 0 end
-- Before the gateway hears of the end (and perhaps sends the session's
-- next turn).
give_slot_back(redis.call('HGET', KEYS[K_NODE], id))
if T.fair and ARGV[5] ~= '' then
  add_service(redis.call('HGET', KEYS[K_TIER], id), redis.call('HGET', KEYS[K_TENANT], id),
              ARGV[5])
end
local ended = redis.call('ZSCORE', KEYS[K_EXPIRY], id)
forget(id)
redis.call('ZADD', KEYS[K_DONE], ended, id)
if ARGV[3] ~= '' then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
return 1
