//! A new connection's first request waits in its group before hyper takes the
//! connection, so that a waiting request costs its socket and its place in the queue,
//! not a connection's buffers.
//!
//! hyper gives every HTTP/1 connection a write buffer when it sets the connection up and
//! a read buffer it keeps to notice a client that leaves, 8 KiB each and not a setting:
//! a request waiting inside hyper held ≈ 15 KiB (BENCHMARKS.md, "Queue memory"). Here the
//! head of the first request is read with a peek, which leaves the bytes in the kernel's
//! socket buffer, and classified as [`Proxy::handle`] will classify it. When its group
//! would make it wait ([`Proxy::queue_ahead`]) it waits here, in the same queue and the
//! same order as every other request of the group; hyper starts once it is admitted or
//! refused, and the outcome rides with the connection to its first request
//! ([`Admission`]), which the throttle does not queue again.
//!
//! A client that leaves while its request waits here is noticed by the socket's
//! read-closed readiness (`EPOLLRDHUP`), as hyper notices it by reading: the request is
//! never sent. Later requests on a kept-alive connection, and a first request whose head
//! did not arrive whole, wait inside hyper as before.

use std::io;
use std::net::SocketAddr;

use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::sniff::peek_head;
use crate::limit::layer::Admission;
use crate::proxy::Proxy;

/// What became of a connection's first request before hyper.
pub(super) enum FirstRequest {
    /// It did not wait here: no whole head in the first bytes, or its group lets it
    /// leave now. hyper serves it like any other.
    NotHeld,
    /// It waited here and was admitted or refused; the connection's first request
    /// carries this outcome.
    Decided(Admission),
    /// The client closed the connection while its request waited: nothing was sent.
    Left,
    /// Shutdown's grace ran out while it waited.
    Cut,
}

/// Waits in its group for the first request on `stream`, when its head is all there and
/// its group would make it wait (see the module documentation).
pub(super) async fn wait_in_group(
    stream: &TcpStream,
    proxy: &Proxy,
    local: SocketAddr,
    cut: &CancellationToken,
) -> FirstRequest {
    let arrived = Instant::now();
    let Some((group, cost)) =
        peek_head(stream).and_then(|mut head| proxy.queue_ahead(&mut head, local))
    else {
        return FirstRequest::NotHeld;
    };
    let deadline = arrived + group.settings.max_wait;
    let admit = {
        let group = group.clone();
        async move { group.admit(cost, arrived, deadline, false).await }
    };
    // Shutdown's drain does not end the wait: the request was made, and is served or
    // refused like one waiting inside hyper.
    tokio::select! {
        outcome = admit => FirstRequest::Decided(Admission { group, arrived, outcome }),
        () = client_leaves(stream) => FirstRequest::Left,
        () = cut.cancelled() => FirstRequest::Cut,
    }
}

/// Resolves when the client closes its side of the connection, or the connection fails.
/// Only readiness is looked at, never the bytes: the request's head, and anything the
/// client sends after it, stay in the socket for hyper.
async fn client_leaves(stream: &TcpStream) {
    loop {
        match stream.ready(Interest::READABLE).await {
            Ok(ready) if !ready.is_read_closed() => {
                // Bytes (the head, a body) are not a leave: forget this readiness and
                // wait for the next change. (Why the stream is registered again after.)
                let _ = stream.try_io(Interest::READABLE, || {
                    Err::<(), _>(io::ErrorKind::WouldBlock.into())
                });
            }
            _ => return,
        }
    }
}

/// `stream` registered afresh with the reactor. Waiting for the client to leave cleared
/// the readiness its unread bytes had raised, and epoll reports a change only once: hyper's
/// first read would wait for an event that never comes. A new registration reports the
/// bytes already there.
pub(super) fn register_again(stream: TcpStream) -> io::Result<TcpStream> {
    TcpStream::from_std(stream.into_std()?)
}
