//! The settings that name something outside the file — `[proxy] ca_file`, `[access]
//! users`, `[backend] url` — checked without side effects: the files are read, the
//! Redis URL is parsed but not dialled, and nothing needs a runtime. A problem is
//! reported at the place in `config.toml` where the setting is written.

use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

use super::{line_column, Config, ConfigError};

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
}

/// The same file read again for the spans of those settings alone (other keys are
/// checked by the main pass, and ignored here).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Spans {
    proxy: ProxySpans,
    access: AccessSpans,
    backend: BackendSpans,
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
        }
    }
}

/// `message` about the setting `key` written at `place`.
fn at(place: &Option<Place>, key: &str, message: String) -> ConfigError {
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

impl Config {
    /// Checks the settings that name files or servers: the files are readable and
    /// well-formed, the Redis URL is one the client accepts. Reads files, dials nothing,
    /// needs no runtime.
    pub fn check_external(&self) -> Result<(), ConfigError> {
        if let Some(path) = &self.proxy.ca_file {
            crate::upstream::tls_config(Some(path))
                .map_err(|e| at(&self.places.ca_file, "proxy.ca_file", e))?;
        }
        if let Some(path) = &self.access.users {
            crate::access::Users::load(path)
                .map_err(|e| at(&self.places.users, "access.users", e.to_string()))?;
        }
        if let Some(url) = &self.backend.url {
            use redis::IntoConnectionInfo;
            url.0.as_str().into_connection_info().map_err(|e| {
                at(
                    &self.places.backend_url,
                    "backend.url",
                    format!("invalid Redis URL: {e}"),
                )
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<(), String> {
        let config = Config::parse(text, "t.toml").map_err(|e| e.to_string())?;
        config.check_external().map_err(|e| e.to_string())
    }

    /// A plain test, outside any runtime: nothing here may need one.
    #[test]
    fn external_settings_are_checked_at_their_place_without_a_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let cases = [
            (
                format!("[proxy]\nca_file = {:?}\n", missing.display().to_string()),
                "t.toml:2:11: ca_file",
            ),
            (
                format!("[proxy]\n\nca_file = {:?}\n", empty.display().to_string()),
                "t.toml:3:11: ca_file",
            ),
            (
                format!("[access]\nusers = {:?}\n", missing.display().to_string()),
                "t.toml:2:9:",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:notaport\"\n".into(),
                "t.toml:3:7: invalid Redis URL",
            ),
        ];
        for (text, expected) in cases {
            let e = check(&text).unwrap_err();
            assert!(e.starts_with(expected), "{text}: {e}");
        }
        // A Redis URL to a port nobody listens on is fine: nothing is dialled.
        check("[backend]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1/0\"\n").unwrap();
    }
}
