//! Every failure tollgate makes, and the HTTP response each one becomes.
//!
//! The library returns [`ProxyError`] with the context a user needs (which host, which
//! group, what timed out); the outermost service turns it into a response with a short
//! plain-text body and a `Proxy-Status` header (RFC 9209), so a client always gets an
//! answer that says what happened and where.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::{self, Body};

use crate::access::PROXY_NAME;

/// A request tollgate could not carry through, and why.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    /// The request itself is malformed or unsupported.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// An origin-form request matched no gateway route.
    #[error("no route matches {path}; {}", list_routes(.routes))]
    NoRoute {
        /// The request path.
        path: String,
        /// The configured route prefixes, to help the user.
        routes: Vec<String>,
    },
    /// CONNECT to a port that `connect_ports` does not allow.
    #[error("CONNECT to port {port} is not allowed (proxy.connect_ports)")]
    PortNotAllowed {
        /// The refused port.
        port: u16,
    },
    /// The destination policy refuses the destination (`[access]`); nothing was dialled.
    #[error("{denial}{}", allow_hint(.denial))]
    DestinationDenied {
        /// What was refused, and by which rule.
        denial: crate::access::Denial,
    },
    /// `[access] users` is set and the request carries no valid `Proxy-Authorization`.
    #[error("proxy authentication required: send Proxy-Authorization: Basic with a user of [access] users")]
    ProxyAuthRequired,
    /// Too many credentials wait for their check: one more would wait behind them all.
    #[error("too many proxy credentials are being checked at once: try again in a second")]
    AuthBusy,
    /// The client's address is not in `[access] clients`.
    #[error("client {client} may not use this proxy ([access] clients)")]
    ClientDenied {
        /// The client's address.
        client: std::net::IpAddr,
    },
    /// The request already passed through this tollgate (its `Via` names it).
    #[error("loop detected: the request already passed through tollgate (Via: {via})")]
    LoopDetected {
        /// The request's `Via` header.
        via: String,
    },
    /// A request inside an intercepted tunnel names another host than the tunnel's.
    #[error("this tunnel was opened to {tunnel}, and the request names {named}: open a tunnel to {named} for it")]
    Misdirected {
        /// The host the request names.
        named: String,
        /// The host the tunnel was opened to.
        tunnel: String,
    },
    /// The upstream host name did not resolve.
    #[error("could not resolve {host}: {reason}")]
    Dns {
        /// The host name.
        host: String,
        /// The resolver's answer.
        reason: String,
    },
    /// The upstream refused the TCP connection.
    #[error("connection refused by {authority}")]
    ConnectionRefused {
        /// `host:port`.
        authority: String,
    },
    /// Resolving, connecting or the TLS handshake took longer than `connect_timeout`.
    #[error("no connection to {authority} within {}", humantime::format_duration(*.after))]
    ConnectTimeout {
        /// `host:port`.
        authority: String,
        /// The configured limit.
        after: Duration,
    },
    /// Connecting failed for another reason (unreachable network, reset, ...).
    #[error("could not connect to {authority}: {reason}")]
    Connect {
        /// `host:port`.
        authority: String,
        /// The operating system's answer.
        reason: String,
    },
    /// The upstream's certificate was not accepted.
    #[error("TLS certificate of {authority} not accepted: {reason}; an upstream with a private CA is trusted with [proxy] ca_file")]
    TlsCertificate {
        /// `host:port`.
        authority: String,
        /// rustls's reason.
        reason: String,
    },
    /// The TLS handshake failed for a reason other than the certificate.
    #[error("TLS handshake with {authority} failed: {reason}")]
    Tls {
        /// `host:port`.
        authority: String,
        /// rustls's reason.
        reason: String,
    },
    /// No response head within `response_timeout`.
    #[error("{authority} sent no response within {}", humantime::format_duration(*.after))]
    ResponseTimeout {
        /// `host:port`.
        authority: String,
        /// The configured limit.
        after: Duration,
    },
    /// The group's queue was full.
    #[error("queue full: group {group} already has {queue} requests waiting")]
    QueueFull {
        /// The group's name.
        group: String,
        /// The group's `queue` bound.
        queue: usize,
        /// An estimate of when a request could get through.
        retry_after: Duration,
    },
    /// The request's flow already had `flow_queue` requests waiting in its group.
    #[error("queue full for this flow: group {group} already has {flow_queue} requests of its fair_by value waiting (flow_queue)")]
    FlowQueueFull {
        /// The group's name.
        group: String,
        /// The group's `flow_queue` bound.
        flow_queue: usize,
        /// An estimate of when a request of the flow could get through.
        retry_after: Duration,
    },
    /// The request's key would have been one more than the group's `max_keys`.
    #[error("group {group} already keeps a budget for each of {max_keys} keys (max_keys): a new key gets one when another has been idle for key_idle")]
    TooManyKeys {
        /// The group's name.
        group: String,
        /// The group's `max_keys` bound.
        max_keys: usize,
        /// The group's `key_idle`, after which an idle key's budget is dropped.
        key_idle: Duration,
    },
    /// The request waited the group's `max_wait` without getting through.
    #[error("waited {} in the queue of group {group} (max_wait) without getting through", humantime::format_duration(*.waited))]
    QueueTimeout {
        /// The group's name.
        group: String,
        /// How long the request waited, rounded to milliseconds.
        waited: Duration,
        /// An estimate of when a request could get through.
        retry_after: Duration,
    },
    /// The wait ahead of the request already outlasts what is left of its `max_wait`.
    #[error("group {group} cannot send this request within max_wait ({}): the wait ahead (the upstream's pause, the queue) is about {}", humantime::format_duration(*.max_wait), humantime::format_duration(*.ahead))]
    WaitTooLong {
        /// The group's name.
        group: String,
        /// The group's `max_wait`.
        max_wait: Duration,
        /// The estimated wait ahead, rounded to milliseconds.
        ahead: Duration,
    },
    /// The shared limit store is unreachable and `on_backend_error = "deny"`.
    #[error("the shared limit store (Redis) is unreachable; group {group} refuses requests until it answers (backend.on_backend_error = \"deny\")")]
    BackendDown {
        /// The group's name.
        group: String,
    },
    /// The client's request body made no progress for `body_idle_timeout`.
    #[error("the request body made no progress for {} (body_idle_timeout)", humantime::format_duration(*.after))]
    RequestBodyIdle {
        /// The configured limit.
        after: Duration,
    },
    /// The request was still queued when shutdown's grace ran out; nothing was sent.
    #[error("shutting down")]
    ShuttingDown,
    /// The upstream broke the exchange (closed early, spoke bad HTTP, ...).
    #[error("{authority} failed: {reason}")]
    Upstream {
        /// `host:port`.
        authority: String,
        /// What went wrong.
        reason: String,
    },
}

fn allow_hint(denial: &crate::access::Denial) -> String {
    match &denial.allow {
        Some(allow) => format!("; to allow it, add {allow:?} to [access] allow"),
        None => String::new(),
    }
}

fn list_routes(routes: &[String]) -> String {
    if routes.is_empty() {
        "no routes are configured; use this address as HTTP_PROXY, or add a [[route]]".into()
    } else {
        format!("routes: {}", routes.join(", "))
    }
}

impl From<crate::access::Refused> for ProxyError {
    fn from(refused: crate::access::Refused) -> ProxyError {
        use crate::access::Refused;
        match refused {
            Refused::Client { client } => ProxyError::ClientDenied { client },
            Refused::AuthRequired => ProxyError::ProxyAuthRequired,
            Refused::AuthBusy => ProxyError::AuthBusy,
            Refused::Loop { via } => ProxyError::LoopDetected { via },
        }
    }
}

impl ProxyError {
    /// The status code the client receives.
    pub fn status(&self) -> StatusCode {
        use ProxyError::*;
        match self {
            BadRequest(_) => StatusCode::BAD_REQUEST,
            RequestBodyIdle { .. } => StatusCode::REQUEST_TIMEOUT,
            Misdirected { .. } => StatusCode::MISDIRECTED_REQUEST,
            NoRoute { .. } => StatusCode::NOT_FOUND,
            PortNotAllowed { .. } | DestinationDenied { .. } | ClientDenied { .. } => {
                StatusCode::FORBIDDEN
            }
            ProxyAuthRequired => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            AuthBusy => StatusCode::TOO_MANY_REQUESTS,
            LoopDetected { .. } => StatusCode::LOOP_DETECTED,
            Dns { .. } | ConnectionRefused { .. } | Connect { .. } => StatusCode::BAD_GATEWAY,
            TlsCertificate { .. } | Tls { .. } | Upstream { .. } => StatusCode::BAD_GATEWAY,
            ConnectTimeout { .. } | ResponseTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            QueueFull { .. }
            | FlowQueueFull { .. }
            | TooManyKeys { .. }
            | QueueTimeout { .. }
            | WaitTooLong { .. }
            | BackendDown { .. }
            | ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The RFC 9209 error type for `Proxy-Status`.
    pub fn proxy_status_error(&self) -> &'static str {
        use ProxyError::*;
        match self {
            BadRequest(_) | RequestBodyIdle { .. } | Misdirected { .. } => "http_request_error",
            NoRoute { .. } => "destination_not_found",
            PortNotAllowed { .. } | ProxyAuthRequired | AuthBusy | ClientDenied { .. } => {
                "http_request_denied"
            }
            DestinationDenied { .. } => "destination_ip_prohibited",
            LoopDetected { .. } => "proxy_loop_detected",
            Dns { .. } => "dns_error",
            ConnectionRefused { .. } => "connection_refused",
            ConnectTimeout { .. } => "connection_timeout",
            Connect { .. } => "destination_unavailable",
            TlsCertificate { .. } => "tls_certificate_error",
            Tls { .. } => "tls_protocol_error",
            ResponseTimeout { .. } => "http_response_timeout",
            Upstream { .. } => "http_protocol_error",
            // RFC 9209 has no queue types: the request was denied by tollgate's own
            // policy, and `details` says which bound.
            QueueFull { .. }
            | FlowQueueFull { .. }
            | TooManyKeys { .. }
            | QueueTimeout { .. }
            | WaitTooLong { .. } => "http_request_denied",
            BackendDown { .. } | ShuttingDown => "proxy_internal_error",
        }
    }

    /// The error for a request its group refused.
    pub fn refused(group: &crate::limit::Group, refusal: crate::limit::Refusal) -> ProxyError {
        let name = group.name.to_string();
        match refusal {
            crate::limit::Refusal::QueueFull { retry_after } => ProxyError::QueueFull {
                group: name,
                queue: group.settings().queue,
                retry_after,
            },
            crate::limit::Refusal::FlowQueueFull { retry_after } => ProxyError::FlowQueueFull {
                flow_queue: (group.settings().keys.flow_queue).unwrap_or(group.settings().queue),
                group: name,
                retry_after,
            },
            crate::limit::Refusal::TooManyKeys => ProxyError::TooManyKeys {
                group: name,
                max_keys: group.settings().keys.max_keys,
                key_idle: group.settings().keys.key_idle,
            },
            crate::limit::Refusal::BackendDown => ProxyError::BackendDown { group: name },
            crate::limit::Refusal::WaitTooLong { ahead } => ProxyError::WaitTooLong {
                group: name,
                max_wait: group.settings().max_wait,
                ahead: Duration::from_millis(ahead.as_millis() as u64),
            },
            crate::limit::Refusal::MaxWait {
                waited,
                retry_after,
            } => ProxyError::QueueTimeout {
                group: name,
                waited: Duration::from_millis(waited.as_millis() as u64),
                retry_after,
            },
        }
    }

    /// When the client may try again, for refusals that know.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::QueueFull { retry_after, .. }
            | ProxyError::FlowQueueFull { retry_after, .. }
            | ProxyError::QueueTimeout { retry_after, .. } => Some(*retry_after),
            // An idle key's budget is dropped within `key_idle`: then there is room.
            ProxyError::TooManyKeys { key_idle, .. } => Some(*key_idle),
            ProxyError::WaitTooLong { ahead, .. } => Some(*ahead),
            // The probe looks twice a second; a second is an honest guess.
            ProxyError::BackendDown { .. } => Some(Duration::from_secs(1)),
            // Another instance, or this one restarted, is expected within seconds.
            ProxyError::ShuttingDown => Some(Duration::from_secs(1)),
            // A check takes milliseconds; the queue of them drains within a second.
            ProxyError::AuthBusy => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// Why tollgate refused the request itself, for `tollgate_refusals_total{reason}`;
    /// `None` for the upstream's failures and the group's refusals (counted apart).
    pub fn refusal_reason(&self) -> Option<&'static str> {
        use ProxyError::*;
        Some(match self {
            BadRequest(_) | Misdirected { .. } => "bad_request",
            ClientDenied { .. } => "client_denied",
            PortNotAllowed { .. } | DestinationDenied { .. } => "destination_denied",
            ProxyAuthRequired => "auth_required",
            AuthBusy => "auth_busy",
            LoopDetected { .. } => "loop",
            TooManyKeys { .. } => "max_keys",
            _ => return None,
        })
    }

    /// The error for a request body that failed with `error`.
    pub fn request_body(error: &crate::body::BoxError) -> ProxyError {
        match error.downcast_ref::<crate::body::BodyIdle>() {
            Some(idle) => ProxyError::RequestBodyIdle { after: idle.0 },
            None => ProxyError::BadRequest(format!("reading the request body failed: {error}")),
        }
    }

    /// The response the client receives for this error.
    pub fn into_response(self) -> Response<Body> {
        let text = self.to_string();
        let mut resp = Response::new(body::full(Bytes::from(format!("{PROXY_NAME}: {text}\n"))));
        *resp.status_mut() = self.status();
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(
            "proxy-status",
            proxy_status(self.proxy_status_error(), &text),
        );
        if let Some(after) = self.retry_after() {
            // Whole seconds (RFC 9110 §10.2.3), rounded up and at least 1 so a client
            // that honours it does not come straight back.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        if matches!(self, ProxyError::ProxyAuthRequired) {
            headers.insert(
                header::PROXY_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"tollgate\""),
            );
        }
        if matches!(self, ProxyError::ShuttingDown) {
            // HTTP/1 only (hyper drops it from HTTP/2 answers, where GOAWAY says it).
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// A `Proxy-Status` value: `tollgate; error=<type>; details="<text>"` (RFC 9209 §2).
pub fn proxy_status(error: &str, details: &str) -> HeaderValue {
    // `details` is a structured-field string: printable ASCII with `"` and `\` escaped.
    let mut value = format!("{PROXY_NAME}; error={error}; details=\"");
    for c in details.chars() {
        match c {
            '"' | '\\' => {
                value.push('\\');
                value.push(c);
            }
            ' '..='~' => value.push(c),
            _ => value.push('?'),
        }
    }
    value.push('"');
    HeaderValue::try_from(value).expect("printable ASCII is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_status_escapes_details() {
        let v = proxy_status("dns_error", "no \"such\" host \\ é");
        assert_eq!(
            v.to_str().unwrap(),
            r#"tollgate; error=dns_error; details="no \"such\" host \\ ?""#
        );
    }

    #[test]
    fn error_becomes_text_response() {
        let resp = ProxyError::ConnectTimeout {
            authority: "10.0.0.1:443".into(),
            after: Duration::from_secs(10),
        }
        .into_response();
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        let ps = resp.headers()["proxy-status"].to_str().unwrap();
        assert!(
            ps.starts_with("tollgate; error=connection_timeout;"),
            "{ps}"
        );
    }
}
