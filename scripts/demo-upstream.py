#!/usr/bin/env python3
"""A demo upstream for the README: allows one request per second, answers
`429 Too Many Requests` with `Retry-After: 1` to anything faster.

    python3 scripts/demo-upstream.py [port] [address]   # default 18099 on 127.0.0.1

(compose.yaml runs it on 0.0.0.0 inside its own network.)
"""
import http.server
import sys
import threading
import time

lock = threading.Lock()
next_allowed = [0.0]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with lock:
            now = time.monotonic()
            allowed = now >= next_allowed[0]
            if allowed:
                next_allowed[0] = now + 1.0
        status, body = (200, b"ok\n") if allowed else (429, b"too many requests\n")
        self.send_response(status)
        if not allowed:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


port = int(sys.argv[1]) if len(sys.argv) > 1 else 18099
address = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
http.server.ThreadingHTTPServer((address, port), Handler).serve_forever()
