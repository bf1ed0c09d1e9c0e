//! A new connection's first request waits in its group before hyper takes the
//! connection, so that a waiting request costs its socket and its place in the queue,
//! not a connection's buffers.
//!
//! hyper gives every HTTP/1 connection a write buffer when it sets the connection up and
//! a read buffer it keeps to notice a client that leaves, 8 KiB each and not a setting:
//! a request waiting inside hyper held ≈ 15 KiB (BENCHMARKS.md, "Queue memory"). Here the
//! first request is read with a peek, which leaves the bytes in the kernel's socket
//! buffer, and classified as [`Proxy::handle`] will classify it ([`Proxy::group_of`]).
//! When its group would make it wait ([`Group::would_wait`]) it waits here, in the same
//! queue and the same order as every other request of the group; hyper starts once it
//! is admitted or refused, and the outcome rides with the connection to its first
//! request ([`Admission`]), which the throttle does not queue again.
//!
//! Before it waits, a connection whose first request is for a group with a home on
//! another serving thread goes there (`server::home`), and waits on that thread.
//!
//! Only a request whose body has all arrived waits here (see [`Peeked::Whole`]). A
//! client that leaves while its request waits here is noticed by the socket's
//! read-closed readiness (`EPOLLRDHUP`), as hyper notices it by reading: the request is
//! never sent. Later requests on a kept-alive connection, and a first request that does
//! not fit the peek, wait inside hyper as before.

use std::io;

use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::home::{Arrival, Homes, Moved};
use super::sniff::{peek_request, Peeked};
use crate::limit::layer::Admission;
use crate::limit::Group;
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
    /// The connection went to its group's home thread, which serves it from here on
    /// (`server::home`).
    Moved,
}

/// How many times a first request that arrives in pieces is looked at again (one look
/// per arrival of more bytes) before it is left to hyper.
const LOOKS: usize = 8;

/// Waits in its group for the first request on `stream` when it has all arrived (by
/// `arrival.give_up`, for one that comes in pieces) and its group would make it wait;
/// see the module documentation. Before that, a connection whose first request is for a
/// group with a home on another serving thread is sent there (`homes`; `None` for a
/// connection that was already moved).
pub(super) async fn wait_in_group(
    stream: TcpStream,
    proxy: &Proxy,
    arrival: Arrival,
    homes: Option<&Homes>,
    cut: &CancellationToken,
) -> Result<ForHyper, Ended> {
    let mut stream = stream;
    // Whether this socket's readiness was spent here (see `register_again`).
    let mut spent = false;
    let head = match peek_request(&stream) {
        Peeked::Whole(head) => Some(head),
        Peeked::Partial => {
            spent = true;
            rest_of_request(&stream, arrival.give_up).await
        }
        Peeked::Unusable => None,
    };
    let is_connect = head
        .as_ref()
        .is_some_and(|h| h.method() == http::Method::CONNECT);
    let first = head.and_then(|mut head| proxy.group_of(&mut head, arrival.local));
    if let (Some((group, _)), Some(homes)) = (&first, homes) {
        // Not a tunnel: its rate counts opens, not the traffic in it, which the home
        // thread need not carry.
        if let Some(home) = homes.elsewhere(group).filter(|_| !is_connect) {
            match go_home(stream, group, homes, home, arrival)? {
                Some(refused) => {
                    stream = refused;
                    spent = true;
                }
                None => return Err(Ended::Moved),
            }
        }
    }
    let mut admission = None;
    if let Some((group, cost)) = first.filter(|(group, _)| group.would_wait()) {
        spent = true;
        let arrived = arrival.arrived;
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

/// Sends the connection to thread `home`, `group`'s: `None` once it is on its way, or
/// back, registered afresh here, when that thread takes no more connections (it is
/// shutting down).
fn go_home(
    stream: TcpStream,
    group: &Group,
    homes: &Homes,
    home: usize,
    arrival: Arrival,
) -> Result<Option<TcpStream>, Ended> {
    let moved = Moved {
        // Off this thread's reactor: the home thread registers it with its own.
        stream: stream.into_std().map_err(Ended::Unregistered)?,
        arrival,
    };
    match homes.send(home, moved) {
        Ok(()) => {
            group.metrics.moved.inc();
            tracing::debug!(remote = %arrival.remote, group = %group.name, home, "moved the connection to its group's thread");
            Ok(None)
        }
        Err(refused) => TcpStream::from_std(refused.stream)
            .map(Some)
            .map_err(Ended::Unregistered),
    }
}

/// Waits for the rest of a first request that arrives in pieces, for a few looks and
/// until `give_up`.
async fn rest_of_request(stream: &TcpStream, give_up: Instant) -> Option<http::Request<()>> {
    for _ in 0..LOOKS {
        let more = tokio::time::timeout_at(give_up, stream.readable()).await;
        more.ok()?.ok()?;
        // Looked at inside `try_io`: a partial request counts as "would block", which
        // clears the readiness this look saw and no later one, so bytes that arrive
        // meanwhile still wake the next wait.
        let looked = stream.try_io(Interest::READABLE, || match peek_request(stream) {
            Peeked::Partial => Err(io::ErrorKind::WouldBlock.into()),
            decided => Ok(decided),
        });
        match looked {
            Ok(Peeked::Whole(head)) => return Some(head),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Ok(_) | Err(_) => return None,
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

/// Clears the socket's read readiness (never a closed one, which is all `client_leaves`
/// waits for), so that the next wait is for a change.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// One group for the loopback host, one request in flight at a time.
    const ONE_AT_A_TIME: &str =
        "[[limit]]\nname = \"one\"\nhosts = [\"127.0.0.1\"]\nconcurrency = 1\n";
    const REQUEST: &[u8] = b"GET http://127.0.0.1:9/x HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n";
    /// Bounds a wait that only a bug makes long (these are not timings).
    const BOUND: Duration = Duration::from_secs(10);

    fn proxy() -> (Proxy, Arc<Group>) {
        let proxy = Proxy::new(&Config::parse(ONE_AT_A_TIME, "t.toml").unwrap()).unwrap();
        let group = proxy.limits().group_for("127.0.0.1", None);
        (proxy, group)
    }

    /// The client's end and tollgate's, after the client sent `sent` and tollgate's
    /// version peek saw it (as `Client::serve` has when it calls `wait_in_group`).
    async fn connection(sent: &[u8]) -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        client.write_all(sent).await.unwrap();
        server.peek(&mut [0u8; 1]).await.unwrap();
        (client, server)
    }

    /// The connection as `Client::serve` describes it, seen now.
    fn arrival(local: std::net::SocketAddr) -> Arrival {
        let now = Instant::now();
        Arrival {
            local,
            remote: local,
            arrived: now,
            give_up: now + BOUND,
        }
    }

    async fn until_queued(group: &Group, n: usize) {
        while group.status().queued != n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The proxy, its group, and the group's only permit, taken: a request waits.
    async fn busy() -> (Proxy, Arc<Group>, crate::limit::Permit) {
        let (proxy, group) = proxy();
        let now = Instant::now();
        let permit = group.admit(1, now, now + BOUND, false).await.unwrap();
        (proxy, group, permit)
    }

    /// Polls `wait` until it is queued in `group`; it must not end before.
    async fn until_queued_in<F: std::future::Future>(wait: std::pin::Pin<&mut F>, group: &Group) {
        tokio::select! {
            biased;
            _ = wait => panic!("it left while the group's only permit was taken"),
            () = until_queued(group, 1) => {}
        }
    }

    #[tokio::test]
    async fn a_busy_group_holds_the_request_here_and_hyper_finds_every_byte() {
        let (proxy, group, permit) = busy().await;
        let (_client, server) = connection(REQUEST).await;
        let local = server.local_addr().unwrap();
        let cut = CancellationToken::new();
        let wait = wait_in_group(server, &proxy, arrival(local), None, &cut);
        tokio::pin!(wait);
        until_queued_in(wait.as_mut(), &group).await;

        drop(permit);
        let mut ready = wait.await.expect("admitted");
        assert!(matches!(
            &ready.admission,
            Some(Admission { outcome: Ok(_), .. })
        ));
        assert!(ready.registered_again);
        assert_eq!(group.status().queued, 0);
        // Unread: every byte of the request is still there for hyper.
        let mut got = vec![0u8; REQUEST.len()];
        tokio::time::timeout(BOUND, ready.stream.read_exact(&mut got))
            .await
            .expect("the request's bytes are readable")
            .unwrap();
        assert_eq!(got, REQUEST);
    }

    #[tokio::test]
    async fn a_request_in_pieces_is_held_once_it_is_whole() {
        let (proxy, group, permit) = busy().await;
        let (mut client, server) = connection(&REQUEST[..20]).await;
        let local = server.local_addr().unwrap();
        let cut = CancellationToken::new();
        let wait = wait_in_group(server, &proxy, arrival(local), None, &cut);
        tokio::pin!(wait);
        tokio::select! {
            biased;
            _ = &mut wait => panic!("it did not wait for the rest"),
            () = async {
                for piece in [&REQUEST[20..40], &REQUEST[40..]] {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    client.write_all(piece).await.unwrap();
                }
                until_queued(&group, 1).await;
            } => {}
        }
        drop(permit);
        let ready = wait.await.expect("admitted");
        assert!(ready.admission.is_some());
    }

    #[tokio::test]
    async fn a_client_that_leaves_ends_the_wait_and_takes_nothing() {
        let (proxy, group, _permit) = busy().await;
        let (client, server) = connection(REQUEST).await;
        let local = server.local_addr().unwrap();
        let cut = CancellationToken::new();
        let wait = wait_in_group(server, &proxy, arrival(local), None, &cut);
        tokio::pin!(wait);
        until_queued_in(wait.as_mut(), &group).await;
        drop(client);
        let ended = tokio::time::timeout(BOUND, wait).await.expect("noticed");
        assert!(matches!(ended, Err(Ended::ClientLeft)), "{:?}", ended.err());
        assert_eq!(group.status().queued, 0);
        let metrics = proxy.metrics().encode();
        assert!(
            metrics.contains(r#"tollgate_requests_total{group="one",outcome="cancelled"} 1"#),
            "{metrics}"
        );
    }

    #[tokio::test]
    async fn a_request_that_may_leave_now_is_left_to_hyper_untouched() {
        let (proxy, _group) = proxy();
        let (_client, server) = connection(REQUEST).await;
        let local = server.local_addr().unwrap();
        let cut = CancellationToken::new();
        let ready = wait_in_group(server, &proxy, arrival(local), None, &cut)
            .await
            .expect("served");
        assert!(ready.admission.is_none());
        assert!(!ready.registered_again);
    }
}
