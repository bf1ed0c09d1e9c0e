//! Which requests may be sent again after the upstream pushed back.
//!
//! A replay is safe when the upstream did not carry the request out. Any refusal
//! status may be replayed for an idempotent method (sending it twice does what
//! sending it once does); for the others (POST, PATCH, ...) only the statuses that
//! say the request was not processed: `429`, and `503` with `Retry-After` (a `503`
//! without it is never a push-back, see [`crate::pushback::judge`]).

use http::{Method, StatusCode};

/// Whether a request with `method` that got `status` (a push-back) may be sent again.
pub fn may_replay(method: &Method, status: StatusCode) -> bool {
    method.is_idempotent()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_idempotent_requests_replay_only_when_not_processed() {
        let cases = [
            (Method::GET, 429, true),
            (Method::GET, 502, true),
            (Method::PUT, 500, true),
            (Method::DELETE, 408, true),
            (Method::POST, 429, true),
            (Method::POST, 503, true),
            (Method::POST, 500, false),
            (Method::POST, 502, false),
            (Method::PATCH, 408, false),
            (Method::PATCH, 429, true),
        ];
        for (method, status, replay) in cases {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(may_replay(&method, status), replay, "{method} {status}");
        }
    }
}
