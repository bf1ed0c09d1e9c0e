//! The listener: accepts client connections and serves them with hyper until shutdown.
//!
//! One thread per core, each with a single-threaded runtime and a listening socket of
//! its own on the proxy's address ([`run`] says why). Each connection is a task on the
//! thread that accepted it, served by [`crate::connection`].
//!
//! Shutdown: stop accepting, ask every connection to finish the request in hand and
//! close (HTTP/1 closes after the response, HTTP/2 sends GOAWAY), wait for them and the
//! open tunnels for up to `shutdown_grace`; then answer every request still queued
//! `503` ([`crate::shutdown`]), and close whatever is left.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ConfigError};
use crate::connection::{Client, Protocols};
use crate::proxy::Proxy;

/// Once shutdown's grace is over, how long the queued requests' `503` answers may take
/// to go out before every connection still open is closed: twice this is how far past
/// the grace a shutdown may run.
const ANSWER_AT_SHUTDOWN: Duration = Duration::from_millis(500);

/// How often an HTTP/2 client is pinged to tell a live idle connection from a dead one.
const H2_KEEP_ALIVE: Duration = Duration::from_secs(20);

/// The proxy's listening sockets: one per serving thread, all on one address
/// (`SO_REUSEPORT`: the kernel spreads new connections over them).
pub struct Sockets {
    /// Served by the thread that calls [`run`].
    first: TcpListener,
    /// One per further thread; registered with that thread's runtime once it runs.
    others: Vec<std::net::TcpListener>,
}

impl Sockets {
    /// Listens on `addr` with `threads` sockets (at least one). Call it inside the
    /// runtime that will call [`run`]. All sockets listen when this returns, so
    /// connections that arrive before the threads run wait in their socket's queue.
    ///
    /// A port another process already serves is refused before anything listens, unless
    /// `share` (`--reuse-port`, for a blue-green switch): with `SO_REUSEPORT` the kernel
    /// would split the connections between the two, and each would keep a budget of
    /// its own.
    pub fn listen(addr: SocketAddr, threads: usize, share: bool) -> std::io::Result<Sockets> {
        if !share && addr.port() != 0 {
            served_elsewhere(addr)?;
        }
        let shared = threads > 1;
        let first = bind(addr, shared)?;
        // With port 0 the first socket chose the port; the others take the same.
        let addr = first.local_addr()?;
        let others = (1..threads)
            .map(|_| bind(addr, shared)?.into_std())
            .collect::<std::io::Result<_>>()?;
        Ok(Sockets { first, others })
    }

    /// The address they listen on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.first.local_addr()
    }
}

/// One socket, served by the calling thread alone.
impl From<TcpListener> for Sockets {
    fn from(first: TcpListener) -> Sockets {
        Sockets {
            first,
            others: Vec::new(),
        }
    }
}

/// `Err` when another process serves `addr`: a socket bound without `SO_REUSEPORT`
/// cannot join listeners that set it, so a bind alone (nothing listens) finds out.
fn served_elsewhere(addr: SocketAddr) -> std::io::Result<()> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => std::io::Error::new(
            e.kind(),
            format!(
                "port {} is already served by another process (another tollgate?); \
                 --reuse-port shares it on purpose",
                addr.port()
            ),
        ),
        _ => e,
    })
}

/// Binds one listening socket, shareable with `reuse_port`.
fn bind(addr: SocketAddr, reuse_port: bool) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // As `TcpListener::bind` does: a restart need not wait for old connections' TIME_WAIT.
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Builds the proxy from `config` and serves `sockets` (and the admin endpoints on
/// `admin`, when given) until `shutdown` completes, then drains for up to
/// `proxy.shutdown_grace`. The caller binds the listeners, so tests pass ones bound to
/// port 0.
///
/// The calling thread serves the first socket; each further socket gets a thread with
/// a single-threaded runtime of its own. A connection is served from accept to
/// response by one thread, and so is the upstream connection its request uses (the
/// pool keeps connections per thread): nothing of one exchange wakes another thread.
/// On one multi-threaded runtime, work stealing moves the halves of an exchange across
/// threads, which costs CPU per forwarded request (BENCHMARKS.md). Groups, metrics and
/// the Redis store are shared, so every limit holds across threads.
pub async fn run(
    sockets: impl Into<Sockets>,
    admin: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConfigError> {
    let sockets = sockets.into();
    // The addresses actually bound (a port 0 chosen), which the destination policy
    // refuses: tollgate never proxies to itself.
    let mut config = config;
    if let Ok(addr) = sockets.local_addr() {
        config.proxy.listen = addr;
    }
    if let Some(Ok(listen)) = admin.as_ref().map(TcpListener::local_addr) {
        config.admin = Some(crate::config::AdminConfig { listen });
    }
    let proxy = Arc::new(Proxy::new(&config)?);
    proxy.start_background();
    let stop = CancellationToken::new();
    // However this function ends, the threads it started stop.
    let _stop_at_exit = stop.clone().drop_guard();
    // The admin listener serves through the drain (its `/readyz` says "draining", its
    // `/metrics` show the queues emptying) and stops when this function ends.
    let admin_stop = CancellationToken::new();
    let _admin_stop_at_exit = admin_stop.clone().drop_guard();
    if let Some(admin) = admin {
        tokio::spawn(crate::admin::serve(
            admin,
            proxy.clone(),
            admin_stop.cancelled_owned(),
        ));
    }
    spawn_reload_on_hangup(proxy.clone(), stop.clone());
    let settings = Arc::new(Settings::new(&config));

    // Every thread keeps its runtime until all have drained: a task one runtime
    // started (a tunnel, the Redis connection) may still serve another's requests.
    let (release, released) = tokio::sync::watch::channel(false);
    let mut others = Vec::new();
    for (thread, socket) in (1..).zip(sockets.others) {
        let serving = Serving {
            proxy: proxy.clone(),
            settings: settings.clone(),
            stop: stop.clone(),
            released: released.clone(),
        };
        others.push(serving.spawn(thread, socket));
    }
    let shutdown = async {
        shutdown.await;
        // Unready before any thread stops accepting, so `/readyz` turns as the drain
        // begins, not once the first thread gets to it.
        proxy.shutdown().begin();
        // Every thread stops accepting at once, and drains on its own.
        stop.cancel();
    };
    serve(sockets.first, proxy.clone(), &settings, shutdown).await;
    stop.cancel();
    for (_, done) in &mut others {
        let _ = done.await;
    }
    let _ = release.send(true);
    for (handle, _) in others {
        let _ = handle.join();
    }
    // The last access lines go before the last line.
    crate::access_log::write::flush_thread();
    let tally = proxy.shutdown().tally();
    tracing::info!(
        sent = tally.sent,
        answered_503 = tally.answered_503,
        cut = tally.cut,
        "shut down"
    );
    Ok(())
}

/// What a serving thread besides the first shares with the others.
struct Serving {
    proxy: Arc<Proxy>,
    settings: Arc<Settings>,
    /// Cancelled when the threads stop accepting.
    stop: CancellationToken,
    /// Turns true once every thread has drained: only then does a runtime end.
    released: tokio::sync::watch::Receiver<bool>,
}

impl Serving {
    /// Serves `socket` on thread number `thread`, a runtime of its own. Returns the
    /// thread, and a receiver that completes once it has drained.
    fn spawn(
        self,
        thread: usize,
        socket: std::net::TcpListener,
    ) -> (
        std::thread::JoinHandle<()>,
        tokio::sync::oneshot::Receiver<()>,
    ) {
        let Serving {
            proxy,
            settings,
            stop,
            mut released,
        } = self;
        let (drained, done) = tokio::sync::oneshot::channel::<()>();
        let handle = std::thread::Builder::new()
            .name(format!("tollgate-{thread}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the tokio runtime starts");
                runtime.block_on(async move {
                    match TcpListener::from_std(socket) {
                        Ok(listener) => {
                            serve(listener, proxy, &settings, stop.cancelled_owned()).await
                        }
                        // Only if epoll refuses a socket; the other threads go on.
                        Err(e) => tracing::error!(thread, error = %e, "cannot accept"),
                    }
                    drop(drained);
                    let _ = released.wait_for(|r| *r).await;
                });
            })
            .expect("a serving thread starts");
        (handle, done)
    }
}

/// What every serving thread needs to know, built once.
struct Settings {
    protocols: Arc<Protocols>,
    grace: Duration,
}

impl Settings {
    fn new(config: &Config) -> Settings {
        let header_timeout = config.proxy.client_header_timeout.0;
        let mut http1 = http1::Builder::new();
        http1
            // A response's head and small body go out in one `write`, which costs the
            // kernel less than a `writev` of several buffers.
            .writev(false)
            .timer(TokioTimer::new())
            // Against slowloris; hyper also applies it while a keep-alive connection is
            // idle.
            .header_read_timeout(header_timeout);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .keep_alive_interval(H2_KEEP_ALIVE);
        Settings {
            protocols: Arc::new(Protocols {
                http1,
                http2,
                header_timeout,
                body_idle: config.proxy.body_idle_timeout.0,
            }),
            grace: config.proxy.shutdown_grace.0,
        }
    }
}

/// Serves one thread's socket until `shutdown` completes, then drains that thread's
/// connections (and the open tunnels) for up to the grace.
async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    settings: &Settings,
    shutdown: impl Future<Output = ()>,
) {
    // tokio's time driver wakes itself with a system call whenever a timer is set to fire
    // before its next wake-up. Every request sets two, tens of seconds out (the header
    // and response timeouts), and with nothing else due each would count as earlier: a
    // write to the reactor's eventfd for most forwarded requests.
    // A tick every second keeps a wake-up near, so those timers never need one.
    // The same tick writes the access lines this thread gathered (`access_log::write`).
    let tick = tokio::spawn(async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            crate::access_log::write::flush_thread();
        }
    });
    // Every client connection is a task here; `drain` asks them to finish the request
    // in hand and close, and `cut` closes whatever is left after the grace.
    let connections = TaskTracker::new();
    let drain = CancellationToken::new();
    let cut = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let client = Client {
            proxy: proxy.clone(),
            protocols: settings.protocols.clone(),
            local,
            remote,
            inside: None,
            keep: None,
            connections: connections.clone(),
            drain: drain.clone(),
            cut: cut.clone(),
            first_byte: None,
            sending: None,
        };
        let open = proxy.metrics().connection_opened();
        // Chained, not awaited in a block: the task would hold the client twice.
        connections.spawn(client.serve(stream).map(move |()| drop(open)));
    }
    drop(listener);
    drain_and_cut(&proxy, &connections, &drain, &cut, settings.grace).await;
    tick.abort();
}

/// Shutdown of one thread's connections: `drain` asks them to finish the request in
/// hand; after `grace`, requests still queued are answered `503`, and `cut` closes
/// what is left, tunnels too.
async fn drain_and_cut(
    proxy: &Proxy,
    connections: &TaskTracker,
    drain: &CancellationToken,
    cut: &CancellationToken,
    grace: Duration,
) {
    let thread = std::thread::current();
    proxy.shutdown().begin();
    tracing::info!(
        thread = thread.name().unwrap_or("main"),
        connections = connections.len(),
        grace = %humantime::format_duration(grace),
        "shutting down"
    );
    drain.cancel();
    connections.close();
    proxy.tunnels().close();
    let drained = || async {
        connections.wait().await;
        proxy.tunnels().wait().await;
    };
    if tokio::time::timeout(grace, drained()).await.is_err() {
        // Requests still queued are answered 503 and their connections close; those
        // answers are small and local, so they get a moment before the cut.
        proxy.shutdown().give_up_queued();
        let _ = tokio::time::timeout(ANSWER_AT_SHUTDOWN, drained()).await;
    }
    if !connections.is_empty() || !proxy.tunnels().is_empty() {
        tracing::warn!(
            connections = connections.len(),
            tunnels = proxy.tunnels().len(),
            "shutdown_grace elapsed; closing what is still open"
        );
        proxy
            .shutdown()
            .cut(connections.len() + proxy.tunnels().len());
        cut.cancel();
        proxy.cut_tunnels();
        // The cut tasks end at their next poll; let them, so nothing outlives `run`.
        let _ = tokio::time::timeout(ANSWER_AT_SHUTDOWN, drained()).await;
    }
}

/// Reloads the configuration on every SIGHUP until `stop` (an operator's `kill -HUP`,
/// as with nginx and HAProxy; without a handler the signal would end the process).
fn spawn_reload_on_hangup(proxy: Arc<Proxy>, stop: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(hangup) => hangup,
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP: reload with POST /reload");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                got = hangup.recv() => if got.is_none() { return },
            }
            tracing::info!("SIGHUP: reloading the configuration");
            // Outcome logged and counted by `reload`.
            let _ = proxy.reload();
        }
    });
}
