//! The answer a client gets: the upstream's, or an error's own, with `Server-Timing`
//! and its access line; and the line of a request whose client left before it.

use std::net::SocketAddr;
use std::sync::Arc;

use http::Response;
use tokio::time::Instant;

use super::Live;
use crate::access_log::{self, Answered, Logged, Record, Timing};
use crate::body::Body;
use crate::error::ProxyError;
use crate::limit::Group;
use crate::metrics::Metrics;

/// A request whose client may leave before its answer (hyper then drops the future
/// that holds this): it still gets its access line, with status 499.
pub(super) struct Unanswered {
    /// The method and URL, while the access log is on and no answer was made.
    pub(super) asked: Option<(http::Method, String)>,
    pub(super) client: SocketAddr,
    pub(super) arrived: Instant,
    pub(super) group: Option<Arc<Group>>,
}

impl Unanswered {
    /// The request `asked` (when the access log is on) of `client`, arrived then.
    pub(super) fn new(
        asked: Option<(http::Method, String)>,
        client: SocketAddr,
        arrived: Instant,
    ) -> Unanswered {
        Unanswered {
            asked,
            client,
            arrived,
            group: None,
        }
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let Some((method, url)) = self.asked.take() else {
            return;
        };
        Record {
            client: self.client,
            user: None,
            method,
            url,
            group: self.group.as_ref().map(|g| g.name.to_string()),
            status: 499,
            answered: Answered::ClientLeft,
            timing: Timing {
                wait: self.arrived.elapsed(),
                ..Timing::default()
            },
            bytes: 0,
            complete: false,
            tunnel: None,
        }
        .emit();
    }
}

/// What became of a request, for its response and its access line.
pub(super) struct Done {
    /// For a CONNECT, what it opened: `blind` or `intercepted`.
    pub(super) tunnel: Option<&'static str>,
    pub(super) client: SocketAddr,
    pub(super) user: Option<String>,
    pub(super) group: Option<Arc<Group>>,
    pub(super) timing: Timing,
}

/// The response the client gets: the upstream's, or an error's own (a refusal of
/// tollgate's own counted in `metrics`); with `Server-Timing` and the access line (of
/// the request `asked`, method and URL) as configured.
pub(super) fn respond(
    answered: Result<Response<Body>, ProxyError>,
    live: &Live,
    metrics: &Metrics,
    asked: Option<(http::Method, String)>,
    done: Done,
) -> Response<Body> {
    let (mut response, answered) = match answered {
        Ok(response) => (response, Answered::Upstream),
        Err(e) => {
            tracing::debug!(error = %e, "request failed");
            if let Some(reason) = e.refusal_reason() {
                metrics.refused(reason);
            }
            let by = Answered::Tollgate(e.proxy_status_error());
            (e.into_response(), by)
        }
    };
    if live.server_timing && done.group.is_some() {
        let value = access_log::server_timing(done.timing.wait);
        if let Ok(value) = http::HeaderValue::from_str(&value) {
            response.headers_mut().append("server-timing", value);
        }
    }
    let Some((method, url)) = asked else {
        return response;
    };
    let record = Record {
        client: done.client,
        user: done.user,
        method,
        url,
        group: done.group.map(|g| g.name.to_string()),
        status: response.status().as_u16(),
        answered,
        timing: done.timing,
        bytes: 0,
        complete: false,
        tunnel: done.tunnel,
    };
    response.map(|body| Logged::wrap(body, record))
}
