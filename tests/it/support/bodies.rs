//! Big bodies: a generated pattern and a streaming digest.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use super::*;

/// The pattern repeats every this many bytes: a prime, so it never lines up with
/// buffer or frame sizes and a dropped or repeated buffer changes the digest.
const PERIOD: usize = 65_521;
/// Largest slice [`pattern`] hands out at once.
const CHUNK: usize = 64 * 1024;

fn pattern_table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        // xorshift: cheap pseudo-random bytes, so compression or run-length tricks
        // anywhere on the path cannot make the transfer look right by accident.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let period: Vec<u8> = (0..PERIOD)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        // One extra chunk so any CHUNK-long slice starting inside the period is contiguous.
        period
            .iter()
            .copied()
            .cycle()
            .take(PERIOD + CHUNK)
            .collect()
    })
}

/// Bytes `offset..offset+len` of the endless test pattern (`len` ≤ 64 KiB), zero-copy.
pub fn pattern(offset: u64, len: usize) -> Bytes {
    assert!(len <= CHUNK);
    let start = (offset % PERIOD as u64) as usize;
    Bytes::from_static(&pattern_table()[start..start + len])
}

/// The digest of the first `len` bytes of [`pattern`].
pub fn pattern_digest(len: u64) -> Digest {
    let mut hasher = Hasher::default();
    let mut offset = 0;
    while offset < len {
        let n = (len - offset).min(CHUNK as u64) as usize;
        hasher.update(&pattern(offset, n));
        offset += n as u64;
    }
    hasher.finish()
}

/// Computes a [`Digest`] over bytes fed in pieces of any size.
#[derive(Default)]
pub struct Hasher {
    len: u64,
    hash: u64,
    tail: Vec<u8>,
}

impl Hasher {
    /// Feeds the next bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        // Words are hashed whole, so first complete a word left over from the last call.
        if !self.tail.is_empty() {
            let need = (8 - self.tail.len()).min(data.len());
            self.tail.extend_from_slice(&data[..need]);
            data = &data[need..];
            if self.tail.len() < 8 {
                return;
            }
            let word = u64::from_le_bytes(self.tail[..].try_into().unwrap());
            self.mix(word);
            self.tail.clear();
        }
        let mut words = data.chunks_exact(8);
        for word in &mut words {
            self.mix(u64::from_le_bytes(word.try_into().unwrap()));
        }
        self.tail.extend_from_slice(words.remainder());
    }

    fn mix(&mut self, word: u64) {
        self.hash = (self.hash ^ word)
            .wrapping_mul(0x0000_0100_0000_01B3)
            .rotate_left(29);
    }

    /// The digest of everything fed so far.
    pub fn finish(mut self) -> Digest {
        if !self.tail.is_empty() {
            let mut last = [0u8; 8];
            last[..self.tail.len()].copy_from_slice(&self.tail);
            self.mix(u64::from_le_bytes(last));
        }
        Digest {
            len: self.len,
            hash: self.hash,
        }
    }
}

/// Held downloads wait here until [`Upstream::release`].
#[derive(Default)]
pub(super) struct Gate {
    /// Whether the gate is open, and the bodies waiting for it to open.
    state: Mutex<(bool, Vec<Waker>)>,
}

impl Gate {
    pub(super) fn open(&self) {
        let waiting = {
            let mut state = self.state.lock().unwrap();
            state.0 = true;
            std::mem::take(&mut state.1)
        };
        waiting.into_iter().for_each(Waker::wake);
    }

    /// Ready once open; otherwise registers `cx` to be woken by [`Gate::open`].
    fn poll_open(&self, cx: &Context<'_>) -> Poll<()> {
        let mut state = self.state.lock().unwrap();
        if state.0 {
            return Poll::Ready(());
        }
        if !state.1.iter().any(|w| w.will_wake(cx.waker())) {
            state.1.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// A response body of `remaining` pattern bytes, generated as it is sent; with a gate
/// `(at, gate)`, it pauses after `at` bytes until the gate opens.
pub(super) struct PatternBody {
    offset: u64,
    remaining: u64,
    gate: Option<(u64, Arc<Gate>)>,
}

impl PatternBody {
    pub(super) fn new(len: u64, gate: Option<(u64, Arc<Gate>)>) -> PatternBody {
        PatternBody {
            offset: 0,
            remaining: len,
            gate,
        }
    }
}

impl HttpBody for PatternBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let mut n = self.remaining.min(CHUNK as u64);
        let offset = self.offset;
        if let Some((at, gate)) = &self.gate {
            if offset >= *at {
                if gate.poll_open(cx).is_pending() {
                    return Poll::Pending;
                }
                self.gate = None;
            } else {
                // Stop exactly at the gate so the client can receive every byte before it.
                n = n.min(*at - offset);
            }
        }
        let n = n as usize;
        let chunk = pattern(self.offset, n);
        self.offset += n as u64;
        self.remaining -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}
