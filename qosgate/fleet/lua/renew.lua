-- ARGV: id, token, expires_at, then the tier args.
if not holds(ARGV[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[K_EXPIRY], 'XX', ARGV[3], ARGV[1])
return 1
