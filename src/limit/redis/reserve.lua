local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[7])
publish(KEYS[2], now)
local learned = redis.call('HMGET', KEYS[2], 'interval', 'base', 'factor', 'source')
local interval = tonumber(learned[1] or 0) or 0
local window = tonumber(ARGV[8])
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
if paused > now then
  return { paused - now, paused - now, learned[2], learned[3], learned[4], 0, 0, now }
end
local depart = now
local tats = {}
for i = 6, #KEYS do
  tats[i] = tonumber(redis.call('GET', KEYS[i]) or 0)
  depart = math.max(depart, tats[i] - tonumber(ARGV[2 * i - 1]))
end
local learned_tat = 0
if interval > 0 then
  learned_tat = tonumber(redis.call('GET', KEYS[3]) or 0)
  depart = math.max(depart, learned_tat)
end
for i = 6, #KEYS do
  local tat = math.max(tats[i], depart) + cost * tonumber(ARGV[2 * i - 2])
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
return { depart - now, paused - now, learned[2], learned[3], learned[4], booked, refused, now }
