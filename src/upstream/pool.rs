//! Upstream connections kept for reuse: one pool per serving thread.
//!
//! A request takes an idle connection to its upstream (`scheme://host:port`) or opens
//! one; an HTTP/1.1 connection goes back to the pool when its response body ends, and
//! an HTTP/2 connection (chosen by ALPN) is shared by every request to that upstream.
//! Idle connections expire after `upstream_idle_timeout`, and a request sent on a
//! reused connection that the upstream closed meanwhile (before the request went out)
//! is sent again on a new one.
//!
//! The pool is ours rather than hyper-util's pooled client so that each request is
//! shaped for the connection it goes out on, whose protocol is known only once ALPN
//! has picked it: over HTTP/1.1 the path in the request line and the upstream in
//! `Host`; over HTTP/2 the absolute URI, the upstream in `:authority` alone. HTTP/2
//! clients should not send `Host` (RFC 9113 §8.3.1), and some servers (nginx 1.22)
//! answer 400 to a request that carries both.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body::Frame;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;
use tower::Service;

use super::{set_host, Connector};
use crate::body::{self, Body, BoxError, Holding, IdleLimit};
use crate::error::ProxyError;

/// Which upstream a connection goes to, from which serving thread. Authorities compare
/// and hash without regard to case, as host names do.
///
/// The thread is part of the key because a connection's task runs on the runtime of the
/// thread that opened it: a request from another thread would wake that thread for
/// every response, and keep two threads busy for one exchange.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    https: bool,
    authority: Authority,
    thread: std::thread::ThreadId,
}

impl Key {
    /// The key of an absolute URI, with an authority of its own. A request's authority
    /// is a slice of the buffer its head was read into, header values and all: a key
    /// kept by the pool or a connection's task would hold that whole buffer as long as
    /// the connection lives.
    fn of(uri: &Uri) -> Option<Key> {
        let authority = uri.authority()?;
        Some(Key {
            https: uri.scheme() == Some(&Scheme::HTTPS),
            authority: Authority::try_from(authority.as_str())
                .unwrap_or_else(|_| authority.clone()),
            thread: std::thread::current().id(),
        })
    }

    /// The absolute URI of `path` (an origin-form URI) at this key's upstream; with "/",
    /// the URI the connector dials.
    fn uri_with(&self, path: Uri) -> Uri {
        let scheme = if self.https {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        };
        let mut parts = path.into_parts();
        parts.scheme = Some(scheme);
        parts.authority = Some(self.authority.clone());
        Uri::from_parts(parts).expect("a scheme, an authority and a path make a URI")
    }
}

/// An HTTP/1.1 connection that is not carrying a request.
struct Idle {
    sender: http1::SendRequest<Body>,
    since: Instant,
}

/// An HTTP/2 connection, shared by the requests to its upstream.
struct Multiplexed {
    sender: http2::SendRequest<Body>,
    used: Instant,
}

/// A connection to send one request on.
enum Conn {
    Http1(http1::SendRequest<Body>),
    Http2(http2::SendRequest<Body>),
}

/// The pool (see the module documentation). Cloning shares it.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    connector: Connector,
    idle_timeout: Duration,
    /// `body_idle_timeout`: a response body that keeps its reader waiting this long is
    /// cut (and its connection with it).
    body_idle: Duration,
    /// Idle HTTP/1.1 connections by upstream, most recently returned last.
    idle: Mutex<HashMap<Key, Vec<Idle>>>,
    multiplexed: Mutex<HashMap<Key, Multiplexed>>,
    /// Whether the task that closes expired idle connections runs.
    sweeping: AtomicBool,
}

/// Locks a map of connections; its entries are valid after any panic of a holder.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Pool {
    /// An empty pool that opens connections with `connector` and closes those idle for
    /// `idle_timeout`.
    pub(super) fn new(connector: Connector, idle_timeout: Duration, body_idle: Duration) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                connector,
                idle_timeout,
                body_idle,
                idle: Mutex::default(),
                multiplexed: Mutex::default(),
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (absolute URI) and returns the response head, its body streaming and
    /// holding `held` until it ends. Errors are the connector's (a [`ProxyError`]
    /// inside) or hyper's.
    pub fn send<H: Send + Sync + 'static>(
        &self,
        mut req: Request<Body>,
        held: H,
    ) -> impl Future<Output = Result<Response<Body>, BoxError>> + Send + 'static {
        let pool = self.inner.clone();
        async move {
            // Each attempt sets the form its connection needs from the key and the
            // request's path: a request tried again may go out on the other protocol.
            let key = Key::of(req.uri())
                .ok_or_else(|| ProxyError::BadRequest(format!("no host in {}", req.uri())))?;
            loop {
                let (conn, reused) = match pool.checkout(&key) {
                    Some(conn) => (conn, true),
                    // Boxed: the handshakes' state is several KiB, which only a request
                    // that opens a connection needs; inline, every request's future
                    // would be that big.
                    None => (Box::pin(pool.connect(&key)).await?, false),
                };
                let mut sent = match conn {
                    Conn::Http1(mut sender) => {
                        // The path in the request line, the upstream in `Host`.
                        *req.uri_mut() = origin_form(req.uri());
                        set_host(req.headers_mut(), &key.authority);
                        match sender.try_send_request(req).await {
                            Ok(response) => {
                                return Ok(returning(response, sender, &pool, &key, held))
                            }
                            Err(e) => e,
                        }
                    }
                    Conn::Http2(mut sender) => {
                        // The absolute URI, the upstream in `:authority` alone.
                        *req.uri_mut() = key.uri_with(origin_form(req.uri()));
                        req.headers_mut().remove(header::HOST);
                        match sender.try_send_request(req).await {
                            Ok(response) => {
                                return Ok(response.map(|b| {
                                    let b = IdleLimit::new(b, pool.body_idle);
                                    body::boxed(Holding::new(b, held))
                                }))
                            }
                            Err(e) => e,
                        }
                    }
                };
                match sent.take_message() {
                    // The reused connection had closed before the request went out: the
                    // upstream never saw it, so it goes again, on a new connection.
                    Some(back) if reused => {
                        tracing::debug!(
                            authority = %key.authority,
                            "pooled connection was closed; sending again"
                        );
                        req = back;
                    }
                    _ => return Err(sent.into_error().into()),
                }
            }
        }
    }
}

impl Inner {
    /// A connection to `key` that can take a request now, if one is pooled.
    fn checkout(&self, key: &Key) -> Option<Conn> {
        {
            let mut multiplexed = lock(&self.multiplexed);
            if let Some(entry) = multiplexed.get_mut(key) {
                if entry.sender.is_ready() {
                    entry.used = Instant::now();
                    return Some(Conn::Http2(entry.sender.clone()));
                }
                multiplexed.remove(key);
            }
        }
        let mut idle = lock(&self.idle);
        let list = idle.get_mut(key)?;
        // The most recently returned first: it is the least likely to have been closed
        // by the upstream, and the rest can expire. Only ready connections are pooled
        // (see `give_back`); one that is not ready any more was closed by the upstream.
        // Dropped: hyper closes it.
        while let Some(conn) = list.pop() {
            if conn.since.elapsed() < self.idle_timeout && conn.sender.is_ready() {
                return Some(Conn::Http1(conn.sender));
            }
        }
        None
    }

    /// Opens a connection to `key` (TLS and HTTP/2 by ALPN for https).
    async fn connect(self: &Arc<Self>, key: &Key) -> Result<Conn, BoxError> {
        let mut connector = self.connector.clone();
        let io = connector.call(key.uri_with(Uri::from_static("/"))).await?;
        let conn = if io.connected().is_negotiated_h2() {
            // Pings, so that a connection the network dropped silently is noticed
            // (without them it would stay "ready", and every request on it time out).
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(Duration::from_secs(20))
                .keep_alive_timeout(Duration::from_secs(20))
                .handshake(io)
                .await?;
            spawn_connection(conn, &key.authority);
            let entry = Multiplexed {
                sender: sender.clone(),
                used: Instant::now(),
            };
            lock(&self.multiplexed).insert(key.clone(), entry);
            Conn::Http2(sender)
        } else {
            // Flattened: a request's head and small body go out in one `write`, which
            // costs the kernel less than a `writev` of several buffers.
            let (sender, conn) = http1::Builder::new().writev(false).handshake(io).await?;
            spawn_connection(conn, &key.authority);
            Conn::Http1(sender)
        };
        self.sweep_from_now_on();
        Ok(conn)
    }

    /// Starts, once, the task that closes connections idle for `idle_timeout` (the
    /// checkout skips them anyway; this closes their sockets), within an eighth of it
    /// after, as the other timeouts are checked. It runs on the runtime of the thread
    /// whose pool this is, and ends with the pool.
    fn sweep_from_now_on(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(self);
        let every = (self.idle_timeout / 8).max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep();
            }
        });
    }

    fn sweep(&self) {
        let timeout = self.idle_timeout;
        lock(&self.idle).retain(|_, list| {
            list.retain(|idle| idle.since.elapsed() < timeout && !idle.sender.is_closed());
            !list.is_empty()
        });
        lock(&self.multiplexed)
            .retain(|_, entry| entry.used.elapsed() < timeout && !entry.sender.is_closed());
    }

    /// Pools an HTTP/1.1 connection that can take the next request.
    fn put(&self, key: Key, sender: http1::SendRequest<Body>) {
        let idle = Idle {
            sender,
            since: Instant::now(),
        };
        lock(&self.idle).entry(key).or_default().push(idle);
    }
}

/// Drives a connection on this thread's runtime until it closes.
fn spawn_connection<C>(conn: C, authority: &Authority)
where
    C: std::future::Future<Output = Result<(), hyper::Error>> + Send + 'static,
{
    let authority = authority.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(%authority, error = %e, "upstream connection ended with an error");
        }
    });
}

/// The response, its body giving the connection back to `pool` under `key` when it
/// ends, and holding `held` until then.
fn returning<H: Send + Sync + 'static>(
    response: Response<Incoming>,
    sender: http1::SendRequest<Body>,
    pool: &Arc<Inner>,
    key: &Key,
    held: H,
) -> Response<Body> {
    response.map(|inner| {
        let mut body = Returning {
            inner,
            back: Some(Back {
                sender,
                pool: Arc::downgrade(pool),
                key: key.clone(),
            }),
        };
        // An empty body may never be polled: its end is now.
        if http_body::Body::is_end_stream(&body.inner) {
            give_back(&mut body.back);
        }
        let body = IdleLimit::new(body, pool.body_idle);
        body::boxed(Holding::new(body, held))
    })
}

/// The path and query of an absolute URI, as HTTP/1.1 sends it.
fn origin_form(uri: &Uri) -> Uri {
    let path = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    Uri::from(path)
}

pin_project_lite::pin_project! {
    /// A response body that gives its HTTP/1.1 connection back to the pool when it
    /// ends; a body dropped or failed before its end takes the connection with it
    /// (hyper closes it: what is left of the response is unread).
    struct Returning {
        #[pin]
        inner: Incoming,
        back: Option<Back>,
    }
}

/// What a [`Returning`] body gives back, and where. The pool is weak: a connection
/// whose pool is gone closes.
struct Back {
    sender: http1::SendRequest<Body>,
    pool: Weak<Inner>,
    key: Key,
}

/// Pools the connection in `back` once it can take the next request. It nearly always
/// can when the response has ended; not while hyper is still writing the request's
/// body (an upstream that answered early, say a 401 to a stalled upload): then a task
/// waits for it, so that no checkout ever gets a connection that is still busy.
fn give_back(back: &mut Option<Back>) {
    let Some(Back {
        mut sender,
        pool,
        key,
    }) = back.take()
    else {
        return;
    };
    if sender.is_ready() {
        if let Some(pool) = pool.upgrade() {
            pool.put(key, sender);
        }
    } else if !sender.is_closed() {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if sender.ready().await.is_ok() {
                    if let Some(pool) = pool.upgrade() {
                        pool.put(key, sender);
                    }
                }
            });
        }
    }
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(None) => give_back(this.back),
            // hyper stops polling a body that says it has ended (a `Content-Length`
            // body after its last byte) or that sent its trailers, so the end is noticed
            // with the last frame.
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() || this.inner.is_end_stream() => {
                give_back(this.back)
            }
            Poll::Ready(Some(Err(_))) => {
                this.back.take();
            }
            _ => {}
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;

    fn key(https: bool, authority: &str) -> Key {
        Key {
            https,
            authority: authority.parse().unwrap(),
            thread: std::thread::current().id(),
        }
    }

    #[test]
    fn keys_equal_but_for_case_hash_alike() {
        let hasher = RandomState::new();
        let (a, b) = ("API.Example:443", "api.example:443");
        assert_eq!(key(true, a), key(true, b));
        assert_eq!(hasher.hash_one(key(true, a)), hasher.hash_one(key(true, b)));
        let mut pool = HashMap::new();
        pool.insert(key(true, "API.example:443"), 1);
        assert_eq!(pool.get(&key(true, "api.EXAMPLE:443")), Some(&1));
        assert_eq!(pool.get(&key(false, "api.example:443")), None);
        assert_eq!(pool.get(&key(true, "api.example:8443")), None);
    }

    #[test]
    fn a_key_holds_none_of_the_request_s_buffer() {
        // What a request's URI is made of: a slice of the buffer its head was read into.
        let buffer = bytes::Bytes::from_static(b"http://api.example:8443/v1 Bearer secret");
        let uri = Uri::from_maybe_shared(buffer.slice(0..26)).unwrap();
        let inside =
            |authority: &Authority| buffer.as_ptr_range().contains(&authority.as_str().as_ptr());
        assert!(
            inside(uri.authority().unwrap()),
            "the test's premise: a request's authority is a slice"
        );
        let kept = Key::of(&uri).unwrap();
        assert!(!inside(&kept.authority));
        assert_eq!(kept, key(false, "api.example:8443"));
    }
}
