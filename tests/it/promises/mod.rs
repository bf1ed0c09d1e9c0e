//! What the `promise_*` tests share: a client through the running binary, its
//! answers, and the admin `/status` of a group.
//!
//! Most of these tests make outcomes deterministic instead of timing them: a group at
//! `1/m` lets its burst out and nothing more for a minute, and a short `max_wait` makes
//! tollgate answer `503` at once to a request whose wait ahead outlasts it. So the
//! count of `200`s, the `503`s and what the upstream received say whether a setting
//! took effect, on any machine, at any load.

// Each promise file uses a different part.
#![allow(dead_code)]

use crate::support::*;

/// A request's answer as a client saw it.
#[derive(Debug)]
pub struct Answer {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: http::HeaderMap,
    /// The body as text.
    pub body: String,
}

impl Answer {
    /// The first value of header `name` as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts this is tollgate's `503` for a request its group could not send within
    /// `max_wait`, for group `group`, and returns its `Proxy-Status`.
    pub fn assert_max_wait(&self, group: &str) -> String {
        assert_eq!(self.status, 503, "{self:?}");
        let proxy_status = self.header("proxy-status").unwrap_or_default().to_string();
        assert!(
            proxy_status.starts_with("tollgate; error=http_request_denied; details=\"")
                && proxy_status.contains(&format!("group {group} "))
                && proxy_status.contains("max_wait"),
            "{proxy_status:?}"
        );
        assert!(self.body.starts_with("tollgate: "), "{self:?}");
        assert!(
            self.header("retry-after")
                .is_some_and(|v| v.parse::<u64>().is_ok()),
            "Retry-After in whole seconds: {self:?}"
        );
        proxy_status
    }
}

/// A client that sends everything through `tollgate` as its HTTP proxy.
pub fn client(tollgate: &Tollgate) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(tollgate.url()).expect("proxy URL"))
        .timeout(BOUND)
        .build()
        .expect("reqwest client")
}

/// Sends `method url` with `client` and reads the whole answer.
pub async fn send(client: &reqwest::Client, method: &str, url: &str) -> Answer {
    let method = http::Method::from_bytes(method.as_bytes()).expect("method");
    let resp = client
        .request(method, url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    Answer {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        body: resp.text().await.expect("body"),
    }
}

/// `GET url` through `tollgate`.
pub async fn get(tollgate: &Tollgate, url: &str) -> Answer {
    send(&client(tollgate), "GET", url).await
}

/// The statuses of `GET url`, sent `n` times one after the other through `tollgate`.
pub async fn get_n(tollgate: &Tollgate, url: &str, n: usize) -> Vec<u16> {
    let client = client(tollgate);
    let mut statuses = Vec::new();
    for _ in 0..n {
        statuses.push(send(&client, "GET", url).await.status);
    }
    statuses
}

/// Group `name` in the admin `/status` document.
pub async fn group_status(tollgate: &Tollgate, name: &str) -> serde_json::Value {
    let (status, body) = tollgate.admin("/status").await;
    assert_eq!(status, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).expect("/status is JSON");
    doc["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no group {name} in {body}"))
        .clone()
}

/// The series `tollgate_requests_total{group="G",outcome="O"}`.
pub fn outcome(group: &str, outcome: &str) -> String {
    format!("tollgate_requests_total{{group=\"{group}\",outcome=\"{outcome}\"}}")
}
