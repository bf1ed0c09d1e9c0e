//! A connection whose first request is for a slowly paced group is served by that
//! group's home thread.
//!
//! Why: the head of a paced queue releases the requests behind it as their slots come
//! (`limit::group`). A request waiting on another serving thread is woken across threads,
//! and on a mostly idle machine that means waking an idle thread for each release; at 10
//! 000 requests/s on two threads it cost 3.4 µs of CPU per request more than one thread
//! serving them all (docs/performance-log.md, "Seventeenth session"). A group whose rate is
//! one thread's work has a home ([`Group::home`]); a connection whose first request is for
//! it is taken off this thread's reactor before the request waits and handed to the home
//! thread's inbox, and that thread serves it from then on as if it had accepted it. The
//! request's bytes were only peeked, so they are still in the socket.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::metrics::Metrics;

    /// A group paced at 10/s, with home `ordinal`.
    fn group(ordinal: usize) -> Group {
        let config = Config::parse("[defaults]\nrate = \"10/s\"\n", "t.toml").unwrap();
        let metrics = Metrics::new().group("g");
        Group::new("g".into(), config.defaults, metrics, None).with_home(ordinal)
    }

    fn arrival() -> Arrival {
        let addr = "127.0.0.1:9".parse().unwrap();
        let now = Instant::now();
        Arrival {
            local: addr,
            remote: addr,
            arrived: now,
            give_up: now,
        }
    }

    #[tokio::test]
    async fn a_connection_goes_to_its_groups_thread_or_stays_when_that_one_is_closing() {
        let mut threads = Homes::new(3);
        let (this, _) = &threads[1];
        // Homes are taken modulo the thread count; its own thread is not elsewhere.
        assert_eq!(this.elsewhere(&group(0)), Some(0));
        assert_eq!(this.elsewhere(&group(1)), None);
        assert_eq!(this.elsewhere(&group(5)), Some(2));
        let unhomed = Group::new(
            "u".into(),
            Config::parse("", "t.toml").unwrap().defaults,
            Metrics::new().group("u"),
            None,
        );
        assert_eq!(this.elsewhere(&unhomed), None);

        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = || std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let this = this.clone();
        let sent = socket();
        let port = sent.local_addr().unwrap().port();
        assert!(this
            .send(
                0,
                Moved {
                    stream: sent,
                    arrival: arrival()
                }
            )
            .is_ok());
        let got = threads[0].1.recv().await.expect("in thread 0's inbox");
        assert_eq!(got.stream.local_addr().unwrap().port(), port);

        // A thread that is shutting down takes nothing more: the sender keeps it.
        threads[2].1.close();
        let kept = this.send(
            2,
            Moved {
                stream: socket(),
                arrival: arrival(),
            },
        );
        assert!(kept.is_err(), "a closed inbox refuses the connection");
    }
}
