//! The listener: accepts connections and serves them with hyper until shutdown.
//!
//! HTTP/1.1 with keep-alive, HTTP/2 where the client offers it (prior knowledge), and
//! upgrades so CONNECT can take over the connection. The caller binds the listener, so
//! tests pass one bound to port 0.
//!
//! * `sniff` — the first bytes, peeked: the HTTP version, and the first request;
//! * `home` — a connection whose first request is for a slowly paced group moves to
//!   that group's serving thread;
//! * `early` — that first request waits in its group before hyper is started;
//! * this module — the listening sockets, the serving threads, hyper's connections and
//!   shutdown.

mod early;
mod home;
mod sniff;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
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
use crate::coalesce::Coalesced;
use crate::coarse_timer::{self, CoarseTimer};
use crate::config::{Config, ConfigError, ProxyConfig};
use crate::proxy::Proxy;
use crate::tunnel::KeepWhileOpen;
use crate::when_woken::WhenWoken;

use early::Ended;
use home::{Arrival, Homes, Inbox, Moved};
use sniff::{sniff_stream, Sniffed};

/// Builds the proxy from `config` and serves `listener` until `shutdown` completes, then
/// drains in-flight requests and tunnels for up to `proxy.shutdown_grace`. One thread;
/// [`serve_threads`] is the general form (more threads, the admin endpoints).
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConfigError> {
    let sockets = Sockets {
        first: listener,
        others: Vec::new(),
    };
    serve_threads(sockets, None, config, shutdown).await
}

/// The proxy's listening sockets, one per serving thread, all on one address
/// (`SO_REUSEPORT`: the kernel spreads new connections over them).
pub struct Sockets {
    /// Served by the thread that calls [`serve_threads`].
    first: TcpListener,
    /// One per further thread; registered with that thread's runtime once it runs.
    others: Vec<std::net::TcpListener>,
}

impl Sockets {
    /// Listens on `addr` with `threads` sockets (at least one). Call it inside the
    /// runtime that will call [`serve_threads`]. All sockets listen when this returns,
    /// so connections that arrive before the threads run wait in their own socket's
    /// queue.
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

/// Builds the proxy from `config` and serves `sockets` until `shutdown` completes (and
/// the admin endpoints on `admin`, when given), then drains in-flight requests and
/// tunnels for up to `proxy.shutdown_grace`. One thread per socket: the caller's (best
/// a single-threaded runtime) serves the first, and each further socket gets a thread
/// with a single-threaded runtime and a [`Proxy::sibling`] of its own. Returns once
/// every thread has drained.
///
/// Why threads that share nothing but the budgets: on tokio's multi-threaded runtime a
/// request's client connection, its upstream connection and the pool's tasks wake each
/// other across threads (0.7 futex calls per request under load); a thread that serves
/// its connections from accept to response does not, and spends less CPU per request
/// (BENCHMARKS.md, "Performance against peers"). Groups, metrics and the shared store
/// are one for all threads, so every limit holds across them; upstream connection pools
/// are per thread. A connection whose first request is for a slowly paced group moves
/// to that group's home thread (`home`), so that the group's queue wakes one thread.
pub async fn serve_threads(
    sockets: Sockets,
    admin: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConfigError> {
    let proxy = Arc::new(Proxy::new(&config)?);
    let stop = CancellationToken::new();
    // However this function ends (an error after some threads started, included), the
    // threads it started stop serving.
    let _stop_at_exit = stop.clone().drop_guard();
    let mut homes = Homes::new(1 + sockets.others.len()).into_iter();
    let (first_homes, first_inbox) = homes.next().expect("one per thread");
    let mut others = Vec::new();
    for ((thread, socket), (homes, inbox)) in (1..).zip(sockets.others).zip(homes) {
        let sibling = Arc::new(proxy.sibling(&config)?);
        let settings = config.proxy.clone();
        let stopped = stop.clone().cancelled_owned();
        let (finished, done) = tokio::sync::oneshot::channel::<()>();
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
                            let on = Thread {
                                listener,
                                homes,
                                inbox,
                            };
                            serve(on, sibling, &settings, stopped).await
                        }
                        // Only if epoll refuses a socket; the other threads go on.
                        Err(e) => {
                            tracing::error!(thread, error = %e, "serving thread cannot accept")
                        }
                    }
                });
                drop(finished);
            })
            .expect("a serving thread starts");
        others.push((handle, done));
    }

    proxy.start_background();
    if let Some(admin) = admin {
        tokio::spawn(crate::admin::serve(
            admin,
            proxy.clone(),
            stop.clone().cancelled_owned(),
        ));
    }
    let shutdown = async {
        shutdown.await;
        // Every thread stops accepting at once, and drains on its own.
        stop.cancel();
    };
    let on = Thread {
        listener: sockets.first,
        homes: first_homes,
        inbox: first_inbox,
    };
    serve(on, proxy, &config.proxy, shutdown).await;
    stop.cancel();
    for (handle, done) in others {
        // `done` closes when the thread's runtime has finished; join is then immediate.
        let _ = done.await;
        let _ = handle.join();
    }
    Ok(())
}

/// What one serving thread takes connections from.
struct Thread {
    /// Its listening socket.
    listener: TcpListener,
    /// Every thread's inbox, for connections that belong on another thread.
    homes: Homes,
    /// Its own inbox: connections other threads moved here.
    inbox: Inbox,
}

/// Serves one thread's connections with an already built [`Proxy`]; see
/// [`serve_threads`].
async fn serve(
    on: Thread,
    proxy: Arc<Proxy>,
    settings: &ProxyConfig,
    shutdown: impl Future<Output = ()>,
) {
    // Against slowloris; hyper also applies it while a keep-alive connection is idle.
    let header_timeout = settings.client_header_timeout.0;
    // Its sweeper ends once the builder and every connection holding the timer are gone.
    let header_timer = CoarseTimer::new(coarse_timer::tick(header_timeout));
    let mut http1 = http1::Builder::new();
    http1
        .timer(header_timer)
        .header_read_timeout(header_timeout);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(20));
    let protocols = Arc::new(Protocols {
        http1,
        http2,
        header_timeout,
    });

    // Every client connection is a task here; at shutdown `drain` asks them to finish
    // the request in hand and close, and `cut` closes whatever is left after the grace.
    let connections = TaskTracker::new();
    let drain = CancellationToken::new();
    let cut = CancellationToken::new();
    let Thread {
        listener,
        homes,
        mut inbox,
    } = on;
    let client = |remote, local, homes| Client {
        proxy: proxy.clone(),
        protocols: protocols.clone(),
        local,
        remote,
        homes,
    };
    // A connection another thread moved here: registered with this thread's reactor,
    // and never moved again.
    let take = |moved: Moved| {
        let Arrival {
            local,
            remote,
            arrived,
            give_up,
        } = moved.arrival;
        match TcpStream::from_std(moved.stream) {
            Ok(stream) => Some((
                client(remote, local, None),
                stream,
                Came::Moved { arrived, give_up },
            )),
            Err(e) => {
                tracing::warn!(%remote, error = %e, "dropped a connection moved to its group's thread: cannot watch its socket");
                None
            }
        }
    };
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            _ = &mut shutdown => break,
            // Never `None` while this thread holds `homes`, the senders' owner.
            Some(moved) = inbox.recv() => {
                if let Some((moved_here, stream, came)) = take(moved) {
                    connections.spawn(moved_here.serve(stream, came, drain.clone(), cut.clone()));
                }
                continue;
            }
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
        let accepted = client(remote, local, Some(homes.clone()));
        connections.spawn(accepted.serve(stream, Came::Accepted, drain.clone(), cut.clone()));
    }
    drop(listener);
    // Connections already on their way here are served like those accepted; any
    // other thread that moves one after this serves it itself. `recv`, not `try_recv`:
    // it also waits for a send that has begun and not yet landed, which `try_recv`
    // would report as an empty inbox, losing that connection.
    inbox.close();
    while let Some(moved) = inbox.recv().await {
        if let Some((moved_here, stream, came)) = take(moved) {
            connections.spawn(moved_here.serve(stream, came, drain.clone(), cut.clone()));
        }
    }

    let grace = settings.shutdown_grace.0;
    // One line per serving thread, each about its own connections.
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
}

/// The two HTTP versions a client may speak, configured once.
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// `client_header_timeout`: how long a new connection may take to show which
    /// version it speaks, and how long an HTTP/2 connection may go without a request.
    header_timeout: Duration,
}

/// One accepted client connection.
struct Client {
    proxy: Arc<Proxy>,
    protocols: Arc<Protocols>,
    /// The address the client connected to (transparent routes depend on it).
    local: SocketAddr,
    remote: SocketAddr,
    /// Where its first request's group may want it served (`home`); `None` for a
    /// connection already moved, which stays where it is.
    homes: Option<Homes>,
}

impl Client {
    /// Serves the connection with the HTTP version its first bytes show, until it ends,
    /// `drain` asks it to finish (then it closes after the request in hand), or `cut`.
    ///
    /// The version is read with a peek rather than by hyper-util's `auto` connection,
    /// which reads the first bytes itself and hands them back to hyper in front of the
    /// socket: hyper's read buffer then grows to 16 KiB on the very first request, which
    /// every waiting client connection paid (BENCHMARKS.md, "Queue memory").
    async fn serve(
        self,
        stream: TcpStream,
        came: Came,
        drain: CancellationToken,
        cut: CancellationToken,
    ) {
        let (local, remote) = (self.local, self.remote);
        let (version, arrived, give_up) = match came {
            Came::Accepted => {
                let give_up = Instant::now() + self.protocols.header_timeout;
                let Some(version) = sniff_stream(&stream, give_up, &drain).await else {
                    tracing::debug!(%remote, "client sent no request");
                    return;
                };
                (version, Instant::now(), give_up)
            }
            Came::Moved { arrived, give_up } => {
                // As after the version peek on the thread that accepted it: the request's
                // bytes are there once this thread's reactor has seen the new
                // registration. Not bounded by the header timeout: the request had
                // arrived whole when it moved.
                let seen = tokio::select! {
                    seen = stream.readable() => seen,
                    () = cut.cancelled() => {
                        report(remote, None);
                        return;
                    }
                };
                if let Err(e) = seen {
                    tracing::debug!(%remote, error = %e, "moved connection failed");
                    return;
                }
                (Sniffed::Http1, arrived, give_up)
            }
        };
        let ended = match version {
            Sniffed::Http2 => {
                // Boxed: an HTTP/2 connection is twice the size of an HTTP/1 one, and
                // inline it would size every client connection's task.
                let io = TokioIo::new(stream);
                let serving = serve_http2(&self.protocols, io, self.proxy, local, &drain, &cut);
                Box::pin(serving).await
            }
            Sniffed::Http1 | Sniffed::NeedMore => {
                let proxy = self.proxy;
                let arrival = Arrival {
                    local,
                    remote,
                    arrived,
                    give_up,
                };
                let wait = early::wait_in_group(stream, &proxy, arrival, self.homes.as_ref(), &cut);
                let ready = match wait.await {
                    Ok(ready) => ready,
                    Err(Ended::ClientLeft) => {
                        tracing::debug!(%remote, "client left while its request waited");
                        return;
                    }
                    Err(Ended::Cut) => {
                        tracing::debug!(%remote, "connection cut at shutdown");
                        return;
                    }
                    Err(Ended::Unregistered(e)) => {
                        tracing::warn!(%remote, error = %e, "dropped a connection whose request waited: cannot watch its socket");
                        return;
                    }
                    // Served by its group's thread from here on.
                    Err(Ended::Moved) => return,
                };
                // hyper must read the request before it is told to finish (it closes a
                // connection it has not read from): told when the first request is in.
                let first_in = ready.registered_again.then(CancellationToken::new);
                // The outcome of the wait goes with the first request only.
                let first = std::cell::Cell::new(ready.admission);
                let service = {
                    // Taken by the first request: `cancel` (and `is_cancelled`) lock the
                    // token, which the requests after it need not do.
                    let first_in = std::cell::Cell::new(first_in.clone());
                    service_fn(move |req| {
                        if let Some(first_in) = first_in.take() {
                            first_in.cancel();
                        }
                        let early = first.take();
                        // Mapped rather than awaited in an `async` block, which would
                        // hold the request's future twice (captured, and awaited).
                        proxy.handle(req, local, early).map(infallible)
                    })
                };
                let drain = async {
                    if let Some(first_in) = first_in {
                        first_in.cancelled().await;
                    }
                    drain.cancelled().await
                };
                let conn = self
                    .protocols
                    .http1
                    .serve_connection(TokioIo::new(Coalesced::new(ready.stream)), service)
                    .with_upgrades();
                until_closed(conn, |c| c.graceful_shutdown(), drain, &cut).await
            }
        };
        report(remote, ended);
    }
}

/// How a connection reached the thread that serves it.
enum Came {
    /// Accepted by this thread.
    Accepted,
    /// Moved here by the thread that accepted it (`home`), once its first request had
    /// arrived whole; its bytes are still in the socket.
    Moved {
        /// When that request was seen.
        arrived: Instant,
        /// When its header timeout ends.
        give_up: Instant,
    },
}

/// Logs how a client connection ended, when that says something.
fn report(remote: SocketAddr, ended: Option<Result<(), hyper::Error>>) {
    match ended {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            tracing::debug!(%remote, error = %e, "client connection ended with an error")
        }
        None => tracing::debug!(%remote, "connection cut at shutdown"),
    }
}

/// A response as hyper's service wants it. A function rather than `Ok` itself: rustc
/// cannot prove the future that maps with `Ok` is `Send` (the boxed error type's lifetime
/// in `Body`, the higher-ranked limitation `crate::limit::layer::BoxFuture` speaks of).
fn infallible(response: Response<Body>) -> Result<Response<Body>, Infallible> {
    Ok(response)
}

/// Serves an HTTP/2 connection until it ends. hyper's HTTP/2 server has no header
/// timeout, so `client_header_timeout` is kept here: once no request has been open on
/// the connection for that long, it is closed gracefully (GOAWAY), as HTTP/1 closes an
/// idle keep-alive connection, and dropped if the client still holds it idle after as
/// long again. A client that opens the connection and sends nothing cannot hold it.
async fn serve_http2(
    protocols: &Protocols,
    io: TokioIo<TcpStream>,
    proxy: Arc<Proxy>,
    local: SocketAddr,
    drain: &CancellationToken,
    cut: &CancellationToken,
) -> Option<Result<(), hyper::Error>> {
    let idle = Arc::new(Idle::new());
    let service = {
        let idle = idle.clone();
        service_fn(move |mut req: Request<Incoming>| {
            let proxy = proxy.clone();
            let stream = Arc::new(Idle::opened(&idle));
            if req.method() == Method::CONNECT {
                // A tunnel is an open stream until it closes, long after its `200`.
                req.extensions_mut().insert(KeepWhileOpen(stream.clone()));
            }
            async move {
                let response = proxy.handle(req, local, None).await;
                // The stream is open until its response body has been sent.
                Ok::<_, Infallible>(response.map(|b| body::boxed(Holding::new(b, stream))))
            }
        })
    };
    let conn = protocols.http2.serve_connection(io, service);
    // Its own drain token, so that an idle close does not touch other connections.
    let drain = drain.child_token();
    let serving = until_closed(conn, |c| c.graceful_shutdown(), drain.cancelled(), cut);
    let limit = protocols.header_timeout;
    let watch = async {
        idle.for_at_least(limit).await;
        // GOAWAY: the client should finish and close. hyper waits for the ping that
        // confirms it; a client that does not answer is closed once it has stayed idle
        // for another `limit`.
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

/// How many requests are open on one HTTP/2 connection, and since when none has been.
struct Idle(std::sync::Mutex<(usize, Instant)>);

/// One open request of an [`Idle`]-watched connection; closing it is dropping it.
struct OpenStream(Arc<Idle>);

impl Idle {
    fn new() -> Idle {
        Idle(std::sync::Mutex::new((0, Instant::now())))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Instant)> {
        // Two plain numbers: valid after any panic of a holder.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn opened(this: &Arc<Idle>) -> OpenStream {
        this.lock().0 += 1;
        OpenStream(this.clone())
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

impl Drop for OpenStream {
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
async fn until_closed<C>(
    conn: C,
    shut: impl FnOnce(Pin<&mut C>),
    drain: impl Future<Output = ()>,
    cut: &CancellationToken,
) -> Option<Result<(), hyper::Error>>
where
    C: Future<Output = Result<(), hyper::Error>>,
{
    tokio::pin!(conn);
    tokio::select! {
        // The connection first: hyper closes one it is told to shut down before it has
        // read anything, so its first poll must read a request that is already there.
        biased;
        ended = conn.as_mut() => return Some(ended),
        // Polled only when shutdown wakes it, not at every wake of the connection.
        () = WhenWoken::new(drain) => shut(conn.as_mut()),
    }
    tokio::select! {
        ended = conn => Some(ended),
        _ = cut.cancelled() => None,
    }
}
