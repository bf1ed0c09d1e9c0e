local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
publish(KEYS[3], now)
local pause = tonumber(ARGV[7])
if ARGV[8] ~= '' then
  local keep = tonumber(ARGV[9])
  redis.call('ZADD', KEYS[2], now, string.format('%.0f:', now) .. ARGV[8])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now - keep))
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[10]) - 1)
  redis.call('PEXPIRE', KEYS[2], math.floor(keep / 1000) + 1000)
  -- The slots booked at least ARGV[12] µs ahead are checked again before they come, and
  -- left unused now that a request was refused: the learned rate's chain restarts after
  -- the slots that are not checked, not after those left unused.
  local interval = tonumber(redis.call('HGET', KEYS[3], 'interval') or 0)
  local restart = now + tonumber(ARGV[12]) + interval
  if interval > 0 and tonumber(redis.call('GET', KEYS[5]) or 0) > restart then
    redis.call('SET', KEYS[5], string.format('%.0f', restart), 'PX', math.floor((restart - now) / 1000) + 1000)
  end
  -- A probe meets the upstream's limit: the others wait through the pause and until
  -- the prober publishes what it learned (its next booking, typically the refused
  -- request's retry), or for a probe's time after the pause.
  local probe = tonumber(redis.call('HGET', KEYS[4], 'until') or 0)
  if probe > now then
    local ends = now + pause + tonumber(ARGV[11]) * 1000
    redis.call('HSET', KEYS[4], 'until', string.format('%.0f', ends))
    local ttl = math.floor((ends - now) / 1000) + 1000
    if redis.call('PTTL', KEYS[4]) < ttl then redis.call('PEXPIRE', KEYS[4], ttl) end
  end
end
local current = tonumber(redis.call('GET', KEYS[1]) or 0)
if now + pause > current then
  redis.call('SET', KEYS[1], string.format('%.0f', now + pause), 'PX', math.floor(pause / 1000) + 1000)
end
return 1
