-- Publishes the learned state in ARGV[1..6] to the hash `key`: its interval in µs
-- (empty: nothing to publish), base, factor and source; how long the hash lives, in ms;
-- its precedence (`Precedence::code`). The state published less than a second before
-- holds when the precedence says so.
local function publish(key, now)
  if ARGV[1] ~= '' then
    local old = redis.call('HMGET', key, 'interval', 'at')
    local recent = old[1] and old[2] and now - tonumber(old[2]) < 1000000
    local faster = recent and tonumber(ARGV[1]) < tonumber(old[1])
    local slower = recent and tonumber(ARGV[1]) > tonumber(old[1])
    if not ((ARGV[6] == '1' and faster) or (ARGV[6] == '2' and slower)) then
      redis.call('HSET', key, 'interval', ARGV[1], 'base', ARGV[2], 'factor', ARGV[3], 'source', ARGV[4], 'at', string.format('%.0f', now))
    end
  end
  redis.call('PEXPIRE', key, tonumber(ARGV[5]))
end

