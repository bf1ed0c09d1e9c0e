//! The interception CA: the operator's CA checked at load, a new one made by
//! `tollgate ca init`, and the leaf certificates it signs for intercepted hosts.
//!
//! Leaves share one key pair, made at start: a leaf then costs one signature, not a key
//! generation, and clients never see the key anyway (it stays in this process). Each
//! leaf is valid for [`LEAF_VALIDITY`] from an hour ago (a client whose clock runs a
//! little behind still accepts it) and is made again once half of that has passed.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use lru::LruCache;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData, SerialNumber,
};
use ring::rand::SecureRandom;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ServerConfig, ServerSessionMemoryCache};

/// How long a leaf certificate is valid.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(2 * 24 * 3600);

/// How far back a certificate's validity starts, for clients whose clock is behind.
const BACKDATE: Duration = Duration::from_secs(3600);

/// How long a CA made by `tollgate ca init` is valid.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The most leaf certificates kept; the least recently used goes first.
pub const LEAF_CACHE: usize = 1024;

/// Why a CA certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// Something is wrong with the certificate file or its content.
    #[error("{0}")]
    Cert(String),
    /// Something is wrong with the key file or its content.
    #[error("{0}")]
    Key(String),
    /// A leaf could not be signed (an rcgen error; not expected with a checked CA).
    #[error("cannot sign a certificate for {host}: {reason}")]
    Sign {
        /// The host the leaf was for.
        host: String,
        /// What rcgen said.
        reason: String,
    },
}

/// A CA certificate and its key, checked to belong together and to be able to sign.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    /// When the CA expires: no leaf it signs outlives it.
    not_after: SystemTime,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    /// Reads and checks the CA certificate and key files.
    pub fn load(cert: &Path, key: &Path) -> Result<Ca, CaError> {
        let cert_pem = std::fs::read_to_string(cert)
            .map_err(|e| CaError::Cert(format!("cannot read {}: {e}", cert.display())))?;
        let key_pem = std::fs::read_to_string(key)
            .map_err(|e| CaError::Key(format!("cannot read {}: {e}", key.display())))?;
        Ca::from_pem(&cert_pem, &key_pem)
    }

    /// Checks a PEM CA certificate and its PEM (PKCS#8) key: the certificate must be a
    /// CA allowed to sign certificates and valid now, and the key must be its own.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, CaError> {
        let cert = rustls_pemfile::certs(&mut cert_pem.as_bytes())
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| CaError::Cert("no PEM certificate found".into()))?;
        let (_, x509) = x509_parser::parse_x509_certificate(&cert)
            .map_err(|e| CaError::Cert(format!("not a valid certificate: {e}")))?;
        if !x509.is_ca() {
            return Err(CaError::Cert(
                "not a CA certificate (basicConstraints CA:TRUE is missing); make one with \
                 `tollgate ca init`"
                    .into(),
            ));
        }
        if let Ok(Some(usage)) = x509.key_usage() {
            if !usage.value.key_cert_sign() {
                return Err(CaError::Cert(
                    "the CA certificate's keyUsage does not allow keyCertSign".into(),
                ));
            }
        }
        if !x509.validity().is_valid() {
            return Err(CaError::Cert(format!(
                "the CA certificate is not valid now (from {} to {})",
                x509.validity().not_before,
                x509.validity().not_after
            )));
        }
        let key = KeyPair::from_pem(key_pem).map_err(|e| {
            CaError::Key(format!(
                "not a usable private key ({e}); expected a PEM PKCS#8 key (ECDSA P-256/P-384, \
                 Ed25519 or RSA)"
            ))
        })?;
        if key.subject_public_key_info() != x509.public_key().raw {
            return Err(CaError::Key(
                "this key does not belong to the CA certificate".into(),
            ));
        }
        let expires = x509.validity().not_after.timestamp();
        let not_after = SystemTime::UNIX_EPOCH + Duration::from_secs(expires.max(0) as u64);
        let issuer = Issuer::from_ca_cert_der(&cert, key)
            .map_err(|e| CaError::Cert(format!("cannot use the CA certificate: {e}")))?;
        Ok(Ca {
            issuer,
            cert: cert.into_owned(),
            not_after,
        })
    }

    /// Makes a new CA: its certificate and key, as PEM.
    pub fn generate(name: &str) -> Result<(String, String), rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "tollgate");
        // It signs leaves and nothing that signs in turn.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + CA_VALIDITY).into();
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// Why `tollgate ca init` could not write a CA.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A file it would write exists: a CA is made once, and clients trust it.
    #[error(
        "{0} exists; remove it or choose another --dir (a CA is made once, and clients trust it)"
    )]
    Exists(PathBuf),
    /// The directory or a file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The directory or file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// rcgen could not make the certificate (not expected).
    #[error("cannot make a CA: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Writes a new CA into `dir` as `ca.pem` and `ca-key.pem` (mode 0600), refusing to
/// overwrite either; returns their absolute paths, which the config can name from any
/// working directory.
pub fn init(dir: &Path) -> Result<(PathBuf, PathBuf), InitError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |path: &Path| {
        let path = path.to_path_buf();
        move |source| InitError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(failed(dir))?;
    let dir = dir.canonicalize().map_err(failed(dir))?;
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    for path in [&cert_path, &key_path] {
        if path.exists() {
            return Err(InitError::Exists(path.clone()));
        }
    }
    // Dated, so that two CAs made on different machines are told apart by name.
    let name = format!(
        "tollgate interception CA {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    );
    let (cert, key) = Ca::generate(&name)?;
    let write = |path: &Path, text: &str, mode: u32| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(failed(path))
    };
    write(&key_path, &key, 0o600)?;
    // Without its certificate the key is of no use, and would block the next attempt.
    if let Err(e) = write(&cert_path, &cert, 0o644) {
        let _ = std::fs::remove_file(&key_path);
        return Err(e);
    }
    Ok((cert_path, key_path))
}

/// A random positive serial number (RFC 5280 §4.1.2.2: unique per CA, at most 20 octets).
fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source works");
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

/// The TLS server side of intercepted tunnels: one configuration per host, with a leaf
/// certificate the CA signed, in a bounded cache.
pub struct Leaves {
    ca: Arc<Ca>,
    /// The key of every leaf.
    key: KeyPair,
    /// One resumption cache for every host's configuration, so the cache's bound holds
    /// for the whole process.
    sessions: Arc<ServerSessionMemoryCache>,
    cache: Mutex<LruCache<String, Leaf>>,
}

struct Leaf {
    config: Arc<ServerConfig>,
    issued: SystemTime,
}

/// Whether a leaf issued at `issued` may still be handed out at `now`: for half of its
/// validity, and not if the clock went back before it was issued (its validity would
/// start in the future for clients).
fn fresh(issued: SystemTime, now: SystemTime) -> bool {
    now.duration_since(issued)
        .is_ok_and(|age| age < LEAF_VALIDITY / 2)
}

impl Leaves {
    /// Leaves signed by `ca`, with a new key shared by all of them.
    pub fn new(ca: Arc<Ca>) -> Result<Leaves, CaError> {
        let key = KeyPair::generate().map_err(|e| CaError::Key(e.to_string()))?;
        Ok(Leaves {
            ca,
            key,
            sessions: ServerSessionMemoryCache::new(4096),
            cache: Mutex::new(LruCache::new(
                NonZeroUsize::new(LEAF_CACHE).expect("not zero"),
            )),
        })
    }

    /// The TLS configuration that presents a certificate for `host` (canonical; an IPv6
    /// literal in brackets), offering h2 and HTTP/1.1; from the cache while it is fresh.
    pub fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, CaError> {
        let now = SystemTime::now();
        let cached = self
            .lock()
            .get(host)
            .and_then(|leaf| fresh(leaf.issued, now).then(|| leaf.config.clone()));
        if let Some(config) = cached {
            return Ok(config);
        }
        // Signed without the lock: other hosts' tunnels are served meanwhile, however
        // slow the CA's key is. Two first tunnels to one host may both sign; the later
        // leaf stays.
        let config = Arc::new(self.sign(host, now)?);
        self.lock().put(
            host.to_string(),
            Leaf {
                config: config.clone(),
                issued: now,
            },
        );
        Ok(config)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, Leaf>> {
        // A cache: valid after any panic of a holder.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many leaves are cached.
    pub fn cached(&self) -> usize {
        self.lock().len()
    }

    fn sign(&self, host: &str, now: SystemTime) -> Result<ServerConfig, CaError> {
        let leaf = self.issue(host, now)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let fail = |e: rustls::Error| CaError::Sign {
            host: host.to_string(),
            reason: e.to_string(),
        };
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(fail)?
            .with_no_client_auth()
            .with_single_cert(vec![leaf, self.ca.cert.clone()], key)
            .map_err(fail)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.session_storage = self.sessions.clone();
        Ok(config)
    }

    /// A leaf certificate for `host`, valid from a little before `now`.
    fn issue(&self, host: &str, now: SystemTime) -> Result<CertificateDer<'static>, CaError> {
        let fail = |e: rcgen::Error| CaError::Sign {
            host: host.to_string(),
            reason: e.to_string(),
        };
        let name = host.trim_start_matches('[').trim_end_matches(']');
        // An IP literal becomes an IP SAN, a name a DNS SAN.
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(fail)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + LEAF_VALIDITY).min(self.ca.not_after).into();
        params.serial_number = Some(random_serial());
        let leaf = params.signed_by(&self.key, &self.ca.issuer).map_err(fail)?;
        Ok(leaf.der().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a client that trusts `ca_pem` alone accepts `leaf` for `host`.
    fn client_accepts(ca_pem: &str, leaf: &CertificateDer<'static>, host: &str) -> bool {
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::{ServerName, UnixTime};
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .unwrap();
        let name = ServerName::try_from(host.to_string()).unwrap();
        verifier
            .verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
            .is_ok()
    }

    #[test]
    fn a_made_ca_loads_and_signs_leaves_clients_accept() {
        let (cert, key) = Ca::generate("test CA").unwrap();
        let leaves = Leaves::new(Arc::new(Ca::from_pem(&cert, &key).unwrap())).unwrap();
        let now = SystemTime::now();
        for (host, name) in [
            ("api.example.com", "api.example.com"),
            ("127.0.0.1", "127.0.0.1"),
            ("[::1]", "::1"),
        ] {
            let leaf = leaves.issue(host, now).unwrap();
            assert!(client_accepts(&cert, &leaf, name), "{host}");
            assert!(!client_accepts(&cert, &leaf, "other.example.com"), "{host}");
        }
        // A client that trusts another CA refuses it.
        let (other, _) = Ca::generate("other CA").unwrap();
        let leaf = leaves.issue("api.example.com", now).unwrap();
        assert!(!client_accepts(&other, &leaf, "api.example.com"));
        // A leaf made two days ago has expired.
        let old = leaves
            .issue("api.example.com", now - LEAF_VALIDITY - BACKDATE)
            .unwrap();
        assert!(!client_accepts(&cert, &old, "api.example.com"));
    }

    #[test]
    fn a_leaf_is_fresh_for_half_its_validity_and_never_before_it_was_made() {
        let made = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let half = LEAF_VALIDITY / 2;
        for (now, expected) in [
            (made, true),
            (made + half - Duration::from_secs(1), true),
            (made + half, false),
            (made + LEAF_VALIDITY, false),
            // The clock went back: the leaf would not be valid yet for clients.
            (made - Duration::from_secs(1), false),
        ] {
            assert_eq!(fresh(made, now), expected, "{:?}", now.duration_since(made));
        }
    }

    #[test]
    fn configurations_are_cached_per_host_and_bounded() {
        let (cert, key) = Ca::generate("test CA").unwrap();
        let leaves = Leaves::new(Arc::new(Ca::from_pem(&cert, &key).unwrap())).unwrap();
        let first = leaves.server_config("api.example.com").unwrap();
        let again = leaves.server_config("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&first, &again), "a fresh leaf is reused");
        for i in 0..LEAF_CACHE + 10 {
            leaves.server_config(&format!("h{i}.example.com")).unwrap();
        }
        assert_eq!(leaves.cached(), LEAF_CACHE);
    }

    #[test]
    fn refuses_what_cannot_sign() {
        let (cert, key) = Ca::generate("test CA").unwrap();
        let (_, other_key) = Ca::generate("other CA").unwrap();
        let cases: [(&str, &str, &str); 4] = [
            ("", &key, "no PEM certificate"),
            (&cert, "nonsense", "not a usable private key"),
            (&cert, &other_key, "does not belong"),
            (&leaf_pem(), &key, "not a CA certificate"),
        ];
        for (cert, key, says) in cases {
            let e = Ca::from_pem(cert, key).unwrap_err().to_string();
            assert!(e.contains(says), "{e:?} should say {says:?}");
        }
    }

    /// A certificate that is not a CA's.
    fn leaf_pem() -> String {
        let key = KeyPair::generate().unwrap();
        CertificateParams::new(vec!["x.example".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem()
    }

    #[test]
    fn init_writes_a_private_key_and_refuses_to_overwrite() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = init(dir.path()).unwrap();
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        Ca::load(&cert, &key).unwrap();
        let e = init(dir.path()).unwrap_err();
        assert!(matches!(e, InitError::Exists(_)), "{e}");
        assert!(cert.is_absolute() && key.is_absolute());
    }
}
