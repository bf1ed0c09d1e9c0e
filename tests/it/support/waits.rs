//! Waiting on observable state, and assertions on what the upstream saw.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;

/// How long a wait lets pass between two looks at what it waits for.
const POLL: Duration = Duration::from_millis(5);

/// Asks `check` (every 5 ms) until it finds what it looks for, and returns it; `None`
/// once [`BOUND`] has passed without. The waits below are made of it; one that fails
/// says then what it saw instead.
pub async fn within_bound<T>(mut check: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(found) = check().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        // What it waits for happens elsewhere, in its own time: look again shortly.
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until `check` finds what it looks for (asked every 5 ms, for [`BOUND`] at
/// most), and returns it.
pub async fn eventually<T>(mut check: impl FnMut() -> Option<T>) -> T {
    eventually_async(async || check()).await
}

/// [`eventually`] for a check that awaits: a request to `/metrics`, a connection.
pub async fn eventually_async<T>(check: impl AsyncFnMut() -> Option<T>) -> T {
    within_bound(check).await.expect("never came to pass")
}

/// Waits until `group`'s queue (waiting requests and the one at its head) holds `n`,
/// as `/metrics` on the admin listener shows it.
pub async fn wait_queued(proxy: &Proxy, group: &str, n: usize) {
    wait_metric_line(
        proxy,
        &format!("tollgate_queue_depth{{group=\"{group}\"}} {n}"),
    )
    .await;
}

/// Waits until `/metrics` on the admin listener has a line that is exactly `line`
/// (name, labels and value); returns the metrics text.
pub async fn wait_metric_line(proxy: &Proxy, line: &str) -> String {
    let found = within_bound(async || {
        let metrics = admin_get(proxy, "/metrics").await;
        metrics.lines().any(|l| l == line).then_some(metrics)
    })
    .await;
    match found {
        Some(metrics) => metrics,
        None => panic!(
            "/metrics never showed {line:?}:\n{}",
            admin_get(proxy, "/metrics").await
        ),
    }
}

/// Waits until `upstream` is handling `n` requests at once.
pub async fn wait_in_flight(upstream: &Upstream, n: usize) {
    let found = within_bound(async || (upstream.in_flight() >= n).then_some(())).await;
    assert!(
        found.is_some(),
        "upstream never had {n} in flight, only {}",
        upstream.in_flight()
    );
}

/// Waits until connecting to `addr` is refused: its listener has closed. Connections
/// that still succeed, or are reset by a listener that is closing, are dropped.
pub async fn wait_until_refused(addr: SocketAddr) {
    let refused = within_bound(async || match tokio::net::TcpStream::connect(addr).await {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Some(()),
        // Reset: it reached the backlog of a listener that was closing.
        Err(e) if e.kind() == ErrorKind::ConnectionReset => None,
        Err(e) => panic!("unexpected connect error: {e}"),
        Ok(_) => None,
    })
    .await;
    assert!(refused.is_some(), "{addr} still accepts connections");
}

/// Waits until the other end of `stream` has read every byte written on it so far, as
/// the kernel's socket table shows: nothing left unacknowledged on this side, nothing
/// unread on that one. Both ends must be in this network namespace (loopback).
pub async fn wait_until_read(stream: &tokio::net::TcpStream) {
    let (ours, theirs) = (stream.local_addr().unwrap(), stream.peer_addr().unwrap());
    let read = within_bound(async || {
        let sockets = tcp_sockets();
        let end = |local, remote| {
            sockets
                .iter()
                .find(|s| s.local == local && s.remote == remote)
        };
        let (sent, unread) = (end(ours, theirs)?.tx_queue, end(theirs, ours)?.rx_queue);
        (sent == 0 && unread == 0).then_some(())
    })
    .await;
    assert!(
        read.is_some(),
        "{theirs} never read what {ours} wrote: {:?}",
        tcp_sockets()
            .iter()
            .filter(
                |s| (s.local, s.remote) == (ours, theirs) || (s.local, s.remote) == (theirs, ours)
            )
            .collect::<Vec<_>>()
    );
}

/// Waits until no connection to `addr` is established any more: each has been closed,
/// by the end at `addr` (and the close has arrived) or by the other end.
pub async fn wait_connections_closed(addr: SocketAddr) {
    let open = || {
        tcp_sockets()
            .into_iter()
            .filter(|s| s.remote == addr && s.state == TCP_ESTABLISHED)
            .collect::<Vec<_>>()
    };
    let closed = within_bound(async || open().is_empty().then_some(())).await;
    assert!(closed.is_some(), "still open to {addr}: {:?}", open());
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

/// When the upstream received each request head, in time order.
pub fn arrivals(upstream: &Upstream) -> Vec<Instant> {
    let mut at: Vec<Instant> = upstream.requests().iter().map(|s| s.at).collect();
    at.sort();
    at
}

/// Asserts that `arrivals` (sorted) kept to one per `interval` after a first `burst`,
/// with statistics a loaded machine does not fake and a limiter that lets requests out
/// early cannot pass:
///
/// * the span: N arrivals take at least N − burst − 1 intervals (one interval of room
///   for a first request that reached the upstream late);
/// * any window of ten intervals holds at most burst + 10 (+1 for a request that
///   arrived late, next to the one after it);
/// * the median gap between neighbours is between half and one and a half intervals:
///   tollgate sends on absolute slots, so a late request does not move the next ones,
///   while a limiter that bursts shows a median near zero and one that stalls a long
///   one.
///
/// A single pair closer than the interval proves nothing: one request delivered late
/// makes its gap to the next one short.
pub fn assert_paced(arrivals: &[Instant], interval: Duration, burst: usize) {
    let n = arrivals.len();
    assert!(n >= 2, "too few arrivals to judge a pace: {n}");
    let span = arrivals[n - 1] - arrivals[0];
    let floor = interval * n.saturating_sub(burst + 1) as u32;
    assert!(
        span >= floor,
        "{n} arrivals spanned {span:?}; one per {interval:?} after a burst of {burst} takes {floor:?}"
    );
    let window = interval * 10;
    let busiest = max_in_window(arrivals, window);
    assert!(
        busiest <= burst + 10 + 1,
        "{busiest} arrivals within {window:?}; the rate allows {} (burst {burst})",
        burst + 10
    );
    let paced = &arrivals[burst.min(n - 1)..];
    if paced.len() > 5 {
        let mut gaps: Vec<Duration> = paced.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort();
        let median = gaps[gaps.len() / 2];
        assert!(
            median >= interval / 2 && median <= interval * 3 / 2,
            "median gap {median:?} for an interval of {interval:?}; gaps: {gaps:?}"
        );
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
