//! `--tls-cert-file` and `--tls-key-file` as an attacker or a careless operator might set them: each
//! wrong file refuses the start with a reason naming its flag, and no reason quotes a key. (The
//! certificates are made here, `sluice_tests::certs`; serving and reloading them is shown in real
//! Envoy, `tests/tests/e2e_tls.rs`.) Then mutual TLS, as an attacker would try it: below.

use clap::Parser;
use sluice_counter_service::Settings;
use sluice_tests::certs::Authority;

fn tls_error(cert: &std::path::Path, key: &std::path::Path) -> String {
    let settings = Settings::try_parse_from([
        "sluice-counter-service".as_ref(),
        "--token".as_ref(),
        "t".as_ref(),
        "--tls-cert-file".as_ref(),
        cert.as_os_str(),
        "--tls-key-file".as_ref(),
        key.as_os_str(),
    ])
    .unwrap();
    match settings.tls() {
        Ok(_) => String::new(),
        Err(reason) => reason,
    }
}

#[test]
fn a_good_pair_loads() {
    let ca = Authority::new("ok").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    assert_eq!(tls_error(&issued.cert_file, &issued.key_file), "");
}

#[test]
fn one_flag_without_the_other_is_refused_naming_it() {
    for (flag, other) in [
        ("--tls-cert-file", "--tls-key-file"),
        ("--tls-key-file", "--tls-cert-file"),
    ] {
        let settings =
            Settings::try_parse_from(["sluice-counter-service", "--token", "t", flag, "x.pem"])
                .unwrap();
        let reason = settings.tls().err().unwrap_or_default();
        assert_eq!(reason, format!("{flag} needs {other}"));
    }
}

#[test]
fn each_wrong_file_is_refused_naming_its_flag_and_quoting_no_key() {
    let ca = Authority::new("wrong").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    let other = ca.issue("other", &["127.0.0.1"]).unwrap();
    let dir = ca.dir();
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let huge = dir.join("huge.pem");
    std::fs::write(&huge, vec![b'A'; 2 << 20]).unwrap();
    let missing = dir.join("missing.pem");
    let key_text = std::fs::read_to_string(&issued.key_file).unwrap();
    let cases = [
        (garbage.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (empty.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (huge.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (missing.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (issued.cert_file.clone(), garbage.clone(), "--tls-key-file"),
        (issued.cert_file.clone(), missing.clone(), "--tls-key-file"),
        // A certificate's own file as its key: no key in it.
        (
            issued.cert_file.clone(),
            issued.cert_file.clone(),
            "--tls-key-file",
        ),
        // Another certificate's key.
        (
            issued.cert_file.clone(),
            other.key_file.clone(),
            "--tls-key-file",
        ),
        // The key where the certificate goes.
        (
            issued.key_file.clone(),
            issued.key_file.clone(),
            "--tls-cert-file",
        ),
    ];
    for (cert, key, flag) in cases {
        let reason = tls_error(&cert, &key);
        assert!(
            reason.starts_with(&format!("{flag} ")),
            "{} / {}: {reason:?} does not name {flag}",
            cert.display(),
            key.display()
        );
        assert!(
            !reason.contains("PRIVATE KEY")
                && !reason.contains(key_text.lines().nth(1).unwrap_or("-")),
            "{reason}"
        );
    }
}

// Mutual TLS: client certificates as credentials (`--tls-client-ca-file`, `--client-certs-file`,
// `--admin-client-certs-file`), over real TLS to the server on a loopback port. A call that
// passes the gate reaches its handler: `/v1/check` with `{}` answers 400 `malformed_json` (no
// Redis needed), an admin call 503 `redis_unavailable` (no Redis here); the gate itself answers
// 401 or 403, or the handshake fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::Value;
use sluice_counter_service::{reload, server, AppState};
use sluice_tests::eventually;

/// An authority that signs client certificates (the operator's, or an attacker's own).
struct ClientCa {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

/// A client certificate and its key, PEM.
struct ClientCert {
    cert_pem: String,
    key_pem: String,
}

impl ClientCa {
    fn new(name: &str) -> ClientCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut subject = DistinguishedName::new();
        subject.push(DnType::CommonName, format!("sluice test client CA {name}"));
        params.distinguished_name = subject;
        let key = KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        ClientCa { params, key, pem }
    }

    /// A client certificate for `sans`: a URI SAN if it holds a `:`, else a DNS SAN.
    fn issue(&self, sans: &[&str]) -> ClientCert {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = sans
            .iter()
            .map(|san| {
                let text = (*san).try_into().unwrap();
                if san.contains(':') {
                    SanType::URI(text)
                } else {
                    SanType::DnsName(text)
                }
            })
            .collect();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert_pem = params.signed_by(&key, &issuer).unwrap().pem();
        ClientCert {
            cert_pem,
            key_pem: key.serialize_pem(),
        }
    }
}

static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the service logged so far (every test of this process).
fn logged() -> String {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .try_init();
    });
    let log = LOG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    String::from_utf8_lossy(&log).into_owned()
}

/// The proxies' and the admins' names, as files, and the SANs the tests use.
const PROXY_A: &str = "edge-a.proxies.internal";
const PROXY_B: &str = "spiffe://sluice.test/edge-b";
const ADMIN: &str = "spiffe://sluice.test/ops/alice";
const TOKENS: &str = "edge-a tok-a\nedge-b tok-b\n";
const ADMIN_TOKENS: &str = "oncall tok-admin\n";

/// Everything a test's service is made of: the service's certificate (signed by `server_ca`),
/// the clients' CA, the mapping files, and the flags naming them.
struct Setup {
    server_ca: Authority,
    client_ca: ClientCa,
    server_cert: sluice_tests::certs::Issued,
}

impl Setup {
    fn new() -> Setup {
        let server_ca = Authority::new("mtls").unwrap();
        let server_cert = server_ca.issue("service", &["127.0.0.1"]).unwrap();
        Setup {
            server_ca,
            client_ca: ClientCa::new("operator"),
            server_cert,
        }
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.server_ca.dir().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The flags of a service with every mapping: `--tokens-file`, `--admin-tokens-file`, the
    /// clients' CA, `--client-certs-file` (edge-a by DNS name, edge-b by URI) and
    /// `--admin-client-certs-file` (alice by URI), and `more`.
    fn args(&self, redis_url: &str, more: &[&str]) -> Vec<String> {
        let ca = self.file("client-ca.pem", &self.client_ca.pem);
        let tokens = self.file("tokens", TOKENS);
        let admin_tokens = self.file("admin-tokens", ADMIN_TOKENS);
        let certs = self.file(
            "client-certs",
            &format!("# proxies\n{PROXY_A} edge-a\n{PROXY_B} edge-b\n"),
        );
        let admin_certs = self.file("admin-client-certs", &format!("{ADMIN} alice\n"));
        let path = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = [
            "sluice-counter-service",
            "--redis-url",
            redis_url,
            "--tls-cert-file",
            &path(&self.server_cert.cert_file),
            "--tls-key-file",
            &path(&self.server_cert.key_file),
            "--tls-client-ca-file",
            &path(&ca),
            "--tokens-file",
            &path(&tokens),
            "--admin-tokens-file",
            &path(&admin_tokens),
            "--client-certs-file",
            &path(&certs),
            "--admin-client-certs-file",
            &path(&admin_certs),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(more.iter().map(|s| s.to_string()));
        args
    }

    /// A client that trusts the service, showing `cert` if given.
    fn client(&self, cert: Option<&ClientCert>) -> Client {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.server_ca.ca_pem.as_bytes()).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match cert {
            Some(cert) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(cert.cert_pem.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        Client {
            config: Arc::new(config),
        }
    }
}

struct Client {
    config: Arc<rustls::ClientConfig>,
}

/// An answer: its status and JSON body.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Value,
}

impl Answer {
    fn error(&self) -> &str {
        self.body["error"].as_str().unwrap_or("")
    }
}

impl Client {
    /// `method path` with `body`, `Authorization: Bearer <token>` if given, on a connection of
    /// its own. `Err` when no HTTP answer came (the handshake failed): the reason.
    fn call(
        &self,
        address: SocketAddr,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> Result<Answer, String> {
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let connection = rustls::ClientConnection::new(self.config.clone(), name).unwrap();
        let tcp = TcpStream::connect(address).unwrap();
        // A bound on a test that would otherwise hang, not an assertion.
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut stream = rustls::StreamOwned::new(connection, tcp);
        let authorization = token
            .map(|token| format!("authorization: Bearer {token}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             {authorization}content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let written = stream.write_all(request.as_bytes());
        let mut bytes = Vec::new();
        let read = stream.read_to_end(&mut bytes);
        let text = String::from_utf8_lossy(&bytes);
        let Some(status) = text
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
        else {
            return Err(format!("no answer: write {written:?}, read {read:?}"));
        };
        let body = text
            .split_once("\r\n\r\n")
            .and_then(|(_, body)| serde_json::from_str(body).ok())
            .unwrap_or(Value::Null);
        Ok(Answer { status, body })
    }

    /// `POST /v1/check` with `{}`: 400 `malformed_json` once past the gate.
    fn check(&self, address: SocketAddr, token: Option<&str>) -> Result<Answer, String> {
        self.call(address, "POST", "/v1/check", token, "{}")
    }

    /// `GET /admin/v1/audit`: 503 `redis_unavailable` once past the gate (without Redis).
    fn audit(&self, address: SocketAddr, token: Option<&str>) -> Result<Answer, String> {
        self.call(address, "GET", "/admin/v1/audit", token, "")
    }
}

/// What an answer's status and error say, for assertions.
fn outcome(answer: &Result<Answer, String>) -> String {
    match answer {
        Ok(answer) => format!("{} {}", answer.status, answer.error()),
        Err(_) => "handshake refused".to_owned(),
    }
}

const PAST_THE_GATE: &str = "400 malformed_json";
const ADMIN_PAST_THE_GATE: &str = "503 redis_unavailable";

/// The service, in this process, on a loopback port, with its reloads running; stopped on drop.
struct Running {
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Where no Redis listens: the service starts anyway and answers 503 past its gates.
const NO_REDIS: &str = "redis://127.0.0.1:1";

fn start(args: Vec<String>) -> Running {
    logged();
    let settings = Settings::try_parse_from(args).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, address) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let tls = settings.tls().unwrap().map(Arc::new);
            let state = AppState::new(settings).unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ready.send(listener.local_addr().unwrap()).unwrap();
            if let Some(tls) = &tls {
                tls.clone().watch();
            }
            reload::watch_credentials(state.clone());
            let shutdown = async {
                let _ = stopped.await;
            };
            server::serve_with(listener, state, tls, shutdown)
                .await
                .unwrap();
        });
    });
    Running {
        address: address.recv().unwrap(),
        stop: Some(stop),
        thread: Some(thread),
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_mapped_certificate_is_its_credential_without_a_token() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let at = service.address;
    for san in [PROXY_A, PROXY_B] {
        let proxy = setup.client(Some(&setup.client_ca.issue(&[san])));
        assert_eq!(outcome(&proxy.check(at, None)), PAST_THE_GATE, "{san}");
        // `Bearer ` and nothing more (a filter without `service.token`) is no token.
        assert_eq!(outcome(&proxy.check(at, Some(""))), PAST_THE_GATE, "{san}");
    }
    // A DNS SAN in another case is the same name.
    let upper = setup.client(Some(&setup.client_ca.issue(&["EDGE-A.proxies.internal"])));
    assert_eq!(outcome(&upper.check(at, None)), PAST_THE_GATE);
    // Tokens keep working without a certificate; nothing at all is 401.
    let bare = setup.client(None);
    assert_eq!(outcome(&bare.check(at, Some("tok-a"))), PAST_THE_GATE);
    assert_eq!(outcome(&bare.check(at, None)), "401 unauthorized");
}

#[test]
fn a_certificate_another_ca_signed_fails_the_handshake() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let rogue = ClientCa::new("rogue");
    // Its SAN is mapped, and it sends a valid token as well: no byte of HTTP is answered.
    let forged = setup.client(Some(&rogue.issue(&[PROXY_A])));
    for token in [None, Some("tok-a")] {
        let answer = forged.check(service.address, token);
        let reason = answer.as_ref().err().cloned().unwrap_or_default();
        assert!(reason.contains("AlertReceived(UnknownCA)"), "{answer:?}");
    }
    // The operator's CA signed an admin's certificate; the rogue one's for the same URI fails too.
    let forged_admin = setup.client(Some(&rogue.issue(&[ADMIN])));
    assert_eq!(
        outcome(&forged_admin.audit(service.address, None)),
        "handshake refused"
    );
}

#[test]
fn a_certificate_and_a_token_of_different_credentials_are_refused() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let at = service.address;
    let b = setup.client(Some(&setup.client_ca.issue(&[PROXY_B])));
    let refused = b.check(at, Some("tok-a"));
    assert_eq!(outcome(&refused), "403 credentials_disagree");
    let message = refused
        .map(|a| a.body["message"].to_string())
        .unwrap_or_default();
    assert!(message.contains("different credentials"), "{message}");
    // The same credential's token agrees; a token nobody holds is 401 whatever the certificate.
    assert_eq!(outcome(&b.check(at, Some("tok-b"))), PAST_THE_GATE);
    assert_eq!(outcome(&b.check(at, Some("tok-x"))), "401 unauthorized");
    // An admin token is no proxy's: refused beside a proxy certificate too.
    assert_eq!(outcome(&b.check(at, Some("tok-admin"))), "401 unauthorized");
    // One certificate naming two credentials is refused, with or without a token.
    let both = setup.client(Some(&setup.client_ca.issue(&[PROXY_A, PROXY_B])));
    assert_eq!(outcome(&both.check(at, None)), "403 certificate_ambiguous");
    assert_eq!(
        outcome(&both.check(at, Some("tok-a"))),
        "403 certificate_ambiguous"
    );
}

#[test]
fn a_proxy_certificate_is_nobody_on_the_admin_api_and_an_admin_one_nobody_on_v1() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let at = service.address;
    let proxy = setup.client(Some(&setup.client_ca.issue(&[PROXY_A])));
    assert_eq!(outcome(&proxy.audit(at, None)), "401 unauthorized");
    // Nor with its own proxy token.
    assert_eq!(outcome(&proxy.audit(at, Some("tok-a"))), "401 unauthorized");
    let admin = setup.client(Some(&setup.client_ca.issue(&[ADMIN])));
    assert_eq!(outcome(&admin.audit(at, None)), ADMIN_PAST_THE_GATE);
    assert_eq!(outcome(&admin.check(at, None)), "401 unauthorized");
    // An admin certificate with another admin's token: two names, refused.
    assert_eq!(
        outcome(&admin.audit(at, Some("tok-admin"))),
        "403 credentials_disagree"
    );
    // The admin token alone still works.
    assert_eq!(
        outcome(&setup.client(None).audit(at, Some("tok-admin"))),
        ADMIN_PAST_THE_GATE
    );
}

#[test]
fn an_unmapped_certificate_is_nobody_and_needs_a_token() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let at = service.address;
    let cases: [&[&str]; 4] = [
        &["edge-z.proxies.internal"],
        // A wildcard is not the names it covers.
        &["*.proxies.internal"],
        // A DNS name is not a mapped URI with the same text, nor a URI in another case.
        &["spiffe://SLUICE.test/edge-b"],
        &[],
    ];
    for sans in cases {
        let unmapped = setup.client(Some(&setup.client_ca.issue(sans)));
        let answer = unmapped.check(at, None);
        assert_eq!(outcome(&answer), "401 unauthorized", "{sans:?}");
        assert_eq!(outcome(&unmapped.check(at, Some(""))), "401 unauthorized");
        assert_eq!(
            outcome(&unmapped.check(at, Some("tok-b"))),
            PAST_THE_GATE,
            "{sans:?}"
        );
    }
}

#[test]
fn a_malformed_mapping_or_a_missing_flag_is_refused_at_start_naming_it() {
    let setup = Setup::new();
    let start_error = |args: Vec<String>| -> String {
        let settings = match Settings::try_parse_from(args) {
            Ok(settings) => settings,
            Err(error) => return error.to_string(),
        };
        if let Err(reason) = settings.tls() {
            return reason;
        }
        // The state's Redis client needs a runtime, as in the service.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            match AppState::new(settings) {
                Ok(_) => String::new(),
                Err(error) => error.to_string(),
            }
        })
    };
    assert_eq!(start_error(setup.args(NO_REDIS, &[])), "");
    let bad = setup.file("bad-certs", &format!("{PROXY_A} edge-a\n{PROXY_B}\n"));
    let reason = start_error(setup.args(
        NO_REDIS,
        &["--client-certs-file", &bad.display().to_string()],
    ));
    assert_eq!(
        reason,
        format!(
            "--client-certs-file {}: line 2: expected `san name`",
            bad.display()
        )
    );
    let wildcard = setup.file("wildcard-certs", "*.ops.internal alice\n");
    let reason = start_error(setup.args(
        NO_REDIS,
        &["--admin-client-certs-file", &wildcard.display().to_string()],
    ));
    assert!(
        reason.starts_with(&format!(
            "--admin-client-certs-file {}: line 1: the SAN \"*.ops.internal\" is a wildcard",
            wildcard.display()
        )),
        "{reason}"
    );
    let garbage_ca = setup.file("garbage-ca.pem", "not a certificate\n");
    let reason = start_error(setup.args(
        NO_REDIS,
        &["--tls-client-ca-file", &garbage_ca.display().to_string()],
    ));
    assert!(
        reason.starts_with(&format!("--tls-client-ca-file {}: ", garbage_ca.display())),
        "{reason}"
    );
    // A client certificate's key where the CA goes: no CA in it, and the key is not quoted.
    let key_file = setup.file("client-key.pem", &setup.client_ca.issue(&[PROXY_A]).key_pem);
    let reason = start_error(setup.args(
        NO_REDIS,
        &["--tls-client-ca-file", &key_file.display().to_string()],
    ));
    assert!(
        reason.starts_with("--tls-client-ca-file ") && !reason.contains("PRIVATE KEY"),
        "{reason}"
    );

    // Flags that do not go together.
    let minimal = |more: &[&str]| {
        let mut args = vec!["sluice-counter-service".to_owned()];
        args.extend(more.iter().map(|s| s.to_string()));
        start_error(args)
    };
    assert_eq!(
        minimal(&["--tokens-file", "t", "--client-certs-file", "m"]),
        "--client-certs-file needs --tls-client-ca-file (who signs the certificates)"
    );
    assert_eq!(
        minimal(&["--tokens-file", "t", "--admin-client-certs-file", "m"]),
        "--admin-client-certs-file needs --tls-client-ca-file (who signs the certificates)"
    );
    assert_eq!(
        minimal(&[
            "--tokens-file",
            "t",
            "--tls-client-ca-file",
            "ca",
            "--client-certs-file",
            "m"
        ]),
        "--tls-client-ca-file needs --tls-cert-file (client certificates are shown over TLS only)"
    );
    let cert = setup.server_cert.cert_file.display().to_string();
    let key = setup.server_cert.key_file.display().to_string();
    assert_eq!(
        minimal(&[
            "--tokens-file",
            "t",
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-client-ca-file",
            "ca"
        ]),
        "--tls-client-ca-file needs --client-certs-file or --admin-client-certs-file (what a \
         certificate's SAN is a credential of)"
    );
    // A shared token beside certificate names: its holders could pass for a certificate's proxy.
    let reason = minimal(&["--token", "t", "--client-certs-file", "m"]);
    assert!(
        reason.starts_with("--client-certs-file names credentials as --tokens-file does"),
        "{reason}"
    );
}

#[test]
fn a_mapping_reloads_and_a_malformed_one_keeps_the_mapping_in_use() {
    let setup = Setup::new();
    let service = start(setup.args(NO_REDIS, &[]));
    let at = service.address;
    let mapping = setup.server_ca.dir().join("client-certs");
    let a = setup.client(Some(&setup.client_ca.issue(&[PROXY_A])));
    let c = setup.client(Some(&setup.client_ca.issue(&["edge-c.proxies.internal"])));
    assert_eq!(outcome(&a.check(at, None)), PAST_THE_GATE);
    assert_eq!(outcome(&c.check(at, None)), "401 unauthorized");

    // A malformed file: refused, logged naming the flag, the file and the line; edge-a still in.
    std::fs::write(
        &mapping,
        format!("{PROXY_A} edge-a\nedge-c.proxies.internal\n"),
    )
    .unwrap();
    let expected = format!(
        "credentials: reload refused, the set in use is kept: --client-certs-file {}: line 2: \
         expected `san name`",
        mapping.display()
    );
    assert!(
        eventually(Duration::from_secs(20), || logged().contains(&expected)),
        "no refusal logged: {}",
        logged()
    );
    assert_eq!(outcome(&a.check(at, None)), PAST_THE_GATE);
    assert_eq!(outcome(&c.check(at, None)), "401 unauthorized");

    // A good one: edge-c in, edge-a out (at once, for every request from then on).
    std::fs::write(&mapping, "edge-c.proxies.internal edge-c\n").unwrap();
    assert!(
        eventually(Duration::from_secs(20), || outcome(&c.check(at, None))
            == PAST_THE_GATE),
        "the new mapping was not taken: {}",
        logged()
    );
    assert_eq!(outcome(&a.check(at, None)), "401 unauthorized");
    // And the token of the removed name still works alone: the mapping is not the tokens file.
    assert_eq!(
        outcome(&setup.client(None).check(at, Some("tok-a"))),
        PAST_THE_GATE
    );
}

/// With Redis: the credential a certificate names is the caller the handlers see (the proxy id
/// kept under it, the admin the audit log records), and a reload of a mapping is audited.
#[cfg(feature = "redis")]
#[test]
fn a_certificates_name_reaches_the_handlers_and_a_reload_is_audited() {
    let redis = sluice_tests::redis::Redis::start().unwrap();
    let setup = Setup::new();
    let service = start(setup.args(&redis.url(), &["--redis-timeout-ms", "1000"]));
    let at = service.address;
    let a = setup.client(Some(&setup.client_ca.issue(&[PROXY_A])));
    let admin = setup.client(Some(&setup.client_ca.issue(&[ADMIN])));
    let sync = r#"{"proxy": "envoy-1", "interval_ms": 1000, "entries": [
        {"key": "mtls\u001fk", "limits": [{"requests": 10, "period_ms": 60000, "burst": 10}], "spent": 1, "denied": 0}]}"#;
    let synced = a.call(at, "POST", "/v1/sync", None, sync).unwrap();
    assert_eq!(synced.status, 200, "{:?}", synced.body);
    // The lease is kept under the credential's name, as a token of edge-a would keep it.
    let limits = "%5B%7B%22requests%22%3A10%2C%22per%22%3A%22minute%22%7D%5D";
    let key = admin
        .call(
            at,
            "GET",
            &format!("/admin/v1/keys/mtls?key=k&limits={limits}"),
            None,
            "",
        )
        .unwrap();
    assert_eq!(key.status, 200, "{:?}", key.body);
    let proxies: Vec<&str> = key.body["limits"][0]["leases"]
        .as_array()
        .map(|leases| leases.iter().filter_map(|l| l["proxy"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(proxies, ["edge-a/envoy-1"], "{:?}", key.body);
    // The admin the certificate names is who the audit log records.
    let put = admin
        .call(
            at,
            "PUT",
            "/admin/v1/overrides/bypass",
            None,
            r#"{"enabled": true, "ttl_s": 60, "reason": "mtls test"}"#,
        )
        .unwrap();
    assert_eq!(put.status, 200, "{:?}", put.body);
    let mapping = setup.server_ca.dir().join("client-certs");
    std::fs::write(
        &mapping,
        format!("{PROXY_A} edge-a\n{PROXY_B} edge-b\nedge-c.internal edge-c\n"),
    )
    .unwrap();
    let audited = eventually(Duration::from_secs(20), || {
        let audit = admin.audit(at, None).unwrap();
        audit.body.to_string().contains("--client-certs-file")
    });
    let audit = admin.audit(at, None).unwrap();
    assert!(audited, "{:?}", audit.body);
    let text = audit.body.to_string();
    assert!(text.contains(r#""who":"alice""#), "{text}");
    assert!(
        text.contains(r#""action":"reload credentials""#)
            && text.contains(r#""value":{"names":3,"sans":3}"#),
        "{text}"
    );
}
