//! TLS for the Redis fixtures: certificates made per test with `rcgen` (a CA, Redis's
//! certificate for `localhost` and `127.0.0.1`, a client certificate, and a second CA that
//! signed none of them), written in a temp dir; and a blocking TLS client for the fixture's own
//! commands. No key material is kept in the repository.

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tempfile::TempDir;

use super::resp::{packet, read, Reply};

/// A test CA and the certificates it signed, as PEM files in a temp dir (removed on drop).
pub struct TestCertificates {
    dir: TempDir,
}

impl TestCertificates {
    /// Makes a CA, a server certificate for `localhost` and `127.0.0.1`, a client certificate,
    /// and an unrelated CA (`other-ca.pem`), each with a fresh key.
    pub fn generate() -> Result<TestCertificates> {
        let dir = tempfile::Builder::new().prefix("sluice-tls-").tempdir()?;
        let ca = make_ca("sluice test CA")?;
        let other = make_ca("an unrelated CA")?;
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text);
        write("ca.pem", &ca.pem())?;
        write("other-ca.pem", &other.pem())?;

        let mut server =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        server.distinguished_name.push(DnType::CommonName, "redis");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate()?;
        write("server.pem", &server.signed_by(&key, &ca)?.pem())?;
        write("server.key", &key.serialize_pem())?;

        // A certificate for `localhost` only (not for `127.0.0.1`), from the same CA.
        let mut named = CertificateParams::new(vec!["localhost".to_owned()])?;
        named.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate()?;
        write("localhost-only.pem", &named.signed_by(&key, &ca)?.pem())?;
        write("localhost-only.key", &key.serialize_pem())?;

        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client.distinguished_name.push(DnType::CommonName, "sluice");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        write("client.pem", &client.signed_by(&key, &ca)?.pem())?;
        write("client.key", &key.serialize_pem())?;

        // A client certificate from the unrelated CA (Redis does not trust it).
        let key = KeyPair::generate()?;
        write("stranger.pem", &client.signed_by(&key, &other)?.pem())?;
        write("stranger.key", &key.serialize_pem())?;
        Ok(TestCertificates { dir })
    }

    /// A file of the directory: `ca.pem`, `other-ca.pem`, `server.pem`, `server.key`,
    /// `localhost-only.pem`, `localhost-only.key` (not for `127.0.0.1`), `client.pem`,
    /// `client.key`, `stranger.pem`, `stranger.key` (signed by the unrelated CA).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn make_ca(name: &str) -> Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(CertifiedIssuer::self_signed(params, KeyPair::generate()?)?)
}

/// How the fixture reaches a TLS Redis: the CA to trust and its client certificate.
#[derive(Clone)]
pub struct TlsClient {
    config: Arc<rustls::ClientConfig>,
}

impl TlsClient {
    /// Trusts `ca` and shows `cert`/`key`.
    pub fn new(ca: &Path, cert: &Path, key: &Path) -> Result<TlsClient> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca)? {
            roots.add(cert?)?;
        }
        let chain = CertificateDer::pem_file_iter(cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(key)?;
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        Ok(TlsClient {
            config: Arc::new(config),
        })
    }

    /// Sends one command to the TLS Redis on `127.0.0.1:port` over a fresh connection.
    pub fn query(&self, port: u16, args: &[&str]) -> Result<Reply> {
        let tcp = TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("connecting to Redis (TLS) on port {port}"))?;
        tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
        tcp.set_write_timeout(Some(Duration::from_secs(10)))?;
        let name = ServerName::try_from("localhost")?;
        let connection = rustls::ClientConnection::new(self.config.clone(), name)?;
        let mut stream = rustls::StreamOwned::new(connection, tcp);
        stream.write_all(&packet(args))?;
        stream.flush()?;
        read(&mut BufReader::new(stream))
    }
}
