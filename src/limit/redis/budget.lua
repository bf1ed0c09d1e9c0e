-- The shared controller's record (KEYS[n], a hash: `v`, the Redis clock in µs at its
-- last change; `rate` and `ceiling`, per second, '' for none). A replica's change
-- (`p`: `base`, the version it was made on, `rate`, `ceiling`) is written only when
-- that version is still the record's: the version only goes up, and a change made on
-- an older one is dropped (its replica adopts the newer record instead). Returns the
-- record in force, or nil.
local function budget(key, now, p, ttl)
  local cur = redis.call('HMGET', key, 'v', 'rate', 'ceiling')
  if p and (p.base or '') == (cur[1] or '') then
    cur = { string.format('%.0f', now), p.rate or '', p.ceiling or '' }
    redis.call('HSET', key, 'v', cur[1], 'rate', cur[2], 'ceiling', cur[3])
  end
  if not cur[1] then return nil end
  redis.call('PEXPIRE', key, ttl)
  return { v = cur[1], rate = cur[2], ceiling = cur[3] }
end

