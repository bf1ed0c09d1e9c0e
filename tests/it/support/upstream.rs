//! A recording upstream: a real hyper server on 127.0.0.1:0.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use super::*;

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Request method.
    pub method: Method,
    /// Path and query exactly as received (`/a/b?c=d`).
    pub path: String,
    /// HTTP version the request arrived with (HTTP/2 when ALPN chose h2).
    pub version: Version,
    /// Request headers as received.
    pub headers: HeaderMap,
    /// The whole request body (empty on a bulk upstream, which keeps only a digest).
    pub body: Bytes,
    /// When the request head arrived.
    pub at: Instant,
    /// Index (0-based, in accept order) of the TCP connection it came on.
    pub conn: usize,
}

impl Seen {
    /// The first value of header `name` as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// What an upstream handler answers.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Response headers, appended in order (a name may repeat).
    pub headers: Vec<(String, String)>,
    /// Response body.
    pub body: Bytes,
    /// How long to wait before answering.
    pub delay: Duration,
}

impl Reply {
    /// `200 OK` with this body.
    pub fn ok(body: impl Into<Bytes>) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: body.into(),
            delay: Duration::ZERO,
        }
    }

    /// An empty response with this status.
    pub fn status(code: u16) -> Reply {
        Reply {
            status: code,
            ..Reply::ok(Bytes::new())
        }
    }

    /// Adds a response header.
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Replaces the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Reply {
        self.body = body.into();
        self
    }

    /// Waits this long before answering.
    pub fn delay(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }
}

/// The function an [`Upstream`] answers every request with.
pub type Handler = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// Length and order-sensitive checksum of a (possibly huge) byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Digest {
    /// Number of bytes.
    pub len: u64,
    /// Checksum of the bytes in order.
    pub hash: u64,
}

enum Mode {
    Record(Handler),
    Bulk,
}

struct State {
    requests: Mutex<Vec<Seen>>,
    uploads: Mutex<Vec<Digest>>,
    /// Request body bytes a bulk upstream has received so far, counted as they arrive.
    received: AtomicU64,
    /// Opens the gate of `GET /bytes/N?hold=M` responses.
    gate: Arc<Gate>,
    connections: AtomicUsize,
    /// When each TCP connection was accepted, in accept order.
    accepted: Mutex<Vec<Instant>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Default for State {
    fn default() -> Self {
        State {
            requests: Mutex::default(),
            uploads: Mutex::default(),
            received: AtomicU64::new(0),
            gate: Arc::default(),
            connections: AtomicUsize::new(0),
            accepted: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        }
    }
}

/// A real hyper server on 127.0.0.1:0 (HTTP/1.1; with TLS also h2 by ALPN) that records
/// every request it receives. Stops, with all its connections, when dropped.
pub struct Upstream {
    addr: SocketAddr,
    tls: bool,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Upstream {
    /// Plain HTTP upstream answering with `handler`.
    pub async fn start(handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Upstream {
        Upstream::start_at(LOCALHOST, handler).await
    }

    /// Like [`Upstream::start`] on another loopback address (e.g. 127.0.0.2), so a test
    /// can have upstreams that are different hosts to the proxy.
    pub async fn start_at(
        ip: IpAddr,
        handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
    ) -> Upstream {
        Upstream::spawn(ip, Mode::Record(Arc::new(handler)), None).await
    }

    /// HTTPS upstream (h2 and HTTP/1.1 by ALPN) with `ca`'s server certificate.
    pub async fn start_tls(
        handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
        ca: &TestCa,
    ) -> Upstream {
        let acceptor = TlsAcceptor::from(Arc::new(ca.server_config()));
        Upstream::spawn(LOCALHOST, Mode::Record(Arc::new(handler)), Some(acceptor)).await
    }

    /// HTTPS upstream offering HTTP/1.1 alone by ALPN, as many API servers do: every
    /// request on a connection is a TLS read and write of its own.
    pub async fn start_tls_http1(
        handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
        ca: &TestCa,
    ) -> Upstream {
        let acceptor = TlsAcceptor::from(Arc::new(ca.server_config_http1()));
        Upstream::spawn(LOCALHOST, Mode::Record(Arc::new(handler)), Some(acceptor)).await
    }

    /// Plain HTTP upstream answering 200 with the request body.
    pub async fn echo() -> Upstream {
        Upstream::start(|seen| Reply::ok(seen.body.clone())).await
    }

    /// Plain HTTP upstream for big bodies, holding only digests: `GET /bytes/N` streams
    /// N bytes of [`pattern`] (with `?hold=M`, stops after M bytes until
    /// [`Upstream::release`]); any other request has its body hashed as it arrives (see
    /// [`Upstream::received`], [`Upstream::uploads`]) and is answered `200` with
    /// `"<len> <hash>"`.
    pub async fn start_bulk() -> Upstream {
        Upstream::spawn(LOCALHOST, Mode::Bulk, None).await
    }

    async fn spawn(ip: IpAddr, mode: Mode, tls: Option<TlsAcceptor>) -> Upstream {
        assert!(
            ip.is_loopback(),
            "tests only ever listen on loopback, not {ip}"
        );
        let listener = TcpListener::bind((ip, 0)).await.expect("bind upstream");
        let addr = listener.local_addr().expect("upstream address");
        let state = Arc::new(State::default());
        let is_tls = tls.is_some();
        let task = tokio::spawn(serve_upstream(listener, tls, state.clone(), Arc::new(mode)));
        Upstream {
            addr,
            tls: is_tls,
            state,
            task,
        }
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `host:port` as the proxy should send it in `Host`.
    pub fn authority(&self) -> String {
        self.addr.to_string()
    }

    /// A URL on this upstream: `http(s)://127.0.0.1:PORT<path>`.
    pub fn url(&self, path: &str) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}{path}", self.addr)
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<Seen> {
        self.state.requests.lock().unwrap().clone()
    }

    /// The paths of every request received so far, in arrival order.
    pub fn paths(&self) -> Vec<String> {
        self.requests().into_iter().map(|s| s.path).collect()
    }

    /// Digests of the bodies a bulk upstream received, in arrival order.
    pub fn uploads(&self) -> Vec<Digest> {
        self.state.uploads.lock().unwrap().clone()
    }

    /// Request body bytes a bulk upstream has received so far, including bodies still
    /// arriving.
    pub fn received(&self) -> u64 {
        self.state.received.load(Ordering::SeqCst)
    }

    /// Lets held `GET /bytes/N?hold=M` responses send the rest of their bytes.
    pub fn release(&self) {
        self.state.gate.open();
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// When each TCP connection was accepted, in accept order: for pacing of tunnels,
    /// where a request's own arrival also includes the client's TLS handshake.
    pub fn accepted_at(&self) -> Vec<Instant> {
        self.state.accepted.lock().unwrap().clone()
    }

    /// Requests being handled right now (head received, response not yet fully sent).
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests that were ever in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` requests have arrived; panics after [`BOUND`].
    pub async fn wait_for_requests(&self, n: usize) {
        let arrived = within_bound(async || (self.requests().len() >= n).then_some(())).await;
        let seen = self.requests().len();
        assert!(
            arrived.is_some(),
            "upstream saw {seen} requests, expected {n}"
        );
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection.
        self.task.abort();
    }
}

async fn serve_upstream(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    state: Arc<State>,
    mode: Arc<Mode>,
) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: back off instead of spinning on the error.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = {
            // Under the lock, so the index and the accept time stay in step.
            let mut accepted = state.accepted.lock().unwrap();
            accepted.push(Instant::now());
            state.connections.fetch_add(1, Ordering::SeqCst)
        };
        let (state, mode, tls) = (state.clone(), mode.clone(), tls.clone());
        conns.spawn(async move {
            let service = service_fn(move |req| answer(req, conn, state.clone(), mode.clone()));
            let builder = auto::Builder::new(TokioExecutor::new());
            match tls {
                None => {
                    let _ = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    }
                }
            }
        });
        while conns.try_join_next().is_some() {}
    }
}

/// Counts a request as in flight from its head until its response body is dropped.
struct InFlight(Arc<State>);

impl InFlight {
    fn enter(state: &Arc<State>) -> InFlight {
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted in flight until hyper drops it,
/// which happens once it has been written out (or the connection died).
struct Guarded {
    inner: UnsyncBoxBody<Bytes, Infallible>,
    _in_flight: InFlight,
}

impl HttpBody for Guarded {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn answer(
    req: Request<Incoming>,
    conn: usize,
    state: Arc<State>,
    mode: Arc<Mode>,
) -> Result<Response<Guarded>, Infallible> {
    let at = Instant::now();
    let in_flight = InFlight::enter(&state);
    let (parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.to_string(), |p| p.as_str().to_string());
    let mut seen = Seen {
        method: parts.method,
        path,
        version: parts.version,
        headers: parts.headers,
        body: Bytes::new(),
        at,
        conn,
    };
    let response = match &*mode {
        Mode::Record(handler) => {
            // A body cut short by the client is recorded as far as it arrived.
            let mut body = body;
            let mut buf = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
            }
            seen.body = Bytes::from(buf);
            let reply = handler(&seen);
            // Recorded before the delay so a test can see a request that is still waiting.
            state.requests.lock().unwrap().push(seen);
            if !reply.delay.is_zero() {
                // A slow upstream, as the test's handler asked.
                tokio::time::sleep(reply.delay).await;
            }
            let mut resp = Response::new(Full::new(reply.body).boxed_unsync());
            *resp.status_mut() = StatusCode::from_u16(reply.status).expect("valid status");
            for (name, value) in &reply.headers {
                resp.headers_mut().append(
                    http::HeaderName::from_bytes(name.as_bytes()).expect("header name"),
                    http::HeaderValue::from_str(value).expect("header value"),
                );
            }
            resp
        }
        Mode::Bulk => {
            let download = parts
                .uri
                .path()
                .strip_prefix("/bytes/")
                .and_then(|n| n.parse::<u64>().ok());
            let hold = parts
                .uri
                .query()
                .and_then(|q| q.strip_prefix("hold="))
                .and_then(|n| n.parse::<u64>().ok());
            match (seen.method == Method::GET, download) {
                (true, Some(len)) => {
                    state.requests.lock().unwrap().push(seen);
                    let gate = hold.map(|at| (at, state.gate.clone()));
                    Response::new(PatternBody::new(len, gate).boxed_unsync())
                }
                _ => {
                    let mut body = body;
                    let mut hasher = Hasher::default();
                    while let Some(Ok(frame)) = body.frame().await {
                        if let Ok(data) = frame.into_data() {
                            state
                                .received
                                .fetch_add(data.len() as u64, Ordering::SeqCst);
                            hasher.update(&data);
                        }
                    }
                    let digest = hasher.finish();
                    state.requests.lock().unwrap().push(seen);
                    state.uploads.lock().unwrap().push(digest);
                    let text = format!("{} {}", digest.len, digest.hash);
                    Response::new(Full::new(Bytes::from(text)).boxed_unsync())
                }
            }
        }
    };
    Ok(response.map(|inner| Guarded {
        inner,
        _in_flight: in_flight,
    }))
}

/// An upstream that answers the first `refusals` requests with `refusal()` and 200
/// "ok" after that.
pub async fn refusing(
    refusals: usize,
    refusal: impl Fn() -> Reply + Send + Sync + 'static,
) -> Upstream {
    let count = Arc::new(AtomicUsize::new(0));
    Upstream::start(move |_| {
        if count.fetch_add(1, Ordering::SeqCst) < refusals {
            refusal()
        } else {
            Reply::ok("ok")
        }
    })
    .await
}
