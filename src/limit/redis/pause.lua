-- Extends a group's pause on every replica and, for the upstream's refusal, records
-- it (a slot booked before it is checked again: recheck.lua). Publishes this replica's
-- change of the shared pace at once, before more requests are booked at the pace
-- refused. KEYS: pause, refused, budget, probe. ARGV[1]: `protocol::Pause` as JSON.
local req = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
budget(KEYS[3], now, req.publish, req.ttl_ms)
if req.refusal then
  redis.call('ZADD', KEYS[2], now, string.format('%.0f:', now) .. req.refusal)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now - req.keep_us))
  redis.call('PEXPIRE', KEYS[2], math.floor(req.keep_us / 1000) + 1000)
  -- A probe that meets the upstream's limit: the others wait through the pause, and
  -- until the prober publishes what it learned, or for a probe's time after it.
  local probe = tonumber(redis.call('HGET', KEYS[4], 'until') or 0)
  if probe > now then
    local ends = now + req.pause_us + req.probe_ms * 1000
    redis.call('HSET', KEYS[4], 'until', string.format('%.0f', ends))
    local ttl = math.floor((ends - now) / 1000) + 1000
    if redis.call('PTTL', KEYS[4]) < ttl then redis.call('PEXPIRE', KEYS[4], ttl) end
  end
end
local current = tonumber(redis.call('GET', KEYS[1]) or 0)
if now + req.pause_us > current then
  redis.call('SET', KEYS[1], string.format('%.0f', now + req.pause_us), 'PX', math.floor(req.pause_us / 1000) + 1000)
end
return 'ok'
