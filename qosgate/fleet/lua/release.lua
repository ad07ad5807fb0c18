-- ARGV: id, token, then the tier args.
tier_args(3)
if not holds(ARGV[1], ARGV[2]) then return 0 end
requeue(ARGV[1])
return 1
