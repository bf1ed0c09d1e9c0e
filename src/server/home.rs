//! A connection whose first request is for a slowly paced group is served by that
//! group's home thread.
//!
//! Why: the head of a paced queue releases the requests behind it as their slots come
//! (`limit::group`). A request waiting on another serving thread is woken across
//! threads, and on a mostly idle machine that means waking an idle thread for each
//! release; at 10 000 requests/s on two threads it cost 3.4 µs of CPU per request more
//! than one thread serving them all (BENCHMARKS.md, "Seventeenth session"). A group
//! whose rate is one thread's work has a home ([`Group::home`]); a connection whose
//! first request is for it is taken off this thread's reactor before the request waits
//! and handed to the home thread's inbox, and that thread serves it from then on as if
//! it had accepted it. The request's bytes were only peeked, so they are still in the
//! socket.
//!
//! Only the first request decides, once per connection: the later requests of a
//! kept-alive connection are served where it is. HTTP/2 connections stay where they
//! were accepted (their streams may be for any group). With one serving thread nothing
//! moves.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::limit::Group;

/// A client connection on its way to its group's home thread.
pub(super) struct Moved {
    /// The client's socket, off every reactor.
    pub stream: std::net::TcpStream,
    /// What goes with it.
    pub arrival: Arrival,
}

/// What is known of a connection when its first request has been peeked at.
#[derive(Clone, Copy, Debug)]
pub(super) struct Arrival {
    /// The address the client connected to (transparent routes depend on it).
    pub local: SocketAddr,
    /// The client's address.
    pub remote: SocketAddr,
    /// When the first request was seen: its time in the queue counts from there.
    pub arrived: Instant,
    /// When the first request must have arrived whole (`client_header_timeout`).
    pub give_up: Instant,
}

/// The receiving end of one serving thread's inbox.
pub(super) type Inbox = mpsc::UnboundedReceiver<Moved>;

/// Every serving thread's inbox, as one of them sees it.
#[derive(Clone)]
pub(super) struct Homes {
    /// One per serving thread, in thread order.
    inboxes: Arc<[mpsc::UnboundedSender<Moved>]>,
    /// The thread this copy belongs to.
    this: usize,
}

impl Homes {
    /// The inboxes of `threads` serving threads: each thread's view of them and its own
    /// receiving end, in thread order.
    pub fn new(threads: usize) -> Vec<(Homes, Inbox)> {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..threads.max(1))
            .map(|_| mpsc::unbounded_channel())
            .unzip();
        let inboxes: Arc<[_]> = senders.into();
        receivers
            .into_iter()
            .enumerate()
            .map(|(this, inbox)| {
                let homes = Homes {
                    inboxes: inboxes.clone(),
                    this,
                };
                (homes, inbox)
            })
            .collect()
    }

    /// The thread `group`'s connections belong on, when that is not this one.
    pub fn elsewhere(&self, group: &Group) -> Option<usize> {
        let home = group.home()? % self.inboxes.len();
        (home != self.this).then_some(home)
    }

    /// Hands `moved` to thread `home`; gives it back when that thread takes no more
    /// connections (it is shutting down).
    pub fn send(&self, home: usize, moved: Moved) -> Result<(), Moved> {
        self.inboxes[home].send(moved).map_err(|refused| refused.0)
    }
}
