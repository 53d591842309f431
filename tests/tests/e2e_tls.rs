//! The hop from the proxies to the counter service over TLS, all real parts on loopback: the service serving
//! HTTPS (`--tls-cert-file`, `--tls-key-file`) with certificates the tests make (`sluice_tests::certs`), and Envoy
//! calling it through a cluster with an `UpstreamTlsContext` that checks the service's certificate against a CA
//! and a name (`envoy/sluice-service.yaml.tmpl` with that transport socket added, as docs/deploy.md shows). A proxy
//! that trusts the service syncs and its limits hold; one whose CA, expected name or the service's certificate's
//! dates are wrong never sends its token in the clear: its callouts fail, the breaker opens, and the fallback
//! decides. The service refuses plain HTTP on its TLS port, and a certificate swapped on disk (for garbage, then
//! for a renewed one) is taken or refused without dropping a connection. A proxy whose upstream TLS context shows a
//! client certificate the service maps to a credential (`--tls-client-ca-file`, `--client-certs-file`) syncs with no
//! token at all. A request held open across a renewal is answered on its connection. And the secret grep: no token
//! or Redis password in a process's arguments or environment, a log (the service's at debug, Envoy's) or an error.
#![cfg(all(feature = "envoy", feature = "redis"))]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::json;
use sluice_tests::certs::{agent_trusting, Authority, Issued};
use sluice_tests::envoy::{agent, get, wasm_path, DerivedTemplate, Envoy, EnvoyOptions, Template};
use sluice_tests::eventually;
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions, ServiceTls};

static MACHINE: Mutex<()> = Mutex::new(());

/// One test at a time: each starts Envoy, the service and Redis.
fn machine() -> MutexGuard<'static, ()> {
    MACHINE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The name the proxies expect the service's certificate to carry (and send as SNI).
const SERVICE_NAME: &str = "sluice-service.internal";

/// The cluster `sluice_service` of `envoy/sluice-service.yaml.tmpl`, made to speak TLS: the CA it trusts, the name
/// it sends (SNI) and requires in the certificate.
fn tls_template() -> DerivedTemplate {
    tls_template_with("")
}

/// [`tls_template`], with `certificates` (YAML under `common_tls_context`) before its validation context.
fn tls_template_with(certificates: &str) -> DerivedTemplate {
    let transport = format!(
        "  - name: sluice_service\n    type: STATIC\n    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: \"{{{{SERVICE_NAME}}}}\"\n        common_tls_context:\n{certificates}          validation_context:\n            trusted_ca: {{ filename: \"{{{{SERVICE_CA}}}}\" }}\n            match_typed_subject_alt_names:\n            - san_type: DNS\n              matcher: {{ exact: \"{{{{SERVICE_NAME}}}}\" }}\n"
    );
    DerivedTemplate::edited(
        &Template::SluiceService,
        &[("  - name: sluice_service\n    type: STATIC\n", &transport)],
    )
    .unwrap()
}

/// The client certificate Envoy shows the service (mutual TLS), from the files the placeholders name.
const CLIENT_CERTIFICATE: &str = "          tls_certificates:\n          - certificate_chain: { filename: \"{{CLIENT_CERT}}\" }\n            private_key: { filename: \"{{CLIENT_KEY}}\" }\n";

/// sluice's configuration: one cached rule of 50 a minute for everyone, 3 a minute from its fallback, a quick
/// breaker.
fn config(token: &str) -> String {
    json!({
        "headers": "both",
        "service": {
            "cluster": "sluice_service",
            "authority": SERVICE_NAME,
            "token": token,
            "timeout_ms": 300,
            "sync_interval_ms": 100,
            "breaker_failures": 2,
            "breaker_cooldown_ms": 60000,
        },
        "rules": [{
            "name": "shared",
            "key": ["const:all"],
            "consistency": "cached",
            "limits": [{"requests": 50, "per": "minute"}],
            "fallback": {"policy": "fail_open", "limits": [{"requests": 3, "per": "minute"}]},
        }],
    })
    .to_string()
}

/// Envoy calling the service on `service_port` over TLS, trusting `ca_file` and expecting `name`.
fn start_envoy(
    template: &DerivedTemplate,
    service_port: u16,
    ca_file: &std::path::Path,
    name: &str,
    token: &str,
) -> Envoy {
    start_envoy_with(template, service_port, ca_file, name, token, Vec::new())
}

/// [`start_envoy`], with more placeholders.
fn start_envoy_with(
    template: &DerivedTemplate,
    service_port: u16,
    ca_file: &std::path::Path,
    name: &str,
    token: &str,
    more: Vec<(String, String)>,
) -> Envoy {
    let mut placeholders = more;
    placeholders.extend([
        (
            "WASM".to_owned(),
            wasm_path().unwrap().display().to_string(),
        ),
        ("SERVICE_PORT".to_owned(), service_port.to_string()),
        ("SERVICE_CA".to_owned(), ca_file.display().to_string()),
        ("SERVICE_NAME".to_owned(), name.to_owned()),
    ]);
    Envoy::start(EnvoyOptions {
        template: template.template(),
        plugin_config_json: config(token),
        concurrency: 2,
        placeholders,
    })
    .unwrap()
}

fn tls_options(redis: &Redis, ca: &Authority, issued: &Issued) -> ServiceOptions {
    ServiceOptions::new(redis.url()).tls(ServiceTls {
        cert_file: issued.cert_file.clone(),
        key_file: issued.key_file.clone(),
        ca_pem: ca.ca_pem.clone(),
    })
}

fn tls_service(redis: &Redis, ca: &Authority, issued: &Issued) -> Service {
    Service::start_with(tls_options(redis, ca, issued)).unwrap()
}

/// The proxy syncs with the service, and the shared limit holds: 50 a minute, far more than the fallback's 3.
fn syncs_and_the_limit_holds(envoy: &Envoy, service: &Service) {
    let client = agent();
    let url = envoy.url("/api/x");

    // The first requests are the fallback's (no lease yet); once a sync answered, the lease decides. One request
    // every 500 ms at most while waiting, so that a slow first handshake does not spend the minute's 50.
    let mut polls = 0u32;
    let mut warm_up: Vec<u16> = Vec::new();
    let synced = eventually(Duration::from_secs(10), || {
        if polls.is_multiple_of(10) {
            if let Ok(reply) = get(&client, &url, &[]) {
                warm_up.push(reply.status);
            }
        }
        polls += 1;
        envoy.stat("wasmcustom.sluice.sync.ok") > 0
    });
    assert!(
        synced,
        "no sync over TLS; {:?}\nservice log:\n{}",
        envoy.sluice_stats(),
        service.log()
    );
    // 80 requests over 4 s, not at once: a lease follows the proxy's demand and the service may advise syncs up to
    // 10 intervals apart when its Redis is slow (a busy machine), so a burst faster than one sync would meet one
    // small lease (CI once saw 2 of 80 admitted in 0.3 s).
    let statuses: Vec<u16> = (0..80)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            get(&client, &url, &[]).unwrap().status
        })
        .collect();
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    // Up to 50 in the minute, less what the warm-up spent; far above the fallback's 3; never more than the limit
    // plus what the fallback admitted before the first lease.
    assert!(
        (15..=53).contains(&admitted),
        "{admitted} admitted: {statuses:?} after a warm-up of {warm_up:?}; {:?}",
        envoy.sluice_stats()
    );
    assert_eq!(
        envoy.stat("wasmcustom.sluice.sync.failed"),
        0,
        "{:?}",
        envoy.sluice_stats()
    );
    assert!(service.metric("sluice_syncs_total") > 0);
}

/// How many certificate reloads the service logged.
fn reloads(service: &Service) -> usize {
    service.log().matches("certificate reloaded").count()
}

/// A proxy that trusts the service's CA and name syncs over TLS, and the shared limit holds: 50 a minute, far
/// more than the fallback's 3.
#[test]
fn a_proxy_that_trusts_the_service_syncs_over_tls_and_its_limit_holds() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let ca = Authority::new("service").unwrap();
    let issued = ca.issue("service", &[SERVICE_NAME, "127.0.0.1"]).unwrap();
    let service = tls_service(&redis, &ca, &issued);
    let port = service.address().unwrap().port();
    let template = tls_template();
    let envoy = start_envoy(
        &template,
        port,
        &ca.ca_file(),
        SERVICE_NAME,
        service.token(),
    );
    syncs_and_the_limit_holds(&envoy, &service);
}

/// What a misconfigured proxy does: its CA is not the service's, or the service's certificate is for another name or
/// expired. Each time Envoy refuses the handshake: no sync succeeds, the breaker opens, and the fallback decides
/// (3 of 10 admitted). The service counts no request from it.
#[test]
fn a_proxy_that_cannot_verify_the_service_falls_back_and_syncs_nothing() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let ca = Authority::new("service").unwrap();
    let other = Authority::new("other").unwrap();
    let template = tls_template();
    // (what, the certificate the service serves, the CA Envoy trusts)
    let cases: [(&str, Issued, std::path::PathBuf); 3] = [
        (
            "a CA that is not the service's",
            ca.issue("right", &[SERVICE_NAME, "127.0.0.1"]).unwrap(),
            other.ca_file(),
        ),
        (
            "a certificate for another name",
            ca.issue("wrong-name", &["someone-else.internal", "127.0.0.1"])
                .unwrap(),
            ca.ca_file(),
        ),
        (
            "an expired certificate",
            ca.issue_expired("expired", &[SERVICE_NAME, "127.0.0.1"])
                .unwrap(),
            ca.ca_file(),
        ),
    ];
    for (what, served, trusted) in cases {
        // The fixture's own client checks the certificate too: the service starts with a valid one, then the
        // certificate of the case is put in its place (a reload).
        let valid = ca.issue("valid", &[SERVICE_NAME, "127.0.0.1"]).unwrap();
        let service = tls_service(&redis, &ca, &valid);
        std::fs::copy(&served.key_file, &valid.key_file).unwrap();
        std::fs::copy(&served.cert_file, &valid.cert_file).unwrap();
        let swapped = eventually(Duration::from_secs(10), || {
            reloads(&service) >= 1 && !service.log().contains("reload refused")
        });
        assert!(swapped, "{what}: not reloaded:\n{}", service.log());
        let port = service.address().unwrap().port();
        let envoy = start_envoy(&template, port, &trusted, SERVICE_NAME, service.token());
        let client = agent();
        let url = envoy.url("/api/x");
        let mut statuses = Vec::new();
        let open = eventually(Duration::from_secs(10), || {
            statuses.push(get(&client, &url, &[]).unwrap().status);
            envoy.stat("wasmcustom.sluice.breaker.open") == 1
        });
        assert!(
            open,
            "{what}: the breaker did not open; {:?}",
            envoy.sluice_stats()
        );
        statuses.extend((0..10).map(|_| get(&client, &url, &[]).unwrap().status));
        // No lease ever came: the fallback's 3 a minute, and no more.
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(admitted, 3, "{what}: {statuses:?}");
        assert_eq!(
            envoy.stat("wasmcustom.sluice.sync.ok"),
            0,
            "{what}: {:?}",
            envoy.sluice_stats()
        );
        assert!(
            envoy.stat("wasmcustom.sluice.sync.failed") > 0,
            "{what}: {:?}",
            envoy.sluice_stats()
        );
        // The service answered no sync.
        assert_eq!(service.metric("sluice_syncs_total"), 0, "{what}");
    }
}

/// A proxy pointed at an endpoint that does not speak TLS (here, a listener that records every byte it gets) sends a
/// TLS ClientHello and nothing else: its token never crosses the network in the clear.
#[test]
fn a_proxy_never_sends_its_token_in_plaintext() {
    let _machine = machine();
    let ca = Authority::new("service").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(false).unwrap();
    let recorder = std::thread::spawn(move || {
        let mut seen = Vec::new();
        // At most 8 connections, each read until Envoy gives up on it (bounded by a read timeout).
        for _ in 0..8 {
            let Ok((mut stream, _)) = listener.accept() else {
                break;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_millis(1500)));
            let mut buffer = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buffer[..n]);
            }
            if seen.len() > 16 * 1024 {
                break;
            }
        }
        seen
    });
    let token = "a-token-that-must-never-be-seen-in-clear";
    let template = tls_template();
    let envoy = start_envoy(&template, port, &ca.ca_file(), SERVICE_NAME, token);
    let client = agent();
    let url = envoy.url("/api/x");
    let open = eventually(Duration::from_secs(10), || {
        let _ = get(&client, &url, &[]);
        envoy.stat("wasmcustom.sluice.breaker.open") == 1
    });
    assert!(open, "the breaker did not open; {:?}", envoy.sluice_stats());
    drop(envoy);
    // Wake the recorder if it waits for a ninth connection.
    for _ in 0..8 {
        let _ = TcpStream::connect(("127.0.0.1", port)).map(|mut s| s.write_all(b""));
    }
    let seen = recorder.join().unwrap();
    assert!(!seen.is_empty(), "Envoy never connected");
    assert_eq!(
        seen[0],
        0x16,
        "the first byte is not a TLS handshake record: {:?}",
        &seen[..seen.len().min(16)]
    );
    let text = String::from_utf8_lossy(&seen);
    assert!(!text.contains(token), "the token crossed in the clear");
    assert!(
        !text.contains("POST /v1/"),
        "a request crossed in the clear"
    );
}

/// The TLS port answers no plain HTTP, and stays up; a certificate swapped for garbage is refused (the one in use is
/// kept, an error is logged), one swapped for a renewed certificate (another CA here, so the client can tell) serves
/// the connections accepted after it, while a connection opened before it keeps working (SIGHUP and the file
/// watch both reload).
#[test]
fn the_service_refuses_plain_http_and_reloads_its_certificate_without_dropping_a_connection() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let ca = Authority::new("first").unwrap();
    let renewed_ca = Authority::new("renewed").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    // Kept-alive connections stay open for a minute, so the one opened first outlives the reloads.
    let service = Service::start_with(
        tls_options(&redis, &ca, &issued)
            .arg("--header-read-timeout-ms")
            .arg("60000"),
    )
    .unwrap();
    let address = service.address().unwrap();
    let status = |agent: &ureq::Agent| {
        agent
            .get(format!("https://{address}/v1/status"))
            .call()
            .map_err(|e| e.to_string())
            .and_then(|mut r| {
                // Read whole, so the connection goes back to the agent's pool.
                let status = r.status().as_u16();
                r.body_mut().read_to_string().map_err(|e| e.to_string())?;
                Ok(status)
            })
    };

    // Plain HTTP to the TLS port: no HTTP answer.
    let mut plain = TcpStream::connect(address).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    plain
        .write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !String::from_utf8_lossy(&answer).starts_with("HTTP/"),
        "plain HTTP was answered: {answer:?}"
    );

    let first = agent_trusting(&ca.ca_pem).unwrap();
    assert_eq!(status(&first), Ok(200));

    // Garbage in place of the certificate: refused, the old one kept.
    std::fs::write(&issued.cert_file, "not a certificate\n").unwrap();
    let refused = eventually(Duration::from_secs(10), || {
        service.log().contains("reload refused")
    });
    assert!(refused, "no refusal logged:\n{}", service.log());
    assert_eq!(
        status(&agent_trusting(&ca.ca_pem).unwrap()),
        Ok(200),
        "the old certificate still serves"
    );

    // A renewed certificate, by another CA: new connections get it; the kept-alive one still works.
    let renewed = renewed_ca.issue("renewed", &["127.0.0.1"]).unwrap();
    std::fs::copy(&renewed.key_file, &issued.key_file).unwrap();
    std::fs::copy(&renewed.cert_file, &issued.cert_file).unwrap();
    let second = agent_trusting(&renewed_ca.ca_pem).unwrap();
    let taken = eventually(Duration::from_secs(10), || status(&second) == Ok(200));
    assert!(
        taken,
        "the renewed certificate was not taken:\n{}",
        service.log()
    );
    assert_eq!(
        status(&first),
        Ok(200),
        "the connection opened before the reload was dropped"
    );
    assert!(
        status(&agent_trusting(&ca.ca_pem).unwrap()).is_err(),
        "a new connection still got the old certificate"
    );
    let after_renewal = reloads(&service);
    assert!(after_renewal >= 1, "{}", service.log());

    // SIGHUP reloads too (the files unchanged: the same certificate again).
    // SAFETY: kill(2) on the pid of the service this test started.
    unsafe {
        libc::kill(service.pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    let again = eventually(Duration::from_secs(10), || {
        reloads(&service) > after_renewal
    });
    assert!(again, "SIGHUP did not reload:\n{}", service.log());
    assert_eq!(status(&second), Ok(200));
}

/// Mutual TLS: the proxy's upstream TLS context shows a client certificate (a DNS SAN the service's
/// `--client-certs-file` maps to the credential `edge-a`, signed by the CA of `--tls-client-ca-file`), and its
/// configuration has no token (the filter sends `Bearer ` and nothing more); the service has no token either, so the
/// certificate is the only way in. The proxy syncs and the limit holds, as with a token.
#[test]
fn a_proxy_with_a_client_certificate_and_no_token_syncs_over_mutual_tls_and_its_limit_holds() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let ca = Authority::new("service").unwrap();
    let issued = ca.issue("service", &[SERVICE_NAME, "127.0.0.1"]).unwrap();
    let proxies = Authority::new("proxies").unwrap();
    let edge_a = proxies
        .issue("edge-a", &["edge-a.proxies.internal"])
        .unwrap();
    let mapping = proxies.dir().join("client-certs");
    std::fs::write(&mapping, "edge-a.proxies.internal edge-a\n").unwrap();
    let service = Service::start_with(
        tls_options(&redis, &ca, &issued)
            // No token at all: the fixture's shared token is emptied.
            .env("SLUICE_TOKEN", "")
            .arg("--tls-client-ca-file")
            .arg(proxies.ca_file().display().to_string())
            .arg("--client-certs-file")
            .arg(mapping.display().to_string()),
    )
    .unwrap();
    let port = service.address().unwrap().port();
    let template = tls_template_with(CLIENT_CERTIFICATE);
    let envoy = start_envoy_with(
        &template,
        port,
        &ca.ca_file(),
        SERVICE_NAME,
        "",
        vec![
            (
                "CLIENT_CERT".to_owned(),
                edge_a.cert_file.display().to_string(),
            ),
            (
                "CLIENT_KEY".to_owned(),
                edge_a.key_file.display().to_string(),
            ),
        ],
    );
    syncs_and_the_limit_holds(&envoy, &service);
    // Not one call was refused: the certificate was the credential of every sync.
    assert_eq!(
        service.metric("sluice_errors_total{kind=\"unauthorized\"}"),
        0,
        "{}",
        service.log()
    );
}

/// A TLS connection to the service at `address` that trusts only `ca_pem` (the name `127.0.0.1`), its handshake
/// done; `Err` if the handshake failed.
fn tls_connection(
    address: std::net::SocketAddr,
    ca_pem: &str,
) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let connection = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let tcp = TcpStream::connect(address)?;
    // A bound on a test that would otherwise hang, not an assertion.
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock)?;
    }
    Ok(stream)
}

/// The certificate a TLS connection was shown (DER).
fn shown(stream: &rustls::StreamOwned<rustls::ClientConnection, TcpStream>) -> Vec<u8> {
    stream.conn.peer_certificates().unwrap()[0].to_vec()
}

/// A certificate's DER, from its PEM.
fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

/// A strict check held open across a certificate renewal: the client sends its headers, waits for the service's
/// `100 Continue` (its handler is reading the body) and sends half its body; the certificate files are replaced by
/// one of another CA and the service gets SIGHUP; only once a new connection is shown the renewed certificate does
/// the client send the rest. The check is answered 200 on its original
/// connection (which still holds the old certificate), so a reload drops no request in flight.
#[test]
fn a_request_in_flight_across_a_certificate_reload_is_answered_on_its_connection() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let ca = Authority::new("first").unwrap();
    let renewed_ca = Authority::new("renewed").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    let renewed = renewed_ca.issue("renewed", &["127.0.0.1"]).unwrap();
    // The request may take as long as the test needs: no deadline of the service's cuts it.
    let service = Service::start_with(
        tls_options(&redis, &ca, &issued)
            .arg("--request-timeout-ms")
            .arg("60000")
            .arg("--header-read-timeout-ms")
            .arg("60000"),
    )
    .unwrap();
    let address = service.address().unwrap();
    let body = json!({"key": "held", "limits": [{"requests": 5, "period_ms": 60000, "burst": 5}]})
        .to_string();
    let (first_half, second_half) = body.split_at(body.len() / 2);
    let mut held = tls_connection(address, &ca.ca_pem).unwrap();
    // `expect: 100-continue`: the service answers `100 Continue` once its handler starts reading the body, past
    // the token's check, so the request is in the handler before anything is reloaded.
    write!(
        held,
        "POST /v1/check HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         authorization: Bearer {}\r\ncontent-length: {}\r\nconnection: close\r\n\
         expect: 100-continue\r\n\r\n",
        service.token(),
        body.len()
    )
    .unwrap();
    held.flush().unwrap();
    let mut interim = Vec::new();
    let mut byte = [0u8; 1];
    while !interim.ends_with(b"\r\n\r\n") && held.read(&mut byte).unwrap() == 1 {
        interim.push(byte[0]);
    }
    assert!(
        interim.starts_with(b"HTTP/1.1 100 "),
        "{}",
        String::from_utf8_lossy(&interim)
    );
    held.write_all(first_half.as_bytes()).unwrap();
    held.flush().unwrap();
    assert_eq!(shown(&held), der(&issued.cert_pem));

    let before = reloads(&service);
    std::fs::copy(&renewed.key_file, &issued.key_file).unwrap();
    std::fs::copy(&renewed.cert_file, &issued.cert_file).unwrap();
    // SAFETY: kill(2) on the pid of the service this test started.
    unsafe {
        libc::kill(service.pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    let taken = eventually(Duration::from_secs(10), || {
        reloads(&service) > before
            && tls_connection(address, &renewed_ca.ca_pem)
                .is_ok_and(|fresh| shown(&fresh) == der(&renewed.cert_pem))
    });
    assert!(
        taken,
        "the renewed certificate was not taken:\n{}",
        service.log()
    );
    assert!(
        agent_trusting(&ca.ca_pem)
            .unwrap()
            .get(format!("https://{address}/healthz"))
            .call()
            .is_err(),
        "a new connection still got the old certificate"
    );

    held.write_all(second_half.as_bytes()).unwrap();
    held.flush().unwrap();
    let mut answer = Vec::new();
    let read = held.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 200 "),
        "the held request was not answered 200 ({read:?}): {answer}\n{}",
        service.log()
    );
    assert!(answer.contains("\"allowed\":true"), "{answer}");
    assert_eq!(
        shown(&held),
        der(&issued.cert_pem),
        "the held connection's certificate"
    );
}

/// What a process's arguments and environment hold (`/proc/<pid>/cmdline` and `environ`).
fn process_text(pid: u32) -> String {
    let mut text = String::new();
    for file in ["cmdline", "environ"] {
        let bytes = std::fs::read(format!("/proc/{pid}/{file}")).unwrap_or_default();
        text.push_str(&String::from_utf8_lossy(&bytes).replace('\0', " "));
        text.push('\n');
    }
    text
}

/// The secret grep, through a real Envoy and the real service: the proxy's token (in the filter's configuration
/// and `--tokens-file`), an admin token (`--admin-tokens-file`) and the Redis password (`--redis-password-file`, a
/// TLS Redis with an ACL user) appear in no process's arguments or environment, not in the service's log at debug,
/// not in Envoy's log, and not in any error the service answers, while each path that could leak one runs: syncs,
/// refused tokens (each one sent where it is not valid), malformed bodies, Redis refusing the user (503), a tokens
/// file that gives the proxy's token to two names and one with a malformed line holding it (both refused on
/// reload), then the proxy's token removed, so Envoy's syncs are refused and the filter logs it.
#[test]
fn no_token_or_password_appears_in_processes_logs_or_errors() {
    use sluice_tests::redis::TestCertificates;
    let _machine = machine();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let proxy_token = format!("proxy-{}-{nanos}-Jw4", std::process::id());
    let admin_token = format!("admin-{}-{nanos}-Kx5", std::process::id());
    let password = format!("pw-{}-{nanos}-Ly6", std::process::id());
    let secrets = [
        ("the proxy token", proxy_token.as_str()),
        ("the admin token", admin_token.as_str()),
        ("the Redis password", password.as_str()),
    ];

    let redis_certs = TestCertificates::generate().unwrap();
    let dir = redis_certs.dir();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let acl = file(
        "users.acl",
        &format!("user default on nopass ~* &* +@all\nuser sluice on >{password} ~* &* +@all\n"),
    );
    let redis = Redis::start_tls(
        &redis_certs,
        &[
            "--aclfile",
            acl.to_str().unwrap(),
            "--tls-auth-clients",
            "yes",
        ],
    )
    .unwrap();
    let password_file = file("redis-password", &format!("{password}\n"));
    let tokens = file("tokens", &format!("edge {proxy_token}\n"));
    let admins = file("admins", &format!("ops {admin_token}\n"));
    let ca = Authority::new("service").unwrap();
    let issued = ca.issue("service", &[SERVICE_NAME, "127.0.0.1"]).unwrap();
    let mut options = ServiceOptions::new(format!("rediss://sluice@localhost:{}", redis.port()))
        .tls(ServiceTls {
            cert_file: issued.cert_file.clone(),
            key_file: issued.key_file.clone(),
            ca_pem: ca.ca_pem.clone(),
        });
    // No shared token: the files are the only credentials.
    options.token = String::new();
    options.log_filter = "debug".into();
    let path = |name: &str| redis_certs.path(name).display().to_string();
    for arg in [
        "--tokens-file".to_owned(),
        tokens.display().to_string(),
        "--admin-tokens-file".to_owned(),
        admins.display().to_string(),
        "--redis-ca-file".to_owned(),
        path("ca.pem"),
        "--redis-client-cert-file".to_owned(),
        path("client.pem"),
        "--redis-client-key-file".to_owned(),
        path("client.key"),
        "--redis-password-file".to_owned(),
        password_file.display().to_string(),
        "--redis-timeout-ms".to_owned(),
        "1000".to_owned(),
    ] {
        options = options.arg(arg);
    }
    let service = Service::start_with(options).unwrap();
    let port = service.address().unwrap().port();
    let template = tls_template();
    let envoy = start_envoy(&template, port, &ca.ca_file(), SERVICE_NAME, &proxy_token);
    let client = agent();
    let url = envoy.url("/api/x");
    let mut polls = 0u32;
    let synced = eventually(Duration::from_secs(10), || {
        if polls.is_multiple_of(10) {
            let _ = get(&client, &url, &[]);
        }
        polls += 1;
        envoy.stat("wasmcustom.sluice.sync.ok") > 0
    });
    assert!(
        synced,
        "no sync: {:?}\n{}",
        envoy.sluice_stats(),
        service.log()
    );

    // Every refusal the service can answer with a secret at hand: (what, method, path, token, body, status).
    let sync = json!({"proxy": "p1", "interval_ms": 100, "entries": [
        {"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 1, "denied": 0}]})
    .to_string();
    let check = json!({"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}]})
        .to_string();
    let near_miss = format!("{proxy_token}x");
    let bypass = json!({"enabled": "yes", "reason": admin_token}).to_string();
    let mut errors: Vec<(String, u16, String)> = Vec::new();
    let mut call =
        |what: &str, method: &str, path: &str, token: &str, body: Option<&str>, status: u16| {
            let reply = service.request(method, path, Some(token), body).unwrap();
            assert_eq!(reply.status, status, "{what}: {reply:?}");
            errors.push((what.to_owned(), reply.status, reply.body));
        };
    call(
        "the admin token on /v1",
        "POST",
        "/v1/sync",
        &admin_token,
        Some(&sync),
        401,
    );
    call(
        "a token one byte longer",
        "POST",
        "/v1/sync",
        &near_miss,
        Some(&sync),
        401,
    );
    call(
        "the proxy token on the admin API",
        "GET",
        "/admin/v1/audit",
        &proxy_token,
        None,
        401,
    );
    call(
        "a malformed sync",
        "POST",
        "/v1/sync",
        &proxy_token,
        Some("{\"proxy\":"),
        400,
    );
    call(
        "a malformed check",
        "POST",
        "/v1/check",
        &proxy_token,
        Some("[]"),
        400,
    );
    call(
        "a malformed bypass",
        "PUT",
        "/admin/v1/overrides/bypass",
        &admin_token,
        Some(&bypass),
        400,
    );
    // Redis refuses the user every command: the calls answer 503, the service logs Redis's errors.
    redis.query(&["ACL", "SETUSER", "sluice", "-@all"]).unwrap();
    call(
        "a sync Redis refuses",
        "POST",
        "/v1/sync",
        &proxy_token,
        Some(&sync),
        503,
    );
    call(
        "a check Redis refuses",
        "POST",
        "/v1/check",
        &proxy_token,
        Some(&check),
        503,
    );
    call(
        "an admin read Redis refuses",
        "GET",
        "/admin/v1/audit",
        &admin_token,
        None,
        503,
    );
    redis.query(&["ACL", "SETUSER", "sluice", "+@all"]).unwrap();

    // Files holding the secrets, refused on reload: the proxy's token given to two names (and the admin's), then a
    // malformed line holding it.
    let refusals = || service.log().matches("credentials: reload refused").count();
    let hangup = || {
        // SAFETY: kill(2) on the pid of the service this test started.
        unsafe {
            libc::kill(service.pid().unwrap() as libc::pid_t, libc::SIGHUP);
        }
    };
    std::fs::write(
        &tokens,
        format!("edge {proxy_token}\nrogue {proxy_token}\n"),
    )
    .unwrap();
    std::fs::write(&admins, format!("ops {admin_token}\nrogue {admin_token}\n")).unwrap();
    hangup();
    assert!(
        eventually(Duration::from_secs(10), || refusals() >= 2),
        "{}",
        service.log()
    );
    std::fs::write(&admins, format!("ops {admin_token}\n")).unwrap();
    std::fs::write(&tokens, format!("edge {proxy_token} {proxy_token}\n")).unwrap();
    let before = refusals();
    hangup();
    assert!(
        eventually(Duration::from_secs(10), || refusals() > before),
        "{}",
        service.log()
    );
    // The proxy's token removed: its syncs are refused, and the filter logs it.
    std::fs::write(&tokens, "edge another-token\n").unwrap();
    hangup();
    let refused = eventually(Duration::from_secs(10), || {
        let _ = get(&client, &url, &[]);
        envoy.stat("wasmcustom.sluice.sync.unauthorized") > 0
    });
    assert!(refused, "{:?}\n{}", envoy.sluice_stats(), service.log());
    let audit = service
        .request("GET", "/admin/v1/audit", Some(&admin_token), None)
        .unwrap();
    assert_eq!(audit.status, 200, "{audit:?}");

    // The greps could find a secret: each is where it belongs (the files, Envoy's configuration), and each log
    // holds the lines of the paths above.
    let envoy_config = std::fs::read_to_string(envoy.dir().join("envoy.yaml")).unwrap();
    assert!(
        envoy_config.contains(&proxy_token),
        "the grep would not find the token"
    );
    let service_log = service.log();
    let envoy_log = envoy.log();
    for line in [
        "DEBUG",
        "credentials: reload refused",
        "line 2",
        "line 1",
        "credentials: reloaded",
        "NoPerm",
    ] {
        assert!(
            service_log.contains(line),
            "{line:?} not in the service's log:\n{service_log}"
        );
    }
    assert!(envoy_log.contains("refused our token (401)"), "{envoy_log}");

    let redis_log = std::fs::read_to_string(redis.log_path()).unwrap_or_default();
    let places: Vec<(String, String)> = [
        (
            "the service's arguments and environment".to_owned(),
            process_text(service.pid().unwrap()),
        ),
        (
            "Envoy's arguments and environment".to_owned(),
            process_text(envoy.pid()),
        ),
        ("the service's log".to_owned(), service_log),
        ("Envoy's log".to_owned(), envoy_log),
        ("Redis's log".to_owned(), redis_log),
        ("the audit log".to_owned(), audit.body),
    ]
    .into_iter()
    .chain(
        errors
            .into_iter()
            .map(|(what, status, body)| (format!("{what} ({status})"), body)),
    )
    .collect();
    for (place, text) in &places {
        for (secret, value) in secrets {
            assert!(!text.contains(value), "{secret} is in {place}:\n{text}");
        }
    }
}
