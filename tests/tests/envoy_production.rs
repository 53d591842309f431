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

use sluice_tests::envoy::{
    agent, free_ports, get, replace_exactly, repo_root, Demo, Envoy, Reply, Stats,
};
use sluice_tests::eventually;
use sluice_tests::upstream::{Mode, Upstream};

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

// The clusters' circuit breakers, outlier detection and retry budget, each driven by upstreams of the test's own
// (`sluice_tests::upstream`): the clusters' endpoints point at them, everything else is as shipped.

/// `envoy/production.yaml` as shipped.
fn shipped_yaml() -> String {
    std::fs::read_to_string(repo_root().join("envoy/production.yaml")).unwrap()
}

/// The number of `key:` in cluster `cluster`'s block of `yaml` (e.g. `max_requests`, or `budget_percent`, written
/// `{ value: 20.0 }`).
fn cluster_setting(yaml: &str, cluster: &str, key: &str) -> f64 {
    let lines: Vec<&str> = yaml.lines().collect();
    let at = lines
        .iter()
        .position(|line| line.trim() == format!("- name: {cluster}"))
        .unwrap_or_else(|| panic!("no cluster {cluster}"));
    let value = lines[at + 1..]
        .iter()
        .take_while(|line| !line.trim_start().starts_with("- name: "))
        .find_map(|line| line.trim().strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("cluster {cluster} has no {key}"));
    value
        .trim_matches(|c: char| c == '{' || c == '}' || c.is_whitespace())
        .trim_start_matches("value:")
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{cluster}.{key}: {value:?}: {e}"))
}

/// production.yaml with the endpoints of `clusters` replaced by the test's upstreams, sluice's configuration
/// `plugin` (as shipped when `None`), two workers, its counter service on a closed port.
fn start_with_endpoints(clusters: &[(&str, &[u16])], plugin: Option<serde_json::Value>) -> Envoy {
    let production = Demo::production_with_endpoints(&shipped_yaml(), clusters).unwrap();
    let plugin = plugin
        .map(|p| p.to_string())
        .unwrap_or_else(|| production.plugin_config_json.clone());
    let service_port = free_ports(1).unwrap()[0];
    Envoy::start(production.options(plugin, 2, service_port).unwrap()).unwrap()
}

/// `cluster.<cluster>.<name>` from one snapshot of Envoy's stats, 0 when absent.
fn cluster_stat(stats: &Stats, cluster: &str, name: &str) -> u64 {
    stats
        .counter(&format!("cluster.{cluster}.{name}"))
        .unwrap_or(0)
}

/// Sends `count` requests to `url`, each on a connection of its own from a thread of `scope`, one after the other
/// once `upstream` holds the one before: every one of them is in flight when this returns.
fn hold_in_flight<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    url: &'scope str,
    upstream: &Upstream,
    count: u64,
) -> Vec<std::thread::ScopedJoinHandle<'scope, Reply>> {
    let first = upstream.received();
    (1..=count)
        .map(|i| {
            let handle = scope.spawn(move || get(&agent(), url, &[]).unwrap());
            assert!(
                upstream.received_reaching(first + i, Duration::from_secs(10)),
                "request {i} never reached the upstream (it got {})",
                upstream.received() - first
            );
            handle
        })
        .collect()
}

/// Both of Envoy's workers accepted connections on the edge listener: what a test saw spanned the workers.
fn assert_both_workers_served(envoy: &Envoy, stats: &Stats) {
    let port = envoy.url("").rsplit(':').next().unwrap().to_owned();
    for worker in 0..2 {
        let name = format!("listener.127.0.0.1_{port}.worker_{worker}.downstream_cx_total");
        assert!(
            stats.counter(&name).unwrap_or(0) > 0,
            "{name}: {:?}",
            stats.matching("downstream_cx_total")
        );
    }
}

/// sluice's payments bulkhead (static 32) is below the cluster's `max_requests` (64): with the upstream holding every
/// request, sluice sheds by priority (anonymous requests are the class `free`, shed from 70% of the limit) and by
/// concurrency with its own 503 and Retry-After, at most 32 are ever in flight upstream, and Envoy's breaker never
/// overflows.
#[test]
fn the_payments_bulkhead_sheds_before_the_clusters_breaker() {
    let yaml = shipped_yaml();
    let max_requests = cluster_setting(&yaml, "payments", "max_requests") as u64;
    let production = Demo::production().unwrap();
    let config: serde_json::Value = serde_json::from_str(&production.plugin_config_json).unwrap();
    let payments = &config["shedding"]["bulkheads"][2];
    assert_eq!(payments["name"], "payments");
    let bulkhead = payments["limit"]["static"].as_u64().unwrap();
    assert!(bulkhead < max_requests, "{bulkhead} vs {max_requests}");

    let upstream = Upstream::start(Mode::Hold).unwrap();
    let envoy = start_with_endpoints(&[("payments", &[upstream.port()])], None);
    let url = envoy.url("/payments/x");
    std::thread::scope(|scope| {
        // As many requests at once as the breaker allows and more, each held upstream or answered by sluice before
        // the next is sent.
        let mut held = Vec::new();
        let mut shed = Vec::new();
        for i in 0..max_requests + 8 {
            let url = &url;
            let handle = scope.spawn(move || get(&agent(), url, &[]).unwrap());
            let before = held.len() as u64;
            let settled = eventually(Duration::from_secs(10), || {
                upstream.received() > before || handle.is_finished()
            });
            assert!(
                settled,
                "request {i} neither reached the upstream nor was answered"
            );
            if upstream.received() > before {
                held.push(handle);
            } else {
                shed.push(handle.join().unwrap());
            }
        }
        let in_flight = held.len() as u64;
        eprintln!(
            "{in_flight} in flight upstream, {} shed by sluice",
            shed.len()
        );
        // Anonymous requests are the class `free`, shed once the bulkhead is that share full.
        let free = config["shedding"]["classes"]["free"].as_f64().unwrap();
        assert_eq!(
            in_flight,
            (free * bulkhead as f64).ceil() as u64,
            "in flight upstream; the bulkhead is {bulkhead}, class free shed from {free}"
        );
        assert_eq!(upstream.received(), in_flight);
        for reply in &shed {
            assert_eq!(reply.status, 503, "{reply:?}");
            assert!(
                matches!(
                    reply.header("x-sluice-shed"),
                    Some("priority" | "concurrency")
                ),
                "{reply:?}"
            );
            assert!(reply.header("retry-after").is_some(), "{reply:?}");
            assert_eq!(reply.header("x-envoy-overloaded"), None, "{reply:?}");
        }
        let stats = envoy.stats().unwrap();
        for (name, expected) in [
            ("upstream_rq_active_overflow", 0),
            ("upstream_rq_pending_overflow", 0),
            ("circuit_breakers.default.rq_open", 0),
            (
                "circuit_breakers.default.remaining_rq",
                max_requests - in_flight,
            ),
            ("upstream_rq_active", in_flight),
        ] {
            assert_eq!(
                cluster_stat(&stats, "payments", name),
                expected,
                "{name}: {:?}",
                stats.matching("cluster.payments.")
            );
        }
        upstream.release(200);
        for handle in held {
            assert_eq!(handle.join().unwrap().status, 200);
        }
    });
}

/// Envoy's breaker under sluice's bulkhead, reached with the bulkhead lifted: the payments cluster lets
/// `max_requests` (64) requests in flight at once across both workers; every request over it is Envoy's own 503
/// (`x-envoy-overloaded`, counted as an overflow) and never reaches the upstream.
#[test]
fn the_payments_breaker_caps_requests_in_flight_across_the_workers() {
    let max_requests = cluster_setting(&shipped_yaml(), "payments", "max_requests") as u64;
    const OVER: u64 = 16;
    let production = Demo::production().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&production.plugin_config_json).unwrap();
    let payments = &mut config["shedding"]["bulkheads"][2];
    assert_eq!(payments["name"], "payments");
    payments["limit"] = serde_json::json!({"static": 1000});
    payments.as_object_mut().unwrap().remove("success_rate");

    let upstream = Upstream::start(Mode::Hold).unwrap();
    let envoy = start_with_endpoints(&[("payments", &[upstream.port()])], Some(config));
    let url = envoy.url("/payments/x");
    std::thread::scope(|scope| {
        let held = hold_in_flight(scope, &url, &upstream, max_requests);
        let client = agent();
        for _ in 0..OVER {
            let reply = get(&client, &url, &[]).unwrap();
            assert_eq!(reply.status, 503, "{reply:?}");
            assert_eq!(
                reply.header("x-envoy-overloaded"),
                Some("true"),
                "{reply:?}"
            );
            assert_eq!(reply.header("x-sluice-shed"), None, "{reply:?}");
        }
        assert_eq!(upstream.received(), max_requests, "no overflow reached it");
        // Envoy counts a request refused over max_requests in `upstream_rq_active_overflow` from 1.38 on, in
        // `upstream_rq_pending_overflow` before (envoy/README.md, "Envoy releases").
        let version = envoy.version().unwrap();
        let (counted, not_counted) = if version >= (1, 38, 0) {
            (
                "upstream_rq_active_overflow",
                "upstream_rq_pending_overflow",
            )
        } else {
            (
                "upstream_rq_pending_overflow",
                "upstream_rq_active_overflow",
            )
        };
        let stats = envoy.stats().unwrap();
        for (name, expected) in [
            (counted, OVER),
            (not_counted, 0),
            ("circuit_breakers.default.rq_open", 1),
            ("circuit_breakers.default.remaining_rq", 0),
            ("upstream_rq_active", max_requests),
            // Nothing timed out: every held request was in flight when the others overflowed.
            ("upstream_rq_timeout", 0),
        ] {
            assert_eq!(
                cluster_stat(&stats, "payments", name),
                expected,
                "{name}: {:?}",
                stats.matching("cluster.payments.")
            );
        }
        assert_both_workers_served(&envoy, &stats);
        upstream.release(200);
        for handle in held {
            assert_eq!(handle.join().unwrap().status, 200);
        }
    });
    assert_eq!(
        envoy.stat("cluster.payments.circuit_breakers.default.rq_open"),
        0
    );
}

/// The api route retries a 5xx at most twice, but the cluster's retry budget (20% of the requests in flight, at
/// least 3 at once) bounds the retries in flight, not `max_retries` (64): 20 requests failing at once get 3 or 4
/// retries (20% of 20, or the floor of 3 once fewer are in flight), the rest answer their 503 with
/// `upstream_rq_retry_overflow`. sluice sees each client request once, however often Envoy retries it.
#[test]
fn the_api_retry_budget_bounds_the_retries_in_flight_to_its_share() {
    let yaml = shipped_yaml();
    assert_eq!(cluster_setting(&yaml, "api", "budget_percent"), 20.0);
    assert_eq!(cluster_setting(&yaml, "api", "min_retry_concurrency"), 3.0);
    assert!(cluster_setting(&yaml, "api", "max_retries") >= 20.0);
    const IN_FLIGHT: u64 = 20;
    // The originals must all fail before the first's per-try timeout (0.6 s): a machine stalled that long makes a
    // run inconclusive (`upstream_rq_per_try_timeout` says so), and it is run again, three times at most.
    for run in 1..=3 {
        let upstream = Upstream::start(Mode::Hold).unwrap();
        let envoy = start_with_endpoints(&[("api", &[upstream.port()])], None);
        let url = envoy.url("/api/x");
        let go = std::sync::Barrier::new(IN_FLIGHT as usize);
        let conclusive = std::thread::scope(|scope| {
            let clients: Vec<_> = (0..IN_FLIGHT)
                .map(|_| {
                    let (go, url) = (&go, &url);
                    scope.spawn(move || {
                        let client = agent();
                        go.wait();
                        get(&client, url, &[]).unwrap()
                    })
                })
                .collect();
            assert!(
                upstream.received_reaching(IN_FLIGHT, Duration::from_secs(10)),
                "{} of {IN_FLIGHT} reached the upstream",
                upstream.received()
            );
            // Every original fails at once; the retries Envoy sends are held.
            upstream.release(503);
            let decided = |s: &Stats| {
                cluster_stat(s, "api", "upstream_rq_retry")
                    + cluster_stat(s, "api", "upstream_rq_retry_overflow")
                    >= IN_FLIGHT
            };
            let stats = envoy.stats_when(decided);
            let retried = cluster_stat(&stats, "api", "upstream_rq_retry");
            let overflowed = cluster_stat(&stats, "api", "upstream_rq_retry_overflow");
            let conclusive = cluster_stat(&stats, "api", "upstream_rq_per_try_timeout") == 0;
            eprintln!("run {run}: {retried} retried, {overflowed} over the budget");
            if conclusive {
                assert!(
                    decided(&stats),
                    "{:?}",
                    stats.matching("cluster.api.upstream_rq")
                );
                assert!(
                    (3..=4).contains(&retried),
                    "retried {retried} of {IN_FLIGHT}: the budget allows max(3, 20% of {IN_FLIGHT}); {:?}",
                    stats.matching("cluster.api.upstream_rq")
                );
                assert_eq!(retried + overflowed, IN_FLIGHT);
                assert!(
                    upstream.received_reaching(IN_FLIGHT + retried, Duration::from_secs(5)),
                    "{}",
                    upstream.received()
                );
            }
            upstream.set_mode(Mode::Answer(200));
            upstream.release(200);
            let replies: Vec<Reply> = clients.into_iter().map(|c| c.join().unwrap()).collect();
            if conclusive {
                let failed = replies.iter().filter(|r| r.status == 503).count() as u64;
                assert_eq!(
                    failed, overflowed,
                    "each request not retried answers the upstream's 503"
                );
                assert!(
                    replies.iter().all(|r| [200, 503, 504].contains(&r.status)),
                    "{replies:?}"
                );
                // sluice admitted each client request once: retries are not requests to it.
                assert_eq!(
                    envoy.stat_reaching("wasmcustom.sluice.shed.api.admitted", IN_FLIGHT),
                    IN_FLIGHT,
                    "{:?}",
                    envoy.sluice_stats()
                );
            }
            conclusive
        });
        if conclusive {
            return;
        }
        eprintln!("run {run}: a per-try timeout fired before every original failed; again");
    }
    panic!("three runs in a row were inconclusive: the machine stalled past the per-try timeout each time");
}

/// Outlier detection on the api cluster given two hosts: the one answering 503 is ejected after its 5th in a row
/// (not before), the route retries each of its failures on the other host (no client sees one), and once ejected it
/// gets no request at all.
#[test]
fn a_host_failing_5_times_in_a_row_is_ejected_and_its_requests_retried_on_the_other() {
    let consecutive = cluster_setting(&shipped_yaml(), "api", "consecutive_5xx") as u64;
    let failing = Upstream::start(Mode::Answer(503)).unwrap();
    let healthy = Upstream::start(Mode::Answer(200)).unwrap();
    let envoy = start_with_endpoints(&[("api", &[failing.port(), healthy.port()])], None);
    let client = agent();
    let url = envoy.url("/api/x");
    let ejected = "cluster.api.outlier_detection.ejections_enforced_total";
    for _ in 0..50 {
        if failing.received() >= consecutive {
            break;
        }
        assert_eq!(
            envoy.stat(ejected),
            0,
            "ejected after {}",
            failing.received()
        );
        let reply = get(&client, &url, &[]).unwrap();
        assert_eq!(reply.status, 200, "retried on the other host: {reply:?}");
    }
    assert_eq!(failing.received(), consecutive);
    assert!(
        eventually(Duration::from_secs(5), || envoy.stat(ejected) == 1
            && envoy.stat("cluster.api.outlier_detection.ejections_active")
                == 1),
        "{:?}",
        envoy.stats().unwrap().matching("outlier_detection")
    );
    assert_eq!(
        envoy.stat("cluster.api.outlier_detection.ejections_enforced_consecutive_5xx"),
        1
    );
    let before = failing.received();
    for _ in 0..20 {
        assert_eq!(get(&client, &url, &[]).unwrap().status, 200);
    }
    assert_eq!(failing.received(), before, "the ejected host got requests");
    assert_eq!(envoy.stat("cluster.api.upstream_rq_retry"), before);
}

/// `max_ejection_percent: 50`: of two hosts both failing, one is ejected and the other kept (its ejection counted as
/// an overflow); the single host the file ships is never ejected, however often it fails.
#[test]
fn never_more_than_half_the_hosts_are_ejected_and_a_lone_host_never() {
    let yaml = shipped_yaml();
    assert_eq!(cluster_setting(&yaml, "api", "max_ejection_percent"), 50.0);
    let stat =
        |envoy: &Envoy, name: &str| envoy.stat(&format!("cluster.api.outlier_detection.{name}"));
    let consecutive = cluster_setting(&yaml, "api", "consecutive_5xx") as u64;
    // Requests (each tried three times, every try failing) until every host failed `consecutive` times in a row
    // and an ejection was refused; whether one was.
    let fail = |envoy: &Envoy, upstreams: &[&Upstream]| {
        let client = agent();
        for _ in 0..40 {
            if upstreams.iter().all(|u| u.received() >= consecutive)
                && stat(envoy, "ejections_overflow") >= 1
            {
                return true;
            }
            let reply = get(&client, &envoy.url("/api/x"), &[]).unwrap();
            assert_eq!(reply.status, 503, "{reply:?}");
        }
        eventually(Duration::from_secs(5), || {
            stat(envoy, "ejections_overflow") >= 1
        })
    };

    let (a, b) = (
        Upstream::start(Mode::Answer(503)).unwrap(),
        Upstream::start(Mode::Answer(503)).unwrap(),
    );
    let envoy = start_with_endpoints(&[("api", &[a.port(), b.port()])], None);
    assert!(
        fail(&envoy, &[&a, &b]),
        "{:?}",
        envoy.stats().unwrap().matching("outlier")
    );
    assert_eq!(stat(&envoy, "ejections_enforced_total"), 1);
    assert_eq!(stat(&envoy, "ejections_active"), 1);
    drop(envoy);

    let lone = Upstream::start(Mode::Answer(503)).unwrap();
    let envoy = start_with_endpoints(&[("api", &[lone.port()])], None);
    assert!(
        fail(&envoy, &[&lone]),
        "{:?}",
        envoy.stats().unwrap().matching("outlier")
    );
    assert!(stat(&envoy, "ejections_detected_consecutive_5xx") >= 1);
    assert_eq!(stat(&envoy, "ejections_enforced_total"), 0);
    assert_eq!(stat(&envoy, "ejections_active"), 0);
    let before = lone.received();
    assert_eq!(
        get(&agent(), &envoy.url("/api/x"), &[]).unwrap().status,
        503
    );
    assert!(
        lone.received() > before,
        "the lone host still gets requests"
    );
}
