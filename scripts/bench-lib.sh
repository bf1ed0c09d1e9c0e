# Shared by the bash benchmarks (bench-forward-cpu; sourced, not
# run): the configurations they give tollgate and nginx, so that "queued at R/s" means the
# same in both, and the same as peers.sh's `tollgate-limit` and `nginx-limit`.

# tollgate_config PORT [RATE]: tollgate on 127.0.0.1:PORT in forward mode. Without RATE
# every request goes through an unlimited [defaults] group (the throttle layer in the
# path); with RATE through one [[limit]] for 127.0.0.1 at RATE/s with `burst = 1` and
# room for everyone (queue 1000000, max_wait 600 s), so that every request queues.
tollgate_config() {
  if [ -n "${2:-}" ]; then
    printf '[proxy]\nlisten = "127.0.0.1:%s"\n[[limit]]\nname = "bench"\nhosts = ["127.0.0.1"]\nrate = "%s/s"\nburst = 1\nconcurrency = 100000\nqueue = 1000000\nmax_wait = "600s"\n[access]\nallow = ["127.0.0.0/8", "::1"]\n' \
      "$1" "$2"
  else
    printf '[proxy]\nlisten = "127.0.0.1:%s"\n[defaults]\nrate = "unlimited"\nconcurrency = 100000\n[access]\nallow = ["127.0.0.0/8", "::1"]\n' "$1"
  fi
}

# nginx_limit [RATE]: sets `limit_zone` (for nginx's http block) and `limit_req` (for its
# location) to peers.sh's nginx-limit at RATE r/s: every request delayed to the rate,
# none refused; both empty without RATE. Such an nginx must log at `error`, not `warn`:
# limit_req logs every delayed request at warn, a write per request.
nginx_limit() {
  limit_zone="" limit_req=""
  if [ -n "${1:-}" ]; then
    limit_zone="limit_req_zone \$server_addr zone=global:1m rate=${1}r/s; limit_req_status 503;"
    limit_req="limit_req zone=global burst=100000;"
  fi
}

# An awk function for the scripts' medians, to put in front of an awk program:
# median(list) of a space-separated list of numbers. Sorted by hand: mawk, Debian's
# default awk, has no asort.
awk_median='
  function median(list,   v, n, i, j, x, k) {
    n = split(list, v, " ")
    for (i = 2; i <= n; i++) {
      x = v[i] + 0
      for (j = i - 1; j >= 1 && v[j] + 0 > x; j--) v[j + 1] = v[j]
      v[j + 1] = x
    }
    k = int((n + 1) / 2)
    return (n % 2) ? v[k] : (v[k] + v[k + 1]) / 2
  }'
