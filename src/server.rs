//! The listener: accepts client connections and serves them with hyper until shutdown.
//!
//! One thread per core, each with a single-threaded runtime and a listening socket of
//! its own on the proxy's address ([`run`] says why). Each connection is a task on the
//! thread that accepted it. It speaks HTTP/1.1 with keep-alive (and
//! upgrades, so CONNECT can take it over), or HTTP/2 when the client opens with its
//! preface (prior knowledge). Every request is [`Proxy::handle`]'s, whatever its
//! version or its place on the connection.
//!
//! Shutdown: stop accepting, ask every connection to finish the request in hand and
//! close (HTTP/1 closes after the response, HTTP/2 sends GOAWAY), wait for them and the
//! open tunnels for up to `shutdown_grace`, then close whatever is left.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body, Holding};
use crate::classify::Inside;
use crate::config::{Config, ConfigError};
use crate::proxy::Proxy;
use crate::tunnel::{Intercepted, KeepWhileOpen};

/// At shutdown, how long a new connection that has sent nothing yet may take to show
/// its first bytes before it is closed (a request already under way is served).
const FIRST_BYTES_AT_SHUTDOWN: Duration = Duration::from_millis(250);

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
    pub fn listen(addr: SocketAddr, threads: usize) -> std::io::Result<Sockets> {
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
/// On one multi-threaded runtime, work stealing moved the halves of an exchange across
/// threads and cost ≈ 30 % more CPU per forwarded request. Groups,
/// metrics and the Redis store are shared, so every limit holds across threads.
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
    // However this function ends, the threads it started and the admin listener stop.
    let _stop_at_exit = stop.clone().drop_guard();
    if let Some(admin) = admin {
        tokio::spawn(crate::admin::serve(
            admin,
            proxy.clone(),
            stop.clone().cancelled_owned(),
        ));
    }
    let settings = Arc::new(Settings::new(&config));

    // Every thread keeps its runtime until all have drained: a task one runtime
    // started (a tunnel, the Redis connection) may still serve another's requests.
    let (release, released) = tokio::sync::watch::channel(false);
    let mut others = Vec::new();
    for (thread, socket) in (1..).zip(sockets.others) {
        let (proxy, settings) = (proxy.clone(), settings.clone());
        let stopped = stop.clone().cancelled_owned();
        let mut released = released.clone();
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
                        Ok(listener) => serve(listener, proxy, &settings, stopped).await,
                        // Only if epoll refuses a socket; the other threads go on.
                        Err(e) => tracing::error!(thread, error = %e, "cannot accept"),
                    }
                    drop(drained);
                    let _ = released.wait_for(|r| *r).await;
                });
            })
            .expect("a serving thread starts");
        others.push((handle, done));
    }
    let shutdown = async {
        shutdown.await;
        // Every thread stops accepting at once, and drains on its own.
        stop.cancel();
    };
    serve(sockets.first, proxy, &settings, shutdown).await;
    stop.cancel();
    for (_, done) in &mut others {
        let _ = done.await;
    }
    let _ = release.send(true);
    for (handle, _) in others {
        let _ = handle.join();
    }
    Ok(())
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
    // write to the reactor's eventfd per request, ≈ 0.7 per forwarded request measured.
    // A tick every second keeps a wake-up near, so those timers never need one.
    let tick = tokio::spawn(async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
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
            connections: connections.clone(),
            drain: drain.clone(),
            cut: cut.clone(),
        };
        connections.spawn(client.serve(stream));
    }
    drop(listener);

    let grace = settings.grace;
    let thread = std::thread::current();
    tracing::info!(
        thread = thread.name().unwrap_or("main"),
        connections = connections.len(),
        grace = %humantime::format_duration(grace),
        "shutting down"
    );
    drain.cancel();
    connections.close();
    proxy.tunnels().close();
    let drained = async {
        connections.wait().await;
        proxy.tunnels().wait().await;
    };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(
            connections = connections.len(),
            tunnels = proxy.tunnels().len(),
            "shutdown_grace elapsed; closing what is still open"
        );
        cut.cancel();
        proxy.cut_tunnels();
        // The cut tasks end at their next poll; let them, so nothing outlives `run`.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            connections.wait().await;
            proxy.tunnels().wait().await;
        })
        .await;
    }
    tick.abort();
}

/// The two HTTP versions a client may speak, configured once.
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// `client_header_timeout`: how long a new connection may take to show which
    /// version it speaks, and how long an HTTP/2 connection may go without a request.
    header_timeout: Duration,
}

/// One accepted client connection, or one intercepted tunnel inside it.
#[derive(Clone)]
struct Client {
    proxy: Arc<Proxy>,
    protocols: Arc<Protocols>,
    /// The address the client connected to (transparent routes depend on it).
    local: SocketAddr,
    remote: SocketAddr,
    /// The intercepted tunnel this connection is inside; `None` for the TCP connection.
    inside: Option<Arc<Inside>>,
    /// This thread's connections: an intercepted tunnel is served as one of them, so
    /// shutdown drains it like any other.
    connections: TaskTracker,
    /// Asks the connection to finish the requests in hand and close.
    drain: CancellationToken,
    /// Closes it at once (shutdown, once the grace is over).
    cut: CancellationToken,
}

/// What every HTTP/2 connection opens with (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Client {
    /// Serves the connection with the HTTP version its first bytes show, until it ends,
    /// `drain` asks it to finish (it then closes after the requests in hand), or `cut`.
    async fn serve(self, stream: TcpStream) {
        let (remote, drain, cut) = (self.remote, self.drain.clone(), self.cut.clone());
        let h2 = tokio::select! {
            h2 = tokio::time::timeout(self.protocols.header_timeout, speaks_h2(&stream)) => h2,
            // A connection accepted just before shutdown may have its request on the way:
            // it is served if its first bytes come soon after the drain begins.
            () = async {
                drain.cancelled().await;
                tokio::time::sleep(FIRST_BYTES_AT_SHUTDOWN).await;
            } => return,
            () = cut.cancelled() => return,
        };
        let ended = match h2 {
            // Boxed: an HTTP/2 connection's state is twice an HTTP/1 one's, and inline
            // it would size every connection's task.
            Ok(Ok(true)) => Box::pin(self.serve_http2(TokioIo::new(stream))).await,
            Ok(Ok(false)) => self.serve_http1(TokioIo::new(stream)).await,
            Ok(Err(e)) => {
                tracing::debug!(%remote, error = %e, "client connection failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%remote, "client sent no request");
                return;
            }
        };
        match ended {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                tracing::debug!(%remote, error = %e, "client connection ended with an error")
            }
            None => tracing::debug!(%remote, "connection cut at shutdown"),
        }
    }

    async fn serve_http1<I: Io>(self, io: I) -> Option<Result<(), hyper::Error>> {
        let (drain, cut) = (self.drain.clone(), self.cut.clone());
        let client = Arc::new(self);
        let service = {
            let client = client.clone();
            service_fn(move |req: Request<Incoming>| {
                let client = client.clone();
                async move { Ok::<_, Infallible>(client.answer(req).await) }
            })
        };
        let conn = client
            .protocols
            .http1
            .serve_connection(io, service)
            .with_upgrades();
        until_closed(conn, |c| c.graceful_shutdown(), drain.cancelled(), &cut).await
    }

    /// hyper's HTTP/2 server has no header timeout, so `client_header_timeout` is kept
    /// here: once no request has been open on the connection for that long, it is
    /// closed gracefully (GOAWAY), as HTTP/1 closes an idle keep-alive connection, and
    /// dropped if the client still holds it idle after as long again.
    async fn serve_http2<I: Io>(self, io: I) -> Option<Result<(), hyper::Error>> {
        // Its own drain token, so that an idle close does not touch other connections.
        let (drain, cut) = (self.drain.child_token(), self.cut.clone());
        let client = Arc::new(self);
        let idle = Arc::new(Idle::new());
        let service = {
            let (client, idle) = (client.clone(), idle.clone());
            service_fn(move |mut req: Request<Incoming>| {
                let client = client.clone();
                let open = Arc::new(Idle::opened(&idle));
                if req.method() == Method::CONNECT {
                    // A tunnel is an open stream until it closes, long after its `200`.
                    req.extensions_mut().insert(KeepWhileOpen(open.clone()));
                }
                async move {
                    let response = client.answer(req).await;
                    // The stream is open until its response body has been sent.
                    Ok::<_, Infallible>(response.map(|b| body::boxed(Holding::new(b, open))))
                }
            })
        };
        let conn = client.protocols.http2.serve_connection(io, service);
        let serving = until_closed(conn, |c| c.graceful_shutdown(), drain.cancelled(), &cut);
        let limit = client.protocols.header_timeout;
        let watch = async {
            idle.for_at_least(limit).await;
            drain.cancel();
            tokio::time::sleep(limit).await;
            idle.for_at_least(limit).await;
        };
        tokio::select! {
            ended = serving => ended,
            () = watch => {
                tracing::debug!("closed an idle HTTP/2 connection that ignored GOAWAY");
                Some(Ok(()))
            }
        }
    }
}

impl Client {
    /// The proxy's answer to one request of this connection. When it opened an
    /// intercepted tunnel, what the client sends through it is served as a connection of
    /// its own, from when hyper hands the tunnel over.
    async fn answer(&self, req: Request<Incoming>) -> Response<Body> {
        let (local, remote, inside) = (self.local, self.remote, self.inside.as_deref());
        let mut response = self.proxy.handle(req, local, remote, inside).await;
        if let Some(tunnel) = response.extensions_mut().remove::<Intercepted>() {
            let inner = Client {
                inside: None,
                ..self.clone()
            };
            self.connections.spawn(inner.serve_intercepted(tunnel));
        }
        response
    }

    /// Serves an intercepted tunnel: TLS with a certificate for its host (or plain
    /// HTTP/1), then HTTP/1.1 or h2 as the client chose by ALPN. (A named future type:
    /// the connection it serves is one whose answers spawn this.)
    fn serve_intercepted(self, tunnel: Intercepted) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(self.serve_intercepted_inner(tunnel))
    }

    async fn serve_intercepted_inner(mut self, tunnel: Intercepted) {
        let Intercepted {
            on_upgrade,
            host,
            port,
            keep,
        } = tunnel;
        // The outer HTTP/2 stream stays open while the tunnel is.
        let _keep = keep;
        let upgraded = tokio::select! {
            upgraded = on_upgrade => upgraded,
            () = self.cut.cancelled() => return,
        };
        let (Ok(upgraded), Some(intercept)) = (upgraded, self.proxy.intercept()) else {
            tracing::debug!(%host, "client left before the tunnel opened");
            return;
        };
        let within = self.protocols.header_timeout;
        let Some(accepted) = intercept.accept(upgraded, &host, within).await else {
            return;
        };
        let scheme = accepted.scheme;
        self.inside = Some(Arc::new(Inside { host, port, scheme }));
        let io = TokioIo::new(accepted.io);
        let ended = if accepted.h2 {
            Box::pin(self.serve_http2(io)).await
        } else {
            self.serve_http1(io).await
        };
        if let Some(Err(e)) = ended {
            tracing::debug!(error = %e, "intercepted connection ended with an error");
        }
    }
}

/// What a client connection is read and written through: TCP, or an intercepted
/// tunnel.
trait Io: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static {}
impl<T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static> Io for T {}

/// Whether the client opens with HTTP/2's preface, from its first bytes, peeked so
/// that hyper reads them again. (hyper-util's `auto` connection reads them itself and
/// hands them back in front of the socket, which grows hyper's read buffer on the
/// first request of every connection.)
async fn speaks_h2(stream: &TcpStream) -> std::io::Result<bool> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut pause = Duration::from_millis(5);
    loop {
        let n = stream.peek(&mut first).await?;
        if n == 0 || !H2_PREFACE.starts_with(&first[..n]) {
            return Ok(false);
        }
        if n == H2_PREFACE.len() {
            return Ok(true);
        }
        // Part of the preface: peeking again at once would see the same bytes. A client
        // that stalls there is looked at less and less often.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// How many requests are open on one HTTP/2 connection, and since when none has been.
struct Idle(Mutex<(usize, Instant)>);

/// One open request of an [`Idle`]-watched connection; closing it is dropping it.
struct OpenRequest(Arc<Idle>);

impl Idle {
    fn new() -> Idle {
        Idle(Mutex::new((0, Instant::now())))
    }

    fn lock(&self) -> MutexGuard<'_, (usize, Instant)> {
        // Two plain numbers: valid after any panic of a holder.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn opened(this: &Arc<Idle>) -> OpenRequest {
        this.lock().0 += 1;
        OpenRequest(this.clone())
    }

    /// Resolves once no request has been open for `limit`.
    async fn for_at_least(&self, limit: Duration) {
        loop {
            let (open, since) = *self.lock();
            let wake = match open {
                0 if since.elapsed() >= limit => return,
                0 => since + limit,
                // Busy: look again later (it cannot go idle for `limit` sooner).
                _ => Instant::now() + limit,
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

impl Drop for OpenRequest {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.0 -= 1;
        if state.0 == 0 {
            state.1 = Instant::now();
        }
    }
}

/// Drives a hyper connection to its end; when `drain` completes first, starts its
/// graceful shutdown (`shut`) and goes on; `None` when `cut` closed it.
async fn until_closed<C, E>(
    conn: C,
    shut: impl FnOnce(Pin<&mut C>),
    drain: impl Future<Output = ()>,
    cut: &CancellationToken,
) -> Option<Result<(), E>>
where
    C: Future<Output = Result<(), E>>,
{
    tokio::pin!(conn);
    tokio::select! {
        // The connection first: hyper closes one it is told to shut down before it has
        // read anything, so its first poll must read a request that is already there.
        biased;
        ended = conn.as_mut() => return Some(ended),
        () = drain => shut(conn.as_mut()),
    }
    tokio::select! {
        ended = conn => Some(ended),
        _ = cut.cancelled() => None,
    }
}
