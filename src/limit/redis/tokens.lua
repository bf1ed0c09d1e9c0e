-- A group's configured token buckets (docs/tokens.md), shared by every replica: GCRA
-- on Redis's clock, in µs. KEYS[i]: bucket i's TAT, all under the group's hash tag.
-- ARGV[1]: "take" or "settle"; then three numbers per bucket: tokens (take: the
-- estimate; settle: the usage minus the estimate, signed), µs per token, capacity.
-- take: when every bucket has room for its tokens, takes them all and answers 0; else
-- answers the µs until they would fit, and takes nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local take = ARGV[1] == 'take'
local tats, wait = {}, 0
for i, key in ipairs(KEYS) do
  local n, per, cap = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local tat = tonumber(redis.call('GET', key) or now)
  if take then
    local fits = tat + (math.min(n, cap) - cap) * per
    wait = math.max(wait, fits - now)
    tats[i] = math.max(tat, now) + n * per
  elseif n > 0 then
    tats[i] = math.max(tat, now) + n * per
  else
    tats[i] = math.max(tat + n * per, now)
  end
end
if wait > 0 then
  return math.ceil(wait)
end
for i, key in ipairs(KEYS) do
  local left = tats[i] - now
  if left > 0 then
    -- Gone once the bucket is full again.
    redis.call('SET', key, string.format('%d', tats[i]), 'PX', math.ceil(left / 1000) + 1000)
  else
    redis.call('DEL', key)
  end
end
return 0
