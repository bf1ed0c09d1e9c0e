"""An upstream limited by Flask-Limiter, as an app would configure it: LIMIT (its own
notation, e.g. `5/second`) with STRATEGY (`fixed-window`, `moving-window`,
`sliding-window-counter`) and its headers on; one key for every caller, or with
`--per-authorization` one key per `Authorization` header (as APIs limit each token).
Prints `listening <port>`, then `<CLOCK_MONOTONIC ns> <status> <key>` for every
request as it is answered (the time is its arrival). Loopback only.

    python3 flask-limiter-upstream.py LIMIT STRATEGY [--per-authorization]
"""

import sys
import time

from flask import Flask, request
from flask_limiter import Limiter
from werkzeug.serving import make_server

limit, strategy = sys.argv[1], sys.argv[2]
per_authorization = "--per-authorization" in sys.argv[3:]


def key():
    if per_authorization:
        return request.headers.get("Authorization", "none")
    return "every caller"


app = Flask(__name__)
Limiter(
    key_func=key,
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
    caller = environ.get("HTTP_AUTHORIZATION", "-").replace(" ", "_")

    def start(status, headers, exc_info=None):
        print(f"{arrived} {status.split()[0]} {caller}", flush=True)
        return start_response(status, headers, exc_info)

    return inner(environ, start)


app.wsgi_app = logged
server = make_server("127.0.0.1", 0, app, threaded=True)
print(f"listening {server.server_port}", flush=True)
server.serve_forever()
