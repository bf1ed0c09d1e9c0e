"""An upstream limited by Flask-Limiter, as an app would configure it: one key for every
caller, LIMIT (its own notation, e.g. `5/second`) with STRATEGY (`fixed-window`,
`moving-window`, `sliding-window-counter`) and its headers on. Prints
`listening <port>`, then `<CLOCK_MONOTONIC ns> <status>` for every request as it is
answered (the time is its arrival). Loopback only.

    python3 flask-limiter-upstream.py LIMIT STRATEGY
"""

import sys
import time

from flask import Flask
from flask_limiter import Limiter
from werkzeug.serving import make_server

limit, strategy = sys.argv[1], sys.argv[2]
app = Flask(__name__)
Limiter(
    key_func=lambda: "every caller",
    app=app,
    default_limits=[limit],
    strategy=strategy,
    headers_enabled=True,
    storage_uri="memory://",
)


@app.route("/", defaults={"path": ""})
@app.route("/<path:path>")
def ok(path):
    return "ok"


inner = app.wsgi_app


def logged(environ, start_response):
    arrived = time.monotonic_ns()

    def start(status, headers, exc_info=None):
        print(f"{arrived} {status.split()[0]}", flush=True)
        return start_response(status, headers, exc_info)

    return inner(environ, start)


app.wsgi_app = logged
server = make_server("127.0.0.1", 0, app, threaded=True)
print(f"listening {server.server_port}", flush=True)
server.serve_forever()
