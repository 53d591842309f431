//! HTTPS: the certificate and key the service presents (`--tls-cert-file`, `--tls-key-file`),
//! read once at start (a file that cannot be read or parsed stops the start, naming its flag) and
//! again on SIGHUP or when either file changes (checked every [`WATCH_INTERVAL`]). A reload that
//! fails keeps the certificate in use and logs why; one that succeeds serves every connection
//! accepted after it, while connections already open keep theirs (a reload never drops a request
//! in flight). rustls with ring: TLS 1.2 and 1.3, no OpenSSL.
//!
//! With `--tls-client-ca-file`, the service asks each client for a certificate and verifies the
//! one it shows against those CAs (rustls' `WebPkiClientVerifier`: the chain, its dates, its
//! use for client authentication): a certificate they do not verify fails the handshake, no
//! certificate at all is let through (the request then needs a token). The CA file is read
//! again with the other two. What a verified certificate is a credential of is
//! [`crate::client_certs`]'s business; the names of the one a connection showed are taken once,
//! at its handshake ([`peer_certificate`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::client_certs::PeerCertificate;

/// How often the files' modification times are compared with the last loaded ones.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Most bytes read from a certificate or key file (a chain of a few certificates is a few KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The certificate in use, and where it comes from.
pub struct Tls {
    files: Files,
    current: RwLock<Loaded>,
}

/// Where the certificate, its key and the clients' CAs come from.
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

struct Loaded {
    acceptor: TlsAcceptor,
    /// The same certificate for gRPC (`--grpc-bind`): ALPN `h2`, where the HTTP API's is
    /// `http/1.1` only.
    h2_acceptor: TlsAcceptor,
    /// The files' modification times when they were read (the certificate's, the key's, the
    /// clients' CAs').
    stamps: Vec<Option<SystemTime>>,
}

impl Tls {
    /// Reads and checks the certificate chain and its key, and the clients' CAs if given. The
    /// reason names the flag whose file is wrong; it never quotes a file's content.
    pub fn load(
        cert_file: &Path,
        key_file: &Path,
        client_ca_file: Option<&Path>,
    ) -> Result<Tls, String> {
        let files = Files {
            cert: cert_file.to_owned(),
            key: key_file.to_owned(),
            client_ca: client_ca_file.map(Path::to_owned),
        };
        let loaded = read(&files)?;
        Ok(Tls {
            files,
            current: RwLock::new(loaded),
        })
    }

    /// What accepts the next connection: the certificate loaded last.
    pub fn acceptor(&self) -> TlsAcceptor {
        match self.current.read() {
            Ok(current) => current.acceptor.clone(),
            Err(poisoned) => poisoned.into_inner().acceptor.clone(),
        }
    }

    /// [`Tls::acceptor`] for gRPC: the same certificate, ALPN `h2`.
    pub fn h2_acceptor(&self) -> TlsAcceptor {
        match self.current.read() {
            Ok(current) => current.h2_acceptor.clone(),
            Err(poisoned) => poisoned.into_inner().h2_acceptor.clone(),
        }
    }

    /// Reads the files again; on success the new certificate serves the connections accepted
    /// from now on. On failure the one in use stays, and the reason is returned.
    pub fn reload(&self) -> Result<(), String> {
        let loaded = read(&self.files)?;
        match self.current.write() {
            Ok(mut current) => *current = loaded,
            Err(poisoned) => *poisoned.into_inner() = loaded,
        }
        Ok(())
    }

    /// Whether either file changed since it was read last (a file that cannot be stat'ed counts
    /// as changed, so a reload says why).
    fn changed(&self) -> bool {
        let now = self.files.stamps();
        let then = match self.current.read() {
            Ok(current) => current.stamps.clone(),
            Err(poisoned) => poisoned.into_inner().stamps.clone(),
        };
        now != then || now.iter().any(Option::is_none)
    }

    /// Reloads on SIGHUP and when a file changes, for as long as the process runs. A failed
    /// reload from a change is tried again at the next change only (not every second).
    pub fn watch(self: Arc<Tls>) {
        tokio::spawn(async move {
            let mut hangup = crate::hangup::Hangup::new();
            let mut failed_at = None;
            loop {
                let signalled = hangup.or_sleep(WATCH_INTERVAL).await;
                let now = self.files.stamps();
                if !signalled && (!self.changed() || failed_at.as_ref() == Some(&now)) {
                    continue;
                }
                match self.reload() {
                    Ok(()) => {
                        failed_at = None;
                        tracing::info!(
                            cert = %self.files.cert.display(),
                            signalled,
                            "tls: certificate reloaded"
                        );
                    }
                    Err(reason) => {
                        failed_at = Some(now);
                        tracing::error!(
                            "tls: reload refused, the certificate in use is kept: {reason}"
                        );
                    }
                }
            }
        });
    }
}

impl Files {
    fn stamps(&self) -> Vec<Option<SystemTime>> {
        let modified = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let mut stamps = vec![modified(&self.cert), modified(&self.key)];
        stamps.extend(self.client_ca.as_deref().map(modified));
        stamps
    }
}

/// The names of the client certificate the handshake of `stream` verified; `None` if the
/// client showed none.
pub fn peer_certificate<S>(stream: &TlsStream<S>) -> Option<PeerCertificate> {
    let (_, connection) = stream.get_ref();
    let end_entity = connection.peer_certificates()?.first()?;
    Some(PeerCertificate::from_der(end_entity))
}

fn read(files: &Files) -> Result<Loaded, String> {
    let (cert_file, key_file) = (files.cert.as_path(), files.key.as_path());
    // The stamps first: a file written while it is read is read again at the next check.
    let stamps = files.stamps();
    let cert_pem = bounded("--tls-cert-file", cert_file)?;
    let key_pem = bounded("--tls-key-file", key_file)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|_| {
            format!(
                "--tls-cert-file {}: not a PEM certificate chain",
                cert_file.display()
            )
        })?;
    if chain.is_empty() {
        return Err(format!(
            "--tls-cert-file {}: no certificate in it (PEM, -----BEGIN CERTIFICATE-----)",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
        format!(
            "--tls-key-file {}: no private key in it (PEM: PKCS#8, PKCS#1 or SEC1)",
            key_file.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| format!("tls: {error}"))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca_file) => {
            let roots = client_roots(ca_file)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|error| format!("--tls-client-ca-file {}: {error}", ca_file.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|error| {
        format!(
            "--tls-key-file {}: does not go with --tls-cert-file {}: {error}",
            key_file.display(),
            cert_file.display()
        )
    })?;
    let mut h2 = config.clone();
    h2.alpn_protocols = vec![b"h2".to_vec()];
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Loaded {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        h2_acceptor: TlsAcceptor::from(Arc::new(h2)),
        stamps,
    })
}

/// The CAs of `--tls-client-ca-file`: at least one, each a certificate rustls can anchor to.
fn client_roots(ca_file: &Path) -> Result<RootCertStore, String> {
    let flag = "--tls-client-ca-file";
    let pem = bounded(flag, ca_file)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{flag} {}: not PEM certificates", ca_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {}: no certificate in it (PEM, -----BEGIN CERTIFICATE-----)",
            ca_file.display()
        ));
    }
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|error| {
            format!(
                "{flag} {}: certificate {} is not a CA rustls can use: {error}",
                ca_file.display(),
                i + 1
            )
        })?;
    }
    Ok(roots)
}

/// A file's bytes, at most [`MAX_FILE_BYTES`]; the reason names `flag`.
fn bounded(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file =
        std::fs::File::open(path).map_err(|error| format!("{flag} {}: {error}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| format!("{flag} {}: {error}", path.display()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "{flag} {}: larger than {MAX_FILE_BYTES} bytes",
            path.display()
        ));
    }
    Ok(bytes)
}
