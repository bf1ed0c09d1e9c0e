//! Where the settings that name something outside the file are written — `[proxy]
//! ca_file`, `[access] users`, `[backend] url`, `sentinels`, `cluster`, `ca_file`,
//! `client_cert_file` and `client_key_file`, `[intercept] ca_cert` and `ca_key` —
//! so that the step that reads those files (`crate::external`) reports a problem at
//! its place in `config.toml`.

use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

use super::{line_column, ConfigError};

/// Where a setting was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The configuration file.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub column: usize,
}

/// Where each setting that names something outside the file was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Places {
    /// `[proxy] ca_file`.
    pub ca_file: Option<Place>,
    /// `[access] users`.
    pub users: Option<Place>,
    /// `[backend] url`.
    pub backend_url: Option<Place>,
    /// `[backend] sentinels`.
    pub backend_sentinels: Option<Place>,
    /// `[backend] cluster`.
    pub backend_cluster: Option<Place>,
    /// `[backend] ca_file`.
    pub backend_ca_file: Option<Place>,
    /// `[backend] client_cert_file`.
    pub backend_client_cert_file: Option<Place>,
    /// `[backend] client_key_file`.
    pub backend_client_key_file: Option<Place>,
    /// `[intercept] ca_cert`.
    pub ca_cert: Option<Place>,
    /// `[intercept] ca_key`.
    pub ca_key: Option<Place>,
}

/// The same file read again for the spans of those settings alone (other keys are
/// checked by the main pass, and ignored here).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Spans {
    proxy: ProxySpans,
    access: AccessSpans,
    backend: BackendSpans,
    intercept: InterceptSpans,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ProxySpans {
    ca_file: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct AccessSpans {
    users: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct BackendSpans {
    url: Option<Spanned<toml::Value>>,
    sentinels: Option<Spanned<toml::Value>>,
    cluster: Option<Spanned<toml::Value>>,
    ca_file: Option<Spanned<toml::Value>>,
    client_cert_file: Option<Spanned<toml::Value>>,
    client_key_file: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct InterceptSpans {
    ca_cert: Option<Spanned<toml::Value>>,
    ca_key: Option<Spanned<toml::Value>>,
}

impl Places {
    /// The places in `text`, a file that parsed.
    pub(super) fn find(text: &str, file: &str) -> Places {
        let spans: Spans = toml::from_str(text).unwrap_or_default();
        let place = |span: Option<Range<usize>>| {
            span.map(|span| {
                let (line, column) = line_column(text, span.start);
                Place {
                    file: file.to_string(),
                    line,
                    column,
                }
            })
        };
        Places {
            ca_file: place(spans.proxy.ca_file.map(|s| s.span())),
            users: place(spans.access.users.map(|s| s.span())),
            backend_url: place(spans.backend.url.map(|s| s.span())),
            backend_sentinels: place(spans.backend.sentinels.map(|s| s.span())),
            backend_cluster: place(spans.backend.cluster.map(|s| s.span())),
            backend_ca_file: place(spans.backend.ca_file.map(|s| s.span())),
            backend_client_cert_file: place(spans.backend.client_cert_file.map(|s| s.span())),
            backend_client_key_file: place(spans.backend.client_key_file.map(|s| s.span())),
            ca_cert: place(spans.intercept.ca_cert.map(|s| s.span())),
            ca_key: place(spans.intercept.ca_key.map(|s| s.span())),
        }
    }
}

impl ConfigError {
    /// `message` about the setting `key` (`[table] key`) written at `place`.
    pub fn at(place: &Option<Place>, key: &str, message: String) -> ConfigError {
        match place {
            Some(p) => ConfigError::Invalid {
                file: p.file.clone(),
                line: p.line,
                column: p.column,
                message,
            },
            None => ConfigError::Other {
                file: key.into(),
                message,
            },
        }
    }
}
