//! A new connection's first request waits in its group before hyper takes the
//! connection, so that a waiting request costs its socket and its place in the queue,
//! not a connection's buffers.
//!
//! hyper gives every HTTP/1 connection a write buffer when it sets the connection up and
//! a read buffer it keeps to notice a client that leaves, 8 KiB each and not a setting:
//! a request waiting inside hyper held ≈ 15 KiB (BENCHMARKS.md, "Queue memory"). Here the
//! first request is read with a peek, which leaves the bytes in the kernel's socket
//! buffer, and classified as [`Proxy::handle`] will classify it. When its group would
//! make it wait ([`Proxy::queue_ahead`]) it waits here, in the same queue and the same
//! order as every other request of the group; hyper starts once it is admitted or
//! refused, and the outcome rides with the connection to its first request
//! ([`Admission`]), which the throttle does not queue again.
//!
//! Only a request whose body has all arrived waits here (see [`Peeked::Whole`]). A
//! client that leaves while its request waits here is noticed by the socket's
//! read-closed readiness (`EPOLLRDHUP`), as hyper notices it by reading: the request is
//! never sent. Later requests on a kept-alive connection, and a first request that does
//! not fit the peek, wait inside hyper as before.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::sniff::{peek_request, Peeked};
use crate::limit::layer::Admission;
use crate::proxy::Proxy;

/// What became of a connection's first request before hyper.
pub(super) enum FirstRequest {
    /// It did not wait here: it did not fit the peek, or its group lets it leave now.
    /// hyper serves it like any other.
    NotHeld,
    /// It waited here and was admitted or refused; the connection's first request
    /// carries this outcome.
    Decided(Admission),
    /// The client closed the connection while its request waited: nothing was sent.
    Left,
    /// Shutdown's grace ran out while it waited.
    Cut,
}

/// How many times a first request that arrives in pieces is looked at again (one look
/// per arrival of more bytes) before it is left to hyper.
const LOOKS: usize = 8;

/// Waits in its group for the first request on `stream` when it has all arrived (within
/// `within` of now, for one that comes in pieces) and its group would make it wait;
/// see the module documentation.
pub(super) async fn wait_in_group(
    stream: &TcpStream,
    proxy: &Proxy,
    local: SocketAddr,
    within: Duration,
    cut: &CancellationToken,
) -> FirstRequest {
    let arrived = Instant::now();
    let (mut head, watch) = match peek_request(stream) {
        Peeked::Whole(head) => (head, None),
        Peeked::Partial => match rest_of_request(stream, arrived + within).await {
            Some((head, watch)) => (head, Some(watch)),
            None => return FirstRequest::NotHeld,
        },
        Peeked::Unusable => return FirstRequest::NotHeld,
    };
    let Some((group, cost)) = proxy.queue_ahead(&mut head, local) else {
        return FirstRequest::NotHeld;
    };
    drop(head);
    let Some(watch) = watch.or_else(|| watch_socket(stream)) else {
        return FirstRequest::NotHeld;
    };
    let deadline = arrived + group.settings.max_wait;
    // Shutdown's drain does not end the wait: the request was made, and is served or
    // refused like one waiting inside hyper. A client that left is looked at first, so
    // that a request whose client is gone does not take a slot it will never use.
    tokio::select! {
        biased;
        () = client_leaves(&watch) => FirstRequest::Left,
        () = cut.cancelled() => FirstRequest::Cut,
        outcome = group.admit(cost, arrived, deadline, false) => {
            FirstRequest::Decided(Admission { group: group.clone(), arrived, outcome })
        }
    }
}

/// A second descriptor of the client's socket, registered with the reactor on its own.
/// Waiting on it for more bytes or for the client to leave means forgetting the
/// readiness that bytes already there raised; on the socket hyper will read, that would
/// leave hyper's first read waiting for an event that never comes (epoll reports a
/// change once). `None` if the descriptor cannot be had: the request waits in hyper.
fn watch_socket(stream: &TcpStream) -> Option<TcpStream> {
    let fd = stream.as_fd().try_clone_to_owned().ok()?;
    // Non-blocking already: the flag belongs to the socket, which both descriptors share.
    TcpStream::from_std(std::net::TcpStream::from(fd)).ok()
}

/// Waits for the rest of a first request that arrives in pieces, for a few looks and
/// until `give_up`; the request and the watch it was seen on (see [`watch_socket`]).
async fn rest_of_request(
    stream: &TcpStream,
    give_up: Instant,
) -> Option<(http::Request<()>, TcpStream)> {
    let watch = watch_socket(stream)?;
    for _ in 0..LOOKS {
        // A new registration reports the bytes already there, so the first wait ends at
        // once; each later one waits for more bytes (or the client's leaving).
        let ready = tokio::time::timeout_at(give_up, watch.readable()).await;
        ready.ok()?.ok()?;
        match peek_request(&watch) {
            Peeked::Whole(head) => return Some((head, watch)),
            Peeked::Unusable => return None,
            Peeked::Partial => forget_readiness(&watch),
        }
    }
    None
}

/// Resolves when the client closes its side of the connection, or the connection fails.
/// Only readiness is looked at, never the bytes: the request, and anything the client
/// sends after it, stay in the socket for hyper.
async fn client_leaves(watch: &TcpStream) {
    loop {
        match watch.ready(Interest::READABLE).await {
            // Bytes (a pipelined request) are not a leave: wait for the next change.
            Ok(ready) if !ready.is_read_closed() => forget_readiness(watch),
            _ => return,
        }
    }
}

/// Clears `watch`'s read readiness (not a closed one), so the next wait is for a change.
fn forget_readiness(watch: &TcpStream) {
    let _ = watch.try_io(Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}
