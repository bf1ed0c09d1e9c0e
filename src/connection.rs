//! One client connection: which HTTP version it speaks, hyper serving it, and the
//! intercepted tunnels opened on it, which are served as connections of their own.
//!
//! A TCP connection speaks HTTP/1.1 with keep-alive (and upgrades, so CONNECT can take
//! it over), or HTTP/2 when the client opens with its preface (prior knowledge). An
//! intercepted tunnel speaks what the client chose by ALPN inside it. Every request is
//! [`Proxy::handle`]'s, whatever its version or its place on the connection.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::ReadBuf;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body, Holding};
use crate::classify::Inside;
use crate::half_close::{HalfClose, Sending, Unread};
use crate::proxy::Proxy;
use crate::relay::KeepWhileOpen;
use crate::tunnel::Intercepted;

/// At shutdown, how long a new connection that has sent nothing yet may take to show
/// its first bytes before it is closed (a request already under way is served).
const FIRST_BYTES_AT_SHUTDOWN: Duration = Duration::from_millis(250);

/// The two HTTP versions a client may speak, configured once.
pub(crate) struct Protocols {
    pub(crate) http1: http1::Builder,
    pub(crate) http2: http2::Builder<TokioExecutor>,
    /// `client_header_timeout`: how long a new connection may take to show which
    /// version it speaks, and how long an HTTP/2 connection may go without a request.
    pub(crate) header_timeout: Duration,
    /// `body_idle_timeout`: how long a write may wait for a client that reads nothing.
    pub(crate) body_idle: Duration,
}

/// One accepted client connection, or one intercepted tunnel inside it.
#[derive(Clone)]
pub(crate) struct Client {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) protocols: Arc<Protocols>,
    /// The address the client connected to (transparent routes depend on it).
    pub(crate) local: SocketAddr,
    pub(crate) remote: SocketAddr,
    /// The intercepted tunnel this connection is inside; `None` for the TCP connection.
    pub(crate) inside: Option<Arc<Inside>>,
    /// What keeps the outer HTTP/2 stream of that tunnel open. Every request inside
    /// carries it, so that a connection switched to another protocol (WebSocket),
    /// which outlives this one, keeps the stream open too.
    pub(crate) keep: Option<KeepWhileOpen>,
    /// This thread's connections: an intercepted tunnel is served as one of them, so
    /// shutdown drains it like any other.
    pub(crate) connections: TaskTracker,
    /// Asks the connection to finish the requests in hand and close.
    pub(crate) drain: CancellationToken,
    /// Closes it at once (shutdown, once the grace is over).
    pub(crate) cut: CancellationToken,
    /// When the first head's first byte came, as the version check saw it.
    pub(crate) first_byte: Option<Instant>,
    /// The requests of this HTTP/1 connection out upstream (see [`crate::half_close`]).
    pub(crate) sending: Option<Arc<Sending>>,
}

/// What every HTTP/2 connection opens with (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Client {
    /// Serves the connection with the HTTP version its first bytes show, until it ends,
    /// `drain` asks it to finish (it then closes after the requests in hand), or `cut`.
    ///
    /// A plain `fn` returning a block: an `async fn` keeps a second copy of its
    /// arguments for as long as it runs, and this runs as long as the connection.
    pub(crate) fn serve(mut self, stream: TcpStream) -> impl Future<Output = ()> + Send {
        let (remote, drain, cut) = (self.remote, self.drain.clone(), self.cut.clone());
        async move {
            let first = tokio::select! {
                first = tokio::time::timeout(self.protocols.header_timeout, first_bytes(&stream)) => first,
                // A connection accepted just before shutdown may have its request on the way:
                // it is served if its first bytes come soon after the drain begins.
                () = async {
                    drain.cancelled().await;
                    tokio::time::sleep(FIRST_BYTES_AT_SHUTDOWN).await;
                } => return,
                () = cut.cancelled() => return,
            };
            let ended = match first {
                // Boxed: an HTTP/2 connection's state is twice an HTTP/1 one's, and inline
                // it would size every connection's task.
                Ok(Ok(First { h2: true, .. })) => {
                    Box::pin(self.serve_http2(TokioIo::new(stream))).await
                }
                Ok(Ok(First { at, head, .. })) => {
                    self.first_byte = Some(at);
                    let sending = Arc::new(Sending::default());
                    self.sending = Some(sending.clone());
                    let io = HalfClose::new(stream, sending, self.protocols.body_idle, head);
                    self.serve_http1(TokioIo::new(io)).await
                }
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
    }

    /// (A plain `fn`, as [`Client::serve`] is.)
    fn serve_http1<I: Io>(
        self,
        io: I,
    ) -> impl Future<Output = Option<Result<(), hyper::Error>>> + Send {
        let (drain, cut) = (self.drain.clone(), self.cut.clone());
        let client = Arc::new(self);
        let service = {
            let client = client.clone();
            service_fn(move |req: Request<Incoming>| {
                // Now, before hyper reads on: the body stays in the kernel until the
                // proxy asks for it (see `half_close`).
                let req = match &client.sending {
                    Some(sending) => req.map(|body| sending.hold(body)),
                    None => req.map(Unread::free),
                };
                client.answer(req)
            })
        };
        async move {
            // Built and pinned here: moved into `until_closed` it would take its room
            // twice there.
            let conn = http1_for(&client.protocols, client.first_byte)
                .serve_connection(io, service)
                .with_upgrades();
            let conn = std::pin::pin!(conn);
            until_closed(conn, |c| c.graceful_shutdown(), drain.cancelled(), &cut).await
        }
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
                let open = Arc::new(Idle::opened(&idle));
                if req.method() == Method::CONNECT {
                    // A tunnel is an open stream until it closes, long after its `200`.
                    req.extensions_mut()
                        .insert(KeepWhileOpen::new(open.clone()));
                }
                let req = req.map(Unread::free);
                let answer = client.answer(req);
                async move {
                    let Ok(response) = answer.await;
                    // The stream is open until its response body has been sent.
                    Ok::<_, Infallible>(response.map(|b| body::boxed(Holding::new(b, open))))
                }
            })
        };
        let conn = std::pin::pin!(client.protocols.http2.serve_connection(io, service));
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
    ///
    /// The request goes to [`Proxy::handle`] now, and the future is a plain one: hyper
    /// keeps it, in a box of its size, for as long as the request waits, and an `async`
    /// block here would hold the request, and that future, twice.
    fn answer(self: &Arc<Self>, mut req: Request<Unread<Incoming>>) -> Answer<impl Handled> {
        if let Some(keep) = &self.keep {
            req.extensions_mut().insert(keep.clone());
        }
        let (local, remote, inside) = (self.local, self.remote, self.inside.as_deref());
        let sending = self.sending.as_ref();
        Answer {
            handled: self.proxy.handle(req, local, remote, inside, sending),
            client: self.clone(),
        }
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
            user,
        } = tunnel;
        // The outer HTTP/2 stream stays open while the tunnel is.
        self.keep = keep;
        let upgraded = tokio::select! {
            upgraded = on_upgrade => upgraded,
            () = self.cut.cancelled() => return,
        };
        let (Ok(upgraded), Some(intercept)) = (upgraded, self.proxy.intercept()) else {
            tracing::debug!(%host, "client left before the tunnel opened");
            return;
        };
        let within = self.protocols.header_timeout;
        let accepted = tokio::select! {
            accepted = intercept.accept(upgraded, &host, within) => accepted,
            () = self.cut.cancelled() => None,
        };
        let Some(accepted) = accepted else {
            return;
        };
        let scheme = accepted.scheme;
        self.inside = Some(Arc::new(Inside {
            host,
            port,
            scheme,
            user,
        }));
        // Its heads have their own budget, from the start, and its end is the tunnel's.
        self.first_byte = None;
        self.sending = None;
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

/// What [`Proxy::handle`] returns.
trait Handled: Future<Output = Response<Body>> + Send + 'static {}
impl<F: Future<Output = Response<Body>> + Send + 'static> Handled for F {}

pin_project_lite::pin_project! {
    /// The proxy's answer to one request of a connection; one that opened an
    /// intercepted tunnel spawns its serving.
    struct Answer<F> {
        #[pin]
        handled: F,
        client: Arc<Client>,
    }
}

impl<F: Handled> Future for Answer<F> {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(this.handled.poll(cx));
        if let Some(tunnel) = response.extensions_mut().remove::<Intercepted>() {
            let inner = Client {
                inside: None,
                keep: None,
                ..Client::clone(this.client)
            };
            this.client
                .connections
                .spawn(inner.serve_intercepted(tunnel));
        }
        Poll::Ready(Ok(response))
    }
}

/// What a connection's first bytes show, peeked so that hyper reads them again.
/// (hyper-util's `auto` connection reads them itself and hands them back in front of
/// the socket, which grows hyper's read buffer on the first request of every
/// connection.)
struct First {
    /// The client opens with HTTP/2's preface.
    h2: bool,
    /// When the first byte was seen: the first head's budget starts there.
    at: Instant,
    /// How long the first head is, when the peek saw all of it (see
    /// [`HalfClose::new`]).
    head: Option<usize>,
}

/// The most of a first head the version check looks at.
const FIRST_PEEK: usize = 4096;

async fn first_bytes(stream: &TcpStream) -> std::io::Result<First> {
    use futures_util::FutureExt;
    let mut pause = Duration::from_millis(5);
    let mut first_byte = None;
    loop {
        stream.readable().await?;
        // On the heap, and only once bytes are there, for the moment of one peek: the
        // connection's task is sized by its largest state and lives as long as the
        // connection, and buffers held while many new connections wait would stay
        // behind in the allocator's pages.
        let mut space = Vec::with_capacity(FIRST_PEEK);
        let mut first = ReadBuf::uninit(space.spare_capacity_mut());
        let peek = std::future::poll_fn(|cx| stream.poll_peek(cx, &mut first));
        let Some(peeked) = peek.now_or_never() else {
            continue;
        };
        let n = peeked?;
        let at = *first_byte.get_or_insert_with(Instant::now);
        let first = first.filled();
        if n == 0 || !H2_PREFACE.starts_with(&first[..n.min(H2_PREFACE.len())]) {
            let head = first.windows(4).position(|w| w == b"\r\n\r\n");
            let head = head.map(|end| end + 4);
            return Ok(First {
                h2: false,
                at,
                head,
            });
        }
        if n >= H2_PREFACE.len() {
            return Ok(First {
                h2: true,
                at,
                head: None,
            });
        }
        // Part of the preface: peeking again at once would see the same bytes. A client
        // that stalls there is looked at less and less often.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// The HTTP/1 settings for a connection whose first head began at `first_byte`.
/// `client_header_timeout` is the whole budget of a head from its first byte, and
/// hyper's timer starts only once the version check is done: a head that begins like
/// HTTP/2's preface (`P`…, as POST, PUT and PATCH do) and trickles in has spent part of
/// it already, so hyper gets what is left (for the rest of the connection too, which
/// only a client trickling its first bytes ever sees).
fn http1_for(protocols: &Protocols, first_byte: Option<Instant>) -> Cow<'_, http1::Builder> {
    let spent = first_byte.map_or(Duration::ZERO, |at| at.elapsed());
    if spent < Duration::from_millis(10) {
        return Cow::Borrowed(&protocols.http1);
    }
    let mut http1 = protocols.http1.clone();
    let left = protocols.header_timeout.saturating_sub(spent);
    http1.header_read_timeout(left.max(Duration::from_millis(1)));
    Cow::Owned(http1)
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
    mut conn: Pin<&mut C>,
    shut: impl FnOnce(Pin<&mut C>),
    drain: impl Future<Output = ()>,
    cut: &CancellationToken,
) -> Option<Result<(), E>>
where
    C: Future<Output = Result<(), E>>,
{
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
