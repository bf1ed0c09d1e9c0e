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
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::sniff::{peek_request, Peeked};
use crate::limit::layer::Admission;
use crate::proxy::Proxy;

/// A connection for hyper to serve, after [`wait_in_group`].
pub(super) struct ForHyper {
    /// The client's socket.
    pub stream: TcpStream,
    /// The outcome of the first request's wait, when it waited here.
    pub admission: Option<Admission>,
    /// The socket was registered with the reactor afresh (see [`register_again`]):
    /// hyper's first read needs a turn of the reactor, so hyper must not be told to shut
    /// down before that read (it would close the connection unread).
    pub registered_again: bool,
}

/// Why a connection ended before hyper served it.
#[derive(Debug)]
pub(super) enum Ended {
    /// The client closed the connection while its request waited: nothing was sent.
    ClientLeft,
    /// Shutdown's grace ran out while it waited.
    Cut,
    /// The socket could not be registered with the reactor again (out of memory, or of
    /// epoll watches).
    Unregistered(io::Error),
}

/// How many times a first request that arrives in pieces is looked at again (one look
/// per arrival of more bytes) before it is left to hyper.
const LOOKS: usize = 8;

/// Waits in its group for the first request on `stream` when it has all arrived (within
/// `within` of now, for one that comes in pieces) and its group would make it wait;
/// see the module documentation.
pub(super) async fn wait_in_group(
    stream: TcpStream,
    proxy: &Proxy,
    local: SocketAddr,
    within: Duration,
    cut: &CancellationToken,
) -> Result<ForHyper, Ended> {
    let arrived = Instant::now();
    // Whether this socket's readiness was spent here (see `register_again`).
    let mut spent = false;
    let head = match peek_request(&stream) {
        Peeked::Whole(head) => Some(head),
        Peeked::Partial => {
            spent = true;
            rest_of_request(&stream, arrived + within).await
        }
        Peeked::Unusable => None,
    };
    let queue = head.and_then(|mut head| proxy.queue_ahead(&mut head, local));
    let mut admission = None;
    if let Some((group, cost)) = queue {
        spent = true;
        let deadline = arrived + group.settings.max_wait;
        // Shutdown's drain does not end the wait: the request was made, and is served
        // or refused like one waiting inside hyper. A client that left is looked at
        // first, so that a request whose client is gone does not take a slot.
        let outcome = tokio::select! {
            biased;
            () = client_leaves(&stream) => return Err(Ended::ClientLeft),
            () = cut.cancelled() => return Err(Ended::Cut),
            outcome = group.admit(cost, arrived, deadline, false) => outcome,
        };
        admission = Some(Admission {
            group,
            arrived,
            outcome,
        });
    }
    let stream = match spent {
        true => register_again(stream).map_err(Ended::Unregistered)?,
        false => stream,
    };
    Ok(ForHyper {
        stream,
        admission,
        registered_again: spent,
    })
}

/// Waits for the rest of a first request that arrives in pieces, for a few looks and
/// until `give_up`.
async fn rest_of_request(stream: &TcpStream, give_up: Instant) -> Option<http::Request<()>> {
    for _ in 0..LOOKS {
        forget_readiness(stream);
        let more = tokio::time::timeout_at(give_up, stream.readable()).await;
        more.ok()?.ok()?;
        match peek_request(stream) {
            Peeked::Whole(head) => return Some(head),
            Peeked::Unusable => return None,
            Peeked::Partial => {}
        }
    }
    None
}

/// Resolves when the client closes its side of the connection, or the connection fails.
/// Only readiness is looked at, never the bytes: the request, and anything the client
/// sends after it, stay in the socket for hyper.
async fn client_leaves(stream: &TcpStream) {
    loop {
        match stream.ready(Interest::READABLE).await {
            // Bytes (a pipelined request) are not a leave: wait for the next change.
            Ok(ready) if !ready.is_read_closed() => forget_readiness(stream),
            _ => return,
        }
    }
}

/// Clears the socket's read readiness (not a closed one), so that the next wait is for
/// a change: more bytes, or the client leaving.
fn forget_readiness(stream: &TcpStream) {
    let _ = stream.try_io(Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

/// `stream` registered afresh with the reactor. Waiting here cleared the readiness that
/// the unread request raised, and epoll (edge-triggered) reports it only once: hyper's
/// first read would wait for an event that never comes. A new registration reports the
/// bytes already there, at the reactor's next turn.
fn register_again(stream: TcpStream) -> io::Result<TcpStream> {
    TcpStream::from_std(stream.into_std()?)
}
