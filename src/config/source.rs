//! Which file a configuration came from: `/status` shows it, and a reload compares the
//! settings that only a restart applies with it.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::Config;

/// Which file a configuration came from, as written in it, and when it was loaded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Source {
    /// The file as given.
    pub path: PathBuf,
    /// SHA-256 of its text, hex.
    pub sha256: String,
    /// `[proxy] listen` as written (the command line may override it).
    pub listen: Option<SocketAddr>,
    /// `[admin] listen` as written.
    pub admin: Option<SocketAddr>,
}

impl Source {
    /// The source of `config`, parsed from `text` read from `path`.
    pub fn of(path: PathBuf, text: &str, config: &Config) -> Source {
        let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
        Source {
            path,
            sha256: digest.as_ref().iter().map(|b| format!("{b:02x}")).collect(),
            listen: Some(config.proxy.listen),
            admin: config.admin.as_ref().map(|a| a.listen),
        }
    }
}
