"""Shared parts of the scripts/bench-* benchmarks (Python 3.9+, standard library only).

Loaded by path (the name has a dash), e.g.::

    lib = load_lib()   # see the top of scripts/bench-accuracy

Also runnable on its own as the loopback upstream the benchmarks use::

    python3 scripts/bench-lib.py upstream PORT OUTFILE

which answers every request with `200 ok` (keep-alive) and writes one line per request,
`<CLOCK_MONOTONIC ns when the request head was complete> <path>`, to OUTFILE.

Everything here talks to 127.0.0.1 only, and every wait is bounded.
"""

import asyncio
import json
import math
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINARY = ROOT / "target" / "release" / "tollgate"


# ------------------------------------------------------------------------------------
# The upstream
# ------------------------------------------------------------------------------------


class _Upstream(asyncio.Protocol):
    """Minimal HTTP/1.1 server for bodiless requests: timestamp, then `200 ok`."""

    def __init__(self, out):
        self.out = out
        self.buf = b""
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data):
        # First thing: the time the bytes completing a request head were handed to us.
        now = time.monotonic_ns()
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            parts = head.split(b" ", 2)
            path = parts[1].decode("latin-1") if len(parts) > 1 else "?"
            self.out.write(f"{now} {path}\n")
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
            )


def run_upstream(port, outfile):
    """Serves until SIGTERM/SIGINT; flushes every line so nothing is lost on a kill."""

    async def main():
        out = open(outfile, "w", buffering=1)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        server = await loop.create_server(
            lambda: _Upstream(out), "127.0.0.1", port, backlog=4096
        )
        await stop
        server.close()
        out.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------
# Processes and the machine
# ------------------------------------------------------------------------------------


def raise_fd_limit():
    """Soft RLIMIT_NOFILE up to the hard one (inherited by the children we start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port():
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_release():
    print("$ cargo build --release", flush=True)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)


class Children:
    """The processes this script started; `stop_all` ends exactly those (by PID)."""

    def __init__(self):
        self.procs = []

    def start(self, args, log, env=None):
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc, timeout=10):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)

    def stop_all(self):
        for proc in reversed(self.procs):
            try:
                self.stop(proc)
            except Exception as e:  # keep stopping the others
                print(f"could not stop pid {proc.pid}: {e}", file=sys.stderr)
        self.procs.clear()


def exit_on_signals():
    """SIGTERM/SIGINT raise SystemExit, so `finally` blocks stop the children."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def start_upstream(children, port, outfile, log):
    proc = children.start(
        [sys.executable, str(Path(__file__).resolve()), "upstream", str(port), str(outfile)],
        log,
    )
    wait_for_port(port, proc)
    return proc


def start_nginx(children, port, workdir, log):
    """A fast loopback upstream (Debian's nginx, one worker) answering 200 "ok" on
    127.0.0.1:`port`, for measurements where the Python upstream would be the limit."""
    conf = Path(workdir) / f"nginx-{port}.conf"
    conf.write_text(
        f"""worker_processes 1;
daemon off;
pid {workdir}/nginx-{port}.pid;
error_log {workdir}/nginx-{port}.err;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok\\n"; }} }}
}}
"""
    )
    proc = children.start(["nginx", "-c", str(conf)], log)
    wait_for_port(port, proc)
    return proc


def wrk_rps(proxy_port, url, seconds, workdir, connections=16):
    """Requests per second of `wrk -t1` sending absolute-form GETs of `url` through the
    proxy on `proxy_port`; fails on any non-2xx answer or socket error."""
    script = Path(workdir) / "absolute-form.lua"
    script.write_text(f'wrk.path = "{url}"\n')
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script),
         f"http://127.0.0.1:{proxy_port}"],
        capture_output=True, text=True, timeout=seconds + 30, check=True,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return float(out.split("Requests/sec:")[1].split()[0])


# The benchmarks' upstreams are on loopback, which tollgate refuses unless allowed.
ALLOW_LOOPBACK = '\n[access]\nallow = ["127.0.0.0/8", "::1"]\n'


def start_tollgate(children, config_text, workdir, listen_port, admin_port, log):
    config = Path(workdir) / "tollgate.toml"
    if "[access]" not in config_text:
        config_text += ALLOW_LOOPBACK
    config.write_text(config_text)
    proc = children.start(
        [str(BINARY), "--config", str(config), "--listen", f"127.0.0.1:{listen_port}"],
        log,
        env={"RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )
    wait_for_port(listen_port, proc)
    wait_for_port(admin_port, proc)
    return proc


def wait_for_port(port, proc, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pid {proc.pid} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def http_get(port, path, timeout=10):
    """GET http://127.0.0.1:port/path directly (no proxy); returns the body as text."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return resp.read().decode()


def group_status(admin_port, name):
    groups = json.loads(http_get(admin_port, "/status"))["groups"]
    return next((g for g in groups if g["name"] == name), None)


def metric(admin_port, name, **labels):
    """The value of one sample from /metrics, or None."""
    for line in http_get(admin_port, "/metrics").splitlines():
        if line.startswith(f"{name}{{") and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
        if not labels and line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def rss_kib(pid):
    """VmRSS and RssAnon of a process, in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0])
    return values


def cpu_seconds(pid):
    """User + system CPU time of a process so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine():
    """A one-paragraph description of where the numbers came from."""
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break

    def out(args):
        try:
            done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=10)
        except Exception:
            return "?"
        return done.stdout.strip() if done.returncode == 0 else "?"

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "cpu": model,
        "kernel": platform.release(),
        "rustc": out(["rustc", "--version"]),
        "commit": out(["git", "rev-parse", "--short", "HEAD"])
        + (" + local changes" if out(["git", "status", "--porcelain", "--", "src"]) not in ("", "?") else ""),
        "python": platform.python_version(),
    }


def print_machine():
    m = machine()
    print(
        f"machine: {m['nproc']} CPUs, {m['cpu']}, Linux {m['kernel']}; {m['rustc']}; "
        f"Python {m['python']}; tollgate at {m['commit']}; {m['date']}; "
        f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )


def percentile(sorted_values, p):
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    k = math.ceil(p / 100 * len(sorted_values)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, k))]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "upstream":
        run_upstream(int(sys.argv[2]), sys.argv[3])
    else:
        print(__doc__)
        sys.exit(2)
