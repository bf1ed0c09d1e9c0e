//! The floor under tollgate's forward path: a plain-http forward proxy made of nothing
//! but what tollgate is built on (hyper's HTTP/1 server and client, tokio, mimalloc),
//! with none of tollgate's work (no classification, groups, push-back, timeouts, header
//! rewriting, metrics or tower layers).
//!
//! It exists to be measured beside tollgate (docs/performance-log.md, "Ninth session"):
//! what it costs per request is what the libraries cost, and tollgate's own cost is the
//! rest. Not a proxy to use: it forwards absolute-form `http://` requests and nothing else,
//! never times out, and keeps every idle upstream connection until the upstream closes it.
//!
//! ```text
//! cargo build --release --example hyper_floor
//! target/release/examples/hyper_floor 127.0.0.1:18181
//! scripts/bench-forward-cpu --nginx target/release/tollgate target/release/examples/hyper_floor
//! ```
//!
//! Beside tollgate's shipped build, measure the floor built the same way:
//! `scripts/build-pgo --floor` (profile-guided, trained by one `bench-forward-cpu` run)
//! leaves it at `target/pgo/floor/hyper_floor`.
//!
//! It serves as tollgate does: one single-threaded runtime per CPU it may use, each with
//! its own `SO_REUSEPORT` socket and its own idle upstream connections. It listens on the
//! address given first, or on the `listen` of a `--config FILE` (which
//! `scripts/bench-forward-cpu` passes to every binary); nothing else is read.
//!
//! It writes as hyper does by default, a `writev` per message. tollgate sends a small
//! message with one `send` instead (`src/coalesce.rs`), which costs the kernel less: its
//! system time per request is no longer above the floor's by much, and the comparison
//! that still tells is user time (docs/performance-log.md, "Tenth session").

use std::cell::RefCell;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use http_body::{Body as _, Frame};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What the proxy answers with: the upstream's body as it streams, or a short error.
type Body = BoxBody<Bytes, hyper::Error>;

thread_local! {
    /// This serving thread's idle upstream connections, by `host:port`.
    static IDLE: RefCell<HashMap<String, Vec<SendRequest<Incoming>>>> = RefCell::default();
}

/// Listens on the address given first (or in `--config`'s `listen`) and serves.
fn main() {
    // `bench-forward-cpu` passes every binary `--config FILE`, as it does tollgate.
    let addr = config_listen().unwrap_or_else(|| {
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "127.0.0.1:18181".into())
            .parse()
            .expect("the first argument is the address to listen on")
    });
    // SIGTERM (how the benchmark scripts stop it) ends the process through `exit`, so
    // that a build instrumented for profile-guided optimisation writes its counts then
    // (`scripts/build-pgo --floor`); a process killed by the signal writes nothing.
    // The handler is in place before the first connection is served.
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut term = {
        let _inside = signals.enter();
        let kind = tokio::signal::unix::SignalKind::terminate();
        tokio::signal::unix::signal(kind).expect("a SIGTERM handler")
    };
    std::thread::spawn(move || {
        signals.block_on(term.recv());
        std::process::exit(0);
    });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let handles: Vec<_> = (0..threads)
        .map(|_| std::thread::spawn(move || serve_thread(addr)))
        .collect();
    for handle in handles {
        handle.join().expect("a serving thread ends cleanly");
    }
}

/// `listen` from a tollgate `--config FILE`, when one is given (a plain text search:
/// the benchmark scripts write that line in one form).
fn config_listen() -> Option<SocketAddr> {
    let args: Vec<String> = std::env::args().collect();
    let file = args.iter().position(|a| a == "--config")?;
    let text = std::fs::read_to_string(args.get(file + 1)?).ok()?;
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("listen"))?;
    line.split('"').nth(1)?.parse().ok()
}

/// One serving thread: its own runtime and socket, as tollgate's are.
fn serve_thread(addr: SocketAddr) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket.set_reuseport(true).expect("SO_REUSEPORT");
        socket.bind(addr).expect("bind");
        let listener = socket.listen(1024).expect("listen");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(forward);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

/// Sends `req` in origin form on an idle connection to its authority (or a new one)
/// and answers with the upstream's response. As tollgate's pool does, it takes only a
/// connection that is ready for a request, and the response body gives the connection
/// back when it ends.
async fn forward(mut req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let (Some(authority), Some(path)) = (req.uri().authority(), req.uri().path_and_query()) else {
        return Ok(refuse(
            StatusCode::BAD_REQUEST,
            "absolute-form http:// only\n",
        ));
    };
    let authority = authority.to_string();
    *req.uri_mut() = path.clone().into();
    let reused = IDLE.with(|idle| {
        let mut idle = idle.borrow_mut();
        let list = idle.get_mut(&authority)?;
        // A connection that is not ready was closed by the upstream: dropped.
        std::iter::from_fn(|| list.pop()).find(SendRequest::is_ready)
    });
    let mut sender = match reused {
        Some(sender) => sender,
        None => match connect(&authority).await {
            Ok(sender) => sender,
            Err(e) => return Ok(refuse(StatusCode::BAD_GATEWAY, &format!("{e}\n"))),
        },
    };
    match sender.send_request(req).await {
        Ok(response) => Ok(response.map(|inner| {
            let mut body = Returning {
                inner,
                back: Some((sender, authority)),
            };
            if body.inner.is_end_stream() {
                give_back(&mut body.back);
            }
            body.boxed()
        })),
        Err(e) => Ok(refuse(StatusCode::BAD_GATEWAY, &format!("{e}\n"))),
    }
}

/// A response body that gives its connection back to this thread's idle list when it
/// ends.
struct Returning {
    inner: Incoming,
    back: Option<(SendRequest<Incoming>, String)>,
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            give_back(&mut self.back);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Puts the connection in `back` into its idle list, once, as tollgate's pool does: at
/// once if it can take the next request, else when it can.
fn give_back(back: &mut Option<(SendRequest<Incoming>, String)>) {
    let Some((mut sender, authority)) = back.take() else {
        return;
    };
    if sender.is_ready() {
        put(authority, sender);
    } else if !sender.is_closed() {
        tokio::spawn(async move {
            if sender.ready().await.is_ok() {
                put(authority, sender);
            }
        });
    }
}

fn put(authority: String, sender: SendRequest<Incoming>) {
    IDLE.with(|idle| idle.borrow_mut().entry(authority).or_default().push(sender));
}

/// A new HTTP/1.1 connection to `authority`, driven by its own task.
async fn connect(
    authority: &str,
) -> Result<SendRequest<Incoming>, Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(authority).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// An error answer with a plain-text body.
fn refuse(status: StatusCode, text: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(text.to_owned()))
        .map_err(|never| match never {})
        .boxed();
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
}
