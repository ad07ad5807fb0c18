-- ARGV: node, wake channel, then the tier args.
tier_args(3)
local before = tonumber(redis.call('HGET', KEYS[K_ROOM], ARGV[1]) or '0')
redis.call('HDEL', KEYS[K_ROOM], ARGV[1])
redis.call('HDEL', KEYS[K_RATE], ARGV[1])
redis.call('HDEL', KEYS[K_PHELD], ARGV[1])
redis.call('ZREM', KEYS[K_SEEN], ARGV[1])
wake_if_full(before, 0, ARGV[2])
