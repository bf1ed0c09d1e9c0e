//! `[backend] ca_file`, `client_cert_file` and `client_key_file`, read into what the
//! Redis client takes for `rediss://` connections. The files are read and their PEM
//! checked here, so that a missing file, or one with no certificate or key, is
//! refused at start and on reload with the setting at fault rather than found at the
//! first connection.

use std::path::Path;

use redis::{ClientTlsConfig, TlsCertificates};

use super::connect::BackendError;
use crate::config::RedisTls;

/// The certificates `tls` names, or `None` when it names none: `rediss://` then
/// trusts the web roots. A `ca_file` replaces the web roots (the Redis client's
/// `root_cert`): a private CA is the only one that should vouch for one's own Redis.
pub(super) fn certificates(tls: &RedisTls) -> Result<Option<TlsCertificates>, BackendError> {
    if tls.ca_file.is_none() && tls.client_cert.is_none() {
        return Ok(None);
    }
    let root_cert = (tls.ca_file.as_deref())
        .map(|path| read("ca_file", path, roots))
        .transpose()?;
    let client_tls = match &tls.client_cert {
        Some((cert, key)) => Some(ClientTlsConfig {
            client_cert: read("client_cert_file", cert, chain)?,
            client_key: read("client_key_file", key, private_key)?,
        }),
        None => None,
    };
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// The PEM in the file `setting` names, once `check` finds what it needs in it.
fn read(
    setting: &'static str,
    path: &Path,
    check: fn(&[u8]) -> Result<(), String>,
) -> Result<Vec<u8>, BackendError> {
    let fail = |problem: String| BackendError::TlsFile {
        setting,
        path: path.display().to_string(),
        problem,
    };
    let pem = std::fs::read(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    check(&pem).map_err(fail)?;
    Ok(pem)
}

/// One or more certificates, each one rustls takes as a trust anchor.
fn roots(pem: &[u8]) -> Result<(), String> {
    let mut store = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut &*pem) {
        let cert = cert.map_err(|e| e.to_string())?;
        store.add(cert).map_err(|e| e.to_string())?;
    }
    match store.is_empty() {
        true => Err("no PEM certificate found".into()),
        false => Ok(()),
    }
}

/// One or more certificates: the client's, then any intermediates.
fn chain(pem: &[u8]) -> Result<(), String> {
    let certs = rustls_pemfile::certs(&mut &*pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    match certs.is_empty() {
        true => Err("no PEM certificate found".into()),
        false => Ok(()),
    }
}

/// A private key (PKCS#8, PKCS#1 or SEC1).
fn private_key(pem: &[u8]) -> Result<(), String> {
    match rustls_pemfile::private_key(&mut &*pem) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err("no PEM private key found".into()),
        Err(e) => Err(e.to_string()),
    }
}
