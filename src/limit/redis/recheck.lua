local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
local refused = redis.call('ZCOUNT', KEYS[2], '(' .. ARGV[1], '+inf')
return { paused - now, refused }
