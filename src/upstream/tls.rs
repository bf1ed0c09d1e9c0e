//! TLS to upstreams: the public web roots plus `[proxy] ca_file`.

use std::path::Path;
use std::sync::Arc;

/// Why `[proxy] ca_file` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CaFileError {
    /// The file cannot be read, or holds a PEM block that is not readable.
    #[error("ca_file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What reading it met.
        source: std::io::Error,
    },
    /// A certificate in it is not one rustls accepts as a root.
    #[error("ca_file {path}: {source}")]
    Certificate {
        /// The file.
        path: String,
        /// What rustls said.
        source: rustls::Error,
    },
    /// It holds no certificate.
    #[error("ca_file {path}: no PEM certificates found")]
    Empty {
        /// The file.
        path: String,
    },
    /// rustls has no protocol version for its default provider.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

/// The rustls configuration for upstreams: the public web roots plus `ca_file`.
pub fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, CaFileError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let shown = || path.display().to_string();
        let read = |source| CaFileError::Read {
            path: shown(),
            source,
        };
        let pem = std::fs::read(path).map_err(read)?;
        let mut found = 0;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            roots
                .add(cert.map_err(read)?)
                .map_err(|source| CaFileError::Certificate {
                    path: shown(),
                    source,
                })?;
            found += 1;
        }
        if found == 0 {
            return Err(CaFileError::Empty { path: shown() });
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
