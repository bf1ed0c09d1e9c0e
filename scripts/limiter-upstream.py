#!/usr/bin/env python3
"""Loopback upstreams that limit like the common rate-limiter families.

    python3 scripts/limiter-upstream.py FAMILY PORT LIMIT LOGFILE

Serves HTTP/1.1 (keep-alive) on 127.0.0.1:PORT and allows LIMIT requests per second
the way FAMILY does; every answer carries a `Date` header. Standard library only.

  fixed    fixed 1 s windows on the Unix second; every answer has
           `X-RateLimit-Limit/Remaining/Reset` (Reset: the Unix time the window ends);
           a refusal is `429` with `Retry-After: 1` (like express-rate-limit, GitHub);
  sliding  a sliding 1 s window over the accepted requests (a log, like
           limits' moving window); a refusal is `429` + `Retry-After: 1`, no other
           header says anything;
  gcra     GCRA / token bucket of LIMIT per second with a burst of LIMIT (like
           redis-cell, throttled); only a refusal says anything: `429` +
           `Retry-After` in whole seconds, rounded up;
  ietf     fixed 1 s windows announced with `RateLimit-Policy: "default";q=LIMIT;w=1`
           and `RateLimit: "default";r=<remaining>;t=<seconds to reset, rounded up>`;
           a refusal is `429` with those headers and no `Retry-After`;
  strict   a bare `429` (no header) for a request that arrives less than 1/LIMIT
           after the last accepted one (a GCRA without burst, strictly enforced).

A refused request does not count against the budget. LOGFILE gets one line per
request, `<CLOCK_MONOTONIC ns> <status> <path>`, flushed per line. SIGTERM stops it.

Also importable (`Limiter(family, limit).decide(now_monotonic_s, now_unix_s)`), which
is how scripts/bench-learn and the integration tests use the same decisions.
"""

import asyncio
import collections
import email.utils
import math
import signal
import socket
import sys
import time

FAMILIES = ("fixed", "sliding", "gcra", "ietf", "strict")


class Limiter:
    """One family's decision for one request: (status, [(header, value)])."""

    def __init__(self, family, limit):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
        self.family, self.limit = family, limit
        self.window, self.count = None, 0  # fixed, ietf
        self.accepted = collections.deque()  # sliding
        self.tat = 0.0  # gcra
        self.last = None  # strict

    def decide(self, mono, unix):
        f, limit = self.family, self.limit
        if f in ("fixed", "ietf"):
            window = math.floor(unix)
            if window != self.window:
                self.window, self.count = window, 0
            ok = self.count < limit
            if ok:
                self.count += 1
            remaining = limit - self.count
            reset_at = window + 1
            if f == "fixed":
                headers = [
                    ("X-RateLimit-Limit", str(limit)),
                    ("X-RateLimit-Remaining", str(remaining)),
                    ("X-RateLimit-Reset", str(reset_at)),
                ]
                if not ok:
                    headers.append(("Retry-After", "1"))
            else:
                t = max(1, math.ceil(reset_at - unix))
                headers = [
                    ("RateLimit-Policy", f'"default";q={limit};w=1'),
                    ("RateLimit", f'"default";r={remaining};t={t}'),
                ]
            return (200 if ok else 429), headers
        if f == "sliding":
            while self.accepted and self.accepted[0] <= mono - 1.0:
                self.accepted.popleft()
            if len(self.accepted) < limit:
                self.accepted.append(mono)
                return 200, []
            return 429, [("Retry-After", "1")]
        if f == "gcra":
            interval = 1.0 / limit
            tolerance = interval * (limit - 1)
            tat = max(self.tat, mono)
            wait = tat - tolerance - mono
            if wait <= 1e-9:
                self.tat = tat + interval
                return 200, []
            return 429, [("Retry-After", str(max(1, math.ceil(wait))))]
        # strict
        if self.last is None or mono - self.last >= 1.0 / limit:
            self.last = mono
            return 200, []
        return 429, []


class _Protocol(asyncio.Protocol):
    def __init__(self, limiter, out):
        self.limiter, self.out = limiter, out
        self.buf = b""

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            path = head.split(b" ", 2)[1].decode(errors="replace") if b" " in head else "?"
            mono_ns = time.monotonic_ns()
            status, headers = self.limiter.decide(mono_ns / 1e9, time.time())
            body = b"ok" if status == 200 else b"slow down"
            lines = [
                f"HTTP/1.1 {status} {'OK' if status == 200 else 'Too Many Requests'}",
                f"Date: {email.utils.formatdate(usegmt=True)}",
                "Content-Type: text/plain",
                f"Content-Length: {len(body)}",
            ] + [f"{k}: {v}" for k, v in headers]
            self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            self.out.write(f"{mono_ns} {status} {path}\n")


def serve(family, port, limit, logfile):
    async def main():
        out = open(logfile, "w", buffering=1)
        limiter = Limiter(family, limit)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        server = await loop.create_server(
            lambda: _Protocol(limiter, out), "127.0.0.1", port, backlog=1024
        )
        await stop
        server.close()
        out.close()

    asyncio.run(main())


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
