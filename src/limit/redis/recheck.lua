-- Whether a slot booked at ARGV[1] (µs on Redis's clock) still holds. KEYS: pause,
-- refused. Returns `protocol::Rechecked` as JSON: the µs of pause left (≤ 0: none) and
-- the refusals recorded since the booking.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
local refused = redis.call('ZCOUNT', KEYS[2], '(' .. ARGV[1], '+inf')
return cjson.encode({ paused = paused - now, refused = refused })
