//! sluice in a real nginx (Debian's 1.22.1) with Kong's ngx_wasm_module (Wasmtime): the floor filter
//! answers, the limit holds across four worker processes (shared data in ngx_wasm_module's `shm_kv`),
//! a denial carries the documented status, headers and body, bypassed and unmatched paths pass, a bad
//! configuration is refused naming the field, a local rule's traffic logs no failed host call, and a
//! bulkhead gives its slots back, and `nginx/nginx.conf` starts as shipped.
//! Run with `make test-nginx`, which sets `SLUICE_NGINX_MODULE` (docs/nginx.md).

use serde_json::{json, Value};
use sluice_tests::contract::checked_body;
use sluice_tests::envoy::{agent, burst, free_ports, get, replace_exactly, repo_root, Reply};
use sluice_tests::nginx::{nginx_module, Filter, Nginx, NginxOptions};

fn config(limit: Value) -> String {
    json!({
        "host": "nginx",
        "headers": "both",
        "bypass": {"paths": ["/healthz"]},
        "client_ip": {"trusted_hops": 0},
        "rules": [{
            "name": "per-ip",
            "match": {"path_prefix": "/api/"},
            "key": ["client_ip"],
            "limits": [limit],
        }],
    })
    .to_string()
}

fn start(filter: Filter, plugin_config: String, workers: u32) -> Nginx {
    Nginx::start(NginxOptions {
        filter,
        plugin_config,
        workers,
        ..NginxOptions::default()
    })
    .unwrap()
}

fn int_header(reply: &Reply, name: &str) -> u64 {
    let value = reply
        .header(name)
        .unwrap_or_else(|| panic!("no {name} header; headers: {:?}", reply.headers));
    value
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {value:?} is not a whole number of seconds"))
}

/// The value of `param` (e.g. `t`) in a draft-11 `RateLimit` item such as `"per-ip";r=0;t=2`.
fn item_param(item: &str, param: &str) -> Option<u64> {
    item.split(';')
        .filter_map(|part| part.trim().split_once('='))
        .find(|(k, _)| *k == param)
        .and_then(|(_, v)| v.parse().ok())
}

/// The bench's floor filter loads and answers in nginx as in Envoy: its constant 429 on `/api/`, the
/// upstream's 200 elsewhere.
#[test]
fn the_floor_filter_answers() {
    let nginx = start(Filter::Floor, "deny".to_owned(), 2);
    let client = agent();

    let denied = get(&client, &nginx.url("/api/x"), &[]).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    assert_eq!(denied.header("retry-after"), Some("1"), "{denied:?}");
    assert_eq!(
        denied.header("x-ratelimit-limit"),
        Some("100"),
        "{denied:?}"
    );
    let body = checked_body(&denied.body);
    assert_eq!(body["rule"], "bench", "{body}");

    let open = get(&client, &nginx.url("/static/app.js"), &[]).unwrap();
    assert_eq!((open.status, open.body.as_str()), (200, "ok\n"), "{open:?}");
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}

/// 500 concurrent requests on four worker processes against a burst of 50: exactly 50 admitted. The
/// bucket refills 50 a day, so no token comes back during the burst. Each worker has its own Wasm VM;
/// the count is exact only because the buckets live in shared data, which ngx_wasm_module keeps in an
/// `shm_kv` zone that every worker maps.
#[test]
fn the_limit_holds_across_four_workers() {
    let nginx = start(
        Filter::Sluice,
        config(json!({"requests": 50, "per": "day", "burst": 50})),
        4,
    );

    let result = burst(&nginx.url("/api/x"), 500, 16).unwrap();

    assert_eq!(
        (result.count(200), result.count(429)),
        (50, 450),
        "500 requests at once against a burst of 50 that refills one token every 28.8 minutes (run took {:?}); \
         statuses: {:?}",
        result.elapsed,
        result.statuses
    );
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}

/// The answer of docs/clients.md ("A rate limit"): 429, `retry-after`, `content-type`, the draft-11
/// and legacy headers, and a body the reply schema accepts, through nginx.
#[test]
fn a_denial_says_why_and_when_to_retry() {
    let nginx = start(
        Filter::Sluice,
        config(json!({"requests": 5, "per": "minute", "burst": 5})),
        2,
    );
    let client = agent();
    let url = nginx.url("/api/x");

    let mut remaining = Vec::new();
    for _ in 0..5 {
        let reply = get(&client, &url, &[]).unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.body, "ok\n", "the upstream's answer: {reply:?}");
        assert_eq!(int_header(&reply, "x-ratelimit-limit"), 5, "{reply:?}");
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some(r#""per-ip";q=5;w=60"#),
            "{reply:?}"
        );
        let left = int_header(&reply, "x-ratelimit-remaining");
        let ratelimit = reply.header("ratelimit").unwrap_or_default();
        assert_eq!(item_param(ratelimit, "r"), Some(left), "{reply:?}");
        remaining.push(left);
    }
    // 5 a minute is a token every 12 s: none comes back while five requests go through.
    assert_eq!(
        remaining,
        [4, 3, 2, 1, 0],
        "remaining after each admitted request"
    );

    let denied = get(&client, &url, &[]).unwrap();
    assert_eq!(denied.status, 429, "the 6th request: {denied:?}");
    let retry_after = int_header(&denied, "retry-after");
    assert!(
        (1..=12).contains(&retry_after),
        "Retry-After {retry_after}: the next token is at most 12 s away; {denied:?}"
    );
    assert_eq!(int_header(&denied, "x-ratelimit-limit"), 5, "{denied:?}");
    assert_eq!(
        int_header(&denied, "x-ratelimit-remaining"),
        0,
        "{denied:?}"
    );
    let reset = int_header(&denied, "x-ratelimit-reset");
    assert!(
        (1..=60).contains(&reset),
        "X-RateLimit-Reset {reset}; {denied:?}"
    );
    assert_eq!(
        denied.header("ratelimit-policy"),
        Some(r#""per-ip";q=5;w=60"#),
        "{denied:?}"
    );
    let ratelimit = denied.header("ratelimit").unwrap_or_default();
    assert!(ratelimit.starts_with(r#""per-ip";"#), "{denied:?}");
    assert_eq!(item_param(ratelimit, "r"), Some(0), "{denied:?}");
    let t = item_param(ratelimit, "t").unwrap_or_else(|| panic!("RateLimit without t: {denied:?}"));
    assert!((1..=60).contains(&t), "RateLimit t={t}; {denied:?}");

    let content_type = denied.header("content-type").unwrap_or_default();
    assert!(content_type.starts_with("application/json"), "{denied:?}");
    let body: Value = checked_body(&denied.body);
    assert_eq!(body["error"], "rate_limited", "{body}");
    assert_eq!(body["rule"], "per-ip", "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(body["retryAfter"], json!(retry_after), "{body}");
}

#[test]
fn bypassed_and_unmatched_paths_are_never_limited() {
    let nginx = start(
        Filter::Sluice,
        config(json!({"requests": 3, "per": "minute", "burst": 3})),
        2,
    );
    let client = agent();

    let statuses: Vec<u16> = (0..5)
        .map(|_| get(&client, &nginx.url("/api/x"), &[]).unwrap().status)
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429],
        "the limit must be spent first"
    );

    for _ in 0..10 {
        let health = get(&client, &nginx.url("/healthz"), &[]).unwrap();
        assert_eq!(health.status, 200, "/healthz is bypassed: {health:?}");
        assert!(
            !health.has_rate_limit_headers(),
            "a bypassed request carries no rate-limit headers: {health:?}"
        );
        let other = get(&client, &nginx.url("/static/app.js"), &[]).unwrap();
        assert_eq!(other.status, 200, "no rule matches /static/: {other:?}");
    }
    let still = get(&client, &nginx.url("/api/x"), &[]).unwrap();
    assert_eq!(still.status, 429, "/api/ is still limited: {still:?}");
}

/// nginx starts (its master does not run the filter), but every worker fails the filter's
/// `on_configure`, logs sluice's error naming the field, and exits without being respawned.
#[test]
fn a_bad_limit_period_is_refused_naming_the_field() {
    let refusal = Nginx::start_expect_failure(NginxOptions {
        filter: Filter::Sluice,
        plugin_config: config(json!({"requests": 50, "per": "fortnight", "burst": 50})),
        workers: 2,
        ..NginxOptions::default()
    })
    .unwrap();

    let line = refusal
        .log
        .lines()
        .find(|l| l.contains("sluice: invalid configuration"))
        .unwrap_or_else(|| {
            panic!(
                "no `sluice: invalid configuration` line in nginx's log:\n{}",
                refusal.log
            )
        });
    assert!(
        line.contains("rules[0].limits[0].per"),
        "the error must name the field: {line}"
    );
}

/// A local rule's requests, admitted and denied, on several workers and across a few of the filter's
/// ticks: nginx logs no error, so no host call the filter makes on that path failed or trapped.
#[test]
fn a_local_rule_makes_no_host_call_nginx_rejects() {
    let nginx = start(
        Filter::Sluice,
        config(json!({"requests": 20, "per": "minute", "burst": 20})),
        2,
    );
    let client = agent();

    let mut statuses = Vec::new();
    for i in 0..40 {
        statuses.push(get(&client, &nginx.url("/api/x"), &[]).unwrap().status);
        if i % 10 == 9 {
            // The filter flushes its metrics on its tick (1 s at most): let a few happen.
            std::thread::sleep(std::time::Duration::from_millis(600));
        }
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        statuses.len() - statuses.iter().filter(|s| **s == 200).count(),
        "only 200s and 429s: {statuses:?}"
    );
    assert!(statuses.contains(&429), "{statuses:?}");
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}

fn shedding(bulkhead_limit: u32) -> Value {
    json!({
        "mode": "enforce",
        "bulkheads": [{"name": "api", "match": {"path_prefix": "/api/"}, "limit": {"static": bulkhead_limit}}],
    })
}

/// A bulkhead in nginx: every request under its limit passes, one at a time, 20 times over a limit
/// of 2: each request gives its slot back when it ends (a slot never given back would shed the third).
#[test]
fn a_bulkhead_gives_every_slot_back() {
    let nginx = start(
        Filter::Sluice,
        json!({"host": "nginx", "rules": [], "shedding": shedding(2)}).to_string(),
        2,
    );
    let client = agent();
    let statuses: Vec<u16> = (0..20)
        .map(|_| get(&client, &nginx.url("/api/x"), &[]).unwrap().status)
        .collect();
    assert_eq!(
        statuses, [200; 20],
        "one request at a time under a limit of 2"
    );
    assert_eq!(nginx.errors(), Vec::<String>::new(), "nginx logged errors");
}

/// `nginx/nginx.conf` as shipped, with only its ports, its module path and its run dir edited: it
/// starts, its local rule `demo` admits 5 a minute on /api/, and /healthz is bypassed. (Its cached rule
/// has no counter service here: its fallback decides.)
#[test]
fn the_shipped_nginx_conf_starts_and_limits() {
    let shipped = std::fs::read_to_string(repo_root().join("nginx/nginx.conf")).unwrap();
    let ports = free_ports(3).unwrap();
    let (listen, upstream, service) = (ports[0], ports[1], ports[2]);
    let module = nginx_module().unwrap();
    let nginx = Nginx::start_config(
        |dir| {
            let text = replace_exactly(
                &shipped,
                "/usr/lib/nginx/modules/ngx_wasmx_module.so",
                &module.display().to_string(),
                1,
            )?;
            let text =
                replace_exactly(&text, "127.0.0.1:10000", &format!("127.0.0.1:{listen}"), 2)?;
            let text = replace_exactly(
                &text,
                "127.0.0.1:10001",
                &format!("127.0.0.1:{upstream}"),
                3,
            )?;
            let text =
                replace_exactly(&text, "127.0.0.1:8081", &format!("127.0.0.1:{service}"), 2)?;
            replace_exactly(&text, ".run/nginx/", &format!("{}/", dir.display()), 9)
        },
        4,
        listen,
        upstream,
    )
    .unwrap();
    let client = agent();

    let statuses: Vec<u16> = (0..6)
        .map(|_| get(&client, &nginx.url("/api/x"), &[]).unwrap().status)
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 429],
        "rule demo: 5 a minute"
    );
    let health = get(&client, &nginx.url("/healthz"), &[]).unwrap();
    assert_eq!(health.status, 200, "{health:?}");
    assert!(!health.has_rate_limit_headers(), "{health:?}");
    // Each `proxy_wasm sluice` comes with its request hook in the access phase, the only phase where
    // ngx_wasm_module holds a paused request (nginx_service::checked_rules_hold_every_request_...).
    let lines: Vec<&str> = shipped.lines().map(str::trim).collect();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("proxy_wasm sluice") {
            let block_start = lines[..i]
                .iter()
                .rposition(|l| l.ends_with('{'))
                .unwrap_or(0);
            assert!(
                lines[block_start..i].contains(&"proxy_wasm_request_headers_in_access on;"),
                "line {}: proxy_wasm sluice without proxy_wasm_request_headers_in_access on;",
                i + 1
            );
        }
    }
}
