local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[7])
publish(KEYS[2], now)
local learned = redis.call('HMGET', KEYS[2], 'interval', 'base', 'factor', 'source')
local interval = tonumber(learned[1] or 0) or 0
local window = tonumber(ARGV[8])
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
if paused > now then
  return { paused - now, paused - now, learned[2], learned[3], learned[4], 0, 0, now, 0 }
end
-- One replica probes for a group that has no rate yet: the first to ask while its
-- own probe is on. The others wait until it has learned a rate or its probe is over;
-- then theirs is over too.
local probe = 0
if interval == 0 and #KEYS == 6 then
  local prober = redis.call('HMGET', KEYS[6], 'id', 'until')
  local on = prober[1] and now < tonumber(prober[2])
  local mine = prober[1] == ARGV[10]
  if on and mine and ARGV[11] ~= '1' then
    -- The prober's own probe ended: so does the group's.
    redis.call('HSET', KEYS[6], 'until', string.format('%.0f', now))
  elseif on and mine then
    -- Still probing for the group.
    probe = 1
  elseif on and ARGV[11] == '1' then
    -- Another replica probes: nothing booked; the time left, negative.
    return { 0, 0, learned[2], learned[3], learned[4], 0, 0, now, now - tonumber(prober[2]) }
  elseif prober[1] and ARGV[11] == '1' then
    -- The group's probe is over: so is this replica's.
    probe = 2
  elseif ARGV[11] == '1' then
    -- No probe yet: this replica probes for the group.
    local ends = now + tonumber(ARGV[12]) * 1000
    redis.call('HSET', KEYS[6], 'id', ARGV[10], 'until', string.format('%.0f', ends))
    redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[5]))
    probe = 1
  end
end
local depart = now
local tats = {}
for i = 7, #KEYS do
  tats[i] = tonumber(redis.call('GET', KEYS[i]) or 0)
  depart = math.max(depart, tats[i] - tonumber(ARGV[2 * i]))
end
local learned_tat = 0
if interval > 0 then
  learned_tat = tonumber(redis.call('GET', KEYS[3]) or 0)
  depart = math.max(depart, learned_tat)
end
for i = 7, #KEYS do
  local tat = math.max(tats[i], depart) + cost * tonumber(ARGV[2 * i - 1])
  redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', math.floor((tat - now) / 1000) + 1000)
end
if interval > 0 then
  local tat = math.max(learned_tat, depart) + cost * interval
  redis.call('SET', KEYS[3], string.format('%.0f', tat), 'PX', math.floor((tat - now) / 1000) + 1000)
end
local booked, refused = 0, 0
if window > 0 then
  refused = redis.call('ZCOUNT', KEYS[5], string.format('(%.0f', now - window), '+inf')
  redis.call('ZADD', KEYS[4], depart, string.format('%.0f:%.0f', depart, now))
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', string.format('%.0f', depart - window))
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -tonumber(ARGV[9]) - 1)
  redis.call('PEXPIRE', KEYS[4], math.floor((depart - now + window) / 1000) + 1000)
  booked = redis.call('ZCARD', KEYS[4])
  if booked >= tonumber(ARGV[9]) then booked = 0 end
end
return { depart - now, paused - now, learned[2], learned[3], learned[4], booked, refused, now, probe }
