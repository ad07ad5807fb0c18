-- KEYS: a job's lease. ARGV: the driver's token.
-- Deleted only while it is still that driver's (a lease taken over is not
-- another's to end).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
