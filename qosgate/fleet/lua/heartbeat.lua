-- ARGV: node, room, live until, wake channel, drain rate (milli), then the
-- tier args.
tier_args(6)
set_room(ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[5], ARGV[4])
