-- Books the next slot of a group for every replica: the Redis form of gcra.rs (µs on
-- Redis's clock), with the group's pause, its shared pace, and at most `quota`
-- departures in any `span` of an announced window. KEYS: pause, budget, rate:learned,
-- booked, probe, then one TAT per configured rate. ARGV[1]: `protocol::Reserve` as
-- JSON. Returns `protocol::Reserved` as JSON.
local req = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local answer = { wait = 0, paused = 0, stamp = string.format('%.0f', now), probe = 'no', probe_left = 0 }
answer.shared = budget(KEYS[2], now, req.publish, req.ttl_ms)
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
if paused > now then
  answer.paused = paused - now
  return cjson.encode(answer)
end
-- One replica probes for a group that has learned nothing yet: the first to ask while
-- its own probe is on. The others wait until it has learned or its probe is over;
-- then theirs is over too.
if not req.learned and not answer.shared then
  local prober = redis.call('HMGET', KEYS[5], 'id', 'until')
  local on = prober[1] and now < tonumber(prober[2])
  local mine = prober[1] == req.id
  if on and mine and not req.probing then
    redis.call('HSET', KEYS[5], 'until', string.format('%.0f', now))
  elseif on and mine then
    answer.probe = 'group'
  elseif on and req.probing then
    answer.probe = 'elsewhere'
    answer.probe_left = tonumber(prober[2]) - now
    return cjson.encode(answer)
  elseif prober[1] and req.probing then
    answer.probe = 'over'
  elseif req.probing then
    redis.call('HSET', KEYS[5], 'id', req.id, 'until', string.format('%.0f', now + req.probe_ms * 1000))
    redis.call('PEXPIRE', KEYS[5], req.ttl_ms)
    answer.probe = 'group'
  end
end
-- Earliest: every rate's TAT less its tolerance, the pace's TAT, the window, and the
-- floor of a replica back from its local rates (what it sent meanwhile is not here).
local depart = now + (req.floor or 0)
local tats = {}
for i, rate in ipairs(req.rates) do
  tats[i] = tonumber(redis.call('GET', KEYS[5 + i]) or 0)
  depart = math.max(depart, tats[i] - rate[2])
end
local pace_tat = 0
if req.pace > 0 then
  pace_tat = tonumber(redis.call('GET', KEYS[3]) or 0)
  depart = math.max(depart, pace_tat)
end
-- The window is the group's: one replica's announcement holds every replica's
-- bookings, those of replicas that have not heard it yet too, and its length is the
-- longest any replica read (a reading is a bound from below: budget/window.rs).
local window = req.window
local stored = redis.call('HMGET', KEYS[2], 'wq', 'ws')
if window then
  window = { window[1], math.max(window[2], tonumber(stored[2] or 0)) }
  redis.call('HSET', KEYS[2], 'wq', window[1], 'ws', window[2])
  redis.call('PEXPIRE', KEYS[2], req.ttl_ms)
elseif stored[1] then
  window = { tonumber(stored[1]), tonumber(stored[2]) }
end
if window then
  local q = window[1]
  local oldest = redis.call('ZREVRANGE', KEYS[4], q - 1, q - 1, 'WITHSCORES')
  if oldest[2] then depart = math.max(depart, tonumber(oldest[2]) + window[2]) end
end
-- Departs at `depart`: every TAT advances from there.
local function advance(key, tat, interval)
  local next = math.max(tat, depart) + req.cost * interval
  redis.call('SET', key, string.format('%.0f', next), 'PX', math.floor((next - now) / 1000) + 1000)
end
for i, rate in ipairs(req.rates) do advance(KEYS[5 + i], tats[i], rate[1]) end
if req.pace > 0 then advance(KEYS[3], pace_tat, req.pace) end
-- Every booking is kept (a quota's worth, 64 at least), so that the departures
-- before a window was announced count in it too.
redis.call('ZADD', KEYS[4], depart, string.format('%.0f:%s', now, req.id))
redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -math.max(window and window[1] or 0, 64) - 1)
redis.call('PEXPIRE', KEYS[4], math.floor((depart - now + (window and window[2] or 0)) / 1000) + 1000)
answer.wait = depart - now
return cjson.encode(answer)
