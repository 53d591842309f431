//! The comparison configurations of `envoy/` in a real Envoy: the no-limiter baseline answers everything, and
//! Envoy's native local_ratelimit, at the limit the sluice tests use, admits exactly its bucket across all
//! workers. These are the yardsticks `make bench` measures sluice against.

use sluice_tests::envoy::{agent, burst, get, Envoy, EnvoyOptions, Template};

fn placeholders(max_tokens: u32, fill_interval: &str) -> Vec<(String, String)> {
    vec![
        ("MAX_TOKENS".to_owned(), max_tokens.to_string()),
        ("TOKENS_PER_FILL".to_owned(), max_tokens.to_string()),
        ("FILL_INTERVAL".to_owned(), fill_interval.to_owned()),
    ]
}

#[test]
fn no_limiter_answers_every_request() {
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::NoLimiter,
        concurrency: 2,
        ..EnvoyOptions::default()
    })
    .unwrap();

    let result = burst(&envoy.url("/api/x"), 200, 8).unwrap();

    assert_eq!(result.count(200), 200, "statuses: {:?}", result.statuses);
    let reply = get(&agent(), &envoy.url("/api/x"), &[]).unwrap();
    assert_eq!(reply.body, "ok\n");
    assert!(
        !reply.has_rate_limit_headers(),
        "headers: {:?}",
        reply.headers
    );
}

#[test]
fn native_local_ratelimit_admits_its_bucket_across_workers() {
    let envoy = Envoy::start(EnvoyOptions {
        template: Template::NativeLocalRateLimit,
        concurrency: 4,
        placeholders: placeholders(50, "60s"),
        ..EnvoyOptions::default()
    })
    .unwrap();

    let result = burst(&envoy.url("/api/x"), 500, 16).unwrap();

    // One fill of 50 per 60 s: a burst this short never sees a second fill.
    assert_eq!(result.count(200), 50, "statuses: {:?}", result.statuses);
    assert_eq!(result.count(429), 450, "statuses: {:?}", result.statuses);
    let stats = envoy.stats().unwrap();
    let limited = "http_local_rate_limiter.http_local_rate_limit.rate_limited";
    assert_eq!(
        stats.counter(limited),
        Some(450),
        "{:?}",
        stats.matching("local_rate")
    );
}
