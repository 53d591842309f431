//! sluice's security properties in a real Envoy (the pinned wheel, V8), with the configurations as shipped:
//!
//! - `client_address`: a client cannot pick its own address. With the shipped configurations (the edge's
//!   `use_remote_address: true`, `xff_num_trusted_hops: 0`, sluice's `trusted_hops: 0`), forged `X-Forwarded-For`,
//!   `X-Real-IP` and `Forwarded` headers neither get a fresh bucket nor pass `bypass.cidrs`; behind a load balancer,
//!   both documented settings use the entry the load balancer appended, never a forged one to its left.
//! - `paths`: every spelling of a path (`//api/x`, `/./api/x`, `/x/../api/x`, `/%61pi/x`, `/api//x`, `/%2e/api/x`)
//!   is counted as the path it names, with Envoy's normalization and without it; `bypass.paths` stays exact.
//! - `sync_batches`: one over-long key, or a flood of long keys queued while the service was down, does not stop a
//!   proxy from syncing.
//! - `memory`: unique keys while the counter service is unreachable do not grow the proxy without bound.
//! - `eviction`: keys aimed at a victim's set of the key table do not give the victim a full bucket again.
//! - `login_recipe`: docs/recipes.md's login protection as shipped: failures without the session cookie lock out
//!   no other client, a session in its penalty is still denied when sent as `a=1, session=…`, and a burst of failed
//!   logins for one account on one HTTP/2 connection reaches the backend no more than the account's lease.
//!
//! Run with `make test` (it builds the filter and the service and sets `SLUICE_ENVOY`, `SLUICE_WASM` and
//! `SLUICE_REDIS_SERVER`). Every load here is bounded in count and in time, on loopback only.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::envoy::{
    agent, free_ports, get, raw_get, repo_root, streams, wasm_path, Demo, DerivedTemplate, Envoy,
    EnvoyOptions, Reply, Template,
};
use sluice_tests::eventually;
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

const BYPASSED: &str = "wasmcustom.sluice.bypassed";
const SYNC_OK: &str = "wasmcustom.sluice.sync.ok";
const SYNC_FAILED: &str = "wasmcustom.sluice.sync.failed";
const BREAKER_OPEN: &str = "wasmcustom.sluice.breaker.open";

/// A loopback port nothing listens on (a counter service that is not there: connections are refused).
fn closed_port() -> u16 {
    free_ports(1).unwrap()[0]
}

/// The last `n` lines of a log, for assert messages.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Starts `template` with sluice's configuration `plugin_config_json`, two workers, the `.wasm` under test and
/// `extra` placeholders.
fn start(template: Template, plugin_config_json: String, extra: &[(&str, String)]) -> Envoy {
    let mut placeholders = vec![(
        "WASM".to_owned(),
        wasm_path().unwrap().display().to_string(),
    )];
    placeholders.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    Envoy::start(EnvoyOptions {
        template,
        plugin_config_json,
        concurrency: 2,
        placeholders,
    })
    .unwrap()
}

/// sluice's configuration of the address and path tests: 3 requests a minute per client address on `/api/`,
/// `/healthz` and `10.0.0.0/8` bypassed, the client address `trusted_hops` entries from the right of
/// `X-Forwarded-For` (0: Envoy's `source.address`).
fn per_ip_config(trusted_hops: u32) -> String {
    json!({
        "headers": "both",
        "bypass": {"paths": ["/healthz"], "cidrs": ["10.0.0.0/8"]},
        "client_ip": {"trusted_hops": trusted_hops},
        "rules": [{
            "name": "per-ip",
            "match": {"path_prefix": "/api/"},
            "key": ["client_ip"],
            "limits": [{"requests": 3, "per": "minute", "burst": 3}],
        }],
    })
    .to_string()
}

/// What a run of requests got back.
#[derive(Debug, Default)]
struct Sent {
    statuses: BTreeMap<u16, usize>,
    errors: usize,
    elapsed: Duration,
}

impl Sent {
    fn answered(&self) -> usize {
        self.statuses.values().sum()
    }
}

/// Sends up to `count` GETs of `url`, each with its own value of `header` (`value_len` bytes, unique per request
/// and per `prefix`), over `connections` keep-alive connections, for at most `within`.
fn send_unique(
    url: &str,
    header: &str,
    prefix: &str,
    count: usize,
    value_len: usize,
    connections: usize,
    within: Duration,
) -> Sent {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let deadline = started + within;
    let per_thread: Vec<(BTreeMap<u16, usize>, usize)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..connections)
            .map(|_| {
                scope.spawn(|| {
                    let mut client = agent();
                    let mut statuses = BTreeMap::new();
                    let mut errors = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count || Instant::now() > deadline {
                            break;
                        }
                        let mut value = format!("{prefix}-{i:08}-");
                        let fill = value_len.saturating_sub(value.len());
                        value.extend(std::iter::repeat_n('v', fill));
                        match get(&client, url, &[(header, &value)]) {
                            Ok(reply) => *statuses.entry(reply.status).or_insert(0) += 1,
                            Err(_) => {
                                errors += 1;
                                client = agent();
                            }
                        }
                    }
                    (statuses, errors)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a load thread panicked"))
            .collect()
    });
    let mut sent = Sent {
        elapsed: started.elapsed(),
        ..Sent::default()
    };
    for (statuses, errors) in per_thread {
        sent.errors += errors;
        for (status, n) in statuses {
            *sent.statuses.entry(status).or_insert(0) += n;
        }
    }
    sent
}

mod client_address {
    use super::*;

    /// Headers a client may send to pass for another address, the `n`-th variant of each.
    fn forgeries(n: u32) -> Vec<Vec<(&'static str, String)>> {
        vec![
            vec![("X-Forwarded-For", format!("198.18.0.{n}"))],
            vec![("X-Forwarded-For", format!("198.18.1.{n}, 198.18.2.{n}"))],
            vec![("X-Real-IP", format!("198.18.3.{n}"))],
            vec![("Forwarded", format!("for=198.18.4.{n}"))],
            vec![("Forwarded", format!("for=\"[2001:db8::{n}]\";proto=http"))],
            vec![
                ("X-Forwarded-For", format!("198.18.5.{n}")),
                ("X-Real-IP", format!("198.18.6.{n}")),
                ("Forwarded", format!("for=198.18.7.{n}")),
            ],
        ]
    }

    /// The same, claiming an address of `bypass.cidrs` (`10.0.0.0/8`).
    fn bypass_forgeries(n: u32) -> Vec<Vec<(&'static str, String)>> {
        vec![
            vec![("X-Forwarded-For", format!("10.9.9.{n}"))],
            vec![("X-Forwarded-For", format!("198.18.0.{n}, 10.9.9.{n}"))],
            vec![("X-Real-IP", format!("10.9.9.{n}"))],
            vec![("Forwarded", format!("for=10.9.9.{n}"))],
        ]
    }

    /// The client (127.0.0.1) spends its `limit` on `path`; then every request with forged client headers (and,
    /// with `cidrs`, every one claiming an address of `10.0.0.0/8`) must be denied, and none bypassed.
    fn assert_the_client_cannot_pick_its_address(
        envoy: &Envoy,
        path: &str,
        limit: usize,
        cidrs: bool,
        what: &str,
    ) {
        let client = agent();
        let url = envoy.url(path);
        let spent: Vec<u16> = (0..limit)
            .map(|_| get(&client, &url, &[]).unwrap().status)
            .collect();
        assert!(
            spent.iter().all(|s| *s == 200),
            "{what}: the client's first {limit} requests on {path}: {spent:?}"
        );
        let next = get(&client, &url, &[]).unwrap();
        assert_eq!(next.status, 429, "{what}: the limit is spent: {next:?}");

        let bypassed_before = envoy.stat_settled(BYPASSED);
        let mut tried = 0;
        let mut not_denied = Vec::new();
        for n in 1..=5 {
            let mut sets = forgeries(n);
            if cidrs {
                sets.extend(bypass_forgeries(n));
            }
            for headers in sets {
                let headers: Vec<(&str, &str)> =
                    headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let reply = get(&client, &url, &headers).unwrap();
                tried += 1;
                if reply.status != 429 {
                    not_denied.push((format!("{headers:?}"), reply.status));
                }
            }
        }
        let bypassed = envoy.stat_settled(BYPASSED) - bypassed_before;
        assert!(
            not_denied.is_empty() && bypassed == 0,
            "{what}: once 127.0.0.1 had spent its {limit} on {path}, {} of {tried} requests with forged client \
             headers were not denied and {bypassed} were bypassed; the client picked its own address (the edge \
             must set use_remote_address: true, xff_num_trusted_hops: 0):\n{not_denied:#?}\nsluice's stats: {:?}",
            not_denied.len(),
            envoy.sluice_stats()
        );
    }

    #[test]
    fn the_demo_as_shipped_keys_on_the_peer_not_on_headers() {
        let demo = Demo::shipped().unwrap();
        let options = demo
            .options(demo.plugin_config_json.clone(), 2, closed_port())
            .unwrap();
        let envoy = Envoy::start(options).unwrap();
        assert_the_client_cannot_pick_its_address(
            &envoy,
            "/api/hello",
            5,
            false,
            "envoy/demo.yaml",
        );
    }

    #[test]
    fn the_demo_with_bypass_cidrs_is_not_bypassed_by_a_forged_address() {
        let demo = Demo::shipped().unwrap();
        let mut config: Value = serde_json::from_str(&demo.plugin_config_json).unwrap();
        config["bypass"]["cidrs"] = json!(["10.0.0.0/8"]);
        let options = demo.options(config.to_string(), 2, closed_port()).unwrap();
        let envoy = Envoy::start(options).unwrap();
        assert_the_client_cannot_pick_its_address(
            &envoy,
            "/api/hello",
            5,
            true,
            "envoy/demo.yaml with bypass.cidrs [10.0.0.0/8]",
        );
    }

    #[test]
    fn sluice_yaml_tmpl_keys_on_the_peer_not_on_headers() {
        let envoy = start(Template::Sluice, per_ip_config(0), &[]);
        assert_the_client_cannot_pick_its_address(
            &envoy,
            "/api/x",
            3,
            true,
            "envoy/sluice.yaml.tmpl",
        );
    }

    #[test]
    fn sluice_service_yaml_tmpl_keys_on_the_peer_not_on_headers() {
        let envoy = start(
            Template::SluiceService,
            per_ip_config(0),
            &[("SERVICE_PORT", closed_port().to_string())],
        );
        assert_the_client_cannot_pick_its_address(
            &envoy,
            "/api/x",
            3,
            true,
            "envoy/sluice-service.yaml.tmpl",
        );
    }

    #[test]
    fn sluice_service_bench_yaml_tmpl_keys_on_the_peer_not_on_headers() {
        let template = Template::File(repo_root().join("envoy/sluice-service-bench.yaml.tmpl"));
        let envoy = start(
            template,
            per_ip_config(0),
            &[("SERVICE_PORT", closed_port().to_string())],
        );
        assert_the_client_cannot_pick_its_address(
            &envoy,
            "/api/x",
            3,
            true,
            "envoy/sluice-service-bench.yaml.tmpl",
        );
    }

    /// The settings every edge listener of every shipped configuration must carry (the Envoy-only baselines of
    /// the benchmark too, so that they are compared on equal terms).
    #[test]
    fn every_shipped_edge_listener_takes_the_address_from_the_connection_and_normalizes_paths() {
        let required = [
            "use_remote_address: true",
            "xff_num_trusted_hops: 0",
            "normalize_path: true",
            "merge_slashes: true",
            "path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT",
        ];
        let dir = repo_root().join("envoy");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                name.ends_with(".yaml") || name.ends_with(".yaml.tmpl")
            })
            .collect();
        files.sort();
        assert!(files.len() >= 6, "shipped configurations: {files:?}");
        let mut missing = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).unwrap();
            if !text.contains("static_resources:") && !text.contains("resources:") {
                // Not an Envoy configuration (envoy/ratelimit-descriptors.yaml is the rate limit
                // service's).
                continue;
            }
            if text.contains("lds_config:") && !text.contains("stat_prefix: edge") {
                // A bootstrap whose listeners come from a file of their own (envoy/reload.yaml.tmpl
                // and its reload-lds.yaml.tmpl, which this loop checks as it checks the others).
                continue;
            }
            let edge = text
                .find("stat_prefix: edge")
                .unwrap_or_else(|| panic!("{}: no edge listener", file.display()));
            let end = edge
                + text[edge..]
                    .find("route_config:")
                    .unwrap_or_else(|| panic!("{}: no route_config", file.display()));
            let settings: Vec<&str> = text[edge..end].lines().map(str::trim).collect();
            for setting in required {
                if !settings.contains(&setting) {
                    missing.push(format!("{}: {setting}", file.display()));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "edge listeners without the settings that make the client address and the path trustworthy:\n{}",
            missing.join("\n")
        );
    }

    /// Envoy behind one trusted load balancer. The test client plays it: it connects from 127.0.0.1 and writes
    /// `X-Forwarded-For` as a load balancer that appends its peer would (`<what the client sent>, <client>`).
    fn assert_the_load_balancers_entry_is_used(envoy: &Envoy, what: &str) {
        let client = agent();
        let url = envoy.url("/api/x");
        let send = |xff: &str| get(&client, &url, &[("X-Forwarded-For", xff)]).unwrap();

        // 203.0.113.7 spends its 3, each time with another forged entry on the left: one bucket.
        let statuses: Vec<u16> = (1..=5)
            .map(|n| send(&format!("198.18.0.{n}, 203.0.113.7")).status)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 200, 429, 429],
            "{what}: the client is the entry the load balancer appended (203.0.113.7), whatever it sent before \
             it; sluice's stats: {:?}",
            envoy.sluice_stats()
        );
        // A load balancer that adds its own header line instead of appending to the client's: one list.
        let two_lines = raw_get(
            envoy.listen_port,
            "/api/x",
            &[
                ("X-Forwarded-For", "198.18.0.9"),
                ("X-Forwarded-For", "203.0.113.7"),
            ],
        )
        .unwrap();
        assert_eq!(
            two_lines.status, 429,
            "{what}: X-Forwarded-For in two lines, the load balancer's (203.0.113.7) last: {two_lines:?}"
        );
        // Another client behind the same load balancer, claiming the spent address on the left: its own bucket.
        let other = send("203.0.113.7, 203.0.113.8");
        assert_eq!(
            other.status, 200,
            "{what}: 203.0.113.8 (appended by the load balancer) has its own bucket: {other:?}"
        );

        let bypassed = envoy.stat_settled(BYPASSED);
        let forged = send("10.9.9.9, 203.0.113.7");
        assert_eq!(
            forged.status, 429,
            "{what}: a forged 10.9.9.9 left of the load balancer's entry must not pass bypass.cidrs: {forged:?}"
        );
        let trusted = send("203.0.113.7, 10.9.9.9");
        assert!(
            trusted.status == 200 && !trusted.has_rate_limit_headers(),
            "{what}: the load balancer says the client is 10.9.9.9, in bypass.cidrs: {trusted:?}"
        );
        assert_eq!(
            envoy.stat_settled(BYPASSED),
            bypassed + 1,
            "{what}: one bypassed, the load balancer's 10.9.9.9 (not the forged one): {:?}",
            envoy.sluice_stats()
        );
    }

    /// The README's first setting behind N load balancers: Envoy resolves the address (`use_remote_address:
    /// true`, `xff_num_trusted_hops: N`), its `source.address` is the client, sluice's `trusted_hops` stays 0.
    #[test]
    fn behind_one_load_balancer_envoy_resolves_the_address_with_xff_num_trusted_hops() {
        let template = DerivedTemplate::edited(
            &Template::Sluice,
            &[("xff_num_trusted_hops: 0", "xff_num_trusted_hops: 1")],
        )
        .unwrap();
        let envoy = start(template.template(), per_ip_config(0), &[]);
        assert_the_load_balancers_entry_is_used(
            &envoy,
            "use_remote_address: true, xff_num_trusted_hops: 1, trusted_hops: 0",
        );
    }

    /// The README's second setting behind N load balancers: Envoy as shipped appends the load balancer's address,
    /// so the client is the (N+1)-th entry from the right: sluice's `trusted_hops: N + 1`.
    #[test]
    fn behind_one_load_balancer_sluice_reads_the_second_entry_from_the_right() {
        let envoy = start(Template::Sluice, per_ip_config(2), &[]);
        assert_the_load_balancers_entry_is_used(
            &envoy,
            "use_remote_address: true, xff_num_trusted_hops: 0, trusted_hops: 2",
        );
    }
}

mod paths {
    use super::*;

    /// Spellings of `/api/x` that name the same resource once normalized (RFC 3986 dot segments and percent-decoding
    /// of unreserved characters, `//` merged).
    const SPELLINGS: [&str; 6] = [
        "//api/x",
        "/./api/x",
        "/x/../api/x",
        "/%61pi/x",
        "/api//x",
        "/%2e/api/x",
    ];

    /// `sluice.yaml.tmpl` with Envoy's path normalization off: the filter sees each path as the client wrote it.
    fn unnormalized() -> DerivedTemplate {
        DerivedTemplate::edited(
            &Template::Sluice,
            &[
                ("normalize_path: true", "normalize_path: false"),
                ("merge_slashes: true", "merge_slashes: false"),
                (
                    "path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT",
                    "path_with_escaped_slashes_action: KEEP_UNCHANGED",
                ),
            ],
        )
        .unwrap()
    }

    /// The client spends its 3 on `/api/x` (sent byte for byte), and the next one is denied.
    fn spend(envoy: &Envoy, what: &str) {
        let statuses: Vec<u16> = (0..4)
            .map(|_| raw_get(envoy.listen_port, "/api/x", &[]).unwrap().status)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 200, 429],
            "{what}: 3 a minute on /api/x"
        );
    }

    fn assert_every_spelling_is_counted(envoy: &Envoy, what: &str) {
        spend(envoy, what);
        let not_denied: Vec<(&str, u16)> = SPELLINGS
            .iter()
            .map(|path| (*path, raw_get(envoy.listen_port, path, &[]).unwrap().status))
            .filter(|(_, status)| *status != 429)
            .collect();
        assert!(
            not_denied.is_empty(),
            "{what}: once the client had spent its 3 on /api/x, these spellings of /api/x were not denied: \
             {not_denied:?} (path, status); a rule must match the path the request names, not its spelling; \
             sluice's stats: {:?}",
            envoy.sluice_stats()
        );
    }

    /// `/healthz` is bypassed exactly: with a query, yes; a path that only starts with it, or names another
    /// resource through it, no. `envoy_merges_slashes`: Envoy itself turns `//healthz` into `/healthz` (then the
    /// upstream gets `/healthz` and bypassing it is right), so it is only checked when Envoy does not.
    fn assert_bypass_is_exact(envoy: &Envoy, envoy_merges_slashes: bool, what: &str) {
        spend(envoy, what);
        let mut problems = Vec::new();
        let mut not_bypassed = vec!["/healthz/../api/x", "/healthz%2f..%2fapi/x"];
        if !envoy_merges_slashes {
            not_bypassed.push("//healthz");
        }
        // sluice counts bypassed requests into Envoy's stats on its tick: read once settled, before
        // and after all of them (only /healthz?x, the last, is bypassed).
        let before = envoy.stat_settled(BYPASSED);
        let mut statuses = Vec::new();
        for path in not_bypassed {
            let reply = raw_get(envoy.listen_port, path, &[]).unwrap();
            statuses.push((path, reply.status));
            if path == "/healthz/../api/x" && reply.status != 429 {
                problems.push(format!(
                    "{path}: status {}, expected 429: it names /api/x, whose limit is spent",
                    reply.status
                ));
            }
        }
        let reply: Reply = raw_get(envoy.listen_port, "/healthz?x", &[]).unwrap();
        let bypassed = envoy.stat_settled(BYPASSED) - before;
        if reply.status != 200 || bypassed != 1 {
            problems.push(format!(
                "/healthz?x: status {}; {bypassed} request(s) bypassed, expected 1 (the query is ignored, it is \
                 /healthz; none of the others is: {statuses:?})",
                reply.status,
            ));
        }
        assert!(
            problems.is_empty(),
            "{what}: bypass.paths [\"/healthz\"] must match exactly:\n{}\nsluice's stats: {:?}",
            problems.join("\n"),
            envoy.sluice_stats()
        );
    }

    #[test]
    fn without_envoy_normalization_every_spelling_of_a_path_is_counted() {
        let template = unnormalized();
        let envoy = start(template.template(), per_ip_config(0), &[]);
        assert_every_spelling_is_counted(
            &envoy,
            "sluice.yaml.tmpl without Envoy's path normalization",
        );
    }

    #[test]
    fn with_the_shipped_normalization_every_spelling_of_a_path_is_counted() {
        let envoy = start(Template::Sluice, per_ip_config(0), &[]);
        assert_every_spelling_is_counted(&envoy, "envoy/sluice.yaml.tmpl");
    }

    #[test]
    fn without_envoy_normalization_bypass_paths_match_exactly() {
        let template = unnormalized();
        let envoy = start(template.template(), per_ip_config(0), &[]);
        assert_bypass_is_exact(
            &envoy,
            false,
            "sluice.yaml.tmpl without Envoy's path normalization",
        );
    }

    #[test]
    fn with_the_shipped_normalization_bypass_paths_match_exactly() {
        let envoy = start(Template::Sluice, per_ip_config(0), &[]);
        assert_bypass_is_exact(&envoy, true, "envoy/sluice.yaml.tmpl");
    }
}

mod sync_batches {
    use super::*;

    /// A cached rule, 10 a minute per `x-api-key`, synced every 100 ms; the breaker opens after 3 failures and
    /// probes after 1 s (±50%).
    fn config(token: &str, fallback: Value) -> String {
        json!({
            "headers": "both",
            "service": {
                "cluster": "sluice_service",
                "authority": "sluice_service",
                "token": token,
                "timeout_ms": 200,
                "sync_interval_ms": 100,
                "breaker_failures": 3,
                "breaker_cooldown_ms": 1000,
            },
            "rules": [{
                "name": "per-key",
                "key": ["header:x-api-key"],
                "consistency": "cached",
                "limits": [{"requests": 10, "per": "minute", "burst": 10}],
                "fallback": fallback,
            }],
        })
        .to_string()
    }

    fn start_proxy(service: &Service, plugin_config_json: String) -> Envoy {
        let port = service.address().expect("the service listens").port();
        start(
            Template::SluiceService,
            plugin_config_json,
            &[("SERVICE_PORT", port.to_string())],
        )
    }

    /// The service refuses keys over 512 bytes: one such key must not fail every batch it is in. With
    /// `fail_closed`, only leases admit, so what a normal key gets admitted shows the proxy is still syncing, and a
    /// second proxy sharing the limit must see what the first spent.
    #[test]
    fn a_600_byte_key_does_not_stop_the_sync() {
        let redis = Redis::start().unwrap();
        let service = Service::start(&redis.url()).unwrap();
        let plugin = config(service.token(), json!({"policy": "fail_closed"}));
        let a = start_proxy(&service, plugin.clone());
        let b = start_proxy(&service, plugin);
        let client = agent();
        let started = Instant::now();

        let long_key = format!("long-{}", "k".repeat(595));
        assert_eq!(long_key.len(), 600);
        let long = get(&client, &a.url("/api/x"), &[("x-api-key", &long_key)]).unwrap();
        // fail_closed: admitted from a lease, denied by it, or 503 before its first lease.
        assert!(
            [200, 429, 503].contains(&long.status),
            "the request with a 600-byte key: {long:?}"
        );

        // A normal key on proxy A: the first request is denied (no lease yet, fail_closed), then leases admit.
        let (mut admitted_a, mut sent_a, mut breaker_seen) = (0, 0, 0);
        while admitted_a < 10 && started.elapsed() < Duration::from_secs(3) {
            let reply = get(&client, &a.url("/api/x"), &[("x-api-key", "alice")]).unwrap();
            sent_a += 1;
            admitted_a += usize::from(reply.status == 200);
            if sent_a % 10 == 0 {
                breaker_seen = breaker_seen.max(a.stat(BREAKER_OPEN));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Proxy B: its first request starts its sync; once synced, it knows what A spent.
        let mut admitted_b = usize::from(
            get(&client, &b.url("/api/x"), &[("x-api-key", "alice")])
                .unwrap()
                .status
                == 200,
        );
        let b_synced = eventually(Duration::from_secs(2), || b.stat(SYNC_OK) > 0);
        for _ in 0..10 {
            let reply = get(&client, &b.url("/api/x"), &[("x-api-key", "alice")]).unwrap();
            admitted_b += usize::from(reply.status == 200);
            std::thread::sleep(Duration::from_millis(20));
        }
        let elapsed = started.elapsed();
        breaker_seen = breaker_seen.max(a.stat(BREAKER_OPEN));
        let stats_a = a.sluice_stats();
        let service_log = tail(&service.log(), 10);
        eprintln!(
            "600-byte key: alice admitted {admitted_a} of {sent_a} on A, {admitted_b} of 11 on B in {elapsed:?}; \
             A: sync.ok {}, sync.failed {}, breaker seen {breaker_seen}",
            a.stat(SYNC_OK),
            a.stat(SYNC_FAILED)
        );

        assert_eq!(
            a.stat(SYNC_FAILED),
            0,
            "proxy A's syncs failed after one request with a 600-byte x-api-key (the service refuses keys over \
             512 bytes, and the key went back into every batch); A's stats: {stats_a:?}\nservice log:\n{service_log}"
        );
        assert!(a.stat(SYNC_OK) > 0, "A never synced; {stats_a:?}");
        assert_eq!(
            breaker_seen, 0,
            "A's breaker opened; {stats_a:?}\nservice log:\n{service_log}"
        );
        assert!(
            admitted_a >= 8,
            "alice got {admitted_a} of {sent_a} admitted on A in 3 s; with fail_closed only leases admit, so A got \
             (almost) no lease; {stats_a:?}"
        );
        assert!(b_synced, "B never synced; {:?}", b.sluice_stats());
        let refill = (elapsed.as_secs_f64() * 10.0 / 60.0).floor() as usize;
        assert!(
            admitted_a + admitted_b <= 10 + refill + 1,
            "A admitted {admitted_a} and B {admitted_b} of alice in {elapsed:?}: more than the shared 10 (+{refill} \
             refilled, +1); B did not see what A spent; B: {:?}",
            b.sluice_stats()
        );
    }

    /// 2,500 keys of about 500 bytes (each one valid) queued while the service is down: some 1.5 MB of entries,
    /// more than the service accepts in one body. Once it is back, the proxy must sync again within a few seconds.
    #[test]
    fn a_flood_of_long_keys_while_the_service_is_down_does_not_stop_the_sync_after() {
        let redis = Redis::start().unwrap();
        let mut service = Service::start(&redis.url()).unwrap();
        let envoy = start_proxy(
            &service,
            config(service.token(), json!({"policy": "fail_open"})),
        );
        let client = agent();
        let url = envoy.url("/api/x");
        let normal = |client: &ureq::Agent| {
            let reply = get(client, &url, &[("x-api-key", "alice")]).unwrap();
            assert!(reply.status == 200 || reply.status == 429, "{reply:?}");
        };
        normal(&client);
        assert!(
            eventually(Duration::from_secs(5), || envoy.stat(SYNC_OK) > 0),
            "no sync before the service went down; {:?}",
            envoy.sluice_stats()
        );

        service.kill();
        let flood = send_unique(
            &url,
            "x-api-key",
            "flood",
            2_500,
            497,
            4,
            Duration::from_secs(20),
        );
        assert_eq!(
            (flood.answered(), flood.errors),
            (2_500, 0),
            "the flood: {flood:?}"
        );
        let noticed = eventually(Duration::from_secs(5), || envoy.stat(BREAKER_OPEN) == 1);
        assert!(
            noticed,
            "the breaker did not open with the service down; {:?}",
            envoy.sluice_stats()
        );

        let ok_before = envoy.stat(SYNC_OK);
        let failed_before = envoy.stat(SYNC_FAILED);
        service.restart().unwrap();
        let back = Instant::now();
        let mut recovered = None;
        while back.elapsed() < Duration::from_secs(5) {
            if envoy.stat(SYNC_OK) > ok_before {
                recovered = Some(back.elapsed());
                break;
            }
            normal(&client);
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "flood of 2,500 497-byte keys in {:?} ({:?}); after the service came back: sync.ok {ok_before} -> {}, \
             sync.failed {failed_before} -> {}, recovered after {recovered:?}",
            flood.elapsed,
            flood.statuses,
            envoy.stat(SYNC_OK),
            envoy.stat(SYNC_FAILED)
        );
        assert!(
            recovered.is_some(),
            "sync.ok stayed at {ok_before} for 5 s after the service came back (2,500 keys of ~500 bytes were queued \
             while it was down; sync.failed {failed_before} -> {}); {:?}\nservice log:\n{}",
            envoy.stat(SYNC_FAILED),
            envoy.sluice_stats(),
            tail(&service.log(), 10)
        );
    }
}

mod memory {
    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    /// A cached rule keyed on a 2 KB header, 1024 keys at most, and a counter service that is not there: 20,000
    /// unique keys must not grow Envoy by more than 16 MiB (keeping each key's announcement until a sync that never
    /// comes would take about 2 KB per key, some 40 MB). The breaker, open after the first failures, waits 10 s
    /// (±50%) before a probe: no sync round runs during the load, as with any service that stays away.
    #[test]
    fn unique_keys_while_the_service_is_unreachable_keep_memory_bounded() {
        let config = json!({
            "max_keys": 1024,
            "service": {
                "cluster": "sluice_service",
                "token": "nobody-answers",
                "timeout_ms": 200,
                "sync_interval_ms": 100,
                "breaker_failures": 3,
                "breaker_cooldown_ms": 10_000,
            },
            "rules": [{
                "name": "per-user",
                "key": ["header:x-user"],
                "consistency": "cached",
                "limits": [{"requests": 100, "per": "minute"}],
                "fallback": {"policy": "fail_open"},
            }],
        })
        .to_string();
        let envoy = start(
            Template::SluiceService,
            config,
            &[("SERVICE_PORT", closed_port().to_string())],
        );
        let url = envoy.url("/api/x");
        let limit = Duration::from_secs(30);

        // Warm up: the key table fills (1024 records), allocator caches and Envoy's buffers settle.
        let warm = send_unique(&url, "x-user", "warm", 2_000, 2048, 4, limit);
        assert_eq!(warm.answered(), 2_000, "warm-up: {warm:?}");
        std::thread::sleep(Duration::from_millis(500));
        let (heap_before, rss_before) =
            (envoy.allocated_bytes().unwrap(), envoy.rss_bytes().unwrap());

        let run = send_unique(&url, "x-user", "load", 20_000, 2048, 4, limit);
        std::thread::sleep(Duration::from_secs(1));
        let (heap_after, rss_after) =
            (envoy.allocated_bytes().unwrap(), envoy.rss_bytes().unwrap());
        let heap_growth = heap_after.saturating_sub(heap_before);
        let rss_growth = rss_after.saturating_sub(rss_before);
        eprintln!(
            "memory: {} unique 2 KB keys in {:?} ({:?}, {} errors); Envoy heap allocated {:.1} -> {:.1} MiB \
             (+{:.1}), RSS {:.1} -> {:.1} MiB (+{:.1})",
            run.answered(),
            run.elapsed,
            run.statuses,
            run.errors,
            heap_before as f64 / MIB,
            heap_after as f64 / MIB,
            heap_growth as f64 / MIB,
            rss_before as f64 / MIB,
            rss_after as f64 / MIB,
            rss_growth as f64 / MIB,
        );
        assert_eq!(run.answered(), 20_000, "the load: {run:?}");
        assert!(
            heap_growth < 16 << 20,
            "Envoy's heap grew by {:.1} MiB over 20,000 unique 2 KB keys with the counter service unreachable \
             (max_keys 1024): memory must stay bounded whatever the keys; {:?}",
            heap_growth as f64 / MIB,
            envoy.sluice_stats()
        );
    }
}

mod eviction {
    use super::*;

    /// FNV-1a, 64 bits, as anyone can compute it.
    fn fnv1a(bytes: &[u8]) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash
    }

    /// The set a key would take in a table of `sets` sets if its place were the public FNV-1a of `rule`, the key
    /// separator (U+001F) and `value`.
    fn public_set(rule: &str, value: &str, sets: u64) -> u64 {
        fnv1a(format!("{rule}\u{1f}{value}").as_bytes()).max(1) % sets
    }

    /// A local rule, 3 a minute per `x-user`, 64 keys (8 sets of 8). An attacker who can compute where keys go
    /// sends 8 junk keys of the victim's set before each of the victim's requests: the victim must not get a full
    /// bucket back each time (its place must not be predictable, and a key denied a moment ago must not come back
    /// fresh).
    #[test]
    fn junk_keys_aimed_at_a_victims_set_do_not_refill_its_bucket() {
        const RULE: &str = "per-user";
        const SETS: u64 = 64 / 8;
        let victim = "victim";
        let target = public_set(RULE, victim, SETS);
        let junk: Vec<String> = (0..)
            .map(|i| format!("junk-{i}"))
            .filter(|v| public_set(RULE, v, SETS) == target)
            .take(8)
            .collect();
        let config = json!({
            "headers": "both",
            "max_keys": 64,
            "rules": [{
                "name": RULE,
                "key": ["header:x-user"],
                "limits": [{"requests": 3, "per": "minute", "burst": 3}],
                "consistency": "local",
            }],
        })
        .to_string();
        let envoy = start(Template::Sluice, config, &[]);
        let client = agent();
        let url = envoy.url("/api/x");
        let send = |user: &str| get(&client, &url, &[("x-user", user)]).unwrap().status;

        let spent_from = Instant::now();
        let spent: Vec<u16> = (0..4).map(|_| send(victim)).collect();
        assert_eq!(spent, [200, 200, 200, 429], "the victim spends its 3");

        let mut victim_statuses = Vec::new();
        for _ in 0..20 {
            for value in &junk {
                let status = send(value);
                assert!(status == 200 || status == 429, "junk {value}: {status}");
            }
            victim_statuses.push(send(victim));
        }
        let elapsed = spent_from.elapsed();
        let admitted = victim_statuses.iter().filter(|s| **s == 200).count();
        // One token every 20 s since the bucket was full, plus one for bad luck.
        let refill = (elapsed.as_secs_f64() * 3.0 / 60.0).floor() as usize;
        let most = refill + 1;
        eprintln!(
            "eviction: victim (public set {target} of {SETS}) admitted {admitted} of 20 in {elapsed:?} \
             (at most {most}); junk {junk:?}"
        );
        assert!(
            admitted <= most,
            "the victim, out of tokens (3 a minute), was admitted {admitted} of 20 times in {elapsed:?} (at most \
             {most}: {refill} refilled + 1) while 8 junk keys of its public FNV-1a set (set {target} of {SETS}) came \
             before each request: the junk evicts its record and it comes back with a full bucket; statuses \
             {victim_statuses:?}; {:?}",
            envoy.sluice_stats()
        );
    }
}

/// Header values a client shapes to escape its bucket: a repeated key header whose first value
/// is junk (Envoy hands a filter only the first of a repeated header by name), and values that
/// are not UTF-8 (a lossy conversion would merge different ones into one bucket).
mod key_headers {
    use super::*;
    use sluice_tests::envoy::raw_get_bytes;

    fn per_key(requests: u64) -> String {
        json!({
            "rules": [{
                "name": "per-key",
                "key": ["header:x-api-key"],
                "limits": [{"requests": requests, "per": "minute", "burst": requests}],
            }],
        })
        .to_string()
    }

    #[test]
    fn a_junk_first_value_does_not_escape_an_exhausted_key() {
        let envoy = start(Template::Sluice, per_key(3), &[]);
        let port = envoy.listen_port;
        let send = |values: &[&[u8]]| {
            let headers: Vec<(&str, &[u8])> = values.iter().map(|v| ("x-api-key", *v)).collect();
            raw_get_bytes(port, "/api/x", &headers).unwrap().status
        };
        let spent: Vec<u16> = (0..4).map(|_| send(&[b"real"])).collect();
        assert_eq!(spent, [200, 200, 200, 429], "the real key spends its 3");
        let tricks: Vec<u16> = (0..5)
            .map(|i| send(&[format!("junk-{i}").as_bytes(), b"real"]))
            .collect();
        assert_eq!(
            tricks,
            [429; 5],
            "a junk first value in front of the exhausted real key; {:?}",
            envoy.sluice_stats()
        );
    }

    #[test]
    fn values_that_are_not_utf8_keep_their_own_buckets() {
        let envoy = start(Template::Sluice, per_key(1), &[]);
        let port = envoy.listen_port;
        let send = |value: &[u8]| {
            raw_get_bytes(port, "/api/x", &[("x-api-key", value)])
                .unwrap()
                .status
        };
        let first: Vec<u16> = [b"key-\xff", b"key-\xfe", b"key-\xfd"]
            .iter()
            .map(|v| send(*v))
            .collect();
        assert_eq!(
            first,
            [200, 200, 200],
            "three different values, three buckets of one; {:?}",
            envoy.sluice_stats()
        );
        assert_eq!(
            send(b"key-\xff"),
            429,
            "the same value again shares its bucket"
        );
    }
}

/// Requests an upstream reads as the same client, key or host, spelled so that a stricter parser would miss them:
/// `;` between query parameters (Rack), a name in another case (ASP.NET Core), a host with a trailing dot, an
/// `X-Forwarded-For` entry with a port (Azure Application Gateway). Every one is counted where it belongs.
mod parser_differences {
    use super::*;
    use sluice_tests::envoy::raw_get_to;

    /// The shipped `sluice.yaml.tmpl` with one rule of 3 a minute.
    fn one_rule(rule: Value) -> Envoy {
        start(
            Template::Sluice,
            json!({"headers": "both", "rules": [rule]}).to_string(),
            &[],
        )
    }

    fn status(envoy: &Envoy, target: &str, host: Option<&str>, headers: &[(&str, &str)]) -> u16 {
        let host = host
            .map(str::to_string)
            .unwrap_or_else(|| format!("127.0.0.1:{}", envoy.listen_port));
        let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        raw_get_to(envoy.listen_port, target, &host, &headers)
            .unwrap()
            .status
    }

    #[test]
    fn a_query_key_is_counted_however_its_parameter_is_spelled() {
        let envoy = one_rule(json!({
            "name": "per-key", "key": ["query:api_key"],
            "limits": [{"requests": 3, "per": "minute", "burst": 3}],
        }));
        let spent: Vec<u16> = (0..3)
            .map(|_| status(&envoy, "/api/x?api_key=abc", None, &[]))
            .collect();
        assert_eq!(spent, [200; 3], "api_key=abc spends its 3");
        for target in [
            "/api/x?x=1;api_key=abc",
            "/api/x?API_KEY=abc",
            "/api/x?Api_Key=abc&x=1",
            "/api/x?api%5Fkey=abc",
            "/api/x?x=1;API_KEY=abc;y=2",
            "/api/x?api_key=junk;api_key=abc",
        ] {
            assert_eq!(
                status(&envoy, target, None, &[]),
                429,
                "{target}: the same key as api_key=abc; {:?}",
                envoy.sluice_stats()
            );
        }
        assert_eq!(
            status(&envoy, "/api/x?api_key=other", None, &[]),
            200,
            "another key has its own bucket"
        );
        // No key at all, however often: one shared bucket of 3, never unlimited.
        let anonymous: Vec<u16> = (0..5)
            .map(|i| status(&envoy, &format!("/api/x?apikey{i}=abc"), None, &[]))
            .collect();
        assert_eq!(anonymous, [200, 200, 200, 429, 429], "{anonymous:?}");
    }

    #[test]
    fn a_host_with_a_trailing_dot_is_matched() {
        let envoy = one_rule(json!({
            "name": "api-host", "match": {"hosts": ["api.example.com"]}, "key": ["const:all"],
            "limits": [{"requests": 3, "per": "minute", "burst": 3}],
        }));
        assert_eq!(
            status(&envoy, "/api/x", Some("other.example.com"), &[]),
            200,
            "another host: not the rule's"
        );
        let spent: Vec<u16> = (0..3)
            .map(|_| status(&envoy, "/api/x", Some("api.example.com"), &[]))
            .collect();
        assert_eq!(spent, [200; 3]);
        for (target, host) in [
            ("/api/x", "api.example.com."),
            ("/api/x", "API.Example.com.:8080"),
            // Absolute form: Envoy takes the URI's host for :authority, whatever Host says.
            ("http://api.example.com./api/x", "other.example.com"),
            ("http://api.example.com/api/x", "other.example.com"),
        ] {
            assert_eq!(
                status(&envoy, target, Some(host), &[]),
                429,
                "{target} with Host {host}: the rule's host; {:?}",
                envoy.sluice_stats()
            );
        }
        assert_eq!(
            status(
                &envoy,
                "http://other.example.com./api/x",
                Some("api.example.com"),
                &[]
            ),
            200,
            "an absolute URI's host is the request's host"
        );
    }

    /// `sluice.yaml.tmpl` as shipped appends the peer: the test client plays a load balancer that wrote the
    /// client as `ip:port`, so the client is the second entry from the right (`trusted_hops: 2`).
    fn behind_a_load_balancer(key: &str) -> Envoy {
        start(
            Template::Sluice,
            json!({
                "client_ip": {"trusted_hops": 2},
                "rules": [{"name": "per-ip", "key": [key],
                           "limits": [{"requests": 3, "per": "minute", "burst": 3}]}],
            })
            .to_string(),
            &[],
        )
    }

    fn from(envoy: &Envoy, xff: &str) -> u16 {
        status(envoy, "/api/x", None, &[("X-Forwarded-For", xff)])
    }

    #[test]
    fn forwarded_entries_with_a_port_key_the_address() {
        let envoy = behind_a_load_balancer("client_ip");
        let statuses: Vec<u16> = (0..6)
            .map(|port| from(&envoy, &format!("203.0.113.7:{}", 40_000 + port)))
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 200, 429, 429, 429],
            "one client, a new source port each time: one bucket; {:?}",
            envoy.sluice_stats()
        );
        assert_eq!(from(&envoy, "203.0.113.7"), 429, "with or without its port");
        assert_eq!(
            from(&envoy, "[2001:db8::7]:443"),
            200,
            "an IPv6 client in brackets with a port"
        );
        for _ in 0..2 {
            assert_eq!(from(&envoy, "2001:db8::7"), 200);
        }
        assert_eq!(
            from(&envoy, "[2001:DB8::7]:444"),
            429,
            "the same IPv6 client"
        );
        // Entries that are no address: one missing bucket for all of them, never a key each.
        let junk: Vec<u16> = (0..5)
            .map(|i| from(&envoy, &format!("unknown-{i}")))
            .collect();
        assert_eq!(junk, [200, 200, 200, 429, 429], "{junk:?}");
    }

    #[test]
    fn forwarded_entries_with_a_port_key_the_network() {
        let envoy = behind_a_load_balancer("client_ip/24");
        let statuses: Vec<u16> = (0..6)
            .map(|i| from(&envoy, &format!("203.0.113.{}:{}", 10 + i, 40_000 + i)))
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 200, 429, 429, 429],
            "one /24, entries with ports: one bucket; {:?}",
            envoy.sluice_stats()
        );
        assert_eq!(from(&envoy, "198.51.100.1:1"), 200, "another network");
        let junk: Vec<u16> = (0..5)
            .map(|i| from(&envoy, &format!("_hidden{i}")))
            .collect();
        assert_eq!(
            junk,
            [200, 200, 200, 429, 429],
            "not an address: counted, once; {junk:?}"
        );
    }
}

mod login_recipe {
    use super::*;

    /// The configuration of docs/recipes.md's "Login protection" as shipped, with the test service's token.
    fn recipe(token: &str) -> String {
        let text = std::fs::read_to_string(repo_root().join("docs/recipes.md")).unwrap();
        let section = text
            .split("\n## Login protection\n")
            .nth(1)
            .expect("docs/recipes.md has a Login protection section");
        let block = section
            .split("```json\n")
            .nth(1)
            .and_then(|rest| rest.split("\n```").next())
            .expect("the section has a JSON block");
        let mut config: Value = serde_json::from_str(block).unwrap();
        assert_eq!(config["service"]["token"], json!("…"), "{block}");
        config["service"]["token"] = json!(token);
        config.to_string()
    }

    /// `envoy/sluice-service.yaml.tmpl` behind one load balancer (Envoy takes the client from the last
    /// `X-Forwarded-For` entry, which the test writes, so each client has its own address), whose upstream's
    /// `/login` answers 200 to `x-password: right` and 401 to any other.
    fn start_proxy(service: &Service) -> (DerivedTemplate, Envoy) {
        let template = DerivedTemplate::edited(
            &Template::SluiceService,
            &[
                ("xff_num_trusted_hops: 0", "xff_num_trusted_hops: 1"),
                (
                    "              - match: { prefix: \"/llm\" }\n",
                    "              - match:\n                  prefix: \"/login\"\n                  headers:\n                  - name: x-password\n                    string_match: { exact: \"right\" }\n                direct_response: { status: 200, body: { inline_string: \"welcome\\n\" } }\n              - match: { prefix: \"/login\" }\n                direct_response: { status: 401, body: { inline_string: \"wrong password\\n\" } }\n              - match: { prefix: \"/llm\" }\n",
                ),
            ],
        )
        .unwrap();
        let port = service.address().expect("the service listens").port();
        let envoy = start(
            template.template(),
            recipe(service.token()),
            &[("SERVICE_PORT", port.to_string())],
        );
        (template, envoy)
    }

    /// `POST /login` from `client` for `account`, with `cookie` (none when empty) and `password`.
    fn login(envoy: &Envoy, client: &str, account: &str, cookie: &str, password: &str) -> Reply {
        let mut request = agent()
            .post(envoy.url("/login"))
            .header("x-forwarded-for", client)
            .header("x-account", account)
            .header("x-password", password);
        if !cookie.is_empty() {
            request = request.header("cookie", cookie);
        }
        let what = format!("POST /login from {client} for {account} with cookie {cookie:?}");
        Reply::read(request.send_empty().unwrap(), &what).unwrap()
    }

    /// Attacker's test, on the recipe as shipped: a client without the session cookie fails logins (a new
    /// account each time: the account rule never stops it) until it is denied. Then another client without the
    /// cookie (a fresh browser at another address) still logs in; before, both shared the rule's missing
    /// bucket, and its 10-minute penalty locked out every newcomer. A session that failed twenty times is in
    /// its penalty however its cookie is written: `a=1, session=victim` is `session=victim` to Python's
    /// `http.cookies`.
    #[test]
    fn one_client_without_a_session_does_not_lock_out_the_others() {
        let redis = Redis::start().unwrap();
        let service = Service::start(&redis.url()).unwrap();
        let (_template, envoy) = start_proxy(&service);
        let (mallory, newcomer) = ("203.0.113.66", "198.51.100.7");

        let mut failed = 0;
        let denied = (0..40)
            .map(|i| login(&envoy, mallory, &format!("user{i}"), "", "wrong"))
            .find(|reply| {
                failed += usize::from(reply.status == 401);
                reply.status != 401
            })
            .expect("denied within 40 failures");
        assert_eq!(denied.status, 429, "{denied:?}");
        assert_eq!(failed, 20, "twenty failures a minute");
        for cookie in ["", "theme=dark", "session="] {
            let reply = login(&envoy, newcomer, "alice", cookie, "right");
            assert_eq!(
                reply.status, 200,
                "a newcomer with cookie {cookie:?}, locked out by another client's failures: {reply:?}"
            );
        }
        assert_eq!(login(&envoy, mallory, "bob", "", "right").status, 429);

        for i in 0..20 {
            let reply = login(&envoy, mallory, &format!("v{i}"), "session=victim", "wrong");
            assert_eq!(reply.status, 401, "failure {i}: {reply:?}");
        }
        let denied = login(&envoy, mallory, "v20", "session=victim", "wrong");
        assert_eq!(denied.status, 429, "{denied:?}");
        let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
        assert!((590..=600).contains(&retry), "the penalty: {denied:?}");
        for cookie in [
            "session=victim",
            "a=1, session=victim",
            "a=1 session=victim",
            "theme=dark; a=1, session=victim",
        ] {
            let reply = login(&envoy, newcomer, "carol", cookie, "right");
            assert_eq!(
                reply.status, 429,
                "{cookie:?} escaped the penalty of session=victim: {reply:?}"
            );
        }
    }

    /// Attacker's test, on the recipe as shipped (its account rule `cached`, 5 a minute, with a `penalty`): 20 failed
    /// logins for one account at once, as streams of one HTTP/2 connection, to a backend that takes 400 ms to answer
    /// 401. Each attempt holds its token from its admission until its answer, out of the proxy's lease of the key,
    /// so at most the lease (the limit, with one proxy) reaches the backend and the rest are denied; then the
    /// account is denied. Across proxies, each holds at most what it was leased, so the fleet sends the backend at
    /// most a cached rule's bound. (Counted only when the answer came, all 20 reached it.)
    #[test]
    fn a_burst_on_one_http2_connection_reaches_the_backend_no_more_than_the_lease() {
        const DELAY: &str = "x-envoy-fault-delay-request";
        const ABORT: &str = "x-envoy-fault-abort-request";
        let redis = Redis::start().unwrap();
        let service = Service::start(&redis.url()).unwrap();
        let port = service.address().expect("the service listens").port();
        // The shedding template's upstream delays and fails each request as its headers ask.
        let envoy = start(
            Template::Shedding,
            recipe(service.token()),
            &[("SERVICE_PORT", port.to_string())],
        );
        let account = ("x-account", "victim");
        let attempt = |headers: &[(&str, &str)]| {
            let mut request = agent().post(envoy.url("/login"));
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            Reply::read(request.send_empty().unwrap(), "POST /login").unwrap()
        };

        // A first login that succeeds gives its token back and makes the proxy ask for the account's lease at its
        // next sync: two syncs on, it holds it.
        assert_eq!(attempt(&[account]).status, 200);
        let synced = envoy.stat("wasmcustom.sluice.sync.ok");
        assert!(
            eventually(Duration::from_secs(10), || {
                envoy.stat("wasmcustom.sluice.sync.ok") >= synced + 2
            }),
            "no sync; {:?}",
            envoy.sluice_stats()
        );

        let reached = || envoy.stat("http.upstream.downstream_rq_total");
        let (before, connections) = (reached(), envoy.stat("http.edge.downstream_cx_http2_total"));
        let statuses = streams(
            envoy.listen_port,
            20,
            "POST",
            "/login",
            &[account, (DELAY, "400"), (ABORT, "401")],
            Duration::from_secs(10),
        )
        .unwrap();
        let failed = statuses.iter().filter(|s| **s == 401).count();
        let denied = statuses.iter().filter(|s| **s == 429).count();
        eprintln!("20 streams of one connection: {failed} reached the backend, {denied} denied");
        assert!(
            (1..=5).contains(&failed) && failed + denied == 20,
            "at most the lease's 5 reach the backend, the rest are denied: {statuses:?}"
        );
        assert_eq!(
            reached() - before,
            failed as u64,
            "the backend saw only the attempts answered 401"
        );
        assert_eq!(
            envoy.stat("http.edge.downstream_cx_http2_total") - connections,
            1,
            "the burst came on one HTTP/2 connection"
        );
        let next = attempt(&[account]);
        assert_eq!(next.status, 429, "the account after the burst: {next:?}");
    }
}
