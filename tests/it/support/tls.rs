//! TLS: a throwaway CA and the server certificates it signs.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A throwaway CA (rcgen) and a server certificate it signed for `localhost` and
/// `127.0.0.1`.
pub struct TestCa {
    ca_pem: String,
    cert: CertificateDer<'static>,
    key: Vec<u8>,
    /// The server certificate and key as PEM, for servers that read files (nginx).
    cert_pem: String,
    key_pem: String,
    dir: tempfile::TempDir,
    /// The CA's own parameters and key, to sign client certificates later.
    ca_params: rcgen::CertificateParams,
    ca_key: rcgen::KeyPair,
}

impl TestCa {
    /// Generates the CA and the server certificate.
    pub fn new() -> TestCa {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name
            .push(DnType::CommonName, "tollgate test CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");

        let key = KeyPair::generate().expect("server key");
        let mut leaf =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, "localhost");
        leaf.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = leaf
            .signed_by(&key, &rcgen::Issuer::from_params(&ca, &ca_key))
            .expect("server certificate");

        let dir = tempfile::tempdir().expect("tempdir");
        let ca_pem = ca_cert.pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).expect("write ca.pem");
        TestCa {
            ca_pem,
            cert: cert.der().clone(),
            key: key.serialize_der(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            dir,
            ca_params: ca,
            ca_key,
        }
    }

    /// Writes a client certificate this CA signed (for mutual TLS) and its key as
    /// `client.pem` and `client-key.pem` in `dir`, and returns their paths.
    pub fn write_client_pem(&self, dir: &std::path::Path) -> (PathBuf, PathBuf) {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};
        let key = KeyPair::generate().expect("client key");
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "tollgate test client");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = rcgen::Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).expect("client certificate");
        let (cert_path, key_path) = (dir.join("client.pem"), dir.join("client-key.pem"));
        std::fs::write(&cert_path, cert.pem()).expect("write client.pem");
        std::fs::write(&key_path, key.serialize_pem()).expect("write client-key.pem");
        (cert_path, key_path)
    }

    /// Writes the server certificate and its key as `cert.pem` and `key.pem` in `dir`.
    pub fn write_server_pem(&self, dir: &std::path::Path) {
        std::fs::write(dir.join("cert.pem"), &self.cert_pem).expect("write cert.pem");
        std::fs::write(dir.join("key.pem"), &self.key_pem).expect("write key.pem");
    }

    /// The CA certificate as PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A file holding the CA certificate as PEM (for `ca_file` and `curl --cacert`).
    pub fn ca_pem_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A rustls server configuration with the server certificate, offering h2 and
    /// HTTP/1.1 by ALPN.
    pub fn server_config(&self) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], key)
            .expect("server TLS config");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }
}

impl TestCa {
    /// [`TestCa::server_config`] offering HTTP/1.1 alone by ALPN.
    pub fn server_config_http1(&self) -> rustls::ServerConfig {
        let mut config = self.server_config();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}
