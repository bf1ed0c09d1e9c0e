-- Renews this replica's leases of one group: each id in ARGV[2..] that is still in the
-- lease set (KEYS[1]) lives ARGV[1] ms more. One group's set per call, so that in a
-- cluster the call touches one slot.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return 'ok'
