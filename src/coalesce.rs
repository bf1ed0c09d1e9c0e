//! A stream whose vectored writes of a few small buffers leave as one plain write.
//!
//! hyper writes an HTTP/1 message as a vectored write of its head and its body's
//! buffers, so that a big body is never copied. Most messages tollgate relays are small
//! (an API call, its JSON answer), and for them the vectored write costs more than the
//! copy it saves: `writev` takes the kernel's generic file-write path where `send` does
//! not, and hyper writes even a lone head (a GET sent upstream) with `writev`. With this
//! adapter a vectored write of one buffer goes out as a plain write, and one of several
//! buffers of up to [`SMALL`] bytes in all is gathered into one buffer first; bigger
//! ones stay vectored, so a big body is still never copied.
//!
//! Measured on a forwarded request (`scripts/bench-forward-cpu`, pinned;
//! docs/performance-log.md, "Tenth session"): this took 0.6 µs off its 18.4 µs of CPU.
//! hyper's own switch (`writev(false)`: every message flattened into one buffer) took 0.8
//! µs, but made a 1 MiB response cost 37 % more, its body copied; with this adapter it
//! costs what it did.

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most bytes a vectored write may hold in all to be copied into one plain write.
/// A typical response head and a small body fit; copying this much costs less than the
/// `writev` it replaces.
pub const SMALL: usize = 4096;

thread_local! {
    /// Where a small vectored write is gathered: one per thread rather than per stream,
    /// so that an idle connection holds no buffer.
    static GATHER: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(SMALL));
}

pin_project_lite::pin_project! {
    /// `inner`, with small vectored writes gathered into one (see the module
    /// documentation). Reads and everything else pass straight through.
    #[derive(Debug)]
    pub struct Coalesced<T> {
        #[pin]
        // The stream written to.
        inner: T,
    }
}

impl<T> Coalesced<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Coalesced { inner }
    }

    /// The stream it wraps.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

/// How a vectored write goes to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// As a plain write of the one buffer (of this index) that holds any bytes.
    One(usize),
    /// Gathered into one buffer, written with a plain write: several buffers, no more
    /// than [`SMALL`] bytes in all.
    Gather,
    /// As it is: several buffers, more than [`SMALL`] bytes in all.
    Vectored,
}

/// How `bufs` is best written. Pure, so that the choice is tested on its own.
fn plan(bufs: &[IoSlice<'_>]) -> Plan {
    let mut filled = bufs.iter().enumerate().filter(|(_, buf)| !buf.is_empty());
    let Some((first, _)) = filled.next() else {
        // Nothing to write: a plain write of nothing answers as the vectored one would.
        return Plan::One(0);
    };
    let mut total = bufs[first].len();
    let mut several = false;
    for (_, buf) in filled {
        several = true;
        total += buf.len();
        if total > SMALL {
            return Plan::Vectored;
        }
    }
    if several {
        Plan::Gather
    } else {
        Plan::One(first)
    }
}

impl<T: AsyncWrite> AsyncWrite for Coalesced<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let inner = self.project().inner;
        let one = match plan(bufs) {
            Plan::One(i) => i,
            Plan::Vectored => return inner.poll_write_vectored(cx, bufs),
            Plan::Gather => return gather(inner, cx, bufs),
        };
        inner.poll_write(cx, bufs.get(one).map_or(&[], |buf| &buf[..]))
    }

    /// As vectored as the stream it wraps (a `TcpStream` is), so that hyper keeps a big
    /// body's buffers as they are instead of copying them into its own.
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

/// Writes `bufs` to `inner` as one plain write of their bytes gathered.
fn gather<T: AsyncWrite>(
    inner: Pin<&mut T>,
    cx: &mut Context<'_>,
    bufs: &[IoSlice<'_>],
) -> Poll<io::Result<usize>> {
    GATHER.with(|gather| {
        // Taken only if free: a `Coalesced` under another stream that writes to it from
        // inside its own gathered write (TLS over this, under this) finds it borrowed,
        // and that inner write stays vectored.
        let Ok(mut gathered) = gather.try_borrow_mut() else {
            return inner.poll_write_vectored(cx, bufs);
        };
        gathered.clear();
        for buf in bufs {
            gathered.extend_from_slice(buf);
        }
        // A short write says how many bytes went, as a short `writev` would: the caller
        // advances its buffers by that much and writes the rest again.
        inner.poll_write(cx, &gathered)
    })
}

impl<T: AsyncRead> AsyncRead for Coalesced<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.project().inner.poll_read(cx, buf)
    }
}

/// What hyper-rustls asks of the stream under an upstream connection (its addresses,
/// for the connection's metadata).
impl<T: Connection> Connection for Coalesced<T> {
    fn connected(&self) -> Connected {
        self.inner.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn one_buffer_goes_plain_several_small_ones_gathered_and_big_ones_vectored() {
        let head = [b'h'; 200];
        let body = [b'b'; 3];
        let big = vec![b'x'; SMALL];
        let plan_of = |bufs: &[&[u8]]| {
            let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
            plan(&slices)
        };
        assert_eq!(plan_of(&[&head]), Plan::One(0));
        assert_eq!(
            plan_of(&[&[], &big, &[]]),
            Plan::One(1),
            "one big buffer, no copy"
        );
        assert_eq!(plan_of(&[]), Plan::One(0));
        assert_eq!(plan_of(&[&head, &body]), Plan::Gather);
        assert_eq!(plan_of(&[&head, &[], &body]), Plan::Gather);
        assert_eq!(
            plan_of(&[&big[..SMALL - 3], &body]),
            Plan::Gather,
            "SMALL exactly"
        );
        assert_eq!(plan_of(&[&head, &big]), Plan::Vectored, "over SMALL in all");
    }

    /// A writer that records how each write reached it.
    #[derive(Default)]
    struct Recorder {
        /// The bytes of each plain write.
        plain: Vec<Vec<u8>>,
        /// The number of buffers of each vectored write.
        vectored: Vec<usize>,
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.get_mut().plain.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.get_mut().vectored.push(bufs.len());
            Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// A small head and body reach the stream as one plain write of both; a big body
    /// stays a vectored write of the buffers as they were.
    #[test]
    fn a_small_message_leaves_in_one_plain_write_and_a_big_one_stays_vectored() {
        let mut stream = Coalesced::new(Recorder::default());
        let mut write = |bufs: &[&[u8]]| {
            let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
            let mut cx = Context::from_waker(std::task::Waker::noop());
            match Pin::new(&mut stream).poll_write_vectored(&mut cx, &slices) {
                Poll::Ready(Ok(n)) => n,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(write(&[b"HTTP/1.1 200 OK\r\n\r\n", b"ok\n"]), 22);
        assert_eq!(write(&[b"", b"GET / HTTP/1.1\r\n\r\n", b""]), 18);
        let big = vec![b'x'; SMALL];
        assert_eq!(write(&[b"HTTP/1.1 200 OK\r\n\r\n", &big]), 19 + SMALL);
        let recorded = stream.get_ref();
        assert_eq!(
            recorded.plain,
            [
                b"HTTP/1.1 200 OK\r\n\r\nok\n".to_vec(),
                b"GET / HTTP/1.1\r\n\r\n".to_vec()
            ]
        );
        assert_eq!(recorded.vectored, [2]);
    }

    /// What is written vectored arrives whole and in order, gathered or not, also when
    /// the other end takes it in small pieces (short writes).
    #[tokio::test]
    async fn vectored_writes_arrive_whole_and_in_order() {
        for sizes in [[200, 3, 0, 50], [100, 5000, 7, 1], [1, 1, 1, 1]] {
            let (near, mut far) = tokio::io::duplex(64);
            let mut near = Coalesced::new(near);
            let bufs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, n)| vec![b'a' + i as u8; *n])
                .collect();
            let expected = bufs.concat();
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                far.read_to_end(&mut got).await.unwrap();
                got
            });
            let mut slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
            let mut slices = &mut slices[..];
            while !slices.is_empty() {
                let n = near.write_vectored(slices).await.unwrap();
                assert!(n > 0);
                IoSlice::advance_slices(&mut slices, n);
            }
            near.shutdown().await.unwrap();
            drop(near);
            assert_eq!(reader.await.unwrap(), expected, "sizes {sizes:?}");
        }
    }
}
