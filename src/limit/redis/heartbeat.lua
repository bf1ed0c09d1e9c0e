local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + tonumber(ARGV[3]), ARGV[i + 2])
  redis.call('PEXPIRE', KEYS[i], 2 * tonumber(ARGV[3]))
end
return redis.call('ZCARD', KEYS[1])
