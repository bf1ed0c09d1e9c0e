//! Shared parts for the integration tests: real loopback servers on port 0, the proxy
//! on port 0, and real clients (curl, Python's urllib, reqwest) driven against them.
//!
//! Everything listens on 127.0.0.1 only, and everything is bounded: servers stop when
//! their handle is dropped, child processes are killed if they outlive their timeout.

// Each test file compiles this module on its own and uses a different part of it.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
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
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

/// 127.0.0.1, where everything listens unless a test asks for another loopback address.
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Upper bound for any single child process or network exchange a test starts, so a
/// hang fails the test instead of stalling the suite.
pub const BOUND: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------
// Upstream: a recording HTTP server
// ---------------------------------------------------------------------------------

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
        let deadline = Instant::now() + BOUND;
        while self.requests().len() < n {
            assert!(
                Instant::now() < deadline,
                "upstream saw {} requests, expected {n}",
                self.requests().len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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

// ---------------------------------------------------------------------------------
// Big bodies: a generated pattern and a streaming digest
// ---------------------------------------------------------------------------------

/// The pattern repeats every this many bytes: a prime, so it never lines up with
/// buffer or frame sizes and a dropped or repeated buffer changes the digest.
const PERIOD: usize = 65_521;
/// Largest slice [`pattern`] hands out at once.
const CHUNK: usize = 64 * 1024;

fn pattern_table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        // xorshift: cheap pseudo-random bytes, so compression or run-length tricks
        // anywhere on the path cannot make the transfer look right by accident.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let period: Vec<u8> = (0..PERIOD)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        // One extra chunk so any CHUNK-long slice starting inside the period is contiguous.
        period
            .iter()
            .copied()
            .cycle()
            .take(PERIOD + CHUNK)
            .collect()
    })
}

/// Bytes `offset..offset+len` of the endless test pattern (`len` ≤ 64 KiB), zero-copy.
pub fn pattern(offset: u64, len: usize) -> Bytes {
    assert!(len <= CHUNK);
    let start = (offset % PERIOD as u64) as usize;
    Bytes::from_static(&pattern_table()[start..start + len])
}

/// The digest of the first `len` bytes of [`pattern`].
pub fn pattern_digest(len: u64) -> Digest {
    let mut hasher = Hasher::default();
    let mut offset = 0;
    while offset < len {
        let n = (len - offset).min(CHUNK as u64) as usize;
        hasher.update(&pattern(offset, n));
        offset += n as u64;
    }
    hasher.finish()
}

/// Computes a [`Digest`] over bytes fed in pieces of any size.
#[derive(Default)]
pub struct Hasher {
    len: u64,
    hash: u64,
    tail: Vec<u8>,
}

impl Hasher {
    /// Feeds the next bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        // Words are hashed whole, so first complete a word left over from the last call.
        if !self.tail.is_empty() {
            let need = (8 - self.tail.len()).min(data.len());
            self.tail.extend_from_slice(&data[..need]);
            data = &data[need..];
            if self.tail.len() < 8 {
                return;
            }
            let word = u64::from_le_bytes(self.tail[..].try_into().unwrap());
            self.mix(word);
            self.tail.clear();
        }
        let mut words = data.chunks_exact(8);
        for word in &mut words {
            self.mix(u64::from_le_bytes(word.try_into().unwrap()));
        }
        self.tail.extend_from_slice(words.remainder());
    }

    fn mix(&mut self, word: u64) {
        self.hash = (self.hash ^ word)
            .wrapping_mul(0x0000_0100_0000_01B3)
            .rotate_left(29);
    }

    /// The digest of everything fed so far.
    pub fn finish(mut self) -> Digest {
        if !self.tail.is_empty() {
            let mut last = [0u8; 8];
            last[..self.tail.len()].copy_from_slice(&self.tail);
            self.mix(u64::from_le_bytes(last));
        }
        Digest {
            len: self.len,
            hash: self.hash,
        }
    }
}

/// Held downloads wait here until [`Upstream::release`].
#[derive(Default)]
struct Gate {
    /// Whether the gate is open, and the bodies waiting for it to open.
    state: Mutex<(bool, Vec<Waker>)>,
}

impl Gate {
    fn open(&self) {
        let waiting = {
            let mut state = self.state.lock().unwrap();
            state.0 = true;
            std::mem::take(&mut state.1)
        };
        waiting.into_iter().for_each(Waker::wake);
    }

    /// Ready once open; otherwise registers `cx` to be woken by [`Gate::open`].
    fn poll_open(&self, cx: &Context<'_>) -> Poll<()> {
        let mut state = self.state.lock().unwrap();
        if state.0 {
            return Poll::Ready(());
        }
        if !state.1.iter().any(|w| w.will_wake(cx.waker())) {
            state.1.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// A response body of `remaining` pattern bytes, generated as it is sent; with a gate
/// `(at, gate)`, it pauses after `at` bytes until the gate opens.
struct PatternBody {
    offset: u64,
    remaining: u64,
    gate: Option<(u64, Arc<Gate>)>,
}

impl PatternBody {
    fn new(len: u64, gate: Option<(u64, Arc<Gate>)>) -> PatternBody {
        PatternBody {
            offset: 0,
            remaining: len,
            gate,
        }
    }
}

impl HttpBody for PatternBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let mut n = self.remaining.min(CHUNK as u64);
        let offset = self.offset;
        if let Some((at, gate)) = &self.gate {
            if offset >= *at {
                if gate.poll_open(cx).is_pending() {
                    return Poll::Pending;
                }
                self.gate = None;
            } else {
                // Stop exactly at the gate so the client can receive every byte before it.
                n = n.min(*at - offset);
            }
        }
        let n = n as usize;
        let chunk = pattern(self.offset, n);
        self.offset += n as u64;
        self.remaining -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

// ---------------------------------------------------------------------------------
// Servers that misbehave
// ---------------------------------------------------------------------------------

/// A TCP listener on 127.0.0.1:0 that accepts connections, reads whatever arrives and
/// never writes a byte: a TLS handshake never completes, a request is never answered.
pub struct Silent {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Silent {
    /// Starts listening.
    pub async fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind silent");
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                conns.spawn(async move {
                    let mut buf = [0u8; 4096];
                    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        Silent {
            addr,
            connections,
            task,
        }
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback address nothing listens on: a port that was bound and released.
pub fn closed_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().unwrap()
}

// ---------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------

/// A throwaway CA (rcgen) and a server certificate it signed for `localhost` and
/// `127.0.0.1`.
pub struct TestCa {
    ca_pem: String,
    cert: CertificateDer<'static>,
    key: Vec<u8>,
    /// The server certificate and key as PEM, for servers that read files (nginx).
    cert_pem: String,
    key_pem: String,
    dir: tempfile::TempDir,
}

impl TestCa {
    /// Generates the CA and the server certificate.
    pub fn new() -> TestCa {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name
            .push(DnType::CommonName, "tollgate test CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");

        let key = KeyPair::generate().expect("server key");
        let mut leaf =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, "localhost");
        leaf.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = leaf
            .signed_by(&key, &rcgen::Issuer::from_params(&ca, &ca_key))
            .expect("server certificate");

        let dir = tempfile::tempdir().expect("tempdir");
        let ca_pem = ca_cert.pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).expect("write ca.pem");
        TestCa {
            ca_pem,
            cert: cert.der().clone(),
            key: key.serialize_der(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            dir,
        }
    }

    /// Writes the server certificate and its key as `cert.pem` and `key.pem` in `dir`.
    pub fn write_server_pem(&self, dir: &std::path::Path) {
        std::fs::write(dir.join("cert.pem"), &self.cert_pem).expect("write cert.pem");
        std::fs::write(dir.join("key.pem"), &self.key_pem).expect("write key.pem");
    }

    /// The CA certificate as PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A file holding the CA certificate as PEM (for `ca_file` and `curl --cacert`).
    pub fn ca_pem_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A rustls server configuration with the server certificate, offering h2 and
    /// HTTP/1.1 by ALPN.
    pub fn server_config(&self) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], key)
            .expect("server TLS config");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }
}

impl TestCa {
    /// [`TestCa::server_config`] offering HTTP/1.1 alone by ALPN.
    pub fn server_config_http1(&self) -> rustls::ServerConfig {
        let mut config = self.server_config();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}

// ---------------------------------------------------------------------------------
// The proxy
// ---------------------------------------------------------------------------------

/// tollgate serving on 127.0.0.1:0 in this test's runtime.
pub struct Proxy {
    /// The proxy's listening address.
    pub addr: SocketAddr,
    /// The admin listener's address, when started with [`start_proxy_with_admin`].
    pub admin: Option<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// Parses `config_toml` (no `listen` key needed), binds 127.0.0.1:0 and spawns
/// `tollgate::server::run` on it, on the test's runtime.
pub async fn start_proxy(config_toml: &str) -> Proxy {
    launch(config_toml, false).await
}

/// Like [`start_proxy`], with the admin endpoints on another 127.0.0.1:0 listener; see
/// [`admin_get`].
pub async fn start_proxy_with_admin(config_toml: &str) -> Proxy {
    launch(config_toml, true).await
}

/// What every test config that reaches the loopback upstreams says: tollgate refuses
/// loopback destinations unless `[access] allow` names them.
pub const ALLOW_LOOPBACK: &str = "\n[access]\nallow = [\"127.0.0.0/8\", \"::1\"]\n";

/// `config_toml` with loopback allowed ([`ALLOW_LOOPBACK`]), unless it has an `[access]`
/// table of its own (a test of the policy says what it allows).
pub fn allowing_loopback(config_toml: &str) -> String {
    if config_toml.contains("[access]") {
        config_toml.to_string()
    } else {
        format!("{config_toml}{ALLOW_LOOPBACK}")
    }
}

/// Like [`start_proxy_with_admin`], loading the file at `path` as the binary does, so
/// that a reload (`POST /reload`) reads it again. The file must allow loopback itself.
pub async fn start_proxy_from_file(path: &Path) -> Proxy {
    let config = tollgate::config::Config::load(path)
        .unwrap_or_else(|e| panic!("test config does not load: {e}"));
    launch_config(config, true).await
}

async fn launch(config_toml: &str, with_admin: bool) -> Proxy {
    let config_toml = allowing_loopback(config_toml);
    let config = tollgate::config::Config::parse(&config_toml, "test.toml")
        .unwrap_or_else(|e| panic!("test config does not parse: {e}"));
    launch_config(config, with_admin).await
}

async fn launch_config(config: tollgate::config::Config, with_admin: bool) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().unwrap();
    let admin = match with_admin {
        true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
        false => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        // A dropped sender also means "stop", so a forgotten proxy still drains.
        let shutdown = async {
            let _ = stopped.await;
        };
        let result = tollgate::server::run(listener, admin, config, shutdown).await;
        if let Err(e) = result {
            panic!("tollgate::server::run failed: {e}");
        }
    });
    Proxy {
        addr,
        admin: admin_addr,
        stop: Some(stop),
        task: Some(task),
    }
}

/// Opens a tunnel to `authority` as an HTTP/2 client does: a `CONNECT` stream on a
/// prior-knowledge h2 connection to the proxy; asserts the `200` and returns the tunnel.
pub async fn h2_connect(proxy: &Proxy, authority: &str) -> TokioIo<hyper::upgrade::Upgraded> {
    let tcp = TcpStream::connect(proxy.addr)
        .await
        .expect("connect to the proxy");
    let (mut send, conn) = hyper::client::conn::http2::handshake::<
        _,
        _,
        http_body_util::Empty<Bytes>,
    >(TokioExecutor::new(), TokioIo::new(tcp))
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let connect = Request::connect(authority)
        .body(http_body_util::Empty::new())
        .expect("a CONNECT request");
    let resp = send.send_request(connect).await.expect("CONNECT answered");
    assert_eq!(resp.status(), 200);
    TokioIo::new(hyper::upgrade::on(resp).await.expect("the tunnel opens"))
}

/// GETs `path` from the proxy's admin listener and returns the body; panics unless
/// the answer is 200.
pub async fn admin_get(proxy: &Proxy, path: &str) -> String {
    let admin = proxy
        .admin
        .expect("admin_get needs a proxy from start_proxy_with_admin");
    let resp = reqwest_direct()
        .get(format!("http://{admin}{path}"))
        .send()
        .await
        .expect("admin request");
    let status = resp.status();
    let body = resp.text().await.expect("admin body");
    assert_eq!(status, 200, "GET {path} on the admin listener: {body}");
    body
}

impl Proxy {
    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Completes the shutdown future passed to the server, without waiting.
    pub fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Whether the server has returned.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Triggers shutdown and waits (at most [`BOUND`]) for the server to return.
    pub async fn shutdown(mut self) {
        self.begin_shutdown();
        let task = self.task.take().expect("not yet joined");
        match tokio::time::timeout(BOUND, task).await {
            Err(_) => panic!("the server did not return within {BOUND:?} of shutdown"),
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(_) => {}
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

// ---------------------------------------------------------------------------------
// Real clients
// ---------------------------------------------------------------------------------

/// A command with every `*_proxy` variable removed from its environment (curl and
/// Python read them), then `env` applied; killed if dropped before it exits.
pub fn clean_command(program: &str, env: &[(&str, &str)]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|n| n.to_ascii_lowercase().ends_with("_proxy"))
        {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// What one curl invocation produced.
#[derive(Debug)]
pub struct CurlOutput {
    /// curl's exit code.
    pub code: i32,
    /// Status of the last response (0 if none arrived).
    pub status: u16,
    /// Every response head curl received (`-D`), including a proxy's CONNECT answer.
    pub headers: String,
    /// The response body (stdout).
    pub body: Vec<u8>,
    /// curl's error messages.
    pub stderr: String,
}

impl CurlOutput {
    /// The last response head (after any CONNECT answer or `100 Continue`).
    pub fn final_head(&self) -> &str {
        self.headers
            .split("\r\n\r\n")
            .filter(|block| !block.trim().is_empty())
            .last()
            .unwrap_or("")
    }

    /// Every value of header `name` in the last response head.
    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.final_head()
            .lines()
            .skip(1)
            .filter_map(|line| line.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .collect()
    }

    /// The first value of header `name` in the last response head.
    pub fn header(&self, name: &str) -> Option<String> {
        self.header_all(name).into_iter().next()
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Its `Content-Length`, if it has a valid one.
    pub fn content_length(&self) -> Option<usize> {
        self.header("content-length").and_then(|v| v.parse().ok())
    }
}

/// Runs `curl -q -sS -D <file> <args>` with a proxy-free environment plus `env`, bounded
/// by [`BOUND`].
pub async fn curl(args: &[&str], env: &[(&str, &str)]) -> CurlOutput {
    let dir = tempfile::tempdir().expect("tempdir");
    let head_file = dir.path().join("head");
    let mut cmd = clean_command("curl", env);
    // -q first: ignore any ~/.curlrc on the machine.
    cmd.args(["-q", "-sS", "--max-time", "30", "-D"])
        .arg(&head_file)
        .args(args);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("curl finished in time")
        .expect("curl runs");
    let headers = std::fs::read_to_string(&head_file).unwrap_or_default();
    let status = headers
        .lines()
        .rfind(|l| l.starts_with("HTTP/"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    CurlOutput {
        code: out.status.code().unwrap_or(-1),
        status,
        headers,
        body: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// What a Python script printed.
#[derive(Debug)]
pub struct PyOutput {
    /// Exit code.
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `python3 -I -c <script>` with a proxy-free environment plus `env`, bounded by
/// [`BOUND`].
pub async fn python(script: &str, env: &[(&str, &str)]) -> PyOutput {
    let mut cmd = clean_command("python3", env);
    cmd.args(["-I", "-c", script]);
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("python finished in time")
        .expect("python3 runs");
    PyOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A reqwest client that sends everything through `proxy` (and ignores the
/// environment's proxy settings), optionally trusting `ca`.
pub fn reqwest_via(proxy: &Proxy, ca: Option<&TestCa>) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).expect("proxy URL"))
        .timeout(BOUND);
    if let Some(ca) = ca {
        builder = builder.add_root_certificate(
            reqwest::Certificate::from_pem(ca.ca_pem().as_bytes()).expect("CA PEM"),
        );
    }
    builder.build().expect("reqwest client")
}

/// Sends a GET of every URL through `proxy` at once (concurrent requests open
/// connections of their own) and returns the statuses, in order.
pub async fn get_all_at_once(proxy: &Proxy, urls: impl IntoIterator<Item = String>) -> Vec<u16> {
    let client = reqwest_via(proxy, None);
    let calls = urls.into_iter().map(|url| {
        let client = client.clone();
        async move { client.get(url).send().await.unwrap().status().as_u16() }
    });
    futures_util::future::join_all(calls).await
}

/// Sends `GET /first` through `proxy` and checks it was answered 200. In a group that
/// lets one request through per period, this takes the slot: the next request waits.
pub async fn take_the_slot(proxy: &Proxy, upstream: &Upstream) {
    let first = reqwest_via(proxy, None)
        .get(upstream.url("/first"))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
}

/// A reqwest client that talks to servers directly, never through a proxy.
pub fn reqwest_direct() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(BOUND)
        .build()
        .expect("reqwest client")
}

/// A response read by [`raw_request`].
#[derive(Debug)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Headers in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body (by `Content-Length`, else up to the connection's close).
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Its `Content-Length`, if it has a valid one.
    pub fn content_length(&self) -> Option<usize> {
        self.header("content-length").and_then(|v| v.parse().ok())
    }
}

/// Writes `request` verbatim to `addr` and reads one response; for requests no real
/// client will send (malformed CONNECT targets).
pub async fn raw_request(addr: SocketAddr, request: &[u8]) -> RawResponse {
    tokio::time::timeout(BOUND, async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request).await.expect("write request");
        read_response(&mut stream).await
    })
    .await
    .expect("response within the bound")
}

/// Reads from `stream` to the end of a message head (its blank line); returns the head
/// and the bytes read past it (the start of the body, if any).
pub async fn read_head(stream: &mut TcpStream) -> (Vec<u8>, Vec<u8>) {
    let mut buf = Vec::new();
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.expect("read a head");
        assert!(n > 0, "connection closed before a whole head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let rest = buf.split_off(end);
    (buf, rest)
}

/// Reads one response from `stream`, which stays open for the next request (when the
/// response has a `Content-Length`; without one, the body runs to the close). Bytes
/// read past the response are lost: not for pipelined requests.
pub async fn read_response(stream: &mut TcpStream) -> RawResponse {
    let (mut response, mut body) = read_response_head(stream).await;
    match response.content_length() {
        Some(len) => {
            while body.len() < len {
                let mut chunk = [0u8; 4096];
                let n = stream.read(&mut chunk).await.expect("read body");
                assert!(n > 0, "connection closed inside the body");
                body.extend_from_slice(&chunk[..n]);
            }
            body.truncate(len);
        }
        None => {
            let _ = stream.read_to_end(&mut body).await;
        }
    }
    response.body = body;
    response
}

/// Reads a response head from `stream`: the response with its status and headers and an
/// empty body, and the bytes read past the head.
pub async fn read_response_head(stream: &mut TcpStream) -> (RawResponse, Vec<u8>) {
    let (head, rest) = read_head(stream).await;
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let response = RawResponse {
        status,
        headers,
        body: Vec::new(),
    };
    (response, rest)
}

/// Waits until `group`'s queue (waiting requests and the one at its head) holds `n`,
/// as `/metrics` on the admin listener shows it.
pub async fn wait_queued(proxy: &Proxy, group: &str, n: usize) {
    let line = format!("tollgate_queue_depth{{group=\"{group}\"}} {n}\n");
    let deadline = Instant::now() + BOUND;
    loop {
        let metrics = admin_get(proxy, "/metrics").await;
        if metrics.contains(&line) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "queue of {group} never held {n}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Asserts that `status` came with a `Proxy-Status: tollgate; error=<error>` header
/// and a non-empty `text/plain` body; returns the body text.
pub fn assert_proxy_error(
    status: u16,
    content_type: Option<&str>,
    proxy_status: Option<&str>,
    body: &str,
    expected_status: u16,
    error: &str,
) {
    assert_eq!(status, expected_status, "status; body: {body}");
    let proxy_status = proxy_status.unwrap_or_else(|| panic!("no Proxy-Status; body: {body}"));
    let prefix = format!("tollgate; error={error}");
    assert!(
        proxy_status == prefix || proxy_status.starts_with(&format!("{prefix};")),
        "Proxy-Status {proxy_status:?} should start with {prefix:?}"
    );
    let content_type = content_type.unwrap_or_else(|| panic!("no Content-Type; body: {body}"));
    assert!(
        content_type.starts_with("text/plain"),
        "Content-Type {content_type:?}"
    );
    assert!(!body.trim().is_empty(), "empty error body");
}

/// Writes `text` to `dir/name` and returns the file's path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write file");
    path
}

// ---------------------------------------------------------------------------------
// Pacing, as the upstream saw it
// ---------------------------------------------------------------------------------

/// When the upstream received each request head, in time order.
pub fn arrivals(upstream: &Upstream) -> Vec<Instant> {
    let mut at: Vec<Instant> = upstream.requests().iter().map(|s| s.at).collect();
    at.sort();
    at
}

/// No two arrivals closer than the rate allows: for every pair i < j the upstream saw
/// them at least (j − i)·interval apart, minus `slack` for delivery noise. tollgate
/// dispatches on exact slots, but a request can reach the upstream late (a new
/// connection, a busy machine), making its gap to the next one look short; a request
/// that left early would show up as a gap near zero.
pub fn assert_paced(arrivals: &[Instant], interval: Duration, slack: Duration) {
    for i in 0..arrivals.len() {
        for j in i + 1..arrivals.len() {
            let gap = arrivals[j] - arrivals[i];
            let floor = interval * (j - i) as u32;
            assert!(
                gap + slack >= floor,
                "arrivals {i} and {j} are {gap:?} apart; the rate allows no less than {floor:?}"
            );
        }
    }
}

/// The most arrivals in any window of length `window` (windows start at an arrival).
pub fn max_in_window(arrivals: &[Instant], window: Duration) -> usize {
    (0..arrivals.len())
        .map(|i| {
            arrivals[i..]
                .iter()
                .take_while(|at| **at - arrivals[i] < window)
                .count()
        })
        .max()
        .unwrap_or(0)
}
