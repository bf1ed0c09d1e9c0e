//! A request to an LLM API, in a group that counts tokens (docs/tokens.md): its
//! estimate before it waits, what the answer's headers announce, and its usage read as
//! the answer's body passes, which replaces the estimate when the body ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::Response;
use http_body::Frame;

use crate::body::{self, Body, BoxError};
use crate::limit::Group;
use crate::llm::usage::Scanner;
use crate::llm::{self, Tokens};
use crate::replay::Replayable;

use crate::access_log::Spent;

/// The estimate of `request` in `group`: `None` when the group counts no tokens, or
/// the request does not read as one of an LLM API's (it then counts as a request only).
pub(super) fn estimate(group: &Group, request: &Replayable) -> Option<Tokens> {
    let settings = group.settings();
    let counted = &settings.tokens;
    let (uri, headers, body) = request.peek()?;
    counted.llm?.of_request(uri.path(), headers)?;
    match body {
        Some(body) => llm::estimate(body, counted.max_output),
        // Too large to read before it leaves: its length says what it holds.
        None => {
            let length = headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(settings.max_replay_body);
            Some(llm::estimate_unread(length, counted.max_output))
        }
    }
}

/// A request's tokens, reserved in its group when it left. Dropped unsettled (no
/// answer, or an answer cut short), it is charged its estimate: the upstream may have
/// counted it.
pub(super) struct Reserved {
    group: Arc<Group>,
    estimate: Tokens,
    settled: bool,
}

impl Reserved {
    /// `estimate`, taken from `group`'s buckets as its request left.
    pub(super) fn new(group: Arc<Group>, estimate: Tokens) -> Reserved {
        Reserved {
            group,
            estimate,
            settled: false,
        }
    }

    /// The upstream refused the request: nothing was spent.
    pub(super) fn refunded(self) {
        self.settle(Tokens::default());
    }

    /// What the answer's headers announce of the upstream's token limits.
    pub(super) fn announced<B>(&self, response: &Response<B>) {
        let limits = llm::headers::parse(response.headers(), SystemTime::now());
        if !limits.is_empty() {
            self.group.tokens_announced(&limits);
        }
    }

    /// The answer to hand to the client: a success's body is read for its usage as it
    /// passes; any other answer spent nothing.
    pub(super) fn answer(
        self,
        response: Response<Body>,
        spent: &mut Option<Spent>,
    ) -> Response<Body> {
        if !response.status().is_success() {
            self.refunded();
            return response;
        }
        let content_type = response.headers().get(http::header::CONTENT_TYPE);
        let scanner = Scanner::new(content_type.and_then(|v| v.to_str().ok()));
        let spent = spent.get_or_insert_with(Spent::default).clone();
        response.map(|inner| {
            body::boxed(Tap {
                inner,
                scanner: Some(scanner),
                reserved: Some(self),
                spent,
            })
        })
    }

    fn settle(mut self, used: Tokens) {
        self.group.settle_tokens(self.estimate, used);
        self.settled = true;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if !self.settled {
            self.group.settle_tokens(self.estimate, self.estimate);
        }
    }
}

/// An answer's body, read for its usage as it passes to the client.
struct Tap {
    inner: Body,
    /// Until the body ends.
    scanner: Option<Scanner>,
    reserved: Option<Reserved>,
    spent: Spent,
}

impl Tap {
    /// The body has ended: what it reported replaces the estimate; a kind it did not
    /// report counts as estimated.
    fn ended(&mut self) {
        let (Some(scanner), Some(reserved)) = (self.scanner.take(), self.reserved.take()) else {
            return;
        };
        let usage = scanner.finish();
        let used = Tokens {
            input: usage.input.unwrap_or(reserved.estimate.input),
            output: usage.output.unwrap_or(reserved.estimate.output),
        };
        let _ = self.spent.set((used.input, used.output));
        reserved.settle(used);
    }
}

impl Drop for Tap {
    /// A client may close its connection once a stream's last event has passed, before
    /// the body's end is read: the usage is whole. Cut short before that, the request
    /// keeps its estimate ([`Reserved`]).
    fn drop(&mut self) {
        if self.scanner.as_ref().is_some_and(Scanner::is_over) {
            self.ended();
        }
    }
}

impl http_body::Body for Tap {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(scanner)) = (frame.data_ref(), &mut self.scanner) {
                    scanner.feed(data);
                }
                // hyper stops polling a body that says it has ended.
                if self.inner.is_end_stream() {
                    self.ended();
                }
            }
            Poll::Ready(None) => self.ended(),
            // Cut short: charged its estimate when dropped.
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
