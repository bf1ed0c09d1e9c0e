//! `[backend]`: where limit state lives. One Redis node (`url`), the master a set of
//! Sentinels names (`sentinels`, `master_name`), or a Redis Cluster (`cluster`): exactly
//! one of the three with `kind = "redis"`, and none without it. `ca_file`,
//! `client_cert_file` and `client_key_file` are for `rediss://` connections, and refused
//! where no URL is `rediss://` (they would do nothing).

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

use super::values::Dur;
use super::Located;

/// `[backend]`: where limit state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendConfig {
    /// `memory` (this process only) or `redis` (shared by every replica using it).
    pub kind: BackendKind,
    /// Where Redis is: `Some` exactly when `kind` is `redis`.
    pub redis: Option<RedisAt>,
    /// Prefix of every key tollgate writes.
    pub key_prefix: String,
    /// The longest a request waits for Redis before tollgate treats it as down.
    pub timeout: Dur,
    /// What to do while Redis is unreachable.
    pub on_backend_error: OnBackendError,
    /// How many replicas share the budget, for the local fallback (rate / replicas);
    /// by default, the replicas seen alive in Redis recently.
    pub replicas: Option<u32>,
    /// Whom `rediss://` connections trust, and the certificate they show.
    pub tls: RedisTls,
}

/// `ca_file`, `client_cert_file` and `client_key_file`: TLS to a Redis whose
/// certificates a private CA signs, or that asks for a client certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// The CAs (PEM) that `rediss://` servers' certificates must chain to, instead of
    /// the web roots: a private CA is the only one that should vouch for one's own Redis.
    pub ca_file: Option<PathBuf>,
    /// The certificate chain and its key (PEM) shown to servers that ask for one.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Memory,
            redis: None,
            key_prefix: "tollgate:".into(),
            timeout: Dur(Duration::from_millis(50)),
            on_backend_error: OnBackendError::Local,
            replicas: None,
            tls: RedisTls::default(),
        }
    }
}

/// Where Redis is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisAt {
    /// `url`: one node.
    Node(RedisUrl),
    /// `sentinels` and `master_name`: the master they name, followed through failovers.
    Sentinel {
        /// The sentinels. A URL's scheme, user, password and database are the master's
        /// (`rediss://` also reaches the sentinels over TLS).
        sentinels: Vec<RedisUrl>,
        /// The name the sentinels know the master by.
        master_name: String,
        /// The sentinels' own password (`requirepass` in `sentinel.conf`).
        sentinel_password: Option<String>,
    },
    /// `cluster`: seed nodes of a Redis Cluster; the others are discovered.
    Cluster(Vec<RedisUrl>),
}

/// Where limit state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// In this process.
    Memory,
    /// In Redis, shared by replicas.
    Redis,
}

/// What requests get while the shared store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBackendError {
    /// Keep serving with local limits at rate / replicas.
    Local,
    /// Refuse with 503.
    Deny,
}

/// A Redis URL, checked for its scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        // `unix://` for a Redis on the same machine, listening on a socket file.
        let schemes = ["redis://", "rediss://", "unix://", "redis+unix://"];
        if !schemes.iter().any(|s| text.starts_with(s)) {
            return Err(de::Error::custom(format!(
                "invalid Redis URL {text:?}: expected redis://[:password@]host:port/db, \
                 rediss://... or unix:///path/to/redis.sock"
            )));
        }
        Ok(RedisUrl(text))
    }
}

/// A node of a Sentinel set or a Cluster: `host:port`, or a `redis://` or `rediss://`
/// URL when it takes a password or TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RedisNode(RedisUrl);

impl<'de> Deserialize<'de> for RedisNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text.starts_with("redis://") || text.starts_with("rediss://") {
            return Ok(RedisNode(RedisUrl(text)));
        }
        let port = text.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
        if text.contains('/') || !matches!(port, Some(Ok(p)) if p > 0) {
            return Err(de::Error::custom(format!(
                "invalid Redis node {text:?}: expected host:port, or \
                 redis://[:password@]host:port or rediss://... for a password or TLS"
            )));
        }
        Ok(RedisNode(RedisUrl(format!("redis://{text}"))))
    }
}

/// `[backend]` as written, with the places of the settings that go together or
/// exclude each other.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackend {
    #[serde(default = "memory")]
    kind: BackendKind,
    url: Option<Spanned<RedisUrl>>,
    sentinels: Option<Spanned<Vec<RedisNode>>>,
    master_name: Option<Spanned<String>>,
    sentinel_password: Option<Spanned<String>>,
    cluster: Option<Spanned<Vec<RedisNode>>>,
    key_prefix: Option<String>,
    #[serde(default, deserialize_with = "timeout")]
    timeout: Option<Dur>,
    on_backend_error: Option<OnBackendError>,
    replicas: Option<Spanned<u32>>,
    ca_file: Option<Spanned<PathBuf>>,
    client_cert_file: Option<Spanned<PathBuf>>,
    client_key_file: Option<Spanned<PathBuf>>,
}

fn memory() -> BackendKind {
    BackendKind::Memory
}

fn timeout<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Dur>, D::Error> {
    super::values::timeout(d).map(Some)
}

impl RawBackend {
    /// The checked table; `table` is where it was written.
    pub(super) fn check(self, table: Range<usize>) -> Result<BackendConfig, Located> {
        let defaults = BackendConfig::default();
        if let Some(replicas) = self.replicas.as_ref().filter(|r| *r.get_ref() == 0) {
            return Err((replicas.span(), "replicas must be at least 1".into()));
        }
        let redis = self.redis_at(table)?;
        let tls = self.tls()?;
        Ok(BackendConfig {
            kind: self.kind,
            redis,
            key_prefix: self.key_prefix.unwrap_or(defaults.key_prefix),
            timeout: self.timeout.unwrap_or(defaults.timeout),
            on_backend_error: self.on_backend_error.unwrap_or(defaults.on_backend_error),
            replicas: self.replicas.map(Spanned::into_inner),
            tls,
        })
    }

    /// The TLS files: the client certificate with its key, and none of them where no
    /// URL is `rediss://`, since plain connections would ignore them.
    fn tls(&self) -> Result<RedisTls, Located> {
        let (cert, key) = (&self.client_cert_file, &self.client_key_file);
        let client_cert = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert.get_ref().clone(), key.get_ref().clone())),
            (Some(only), None) | (None, Some(only)) => {
                let (written, missing) = match cert {
                    Some(_) => ("client_cert_file", "client_key_file"),
                    None => ("client_key_file", "client_cert_file"),
                };
                return Err((
                    only.span(),
                    format!("{written} goes with {missing}, which is not written"),
                ));
            }
            (None, None) => None,
        };
        let written = [
            ("ca_file", &self.ca_file),
            ("client_cert_file", cert),
            ("client_key_file", key),
        ]
        .into_iter()
        .find_map(|(name, file)| Some((name, file.as_ref()?.span())));
        if let Some((name, span)) = written.filter(|_| !self.any_tls()) {
            return Err((
                span,
                format!(
                    "{name} is for rediss:// connections, but no url, sentinel or cluster \
                     node here is rediss://: write rediss:// to reach Redis over TLS"
                ),
            ));
        }
        Ok(RedisTls {
            ca_file: self.ca_file.as_ref().map(|f| f.get_ref().clone()),
            client_cert,
        })
    }

    /// Whether any URL written reaches Redis over TLS.
    fn any_tls(&self) -> bool {
        let tls = |url: &RedisUrl| url.0.starts_with("rediss://");
        let lists = [&self.sentinels, &self.cluster];
        self.url.as_ref().is_some_and(|u| tls(u.get_ref()))
            || (lists.iter().filter_map(|l| l.as_ref()))
                .any(|l| l.get_ref().iter().any(|n| tls(&n.0)))
    }

    /// Where Redis is: one of `url`, `sentinels` and `cluster`, with `kind = "redis"`.
    fn redis_at(&self, table: Range<usize>) -> Result<Option<RedisAt>, Located> {
        let written: Vec<(&str, Range<usize>)> = [
            ("url", self.url.as_ref().map(Spanned::span)),
            ("sentinels", self.sentinels.as_ref().map(Spanned::span)),
            ("cluster", self.cluster.as_ref().map(Spanned::span)),
        ]
        .into_iter()
        .filter_map(|(key, span)| Some((key, span?)))
        .collect();
        if let [(first, _), (second, span), ..] = written.as_slice() {
            return Err((
                span.clone(),
                format!("{first} and {second} both say where Redis is: write one of url, sentinels and cluster"),
            ));
        }
        let sentinel_only = [
            ("master_name", self.master_name.as_ref().map(Spanned::span)),
            (
                "sentinel_password",
                self.sentinel_password.as_ref().map(Spanned::span),
            ),
        ];
        for (key, span) in sentinel_only {
            if let (Some(span), None) = (span, &self.sentinels) {
                return Err((
                    span,
                    format!("{key} goes with sentinels, which is not written"),
                ));
            }
        }
        match (self.kind, written.first()) {
            (BackendKind::Memory, None) => return Ok(None),
            (BackendKind::Memory, Some((key, span))) => {
                return Err((
                    span.clone(),
                    format!("{key} says where Redis is, but kind is \"memory\": write kind = \"redis\" to share limits"),
                ))
            }
            (BackendKind::Redis, None) => {
                return Err((
                    table,
                    "kind = \"redis\" needs where Redis is: url (one node), sentinels with master_name, or cluster".into(),
                ))
            }
            (BackendKind::Redis, Some(_)) => {}
        }
        let nodes = |list: &Spanned<Vec<RedisNode>>, key: &str| {
            if list.get_ref().is_empty() {
                return Err((list.span(), format!("{key} lists no node")));
            }
            Ok(list.get_ref().iter().map(|n| n.0.clone()).collect())
        };
        if let Some(url) = &self.url {
            return Ok(Some(RedisAt::Node(url.get_ref().clone())));
        }
        if let Some(cluster) = &self.cluster {
            return Ok(Some(RedisAt::Cluster(nodes(cluster, "cluster")?)));
        }
        let sentinels = self
            .sentinels
            .as_ref()
            .expect("one of the three is written");
        let Some(master_name) = &self.master_name else {
            return Err((
                sentinels.span(),
                "sentinels needs master_name, the name the sentinels know the master by".into(),
            ));
        };
        Ok(Some(RedisAt::Sentinel {
            sentinels: nodes(sentinels, "sentinels")?,
            master_name: master_name.get_ref().clone(),
            sentinel_password: self.sentinel_password.as_ref().map(|p| p.get_ref().clone()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls_by_scheme() {
        let parse = |text: &str| {
            RedisUrl::deserialize(de::value::StrDeserializer::<de::value::Error>::new(text))
        };
        for good in [
            "redis://r:6379/0",
            "rediss://:pw@r/1",
            "unix:///run/redis.sock",
            "redis+unix:///s",
        ] {
            assert_eq!(parse(good).unwrap().0, good);
        }
        for bad in ["http://r:6379", "r:6379", "/run/redis.sock", ""] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nodes_are_host_port_or_tcp_urls() {
        let parse = |text: &str| {
            RedisNode::deserialize(de::value::StrDeserializer::<de::value::Error>::new(text))
                .map(|n| n.0 .0)
        };
        let cases = [
            ("10.0.0.1:7000", "redis://10.0.0.1:7000"),
            ("redis-0.redis:26379", "redis://redis-0.redis:26379"),
            ("rediss://:pw@r:7000", "rediss://:pw@r:7000"),
        ];
        for (text, url) in cases {
            assert_eq!(parse(text).unwrap(), url, "{text}");
        }
        for bad in [
            "r",
            "r:0",
            "r:port",
            "unix:///run/redis.sock",
            "http://r:1",
            "",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_of_url_sentinels_and_cluster_at_its_place() {
        let parse = |text: &str| super::super::Config::parse(text, "t.toml").map(|c| c.backend);
        let cases = [
            (
                "[backend]\nkind = \"redis\"\n",
                "t.toml:1:1: kind = \"redis\" needs where Redis is",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"redis://r\"\ncluster = [\"r:7000\"]\n",
                "t.toml:4:11: url and cluster both say where Redis is",
            ),
            (
                "[backend]\nkind = \"redis\"\nsentinels = [\"r:26379\"]\n",
                "t.toml:3:13: sentinels needs master_name",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"redis://r\"\nmaster_name = \"m\"\n",
                "t.toml:4:15: master_name goes with sentinels",
            ),
            (
                "[backend]\nkind = \"redis\"\ncluster = []\n",
                "t.toml:3:11: cluster lists no node",
            ),
            (
                "[backend]\ncluster = [\"r:7000\"]\n",
                "t.toml:2:11: cluster says where Redis is, but kind is \"memory\"",
            ),
            (
                "[backend]\nkind = \"redis\"\ncluster = [\"r:7000\", \"r\"]\n",
                "t.toml:3:11: invalid Redis node \"r\"",
            ),
            (
                "[backend]\nreplicas = 0\n",
                "t.toml:2:12: replicas must be at least 1",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"redis://r\"\nca_file = \"ca.pem\"\n",
                "t.toml:4:11: ca_file is for rediss:// connections, but no url",
            ),
            (
                "[backend]\nca_file = \"ca.pem\"\n",
                "t.toml:2:11: ca_file is for rediss:// connections",
            ),
            (
                "[backend]\nkind = \"redis\"\ncluster = [\"r:7000\", \"redis://r:7001\"]\n\
                 client_cert_file = \"c.pem\"\nclient_key_file = \"k.pem\"\n",
                "t.toml:4:20: client_cert_file is for rediss:// connections",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"rediss://r\"\nclient_cert_file = \"c.pem\"\n",
                "t.toml:4:20: client_cert_file goes with client_key_file, which is not written",
            ),
            (
                "[backend]\nkind = \"redis\"\nurl = \"rediss://r\"\nclient_key_file = \"k.pem\"\n",
                "t.toml:4:19: client_key_file goes with client_cert_file, which is not written",
            ),
        ];
        for (text, expected) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.starts_with(expected), "{text}: {e}");
        }
        let sentinel = parse(
            "[backend]\nkind = \"redis\"\nsentinels = [\"a:26379\", \"rediss://:pw@b:26379\"]\n\
             master_name = \"main\"\nsentinel_password = \"s\"\n",
        )
        .unwrap();
        assert_eq!(
            sentinel.redis,
            Some(RedisAt::Sentinel {
                sentinels: vec![
                    RedisUrl("redis://a:26379".into()),
                    RedisUrl("rediss://:pw@b:26379".into())
                ],
                master_name: "main".into(),
                sentinel_password: Some("s".into()),
            })
        );
        let tls = |at: &str| {
            parse(&format!(
                "[backend]\nkind = \"redis\"\n{at}\nca_file = \"/ca.pem\"\n\
                 client_cert_file = \"/c.pem\"\nclient_key_file = \"/k.pem\"\n"
            ))
            .map(|b| b.tls)
        };
        let expected = RedisTls {
            ca_file: Some("/ca.pem".into()),
            client_cert: Some(("/c.pem".into(), "/k.pem".into())),
        };
        // One rediss:// URL anywhere is enough for the files to be taken.
        for at in [
            "url = \"rediss://r\"",
            "cluster = [\"r:7000\", \"rediss://r:7001\"]",
            "sentinels = [\"rediss://r:26379\"]\nmaster_name = \"m\"",
        ] {
            assert_eq!(tls(at).unwrap_or_else(|e| panic!("{at}: {e}")), expected);
        }
        assert_eq!(parse("").unwrap(), BackendConfig::default());
    }
}
