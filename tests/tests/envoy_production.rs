//! `envoy/production.yaml` in a real Envoy (the pinned wheel, V8), started as shipped: only its fixed ports (free
//! ones instead) and its `.wasm` path (the built one) changed, two workers, and no counter service (its port is
//! closed: the cached per-user rule decides from its fallback, as the top-level README's failure modes say).
//!
//! - Envoy accepts the file without a warning and sluice is configured; `/healthz` is answered by Envoy.
//! - Every route reaches its cluster, and its upstream is told the load level (`x-sluice-load-level: normal`).
//! - The class and the user reach sluice and the upstream only from a verified JWT: client-sent `x-sluice-class`,
//!   `x-user` and `x-jwt-payload` are removed before any filter; a valid token's `tier` and `sub` claims become
//!   `x-sluice-class` and `x-user`; anonymous requests have neither (sluice's default class). Up to Envoy 1.39
//!   jwt_authn removes its claim headers itself only on the paths it checks; on a path it does not, the early header
//!   mutation is what does (from 1.40 on jwt_authn removes them on every path too).
//! - An invalid JWT (a key the provider never published, a payload edited after signing, not a JWT) is 401, before
//!   sluice counts it.
//! - A client cannot make Envoy retry (its `x-envoy-*` headers are stripped at the edge).
//! - Each bulkhead (one per upstream cluster) publishes its metrics, and its `timeout_ms` is its route's timeout.
//!
//! Run with `make test` (it builds the filter and sets `SLUICE_ENVOY` and `SLUICE_WASM`).

use std::time::Duration;

use sluice_tests::envoy::{agent, free_ports, get, replace_exactly, repo_root, Demo, Envoy, Reply};
use sluice_tests::eventually;

// Tokens of the identity provider whose public key (RS256, kid `sluice-example-2025`) is the inline JWKS of
// production.yaml, signed once when the file was written; the private key is not in the repository. Every one has
// iss `https://idp.example.com`, aud `api.example.com`, iat 2025-01-01 and exp 2100-01-01.

/// sub `user-42`, tier `premium`.
const PREMIUM: &str = "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6InNsdWljZS1leGFtcGxlLTIwMjUifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsImF1ZCI6ImFwaS5leGFtcGxlLmNvbSIsInN1YiI6InVzZXItNDIiLCJ0aWVyIjoicHJlbWl1bSIsImlhdCI6MTczNTY4OTYwMCwiZXhwIjo0MTAyNDQ0ODAwfQ.x9HcQTSrAgTz8jqjwRPbVQeiVxZQno0KJE9__rEnvfLUX10cemEOxfn4uuXeWBP3Dj1T2eM_FePCBxQmOASBRYGO55u2uirT3mI2CzfCCYPxUXglxnylXdGy_WGaHmYqDsf_a93hk_ojoqVYSa3r23BRKbNBi2fVwD323miPitvIyVl5MJs2ZcAZHIhOBwkG1hqqdVnP0PbtM4uVdip-AP_x1F5up6epbYkNAk3MwuH2KYNBislgbr9B9_aHMCAsvy1hbxkK5WBd3MhIhmWomOvWpuAg2sQ1imQyt7rgoa4hpggnGQR1ubm_e48UtDK7kgbF6jRJ8VbuZ0gEHlDpqQ";

/// sub `user-7`, no tier claim.
const NO_TIER: &str = "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6InNsdWljZS1leGFtcGxlLTIwMjUifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsImF1ZCI6ImFwaS5leGFtcGxlLmNvbSIsInN1YiI6InVzZXItNyIsImlhdCI6MTczNTY4OTYwMCwiZXhwIjo0MTAyNDQ0ODAwfQ.RunxGsgV8aPcbn2T6xnb3nA2WsJ7pu4KLGO1jj-WjqtIiu3fguQJis8oIVr9wWcj7Gs-s_Us4uridGkZlDVEPHBXV8YE6eNZkOMtsvpgrnz7cLmRPvNCieNXXqD9VY8ZwNg2L2pIhC3bH7Y489-_8uxcIwFyuQ_yeas5otuq2k0k8NCb-SMRWuAjdNtKO339hfO2kaGrDilRIdJjpC5_T8yd0STIMc-ZW7qx6CC-XNAGkUZqTtzt9zMSLnuFLrjtiGdc5Faqfm5eM2iP2InpVj1IgPuGpN8gRcHMG5VPViEq-gdJsEKVFXBausXW4N5RcoePAFWcPi27BaotHrmT1w";

/// The claims of [`PREMIUM`], signed with another key (same kid): a bad signature.
const OTHER_KEY: &str = "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6InNsdWljZS1leGFtcGxlLTIwMjUifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsImF1ZCI6ImFwaS5leGFtcGxlLmNvbSIsInN1YiI6InVzZXItNDIiLCJ0aWVyIjoicHJlbWl1bSIsImlhdCI6MTczNTY4OTYwMCwiZXhwIjo0MTAyNDQ0ODAwfQ.TjYI6vkMEWGZDelGobIlCIjii3nDl5putnDoTSUWaP4xQQhDM402DLQVdljEaUApMkOMnxkipa_pLawhOOSLu1EvTxN_px29Snns2zz8RmJW3j8ma9iVaa_I1kC-c8hctm53WTzYZEbPsxaxjwQH0DqBqI_VRSrvdFKH34WjZoiZQSmeP1U9SwAPxr3xOzPzrh3SLfI15vE56W6eN95QBvaUx73ieWrBn8crKFRXHkfYvv6xh2wo7zH-E5RF3lMfSS5rvCNXK85odEU_F7fYRMjB_yIWAOldcNy0b7S8MfJdiOmgzVvz-wfOR6xBY2OWCv6BH3J_kXuAt27DQwrrpQ";

/// [`PREMIUM`] with its payload edited to tier `critical` and its signature kept.
const TAMPERED: &str = "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6InNsdWljZS1leGFtcGxlLTIwMjUifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsImF1ZCI6ImFwaS5leGFtcGxlLmNvbSIsInN1YiI6InVzZXItNDIiLCJ0aWVyIjoiY3JpdGljYWwiLCJpYXQiOjE3MzU2ODk2MDAsImV4cCI6NDEwMjQ0NDgwMH0.x9HcQTSrAgTz8jqjwRPbVQeiVxZQno0KJE9__rEnvfLUX10cemEOxfn4uuXeWBP3Dj1T2eM_FePCBxQmOASBRYGO55u2uirT3mI2CzfCCYPxUXglxnylXdGy_WGaHmYqDsf_a93hk_ojoqVYSa3r23BRKbNBi2fVwD323miPitvIyVl5MJs2ZcAZHIhOBwkG1hqqdVnP0PbtM4uVdip-AP_x1F5up6epbYkNAk3MwuH2KYNBislgbr9B9_aHMCAsvy1hbxkK5WBd3MhIhmWomOvWpuAg2sQ1imQyt7rgoa4hpggnGQR1ubm_e48UtDK7kgbF6jRJ8VbuZ0gEHlDpqQ";

const PER_IP_ALLOWED: &str = "wasmcustom.sluice.rule.per-ip.allowed";
const PER_USER_ALLOWED: &str = "wasmcustom.sluice.rule.per-user.allowed";
const JWT_DENIED: &str = "http.edge.jwt_authn.denied";
const BULKHEADS: [&str; 3] = ["api", "search", "payments"];
/// sluice's line when it accepted the file's configuration.
const CONFIGURED: &str =
    "sluice: configured 2 rule(s), 131072 keys per rule, syncing with cluster \"sluice_service\"";

/// `envoy/production.yaml` as shipped, two workers, its counter service on a closed loopback port.
fn start() -> Envoy {
    start_from(Demo::production().unwrap())
}

fn start_from(production: Demo) -> Envoy {
    let plugin = production.plugin_config_json.clone();
    let service_port = free_ports(1).unwrap()[0];
    Envoy::start(production.options(plugin, 2, service_port).unwrap()).unwrap()
}

/// `GET path` through the edge with `headers`.
fn request(envoy: &Envoy, path: &str, headers: &[(&str, &str)]) -> Reply {
    get(&agent(), &envoy.url(path), headers).unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A 200 from the upstream listener for `path`, with what the upstream saw: `(x-seen-class, x-seen-user)`, `None`
/// for a header that did not reach it (Envoy adds no echo header for an absent one).
fn upstream_saw(
    envoy: &Envoy,
    path: &str,
    headers: &[(&str, &str)],
) -> (Option<String>, Option<String>) {
    let reply = request(envoy, path, headers);
    assert_eq!(reply.status, 200, "{path} with {headers:?}: {reply:?}");
    assert_eq!(
        reply.header("x-seen-load-level"),
        Some("normal"),
        "{path}: sluice tells the upstream the load level: {reply:?}"
    );
    let seen = |name: &str| reply.header(name).map(str::to_owned);
    (seen("x-seen-class"), seen("x-seen-user"))
}

/// The lines Envoy itself logged at warning level or above (sluice's own lines, `wasm log`, left out: it reports the
/// counter service it cannot reach).
fn envoy_warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            ["][warning][", "][error][", "][critical]["]
                .iter()
                .any(|level| line.contains(level))
        })
        .filter(|line| !line.contains("wasm log"))
        .collect()
}

#[test]
fn envoy_accepts_it_without_a_warning_sluice_is_configured_and_healthz_is_answered_by_envoy() {
    let envoy = start();
    assert!(
        eventually(Duration::from_secs(5), || envoy.log().contains(CONFIGURED)),
        "sluice's configuration line is missing:\n{}",
        envoy.log()
    );
    let warnings = envoy_warnings(&envoy.log()).join("\n");
    assert!(warnings.is_empty(), "Envoy warned:\n{warnings}");

    let health = request(&envoy, "/healthz", &[]);
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.body, "ok\n");
    assert!(
        !health.has_rate_limit_headers(),
        "/healthz is bypassed: {health:?}"
    );
    assert_eq!(
        health.header("x-seen-load-level"),
        None,
        "answered by the edge: {health:?}"
    );
    // Neither a token nor a forged class matter to the health check.
    let health = request(&envoy, "/healthz", &[("authorization", &bearer(OTHER_KEY))]);
    assert_eq!(health.status, 200, "{health:?}");

    let nowhere = request(&envoy, "/nowhere", &[]);
    assert_eq!(nowhere.status, 404, "no route: {nowhere:?}");
}

#[test]
fn every_route_reaches_its_cluster_and_anonymous_requests_carry_no_class_nor_user() {
    let envoy = start();
    for path in ["/api/x", "/search/x", "/payments/x"] {
        let (class, user) = upstream_saw(&envoy, path, &[]);
        assert_eq!(class, None, "{path}: anonymous, sluice's default class");
        assert_eq!(user, None, "{path}");
    }
    let reply = request(&envoy, "/api/x", &[]);
    assert_eq!(
        reply.header("ratelimit-policy"),
        Some("\"per-ip\";q=1200;w=60"),
        "only the per-ip rule counts anonymous requests: {reply:?}"
    );
    for (cluster, path) in [
        ("api", "/api/x"),
        ("search", "/search/x"),
        ("payments", "/payments/x"),
    ] {
        let name = format!("cluster.{cluster}.upstream_rq_200");
        assert!(envoy.stat(&name) >= 1, "{name}: {path} went elsewhere");
    }
}

#[test]
fn the_class_and_the_user_come_only_from_a_verified_token() {
    let envoy = start();
    let forged = [
        ("x-sluice-class", "critical"),
        ("x-user", "victim"),
        ("x-jwt-payload", "eyJ0aWVyIjoiY3JpdGljYWwifQ"),
    ];

    let (class, user) = upstream_saw(&envoy, "/api/x", &forged);
    assert_eq!(class, None, "an anonymous client cannot name its class");
    assert_eq!(user, None, "nor pass for another user");

    let premium = bearer(PREMIUM);
    let mut headers = forged.to_vec();
    headers.push(("authorization", &premium));
    let (class, user) = upstream_saw(&envoy, "/api/x", &headers);
    assert_eq!(
        class.as_deref(),
        Some("premium"),
        "the token's tier, and only it"
    );
    assert_eq!(user.as_deref(), Some("user-42"), "the token's sub");

    let no_tier = bearer(NO_TIER);
    let (class, user) = upstream_saw(
        &envoy,
        "/search/x",
        &[("x-sluice-class", "critical"), ("authorization", &no_tier)],
    );
    assert_eq!(
        class, None,
        "a token without a tier: the default class, not the client's"
    );
    assert_eq!(user.as_deref(), Some("user-7"));

    // Both authenticated requests were counted per user (by the fallback: the counter service is down).
    assert!(
        eventually(Duration::from_secs(5), || envoy.stat(PER_USER_ALLOWED) == 2),
        "per-user: {:?}",
        envoy.sluice_stats()
    );
    let reply = request(&envoy, "/payments/x", &[("authorization", &premium)]);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("x-seen-class"), Some("premium"), "{reply:?}");
}

/// production.yaml with `/search/` public: a JWT rule without a requirement, as a public path would have.
fn with_public_search(yaml: &str) -> String {
    replace_exactly(
        yaml,
        "              rules:\n              - match: { path: \"/healthz\" }\n",
        "              rules:\n              - match: { path: \"/healthz\" }\n              - match: { prefix: \"/search/\" }\n",
        1,
    )
    .unwrap()
}

/// jwt_authn removes its claim headers only from the requests it verifies: on a path without a requirement it is the
/// early header mutation that keeps a client from naming its class.
#[test]
fn on_a_path_the_jwt_filter_does_not_check_the_early_header_mutation_removes_a_forged_class() {
    let yaml = std::fs::read_to_string(repo_root().join("envoy/production.yaml")).unwrap();
    let forged = [("x-sluice-class", "critical"), ("x-user", "victim")];
    let other_key = bearer(OTHER_KEY);

    let envoy = start_from(Demo::production_from_text(&with_public_search(&yaml)).unwrap());
    let reply = request(&envoy, "/search/x", &[("authorization", &other_key)]);
    assert_eq!(reply.status, 200, "/search/ is not checked: {reply:?}");
    assert_eq!(
        upstream_saw(&envoy, "/search/x", &forged),
        (None, None),
        "the early header mutation removed them"
    );
    drop(envoy);

    // The same without the mutation of x-sluice-class. Up to Envoy 1.39 the client's class reaches sluice and the
    // upstream: jwt_authn removes its claim headers only from the requests it verifies. From 1.40 on it removes them
    // from every request it sees, checked or not; the mutation stays for the older releases sluice supports (and for
    // the headers jwt_authn does not own).
    let unprotected = replace_exactly(
        &with_public_search(&yaml),
        "              - remove: x-sluice-class\n",
        "",
        1,
    )
    .unwrap();
    let envoy = start_from(Demo::production_from_text(&unprotected).unwrap());
    let version = envoy.version().unwrap();
    let (class, user) = upstream_saw(&envoy, "/search/x", &forged);
    let jwt_authn_removes_it_everywhere = version >= (1, 40, 0);
    assert_eq!(
        class.as_deref(),
        if jwt_authn_removes_it_everywhere {
            None
        } else {
            Some("critical")
        },
        "Envoy {version:?}: jwt_authn removes its claim headers on unchecked paths from 1.40 on"
    );
    assert_eq!(user, None, "x-user is still removed");
    let reply = request(&envoy, "/api/x", &forged);
    assert_eq!(
        reply.header("x-seen-class"),
        None,
        "on a checked path jwt_authn removes it itself: {reply:?}"
    );
}

#[test]
fn an_invalid_token_is_401_before_sluice_counts_it() {
    let envoy = start();
    let reply = request(&envoy, "/api/x", &[]);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        eventually(Duration::from_secs(5), || envoy.stat(PER_IP_ALLOWED) == 1),
        "{:?}",
        envoy.sluice_stats()
    );

    for (what, token) in [
        ("signed with another key", OTHER_KEY),
        ("payload edited after signing", TAMPERED),
        ("not a JWT", "not-a-jwt"),
    ] {
        for path in ["/api/x", "/payments/x"] {
            let reply = request(&envoy, path, &[("authorization", &bearer(token))]);
            assert_eq!(reply.status, 401, "{what} on {path}: {reply:?}");
            assert!(
                reply
                    .header("www-authenticate")
                    .is_some_and(|v| v.contains("invalid_token")),
                "{what}: {reply:?}"
            );
            assert_eq!(reply.header("x-seen-class"), None, "{what}: {reply:?}");
        }
    }
    assert_eq!(envoy.stat(JWT_DENIED), 6);
    assert_eq!(
        envoy.stat_settled(PER_IP_ALLOWED),
        1,
        "jwt_authn answered before sluice: {:?}",
        envoy.sluice_stats()
    );
    for cluster in ["api", "payments"] {
        assert_eq!(
            envoy.stat(&format!("cluster.{cluster}.upstream_rq_total")),
            u64::from(cluster == "api"),
            "{cluster}: no rejected request went upstream"
        );
    }
}

#[test]
fn a_client_cannot_make_envoy_retry() {
    let envoy = start();
    // Envoy's router honours these from a trusted (internal) client: "retry on 200, three times" would turn one
    // payment into four. The edge strips them from every client (no address is internal).
    let forged = [
        ("x-envoy-retry-on", "retriable-status-codes"),
        ("x-envoy-retriable-status-codes", "200"),
        ("x-envoy-max-retries", "3"),
        ("x-envoy-upstream-rq-timeout-ms", "60000"),
    ];
    for (cluster, path) in [("payments", "/payments/x"), ("api", "/api/x")] {
        let reply = request(&envoy, path, &forged);
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        assert_eq!(
            envoy.stat(&format!("cluster.{cluster}.upstream_rq_total")),
            1,
            "{path}: one request upstream"
        );
        assert_eq!(
            envoy.stat(&format!("cluster.{cluster}.upstream_rq_retry")),
            0,
            "{path}"
        );
    }
}

#[test]
fn each_bulkhead_publishes_its_metrics() {
    let envoy = start();
    for path in ["/api/x", "/search/x", "/payments/x"] {
        assert_eq!(request(&envoy, path, &[]).status, 200, "{path}");
    }
    let gauge = |bulkhead: &str, what: &str| {
        envoy
            .counter(&format!("wasmcustom.sluice.shed.{bulkhead}.{what}"))
            .unwrap()
    };
    // Static limits as configured; the adaptive one within its bounds (it starts by probing at its minimum).
    assert!(
        eventually(Duration::from_secs(5), || {
            gauge("search", "limit") == Some(64) && gauge("payments", "limit") == Some(32)
        }),
        "{:?}",
        envoy.sluice_stats()
    );
    assert!(
        gauge("api", "limit").is_some_and(|l| (32..=512).contains(&l)),
        "{:?}",
        envoy.sluice_stats()
    );
    for bulkhead in BULKHEADS {
        assert_eq!(gauge(bulkhead, "admitted"), Some(1), "{bulkhead}");
        assert!(
            eventually(Duration::from_secs(5), || gauge(bulkhead, "in_flight")
                == Some(0)),
            "{bulkhead}: every slot given back: {:?}",
            envoy.sluice_stats()
        );
        for what in [
            "queued",
            "utilization_pct",
            "rtt_ms",
            "shed.concurrency",
            "shed.priority",
            "shed.deadline",
            "shed.errors",
            "class.free.shed",
            "class.premium.shed",
            "class.critical.shed",
        ] {
            assert!(
                gauge(bulkhead, what).is_some(),
                "wasmcustom.sluice.shed.{bulkhead}.{what} is missing: {:?}",
                envoy.sluice_stats()
            );
        }
    }
}

/// The seconds of the `timeout:` key (not `per_try_timeout:`) on the line of `cluster: <name>` or the few after it.
fn route_timeout_ms(yaml: &str, cluster: &str) -> u64 {
    let lines: Vec<&str> = yaml.lines().collect();
    let at = lines
        .iter()
        .position(|line| {
            line.contains(&format!("cluster: {cluster},"))
                || line.trim() == format!("cluster: {cluster}")
        })
        .unwrap_or_else(|| panic!("no route to cluster {cluster}"));
    lines[at..(at + 3).min(lines.len())]
        .iter()
        .find_map(|line| {
            let from = line.find(" timeout: ")? + " timeout: ".len();
            let seconds: f64 = line[from..].split('s').next()?.trim().parse().ok()?;
            Some((seconds * 1000.0).round() as u64)
        })
        .unwrap_or_else(|| panic!("the route to cluster {cluster} has no timeout"))
}

#[test]
fn each_bulkhead_times_out_with_its_route_and_its_cluster() {
    let yaml = std::fs::read_to_string(repo_root().join("envoy/production.yaml")).unwrap();
    let production = Demo::production().unwrap();
    let config: serde_json::Value = serde_json::from_str(&production.plugin_config_json).unwrap();
    let bulkheads = config["shedding"]["bulkheads"].as_array().unwrap();
    let names: Vec<&str> = bulkheads
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, BULKHEADS, "one bulkhead per upstream cluster");
    for bulkhead in bulkheads {
        let name = bulkhead["name"].as_str().unwrap();
        assert_eq!(
            bulkhead["timeout_ms"].as_u64(),
            Some(route_timeout_ms(&yaml, name)),
            "bulkhead {name}"
        );
        assert_eq!(
            bulkhead["match"]["path_prefix"].as_str(),
            Some(format!("/{name}/").as_str()),
            "bulkhead {name} matches its route"
        );
    }
}

/// The access log is one JSON object a line, and a request sluice answered itself says why: `sluice_outcome`,
/// `sluice_rule`, the request's `sluice_bulkhead` and `sluice_class`, and `sluice_key`, the key's digest (the first 16
/// hex digits of its SHA-256), never the key. A client's header cannot inject a field: Envoy's JSON formatter escapes
/// it (a user agent forging `sluice_rule` stays a string). Read from the file Envoy's stdout logger wrote.
#[test]
fn the_access_log_is_json_and_says_which_rule_denied_which_key_digest() {
    use sha2::Digest;
    let envoy = start();
    let hostile =
        "x\", \"sluice_rule\": \"forged\", \"sluice_key\": \"127.0.0.1\", \"z\": \"\\\t}{";
    let client = agent();
    // per-ip admits a burst of 200 from this address (and 20 a second more): sent until one is denied.
    let mut statuses = Vec::new();
    while statuses.last() != Some(&429) && statuses.len() < 1_000 {
        let reply = get(&client, &envoy.url("/api/x"), &[("user-agent", hostile)]).unwrap();
        statuses.push(reply.status);
    }
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    let sent = statuses.len();
    // Envoy writes its access logs out every 10 s, or when they are reopened.
    let admin = agent();
    let lines = || -> Vec<serde_json::Value> {
        envoy
            .log()
            .lines()
            .filter(|line| line.starts_with('{'))
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(20), || {
            let _ = admin.post(envoy.admin_url("/reopen_logs")).send_empty();
            lines().len() >= sent
        }),
        "{}",
        envoy.log()
    );
    let lines = lines();
    let digest = sha2::Sha256::digest("per-ip\u{1f}127.0.0.1".as_bytes());
    let key: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    // A number, or a string holding one.
    let status = |line: &serde_json::Value| line["status"].to_string().trim_matches('"').to_owned();
    let denied: Vec<_> = lines.iter().filter(|l| status(l) == "429").collect();
    assert_eq!(denied.len(), 1, "{lines:?}");
    let line = denied[0];
    let field = |name: &str| line[name].as_str().map(str::to_owned);
    assert_eq!(
        field("details").as_deref(),
        Some("sluice_rate_limited"),
        "{line}"
    );
    assert_eq!(field("sluice_outcome").as_deref(), Some("denied"), "{line}");
    assert_eq!(field("sluice_rule").as_deref(), Some("per-ip"), "{line}");
    assert_eq!(field("sluice_bulkhead").as_deref(), Some("api"), "{line}");
    assert_eq!(field("sluice_class").as_deref(), Some("free"), "{line}");
    assert_eq!(field("sluice_key"), Some(key), "{line}");
    assert_eq!(
        field("user_agent").as_deref(),
        Some(hostile),
        "escaped, whole: {line}"
    );
    for line in &lines {
        assert!(
            !line.to_string().contains("\"sluice_key\":\"127.0.0.1\""),
            "no raw key: {line}"
        );
        if status(line) == "200" {
            assert_eq!(line["details"], "via_upstream", "{line}");
            for name in [
                "sluice_outcome",
                "sluice_rule",
                "sluice_bulkhead",
                "sluice_class",
                "sluice_key",
            ] {
                assert!(
                    line[name].is_null(),
                    "{name} only on sluice's answers: {line}"
                );
            }
        }
    }
}
