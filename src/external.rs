//! The one step after parsing that reads what the configuration names outside its
//! file — `[proxy] ca_file`, `[access] users`, the `[intercept]` CA, the `[backend]`
//! Redis URLs and TLS files — without side effects: the files are read, the URL is
//! parsed but not dialled, and nothing needs a runtime. A problem is reported at the
//! place in `config.toml` where the setting is written. It runs at start (and for
//! `check-config`) and before every reload; `config` itself stays plain data.

use crate::config::{Config, ConfigError};

/// Checks the settings of `config` that name files or servers.
pub fn check(config: &Config) -> Result<(), ConfigError> {
    let places = &config.places;
    if let Some(path) = &config.proxy.ca_file {
        crate::upstream::tls_config(Some(path))
            .map_err(|e| ConfigError::at(&places.ca_file, "proxy.ca_file", e.to_string()))?;
    }
    if let Some(path) = &config.access.users {
        crate::access::Users::load(path)
            .map_err(|e| ConfigError::at(&places.users, "access.users", e.to_string()))?;
    }
    if let Some(intercept) = &config.intercept {
        use crate::intercept::{Ca, CaError};
        Ca::load(&intercept.ca_cert, &intercept.ca_key).map_err(|e| match e {
            CaError::Key(message) => ConfigError::at(
                &places.ca_key,
                "intercept.ca_key",
                format!("ca_key: {message}"),
            ),
            e => ConfigError::at(
                &places.ca_cert,
                "intercept.ca_cert",
                format!("ca_cert: {e}"),
            ),
        })?;
    }
    if config.backend.redis.is_some() {
        crate::limit::redis::connect::check(&config.backend).map_err(|e| {
            let place = match e.setting() {
                "sentinels" => &places.backend_sentinels,
                "cluster" => &places.backend_cluster,
                "ca_file" => &places.backend_ca_file,
                "client_cert_file" => &places.backend_client_cert_file,
                "client_key_file" => &places.backend_client_key_file,
                _ => &places.backend_url,
            };
            ConfigError::at(place, &format!("backend.{}", e.setting()), e.to_string())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn check(text: &str) -> Result<(), ConfigError> {
        super::check(&Config::parse(text, "t.toml")?)
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
            let e = check(&text).unwrap_err().to_string();
            assert!(e.starts_with(expected), "{text}: {e}");
        }
        // A Redis URL to a port nobody listens on is fine: nothing is dialled.
        check("[backend]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1/0\"\n").unwrap();
    }

    /// The `[backend]` TLS files of every kind of deployment are read, and a file that
    /// is missing or holds the wrong PEM is pointed at.
    #[test]
    fn backend_tls_files_are_read_at_their_place() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = crate::intercept::init(dir.path()).unwrap();
        let missing = dir.path().join("missing.pem");
        let shown = |p: &Path| format!("{:?}", p.display().to_string());
        let backend = |at: &str, tls: &str| format!("[backend]\nkind = \"redis\"\n{at}\n{tls}\n");
        let url = "url = \"rediss://127.0.0.1:1\"";
        let mtls = format!(
            "ca_file = {}\nclient_cert_file = {}\nclient_key_file = {}",
            shown(&cert),
            shown(&cert),
            shown(&key)
        );
        for at in [
            url,
            "cluster = [\"rediss://127.0.0.1:1\", \"rediss://127.0.0.1:2\"]",
            "sentinels = [\"rediss://127.0.0.1:1\"]\nmaster_name = \"m\"",
        ] {
            check(&backend(at, &mtls)).unwrap_or_else(|e| panic!("{at}: {e}"));
            check(&backend(at, &format!("ca_file = {}", shown(&cert)))).unwrap();
        }
        let cases = [
            (
                format!("ca_file = {}", shown(&missing)),
                format!("t.toml:4:11: ca_file {}: cannot read", missing.display()),
            ),
            (
                format!("ca_file = {}", shown(&key)),
                format!(
                    "t.toml:4:11: ca_file {}: no PEM certificate found",
                    key.display()
                ),
            ),
            (
                format!(
                    "client_cert_file = {}\nclient_key_file = {}",
                    shown(&key),
                    shown(&key)
                ),
                format!(
                    "t.toml:4:20: client_cert_file {}: no PEM certificate",
                    key.display()
                ),
            ),
            (
                format!(
                    "client_cert_file = {}\nclient_key_file = {}",
                    shown(&cert),
                    shown(&cert)
                ),
                format!(
                    "t.toml:5:19: client_key_file {}: no PEM private key",
                    cert.display()
                ),
            ),
        ];
        for (tls, expected) in cases {
            let e = check(&backend(url, &tls)).unwrap_err().to_string();
            assert!(e.starts_with(&expected), "{tls}: {e}");
        }
    }

    #[test]
    fn the_intercept_ca_is_read_and_a_bad_file_is_pointed_at() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = crate::intercept::init(dir.path()).unwrap();
        let other = tempfile::tempdir().unwrap();
        let (_, other_key) = crate::intercept::init(other.path()).unwrap();
        let table = |cert: &Path, key: &Path| {
            format!(
                "[[limit]]\nname = \"gh\"\nhosts = [\"api.github.com\"]\n\n[intercept]\nca_cert = {:?}\nca_key = {:?}\n",
                cert.display().to_string(),
                key.display().to_string()
            )
        };
        check(&table(&cert, &key)).unwrap();
        let e = check(&table(&cert, &other_key)).unwrap_err().to_string();
        assert!(
            e.starts_with("t.toml:7:10: ca_key: this key does not belong"),
            "{e}"
        );
        let e = check(&table(&dir.path().join("missing.pem"), &key))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("t.toml:6:11: ca_cert: cannot read"), "{e}");
        let e = check(&table(&key, &key)).unwrap_err().to_string();
        assert!(
            e.starts_with("t.toml:6:11: ca_cert: no PEM certificate"),
            "{e}"
        );
    }
}
