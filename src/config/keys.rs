//! Budgets per key and fair queues within a budget (docs/keys.md): `key`, `key_idle`,
//! `max_keys`, `key_labels` in a `[[limit]]`; `fair_by`, `weights` and `flow_queue` in
//! `[defaults]` or a `[[limit]]`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

use super::values::Dur;

/// Where a request's key (or flow) is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (`header:<name>`), the first value when it is repeated.
    Header(http::HeaderName),
    /// The proxy user of `[access] users` (`user`).
    User,
    /// The client's address (`client`), without its port.
    Client,
    /// The `model` of the JSON body (`model`): LLM APIs limit each model apart.
    Model,
}

impl std::str::FromStr for KeySource {
    type Err = String;

    fn from_str(text: &str) -> Result<KeySource, String> {
        match text {
            "user" => Ok(KeySource::User),
            "client" => Ok(KeySource::Client),
            "model" => Ok(KeySource::Model),
            _ => match text.strip_prefix("header:") {
                Some(name) => http::HeaderName::try_from(name.trim())
                    .map(KeySource::Header)
                    .map_err(|_| format!("{name:?} is not a header name")),
                None => Err(format!(
                    "invalid key source {text:?}: expected \"header:<name>\", \"user\", \
                     \"client\" or \"model\""
                )),
            },
        }
    }
}

impl<'de> Deserialize<'de> for KeySource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(de::Error::custom)
    }
}

/// Keys that are swept after this long without a request.
pub const KEY_IDLE: Duration = Duration::from_secs(600);
/// The most keys one `[[limit]]` keeps budgets for.
pub const MAX_KEYS: usize = 10_000;

/// A group's keys and flows, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySettings {
    /// Each value of this source gets a budget of its own (`key`); `None`: one budget.
    pub key: Option<KeySource>,
    /// A key's budget is dropped after this long without a request (`key_idle`).
    pub key_idle: Duration,
    /// The most keys kept at once (`max_keys`); a request with a new key past it is
    /// refused.
    pub max_keys: usize,
    /// Names shown for keys in `/status` and on the dashboard, by the first hex digits
    /// of their SHA-256 (`key_labels`).
    pub key_labels: BTreeMap<String, String>,
    /// Requests are queued fairly by this source's value (`fair_by`); `None`: FIFO.
    pub fair_by: Option<KeySource>,
    /// Each flow's share of departures while several wait, by value (`weights`; 1 when
    /// not listed).
    pub weights: BTreeMap<String, u32>,
    /// The most requests one flow may have waiting (`flow_queue`); `None`: the group's
    /// `queue`.
    pub flow_queue: Option<usize>,
}

impl Default for KeySettings {
    fn default() -> Self {
        KeySettings {
            key: None,
            key_idle: KEY_IDLE,
            max_keys: MAX_KEYS,
            key_labels: BTreeMap::new(),
            fair_by: None,
            weights: BTreeMap::new(),
            flow_queue: None,
        }
    }
}

impl KeySettings {
    /// The weight of the flow `value`.
    pub fn weight(&self, value: &str) -> u32 {
        self.weights.get(value).copied().unwrap_or(1)
    }
}

/// The keys of a table as written.
#[derive(Debug, Default)]
pub(super) struct RawKeys {
    pub(super) key: Option<Spanned<KeySource>>,
    pub(super) key_idle: Option<Dur>,
    pub(super) max_keys: Option<Spanned<usize>>,
    pub(super) key_labels: Option<Spanned<BTreeMap<String, String>>>,
    pub(super) fair_by: Option<Spanned<KeySource>>,
    pub(super) weights: Option<BTreeMap<String, Spanned<u32>>>,
    pub(super) flow_queue: Option<Spanned<usize>>,
}

type Located = (std::ops::Range<usize>, String);

impl RawKeys {
    /// These keys over `base`'s; `in_defaults`: the table is `[defaults]`, where a
    /// budget per key has no group to belong to.
    pub(super) fn resolve(
        self,
        base: &KeySettings,
        in_defaults: bool,
    ) -> Result<KeySettings, Located> {
        if let (true, Some(key)) = (in_defaults, &self.key) {
            return Err((
                key.span(),
                "key belongs in a [[limit]]: each of its values gets that limit's budget".into(),
            ));
        }
        if let Some(fair_by) = self
            .fair_by
            .as_ref()
            .filter(|f| *f.get_ref() == KeySource::Model)
        {
            return Err((
                fair_by.span(),
                "fair_by takes \"header:<name>\", \"user\" or \"client\"; \"model\" is a key"
                    .into(),
            ));
        }
        if let Some(labels) = &self.key_labels {
            let bad = labels.get_ref().keys().find(|k| {
                k.is_empty() || k.len() > 64 || !k.bytes().all(|b| b.is_ascii_hexdigit())
            });
            if let Some(bad) = bad {
                return Err((
                    labels.span(),
                    format!(
                        "key_labels are named by the first hex digits of a key's SHA-256 \
                         (as /status shows them), not {bad:?}"
                    ),
                ));
            }
        }
        let mut weights = BTreeMap::new();
        for (value, weight) in self.weights.unwrap_or_else(|| {
            let base = base.weights.iter();
            base.map(|(k, w)| (k.clone(), Spanned::new(0..0, *w)))
                .collect()
        }) {
            if *weight.get_ref() == 0 || *weight.get_ref() > 1000 {
                return Err((weight.span(), "a weight must be between 1 and 1000".into()));
            }
            weights.insert(value, weight.into_inner());
        }
        let positive = |v: Option<Spanned<usize>>, name: &str| match v {
            Some(v) if *v.get_ref() == 0 => Err((v.span(), format!("{name} must be at least 1"))),
            v => Ok(v.map(Spanned::into_inner)),
        };
        Ok(KeySettings {
            key: self
                .key
                .map(Spanned::into_inner)
                .or_else(|| base.key.clone()),
            key_idle: self.key_idle.map_or(base.key_idle, |d| d.0),
            max_keys: positive(self.max_keys, "max_keys")?.unwrap_or(base.max_keys),
            key_labels: self
                .key_labels
                .map(|l| {
                    l.into_inner()
                        .into_iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), v))
                })
                .map_or_else(|| base.key_labels.clone(), Iterator::collect),
            fair_by: self
                .fair_by
                .map(Spanned::into_inner)
                .or_else(|| base.fair_by.clone()),
            weights,
            flow_queue: positive(self.flow_queue, "flow_queue")?.or(base.flow_queue),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_read_as_written() {
        let cases = [
            (
                "header:authorization",
                Ok(KeySource::Header(http::header::AUTHORIZATION)),
            ),
            (
                "header:X-Tenant",
                Ok(KeySource::Header("x-tenant".parse().unwrap())),
            ),
            ("user", Ok(KeySource::User)),
            ("client", Ok(KeySource::Client)),
            ("model", Ok(KeySource::Model)),
        ];
        for (text, want) in cases {
            assert_eq!(text.parse::<KeySource>(), want, "{text}");
        }
        for bad in ["", "header:", "header:a b", "cookie:x", "User"] {
            assert!(bad.parse::<KeySource>().is_err(), "{bad}");
        }
    }
}
