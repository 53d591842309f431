//! sluice in a real nginx (ngx_wasm_module) with its counter service and Redis: the service reached by
//! `service.address` (ngx_wasm_module dispatches to a host and port, it has no clusters), a strict rule exact and failing closed with the documented 503, one cached limit shared by
//! an nginx and an Envoy (one fleet, two hosts), shedding beside a synced rule; a strict rule on
//! keep-alive connections is open (ignored). Run with `make test-nginx` (docs/nginx.md).
//!
//! The tests take turns (one lock): nginx, Envoy, the service and Redis fill a small machine.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::certs::Authority;
use sluice_tests::contract::checked_body;
use sluice_tests::envoy::{agent, get, sustain, Envoy, EnvoyOptions, Load, Sustained, Template};
use sluice_tests::nginx::{Filter, Nginx, NginxOptions};
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions, ServiceTls};

static MACHINE: Mutex<()> = Mutex::new(());

fn machine() -> MutexGuard<'static, ()> {
    MACHINE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a host names the counter service: Envoy by its cluster, nginx by its address.
enum Names<'a> {
    Cluster(&'a str),
    Address(String),
}

/// sluice's configuration with `rules` synced with the service named `service`.
fn config(service: Names, token: &str, rules: Value) -> String {
    let (field, value) = match service {
        Names::Cluster(name) => ("cluster", name.to_owned()),
        Names::Address(address) => ("address", address),
    };
    let mut config = json!({
        "headers": "both",
        "service": {
            "token": token,
            "timeout_ms": 200,
            "sync_interval_ms": 100,
            "breaker_failures": 3,
            "breaker_cooldown_ms": 2000,
        },
        "rules": rules,
    });
    config["service"][field] = Value::String(value);
    if field == "address" {
        config["host"] = json!("nginx");
    }
    config.to_string()
}

fn address(service: &Service) -> Names<'static> {
    Names::Address(service.address().expect("the service listens").to_string())
}

fn start_nginx(plugin_config: String, workers: u32) -> Nginx {
    Nginx::start(NginxOptions {
        filter: Filter::Sluice,
        plugin_config,
        workers,
        ..NginxOptions::default()
    })
    .unwrap()
}

fn assert_only_200_and_429(run: &Sustained, what: &str) {
    let errors = run.errors();
    assert!(
        errors.is_empty(),
        "{what}: {} request(s) got no answer, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    let statuses = run.statuses();
    assert!(
        statuses.keys().all(|s| *s == 200 || *s == 429),
        "{what}: statuses {statuses:?}"
    );
}

/// A strict rule asks the service for every request: exactly 5 a minute for a key, across two
/// workers. With the service gone, `fail_closed` answers docs/clients.md's 503 `limiter_unavailable`.
/// Each request on a connection of its own (see the next test for why).
#[test]
fn a_strict_rule_is_exact_through_the_service_by_address_and_fails_closed() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let mut service = Service::start_with(ServiceOptions::new(redis.url())).unwrap();
    let rules = json!([{
        "name": "strict",
        "key": ["header:x-api-key"],
        "consistency": "strict",
        "limits": [{"requests": 5, "per": "minute"}],
        "fallback": {"policy": "fail_closed"},
    }]);
    let nginx = start_nginx(config(address(&service), service.token(), rules), 2);
    let url = nginx.url("/api/x");
    // A connection per request: see a_strict_rule_survives_keep_alive_connections.
    let send = |key: &str| get(&agent(), &url, &[("x-api-key", key)]).unwrap();

    let replies: Vec<_> = (0..10).map(|_| send("alice")).collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 429, 429, 429, 429, 429],
        "5 per minute, decided by the service one request at a time; nginx errors: {:?}",
        nginx.errors()
    );
    let denied = &replies[5];
    assert!(denied.header("retry-after").is_some(), "{denied:?}");
    assert_eq!(checked_body(&denied.body)["rule"], "strict", "{denied:?}");
    assert_eq!(
        send("carol").status,
        200,
        "a fresh key while the service is up"
    );

    service.kill();
    for i in 0..3 {
        let reply = send("bob");
        assert_eq!(
            reply.status, 503,
            "request {i} for a fresh key with the service dead (fail_closed): {reply:?}"
        );
        assert!(reply.header("retry-after").is_some(), "{reply:?}");
        let content_type = reply.header("content-type").unwrap_or_default();
        assert!(content_type.starts_with("application/json"), "{reply:?}");
        let body = checked_body(&reply.body);
        assert_eq!(body["error"], "limiter_unavailable", "{body}");
        assert_eq!(body["rule"], "strict", "{body}");
    }
}

/// `service.tls` in real nginx: the service serves HTTPS with a certificate for `sluice-service.internal` from a CA
/// of the test's; an nginx whose `wasm {}` block trusts that CA and checks the name (the service's `authority`)
/// has its strict rule decided by the service, exactly. One that trusts another CA, and one that expects another
/// name, never get an answer from the service: the handshake fails, no check is counted, and the rule's
/// `fail_closed` fallback answers 503.
#[test]
fn over_tls_a_proxy_that_trusts_the_service_syncs_and_one_that_does_not_falls_back() {
    let _machine = machine();
    const NAME: &str = "sluice-service.internal";
    let redis = Redis::start().unwrap();
    let ca = Authority::new("nginx-service").unwrap();
    let issued = ca.issue("service", &[NAME, "127.0.0.1"]).unwrap();
    let service = Service::start_with(ServiceOptions::new(redis.url()).tls(ServiceTls {
        cert_file: issued.cert_file.clone(),
        key_file: issued.key_file.clone(),
        ca_pem: ca.ca_pem.clone(),
    }))
    .unwrap();
    let other_ca = Authority::new("not-the-service").unwrap();
    let rules = json!([{
        "name": "strict",
        "key": ["header:x-api-key"],
        "consistency": "strict",
        "limits": [{"requests": 5, "per": "minute"}],
        "fallback": {"policy": "fail_closed"},
    }]);
    let start = |ca_file: &std::path::Path, authority: &str| {
        let mut config: Value =
            serde_json::from_str(&config(address(&service), service.token(), rules.clone()))
                .unwrap();
        config["service"]["tls"] = json!(true);
        config["service"]["authority"] = json!(authority);
        Nginx::start(NginxOptions {
            filter: Filter::Sluice,
            plugin_config: config.to_string(),
            workers: 1,
            wasm_directives: format!(
                "tls_trusted_certificate {}; tls_verify_cert on; tls_verify_host on;",
                ca_file.display()
            ),
            ..NginxOptions::default()
        })
        .unwrap()
    };
    let statuses = |nginx: &Nginx, key: &str, n: usize| -> Vec<u16> {
        let url = nginx.url("/api/x");
        (0..n)
            .map(|_| get(&agent(), &url, &[("x-api-key", key)]).unwrap().status)
            .collect()
    };

    let trusting = start(&ca.ca_file(), NAME);
    assert_eq!(
        statuses(&trusting, "alice", 7),
        [200, 200, 200, 200, 200, 429, 429],
        "decided by the service over TLS; nginx errors: {:?}",
        trusting.errors()
    );
    drop(trusting);

    for (what, ca_file, authority) in [
        ("another CA", other_ca.ca_file(), NAME),
        ("another name", ca.ca_file(), "counter.elsewhere.internal"),
    ] {
        let nginx = start(&ca_file, authority);
        assert_eq!(
            statuses(&nginx, "bob", 3),
            [503, 503, 503],
            "{what}: the service cannot be trusted, so the rule fails closed; nginx errors: {:?}",
            nginx.errors()
        );
        assert!(
            nginx.log().contains("tls certificate"),
            "{what}: nginx logs why the handshake failed:\n{}",
            nginx.log()
        );
    }
    // bob was never counted: the service saw no check of the untrusting proxies
    let trusting = start(&ca.ca_file(), NAME);
    assert_eq!(
        statuses(&trusting, "bob", 6),
        [200, 200, 200, 200, 200, 429],
        "bob's 5 are whole"
    );
}

/// One fleet, two hosts: an nginx (`service.address`) and an Envoy (`service.cluster`,
/// `sluice_service`) share one cached hourly window of 20 through the same service. Together they admit
/// the window, plus at most what each one's fallback (5) admitted before its first lease.
#[test]
fn one_cached_window_is_shared_by_nginx_and_envoy() {
    let _machine = machine();
    // Not across a full hour: the window must not turn during the run.
    let to_hour_end = 3_600 - now_secs() % 3_600;
    if to_hour_end < 30 {
        std::thread::sleep(Duration::from_secs(to_hour_end + 1));
    }
    let redis = Redis::start().unwrap();
    let service = Service::start(&redis.url()).unwrap();
    const REQUESTS: usize = 20;
    const FALLBACK: usize = 5;
    const PROXIES: usize = 2;
    let rules = json!([{
        "name": "hourly",
        "key": ["const:all"],
        "consistency": "cached",
        "limits": [{"requests": REQUESTS, "per": "hour", "algorithm": "fixed_window"}],
        "fallback": {"policy": "fail_open", "limits": [{"requests": FALLBACK, "per": "hour", "algorithm": "fixed_window"}]},
    }]);
    let nginx = start_nginx(config(address(&service), service.token(), rules.clone()), 2);
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::SluiceService,
        plugin_config_json: config(Names::Cluster("sluice_service"), service.token(), rules),
        concurrency: 2,
        placeholders: vec![(
            "SERVICE_PORT".to_owned(),
            service
                .address()
                .expect("the service listens")
                .port()
                .to_string(),
        )],
    })
    .unwrap();

    let loads: Vec<Load> = [nginx.url("/api/x"), envoy.url("/api/x")]
        .into_iter()
        .map(|url| Load {
            max_requests: 2_000,
            pause: Duration::from_millis(5),
            ..Load::new(url, 2, Duration::from_secs(2))
        })
        .collect();
    let runs: Vec<Sustained> = std::thread::scope(|scope| {
        let threads: Vec<_> = loads
            .iter()
            .map(|load| scope.spawn(move || sustain(load)))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (run, what) in runs.iter().zip(["nginx", "envoy"]) {
        assert_only_200_and_429(run, what);
    }
    let admitted: usize = runs.iter().map(|r| r.count(200)).sum();
    let per_host: Vec<_> = runs.iter().map(|r| r.statuses()).collect();
    let most = REQUESTS + PROXIES * FALLBACK;
    let least = REQUESTS - 2;
    assert!(
        (least..=most).contains(&admitted),
        "admitted {admitted} across nginx and Envoy; expected {least}..={most}; statuses (nginx, envoy): \
         {per_host:?}\nnginx errors: {:?}\nservice log:\n{}",
        nginx.errors(),
        service.log()
    );
    assert!(
        runs.iter().all(|r| r.count(200) > 0),
        "each host admitted some: {per_host:?}"
    );
    assert!(
        envoy.stat("wasmcustom.sluice.sync.ok") > 0,
        "Envoy never synced; {:?}",
        envoy.sluice_stats()
    );
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A rule decided by a check on the service, strict or an asked fail-closed cached key: the filter
/// pauses each request until the check answers.
fn checked_rules() -> Value {
    json!([
        {
            "name": "strict",
            "key": ["header:x-api-key"],
            "consistency": "strict",
            "limits": [{"requests": 5, "per": "minute"}],
            "fallback": {"policy": "fail_closed"},
        },
        {
            "name": "asked",
            "key": ["header:x-tenant"],
            "consistency": "cached",
            "limits": [{"requests": 5, "per": "minute", "algorithm": "fixed_window"}],
            "fallback": {"policy": "fail_closed"},
        },
    ])
}

/// The statuses of `n` requests on one keep-alive connection, a transport error by its text.
fn on_one_connection(nginx: &Nginx, n: usize, headers: &[(&str, &str)]) -> Vec<String> {
    let client = agent();
    (0..n)
        .map(|_| match get(&client, &nginx.url("/api/x"), headers) {
            Ok(reply) => reply.status.to_string(),
            Err(error) => format!("{error:#}"),
        })
        .collect()
}

/// A strict check, and an asked fail-closed cached key, pause the request until the service answers.
/// ngx_wasm_module holds such a request only when the filter's request hook runs in nginx's access
/// phase (`proxy_wasm_request_headers_in_access on;`, as `nginx/nginx.conf` and the fixture set it). Then
/// every request of one keep-alive connection waits for its check: 5 admitted, the rest denied, no
/// error, no worker lost. (With the hook in the rewrite phase, ngx_wasm_module 0.6.0 lets the second
/// request of a connection go upstream before its check answers, when nginx runs the request's phases
/// again on a write event, and workers then die of SIGSEGV; `headers_in_access: false` shows it.)
#[test]
fn checked_rules_hold_every_request_of_a_keep_alive_connection() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let service = Service::start_with(ServiceOptions::new(redis.url())).unwrap();
    let nginx = start_nginx(
        config(address(&service), service.token(), checked_rules()),
        2,
    );

    let expected = ["200", "200", "200", "200", "200", "429", "429", "429"];
    let strict = on_one_connection(&nginx, 8, &[("x-api-key", "alice")]);
    assert_eq!(
        strict,
        expected,
        "strict; nginx errors: {:?}",
        nginx.errors()
    );
    let asked = on_one_connection(&nginx, 8, &[("x-tenant", "acme")]);
    assert_eq!(
        asked,
        expected,
        "cached, fail-closed; nginx errors: {:?}",
        nginx.errors()
    );

    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
    let log = nginx.log();
    assert!(!log.contains("exited on signal"), "a worker died:\n{log}");
}

/// Shedding beside a rule synced with the service: each wants the filter's tick, and ngx_wasm_module
/// traps a second `proxy_set_tick_period` (every worker then fails `on_configure`). The filter sets one
/// period: nginx starts, the bulkhead gives its slots back and the rule is decided by the service.
#[test]
fn shedding_beside_a_synced_rule_starts() {
    let _machine = machine();
    let redis = Redis::start().unwrap();
    let service = Service::start_with(ServiceOptions::new(redis.url())).unwrap();
    let mut plugin_config: Value = serde_json::from_str(&config(
        address(&service),
        service.token(),
        json!([{
            "name": "strict",
            "key": ["header:x-api-key"],
            "consistency": "strict",
            "limits": [{"requests": 5, "per": "minute"}],
            "fallback": {"policy": "fail_closed"},
        }]),
    ))
    .unwrap();
    plugin_config["shedding"] = json!({
        "mode": "enforce",
        "bulkheads": [{"name": "api", "match": {"path_prefix": "/api/"}, "limit": {"static": 2}}],
    });
    let nginx = start_nginx(plugin_config.to_string(), 2);
    let url = nginx.url("/api/x");
    let statuses: Vec<u16> = (0..8)
        .map(|_| {
            get(&agent(), &url, &[("x-api-key", "alice")])
                .unwrap()
                .status
        })
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "one at a time under a bulkhead of 2, 5 a minute from the service; nginx errors: {:?}",
        nginx.errors()
    );
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}
