//! Upstream connections kept for reuse: one pool per serving thread.
//!
//! A request takes an idle connection to its upstream (`scheme://host:port`) or opens
//! one; an HTTP/1.1 connection goes back to the pool from the response body itself,
//! when the body ends, and an HTTP/2 connection (chosen by ALPN) is shared by every
//! request to that upstream.
//!
//! Why not hyper-util's pooled client, which this replaces: its checkout and return
//! cost ≈ 3.8k of the 52.9k instructions of a forwarded request (callgrind; SipHash of
//! the pool key twice, the checkout's lazily built connect future, an `Arc`ed pool
//! behind a mutex shared by every thread), and it spawned a task per request to return
//! the connection once its body ended. Here a checkout is a pop from a `Vec` under a
//! lock only this thread takes, and a connection is pooled only once it is ready for
//! the next request (a task waits only in the rare case it is not when the response
//! ends); it goes back onto its upstream's list of idle connections, which the response
//! body holds, without a second lookup. What it did that matters is kept: idle
//! connections expire after `upstream_idle_timeout`, and a request sent on a reused
//! connection that the upstream closed meanwhile (before the request went out) is sent
//! again on a new one.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body::Frame;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;
use tower::Service;

use super::Connector;
use crate::body::{self, Body, BoxError, Holding};
use crate::error::ProxyError;

/// A map by upstream, looked up for every request: foldhash (seeded per map) rather
/// than SipHash, as the group maps (`crate::limit`, which says what it buys and why
/// it is safe enough).
type KeyMap<V> = HashMap<Key, V, foldhash::fast::RandomState>;

/// Which upstream a connection goes to.
#[derive(Debug, Clone)]
struct Key {
    https: bool,
    authority: Authority,
}

/// As `Authority`'s `==` (case-insensitive), but byte-equal spellings, nearly every
/// lookup's, are settled by one `memcmp`: the case-insensitive loop goes a byte at a
/// time (~0.3k instructions per lookup).
impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.https == other.https
            && (self.authority.as_str() == other.authority.as_str()
                || self.authority == other.authority)
    }
}

impl Eq for Key {}

/// Hashed by hand, consistently with `Authority`'s case-insensitive `==`: `Authority`'s
/// own `Hash` feeds the hasher one lower-cased byte at a time, a hasher call per byte
/// (with SipHash, which this map used then, ≈ 1k instructions per lookup when a request
/// cost ≈ 48k; callgrind). Lower-cased in a stack buffer, a key is a few writes.
impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.https.hash(state);
        let mut buf = [0u8; 64];
        for chunk in self.authority.as_str().as_bytes().chunks(buf.len()) {
            let lowered = &mut buf[..chunk.len()];
            lowered.copy_from_slice(chunk);
            lowered.make_ascii_lowercase();
            state.write(lowered);
        }
    }
}

impl Key {
    fn of(uri: &Uri) -> Option<Key> {
        Some(Key {
            https: uri.scheme() == Some(&Scheme::HTTPS),
            authority: uri.authority()?.clone(),
        })
    }

    /// This key with an authority of its own, for keeping. A request's authority is a
    /// slice of the buffer its head was read into (hyper's read buffer, or the copy a
    /// waiting request makes of its head, header values and all): a key kept by the pool
    /// or a connection's task would hold that whole buffer as long as the connection.
    fn owned(&self) -> Key {
        Key {
            https: self.https,
            authority: Authority::try_from(self.authority.as_str())
                .unwrap_or_else(|_| self.authority.clone()),
        }
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

/// A connection that is not carrying a request.
struct Idle {
    sender: http1::SendRequest<Body>,
    since: Instant,
}

/// An HTTP/2 connection, shared by the requests to its upstream.
struct Multiplexed {
    sender: http2::SendRequest<Body>,
    used: Instant,
}

/// The idle HTTP/1.1 connections to one upstream, most recently returned last.
///
/// Shared with the response bodies of the requests out on that upstream's connections,
/// so that a connection goes back without its upstream being looked up again: a lookup
/// hashes the key, and giving back by key cost ≈ 0.7k of the ≈ 34.6k instructions of a
/// forwarded request (callgrind).
type IdleList = Arc<Mutex<Vec<Idle>>>;

/// A connection to send one request on.
enum Conn {
    /// With the list it goes back to when its response ends.
    Http1(http1::SendRequest<Body>, IdleList),
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
    idle: Mutex<KeyMap<IdleList>>,
    multiplexed: Mutex<KeyMap<Multiplexed>>,
    /// Whether the task that closes expired idle connections runs.
    sweeping: AtomicBool,
}

/// Locks a map or list of connections; its entries are valid after any panic of a holder.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Pool {
    /// An empty pool that opens connections with `connector` and closes those idle for
    /// `idle_timeout`.
    pub(super) fn new(connector: Connector, idle_timeout: Duration) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                connector,
                idle_timeout,
                idle: Mutex::new(KeyMap::default()),
                multiplexed: Mutex::new(KeyMap::default()),
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (absolute URI) and returns the response head, its body streaming and
    /// holding `held` until it ends. Errors are the connector's (a [`ProxyError`]
    /// inside) or hyper's.
    ///
    /// Not an `async fn`, which would hold the request twice (its argument and the local
    /// it moves into); see [`super::Upstream::send`] for why the size counts.
    pub fn send<H: Send + Sync + 'static>(
        &self,
        mut req: Request<Body>,
        held: H,
    ) -> impl Future<Output = Result<Response<Body>, BoxError>> + Send + 'static {
        let pool = self.inner.clone();
        async move {
            // The URI is not kept beside the request: its scheme and authority are the
            // key, and each attempt sets the form its connection needs from the key and
            // the request's path. (This future is boxed for every request and written
            // whole each time: a URI kept here made it 88 bytes bigger.)
            let key = Key::of(req.uri())
                .ok_or_else(|| ProxyError::BadRequest(format!("no host in {}", req.uri())))?;
            loop {
                let (conn, reused) = match pool.checkout(&key) {
                    Some(conn) => (conn, true),
                    // Boxed: the TLS and HTTP/2 handshakes make this future many KiB, and
                    // inline it would be the size of every request's future, copied into
                    // its box per request (8k instructions of memcpy per request).
                    None => (Box::pin(pool.connect(&key)).await?, false),
                };
                let mut sent = match conn {
                    Conn::Http1(mut sender, home) => {
                        // HTTP/1.1 names the path only; the authority is in `Host`.
                        *req.uri_mut() = origin_form(req.uri());
                        match sender.try_send_request(req).await {
                            Ok(response) => return Ok(returning(response, sender, home, held)),
                            Err(e) => e,
                        }
                    }
                    Conn::Http2(mut sender) => {
                        // HTTP/2 sends the absolute form: the request's own, unless an
                        // HTTP/1.1 attempt before this one cut it to its path.
                        if req.uri().scheme().is_none() {
                            *req.uri_mut() = key.uri_with(origin_form(req.uri()));
                        }
                        match sender.try_send_request(req).await {
                            Ok(response) => {
                                return Ok(response.map(|b| body::boxed(Holding::new(b, held))))
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
        let home = lock(&self.idle).get(key)?.clone();
        loop {
            // The most recently returned first: it is the least likely to have been
            // closed by the upstream, and the rest can expire.
            let idle = lock(&home).pop()?;
            // Only ready connections are pooled (see `give_back`); one that is not ready
            // any more was closed by the upstream. Dropped: hyper closes it.
            if idle.since.elapsed() < self.idle_timeout && idle.sender.is_ready() {
                return Some(Conn::Http1(idle.sender, home));
            }
        }
    }

    /// Opens a connection to `key` (TLS and HTTP/2 by ALPN for https).
    async fn connect(self: &Arc<Self>, key: &Key) -> Result<Conn, BoxError> {
        // Once per new connection, so the copy costs nothing that matters.
        let key = &key.owned();
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
            let (sender, conn) = http1::handshake(io).await?;
            spawn_connection(conn, &key.authority);
            let home = lock(&self.idle).entry(key.clone()).or_default().clone();
            Conn::Http1(sender, home)
        };
        self.sweep_from_now_on();
        Ok(conn)
    }

    /// Starts, once, the task that closes connections idle for `idle_timeout` (the
    /// checkout skips them anyway; this closes their sockets). It runs on the runtime
    /// of the thread whose pool this is, and ends with the pool.
    fn sweep_from_now_on(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(self);
        let every = (self.idle_timeout / 2).max(Duration::from_millis(100));
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
        lock(&self.idle).retain(|_, home| {
            let mut list = lock(home);
            list.retain(|idle| idle.since.elapsed() < timeout && !idle.sender.is_closed());
            // A list is dropped only when no response holds it: its connection would
            // otherwise go back to a list the pool no longer has. Every other holder
            // cloned it under the map's lock, which this holds.
            !list.is_empty() || Arc::strong_count(home) > 1
        });
        lock(&self.multiplexed)
            .retain(|_, entry| entry.used.elapsed() < timeout && !entry.sender.is_closed());
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

/// The response, its body giving the connection back to `home` when it ends, and
/// holding `held` until then.
fn returning<H: Send + Sync + 'static>(
    response: Response<Incoming>,
    sender: http1::SendRequest<Body>,
    home: IdleList,
    held: H,
) -> Response<Body> {
    response.map(|inner| {
        let mut body = Returning {
            inner,
            back: Some((sender, home)),
        };
        if http_body::Body::is_end_stream(&body.inner) {
            give_back(&mut body.back);
        }
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
        back: Back,
    }
}

/// What a [`Returning`] body gives back, and where.
type Back = Option<(http1::SendRequest<Body>, IdleList)>;

/// Puts the connection in `back` into its idle list once it can take the next request.
/// It nearly always can when the response has ended; not while hyper is still writing
/// the request's body (an upstream that answered early, say a 401 to a stalled upload):
/// then a task waits for it, so that no checkout ever gets a connection that is still
/// busy. If the pool has been dropped meanwhile, the list goes with this last holder of
/// it, and the connection closes.
fn give_back(back: &mut Back) {
    let Some((mut sender, home)) = back.take() else {
        return;
    };
    if sender.is_ready() {
        put(&home, sender);
    } else if !sender.is_closed() {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if sender.ready().await.is_ok() {
                    put(&home, sender);
                }
            });
        }
    }
}

fn put(home: &IdleList, sender: http1::SendRequest<Body>) {
    let idle = Idle {
        sender,
        since: Instant::now(),
    };
    lock(home).push(idle);
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
        }
    }

    #[test]
    fn keys_equal_but_for_case_hash_alike() {
        let hasher = RandomState::new();
        let long = format!("{}.example:8443", "Sub".repeat(40));
        for (a, b) in [
            ("API.Example:443", "api.example:443"),
            (long.as_str(), long.to_lowercase().as_str()),
        ] {
            assert_eq!(key(true, a), key(true, b));
            assert_eq!(hasher.hash_one(key(true, a)), hasher.hash_one(key(true, b)));
        }
        let mut pool = HashMap::new();
        pool.insert(key(true, "API.example:443"), 1);
        assert_eq!(pool.get(&key(true, "api.EXAMPLE:443")), Some(&1));
        assert_eq!(pool.get(&key(false, "api.example:443")), None);
        assert_eq!(pool.get(&key(true, "api.example:8443")), None);
    }

    #[test]
    fn a_kept_key_holds_none_of_the_request_s_buffer() {
        // What a request's URI is made of: a slice of the buffer its head was read into.
        let buffer = bytes::Bytes::from_static(b"http://api.example:8443/v1 Bearer secret");
        let uri = Uri::from_maybe_shared(buffer.slice(0..26)).unwrap();
        let key = Key::of(&uri).unwrap();
        let inside = |k: &Key| {
            buffer
                .as_ptr_range()
                .contains(&k.authority.as_str().as_ptr())
        };
        assert!(
            inside(&key),
            "the test's premise: a request's key is a slice"
        );
        let kept = key.owned();
        assert!(!inside(&kept));
        assert_eq!(kept, key);
        assert!(!kept.https);
    }
}
