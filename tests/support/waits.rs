//! Waiting on observable state, and assertions on what the upstream saw.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;

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
