//! sluice's counter service as Envoy's global rate limit service: real Envoy's own
//! `envoy.filters.http.ratelimit` filter (no Wasm), the shipped `envoy/ratelimit-service.yaml.tmpl`
//! and `envoy/ratelimit-descriptors.yaml`, the real service (`--grpc-bind`) and Redis. Route
//! actions: the client address, a request header under a generic key, a generic key alone;
//! exact across two Envoys and two service replicas; `hits_addend`; `shadow_mode`; `unlimited`;
//! the draft rate-limit headers and `Retry-After` against the real admission time;
//! `failure_mode_deny` both ways, with the service gone and with one that never answers (the
//! timeout); a proxy with a wrong credential; TLS with the certificate checked.

use std::net::TcpListener;
use std::time::Duration;

use sluice_tests::certs::Authority;
use sluice_tests::envoy::{
    agent, get, replace_exactly, repo_root, Envoy, EnvoyOptions, Reply, Template,
};
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions, ServiceTls};

fn descriptors() -> std::path::PathBuf {
    repo_root().join("envoy/ratelimit-descriptors.yaml")
}

fn service(redis: &Redis) -> Service {
    let mut options = ServiceOptions::new(redis.url()).rls(descriptors());
    options.log_filter = "info,sluice_counter_service::rls=debug".into();
    Service::start_with(options).unwrap()
}

/// Envoy in front of the rate limit service at `ports` (two replicas, or one twice).
fn envoy(ports: [u16; 2], token: &str, deny: bool, timeout: &str) -> Envoy {
    Envoy::start(EnvoyOptions {
        template: Template::File(repo_root().join("envoy/ratelimit-service.yaml.tmpl")),
        concurrency: 2,
        placeholders: vec![
            ("RLS_PORT_A".into(), ports[0].to_string()),
            ("RLS_PORT_B".into(), ports[1].to_string()),
            ("TOKEN".into(), token.into()),
            ("FAILURE_MODE_DENY".into(), deny.to_string()),
            ("RLS_TIMEOUT".into(), timeout.into()),
        ],
        ..EnvoyOptions::default()
    })
    .unwrap()
}

fn grpc_port(service: &Service) -> u16 {
    service.grpc_address().unwrap().port()
}

fn statuses(replies: &[Reply]) -> Vec<u16> {
    replies.iter().map(|r| r.status).collect()
}

/// Two Envoys, each taking two replicas in turn: the limits hold exactly across all four.
/// `x-user: alice` 4 an hour, `admin` never limited, no header 2 an hour per address, 5 an hour
/// per address on /by-address; each Envoy answers what the service counted, with the draft
/// headers and a Retry-After of the time until a token is back (15 minutes for 4 an hour).
#[test]
fn limits_are_exact_across_two_envoys_and_two_replicas() {
    let redis = Redis::start().unwrap();
    let (one, two) = (service(&redis), service(&redis));
    let ports = [grpc_port(&one), grpc_port(&two)];
    let edges = [
        envoy(ports, one.token(), true, "2s"),
        envoy(ports, one.token(), true, "2s"),
    ];
    let client = agent();
    let send = |path: &str, headers: &[(&str, &str)], n: usize| -> Vec<Reply> {
        (0..n)
            .map(|i| get(&client, &edges[i % 2].url(path), headers).unwrap())
            .collect()
    };
    let alice = send("/by-user", &[("x-user", "alice")], 8);
    assert_eq!(statuses(&alice), [200, 200, 200, 200, 429, 429, 429, 429]);
    let remaining: Vec<_> = alice[..4]
        .iter()
        .map(|r| r.header("x-ratelimit-remaining").unwrap_or("-").to_owned())
        .collect();
    assert_eq!(remaining, ["3", "2", "1", "0"], "{:?}", alice[0].headers);
    let limit = alice[0].header("x-ratelimit-limit").unwrap_or("");
    assert!(limit.starts_with("4"), "{limit}");
    let denied = &alice[4];
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (890..=900).contains(&retry),
        "a token every 15 minutes: {denied:?}"
    );
    assert_eq!(denied.header("x-envoy-ratelimited"), Some("true"));

    let admin = send("/by-user", &[("x-user", "admin")], 8);
    assert_eq!(
        admin.iter().filter(|r| r.status == 200).count(),
        8,
        "unlimited"
    );
    let anonymous = send("/by-user", &[], 4);
    assert_eq!(
        statuses(&anonymous),
        [200, 200, 429, 429],
        "2 an hour per address"
    );
    let by_address = send("/by-address", &[], 7);
    assert_eq!(statuses(&by_address), [200, 200, 200, 200, 200, 429, 429]);
    // Both replicas answered.
    for replica in [&one, &two] {
        assert!(
            replica.metric("rls_descriptors_total") > 0,
            "{}",
            replica.log()
        );
    }
}

/// `hits_addend: 3` on the route: 10 an hour admit 3 requests (9 tokens), the 4th is over.
/// `shadow_mode`: one an hour, yet every request admitted, the service counting the overs.
#[test]
fn hits_addend_spends_its_cost_and_shadow_mode_admits_and_counts() {
    let redis = Redis::start().unwrap();
    let rls = service(&redis);
    let port = grpc_port(&rls);
    let edge = envoy([port, port], rls.token(), true, "2s");
    let client = agent();
    let expensive: Vec<u16> = (0..5)
        .map(|_| get(&client, &edge.url("/expensive"), &[]).unwrap().status)
        .collect();
    assert_eq!(expensive, [200, 200, 200, 429, 429], "{}", rls.log());
    let shadow: Vec<u16> = (0..3)
        .map(|_| get(&client, &edge.url("/shadow"), &[]).unwrap().status)
        .collect();
    assert_eq!(shadow, [200, 200, 200]);
    let metrics = rls.get("/metrics").unwrap().body;
    assert!(
        metrics.contains("rls_descriptors_total{decision=\"shadow_denied\"} 2"),
        "{metrics}"
    );
}

/// One a second for everyone: a denial's Retry-After is when the next request is admitted,
/// by the real clock: a request sent that long after is admitted.
#[test]
fn retry_after_is_when_the_next_request_is_admitted() {
    let redis = Redis::start().unwrap();
    let rls = service(&redis);
    let port = grpc_port(&rls);
    let edge = envoy([port, port], rls.token(), true, "2s");
    let client = agent();
    // Up to 5 tries: each needs the admitted and the denied request in one second.
    let mut seen = Vec::new();
    for _ in 0..5 {
        let first = get(&client, &edge.url("/fast"), &[]).unwrap();
        let second = get(&client, &edge.url("/fast"), &[]).unwrap();
        seen.push((first.status, second.status));
        if second.status != 429 {
            std::thread::sleep(Duration::from_millis(1_100));
            continue;
        }
        let retry: u64 = second.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(retry, 1, "{second:?}");
        std::thread::sleep(Duration::from_secs(retry));
        let later = get(&client, &edge.url("/fast"), &[]).unwrap();
        assert_eq!(
            later.status, 200,
            "admitted once Retry-After passed: {later:?}"
        );
        return;
    }
    panic!("no denial within a second in 5 tries: {seen:?}");
}

/// `failure_mode_deny`: with the service gone, a limited route is refused (500) when true and
/// admitted when false; with a service that accepts but never answers, the same once the
/// filter's timeout passes. Envoy counts each (`ratelimit.error`, `failure_mode_allowed`).
#[test]
fn failure_mode_deny_decides_when_the_service_is_gone_or_silent() {
    // A port nobody listens on, and one that accepts and never answers.
    let gone = TcpListener::bind("127.0.0.1:0").unwrap();
    let gone_port = gone.local_addr().unwrap().port();
    drop(gone);
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        silent.set_nonblocking(true).unwrap();
        let mut open = Vec::new();
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < until && open.len() < 64 {
            match silent.accept() {
                Ok((stream, _)) => open.push(stream),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    let client = agent();
    for (port, timeout) in [(gone_port, "0.2s"), (silent_port, "0.3s")] {
        for deny in [true, false] {
            let edge = envoy([port, port], "any", deny, timeout);
            let reply = get(&client, &edge.url("/by-address"), &[]).unwrap();
            let expected = if deny { 500 } else { 200 };
            assert_eq!(
                reply.status, expected,
                "port {port}, deny {deny}: {reply:?}"
            );
            let stat = if deny {
                "cluster.upstream.ratelimit.error"
            } else {
                "cluster.upstream.ratelimit.failure_mode_allowed"
            };
            assert!(edge.stat_reaching(stat, 1) >= 1, "{stat}");
            // A route without rate limits never asks.
            assert_eq!(get(&client, &edge.url("/"), &[]).unwrap().status, 200);
        }
    }
    drop(held);
}

/// A proxy with a wrong credential is refused by the service (UNAUTHENTICATED, nothing
/// counted): with failure_mode_deny its requests are refused, never admitted uncounted.
#[test]
fn a_proxy_with_a_wrong_credential_is_refused() {
    let redis = Redis::start().unwrap();
    let rls = service(&redis);
    let port = grpc_port(&rls);
    let forged = envoy([port, port], "not-the-token", true, "2s");
    let client = agent();
    for _ in 0..3 {
        let reply = get(&client, &forged.url("/by-address"), &[]).unwrap();
        assert_eq!(reply.status, 500, "{reply:?}");
    }
    assert_eq!(rls.metric("rls_descriptors_total"), 0, "nothing counted");
    // The right one, after: the address still has its 5.
    let edge = envoy([port, port], rls.token(), true, "2s");
    let reply = get(&client, &edge.url("/by-address"), &[]).unwrap();
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("4"),
        "{reply:?}"
    );
}

/// The rate limit service over TLS (`--tls-cert-file` serves both ports; gRPC's with ALPN
/// `h2`): Envoy with the service's CA and its name checked is answered and limited; an Envoy
/// that trusts another CA never gets an answer, and its requests are refused
/// (`failure_mode_deny`), never admitted uncounted.
#[test]
fn envoy_speaks_to_the_rate_limit_service_over_tls_and_checks_its_certificate() {
    let redis = Redis::start().unwrap();
    let ca = Authority::new("rls").unwrap();
    let issued = ca
        .issue("rls", &["sluice-rls.internal", "127.0.0.1"])
        .unwrap();
    let options = ServiceOptions::new(redis.url())
        .rls(descriptors())
        .tls(ServiceTls {
            cert_file: issued.cert_file.clone(),
            key_file: issued.key_file.clone(),
            ca_pem: ca.ca_pem.clone(),
        });
    let rls = Service::start_with(options).unwrap();
    let port = grpc_port(&rls);
    let other = Authority::new("other").unwrap();
    let client = agent();
    for (trusted, expected) in [
        (ca.ca_file(), [200, 200, 200, 200, 429]),
        (other.ca_file(), [500; 5]),
    ] {
        let template =
            std::fs::read_to_string(repo_root().join("envoy/ratelimit-service.yaml.tmpl")).unwrap();
        let tls = format!(
            "    lb_policy: ROUND_ROBIN\n    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: sluice-rls.internal\n        common_tls_context:\n          alpn_protocols: [h2]\n          validation_context:\n            trusted_ca: {{ filename: {} }}\n            match_typed_subject_alt_names:\n            - san_type: DNS\n              matcher: {{ exact: sluice-rls.internal }}\n",
            trusted.display()
        );
        let derived = replace_exactly(&template, "    lb_policy: ROUND_ROBIN\n", &tls, 1).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ratelimit-tls.yaml.tmpl");
        std::fs::write(&path, derived).unwrap();
        let edge = Envoy::start(EnvoyOptions {
            template: Template::File(path),
            concurrency: 1,
            placeholders: vec![
                ("RLS_PORT_A".into(), port.to_string()),
                ("RLS_PORT_B".into(), port.to_string()),
                ("TOKEN".into(), rls.token().into()),
                ("FAILURE_MODE_DENY".into(), "true".into()),
                ("RLS_TIMEOUT".into(), "2s".into()),
            ],
            ..EnvoyOptions::default()
        })
        .unwrap();
        let user = format!("tls-{}", expected[0]);
        let seen: Vec<u16> = (0..5)
            .map(|_| {
                get(&client, &edge.url("/by-user"), &[("x-user", &user)])
                    .unwrap()
                    .status
            })
            .collect();
        assert_eq!(
            seen,
            expected,
            "trusting {}: {}",
            trusted.display(),
            edge.log()
        );
    }
}
