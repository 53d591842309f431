//! Limits that follow load and time (`scale`, `schedule`) and the quota path, through whole
//! exchanges: the limit in force is what is counted and what the headers and Retry-After say.

use sluice_core::shed::Gauge;
use sluice_core::store::Store;
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Reply, Step};

const SECOND: u64 = 1_000_000;
const HOUR: u64 = 3_600 * SECOND;
/// 2023-11-14 00:00 UTC.
const MIDNIGHT: u64 = 1_699_920_000 * SECOND;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn alice() -> PlainRequest {
    PlainRequest::get("/api/x").with_header("x-user", "alice")
}

/// Requests of `request` at `moment` until one is denied (at most 100): how many were
/// admitted, the headers of the last admitted one and the denial.
fn until_denied(
    limiter: &Limiter,
    store: &mut MemoryStore,
    moment: Moment,
    request: fn() -> PlainRequest,
) -> (u64, Vec<(&'static str, String)>, Reply) {
    let mut admitted = 0;
    let mut headers = Vec::new();
    for _ in 0..100 {
        let (mut exchange, step, _) = Exchange::start(limiter, &mut request(), None, moment, store);
        match step {
            Step::Continue => {
                admitted += 1;
                headers = exchange.response_headers(limiter);
            }
            Step::Respond(reply) => return (admitted, headers, reply),
            other => panic!("{other:?}"),
        }
    }
    panic!("never denied");
}

fn header<'a>(headers: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

const NIGHT: &str = r#"{"headers": "both", "rules": [{"name": "api", "key": ["header:x-user"],
    "limits": [{"requests": 10, "per": "minute"}],
    "schedule": [{"utc": "22:00-06:00", "limits": [{"requests": 3, "per": "minute"}]}]}]}"#;

/// A night window across midnight: 3 a minute from 22:00 to 06:00 UTC, 10 otherwise; the
/// headers and Retry-After of each speak of the limit in force.
#[test]
fn a_night_schedule_counts_and_reports_the_limit_in_force() {
    let limiter = limiter(NIGHT);
    for (hour, limit) in [(12, 10), (23, 3), (24 + 2, 3), (24 + 6, 10), (21, 10)] {
        let mut store = MemoryStore::default();
        let moment = Moment::at(MIDNIGHT + hour * HOUR);
        let (admitted, headers, denial) = until_denied(&limiter, &mut store, moment, alice);
        assert_eq!(admitted, limit, "at {hour}:00");
        assert_eq!(
            header(&headers, "x-ratelimit-limit"),
            Some(&*limit.to_string())
        );
        assert_eq!(denial.status, 429);
        assert_eq!(
            denial.headers.get("x-ratelimit-limit"),
            Some(&*limit.to_string())
        );
        let policy = format!("\"api\";q={limit};w=60");
        assert_eq!(denial.headers.get("ratelimit-policy"), Some(&*policy));
        // One token a sixth (a twentieth) of a minute.
        let wait = 60_u64.div_ceil(limit).to_string();
        assert_eq!(
            denial.headers.get("retry-after"),
            Some(&*wait),
            "at {hour}:00"
        );
    }
}

/// A key that spent its day's limit at 21:59 is still over the night's smaller one at 22:00:
/// its counts carry over the switch; at 06:00 the day's limit holds again.
#[test]
fn a_key_s_counts_carry_over_a_switch() {
    let limiter = limiter(NIGHT);
    let mut store = MemoryStore::default();
    let before = Moment::at(MIDNIGHT + 22 * HOUR - SECOND);
    let (admitted, _, _) = until_denied(&limiter, &mut store, before, alice);
    assert_eq!(admitted, 10);
    let night = Moment::at(MIDNIGHT + 22 * HOUR);
    let (admitted, _, _) = until_denied(&limiter, &mut store, night, alice);
    assert_eq!(admitted, 0, "the night's 3 are spent already");
}

fn fleet(level: f64) -> Moment {
    Moment {
        fleet: Some(level),
        ..Moment::at(MIDNIGHT + 12 * HOUR)
    }
}

const FLEET: &str = r#"{"headers": "both", "service": {"cluster": "counter"},
    "shedding": {"fleet": false, "bulkheads": [{"name": "api", "limit": {"static": 1000}}]},
    "rules": [{"name": "api",
    "consistency": "local", "key": ["header:x-user"],
    "limits": [{"requests": 20, "per": "minute", "burst": 8}],
    "scale": {"high": 0.5, "critical": 0.01, "level": "fleet"}}]}"#;

/// The proxy's own utilization of its one bulkhead, as shedding's gauge keeps it.
fn busy(limiter: &Limiter, store: &mut MemoryStore, use_milli: u32) {
    let gauge_key = &limiter.policy().shedding.as_ref().unwrap().bulkheads[0].gauge_key;
    let gauge = Gauge {
        use_milli,
        ..Gauge::default()
    };
    assert!(store.set(gauge_key, &gauge.encode(), 0).unwrap());
}

/// The fleet level from the service scales the limit (×0.5 at high, ×0.01 at critical, rounded
/// up to 1), and whatever the service answers, no limit rises above the configured one. Here
/// the proxy is busy itself (70%): the fleet's level is believed up to 70% + the 30% margin.
#[test]
fn the_fleet_level_scales_limits_and_never_raises_them() {
    let limiter = limiter(FLEET);
    let cases = [
        (0.0, 8, 20),
        (0.9, 4, 10),
        (0.99, 1, 1),
        (f64::NAN, 8, 20),
        (-7.0, 8, 20),
        (f64::INFINITY, 1, 1),
        (f64::MAX, 1, 1),
    ];
    for (level, burst, limit) in cases {
        let mut store = MemoryStore::default();
        busy(&limiter, &mut store, 700);
        let (admitted, _, denial) = until_denied(&limiter, &mut store, fleet(level), alice);
        assert_eq!(admitted, burst, "fleet level {level}");
        assert_eq!(
            denial.headers.get("x-ratelimit-limit"),
            Some(&*limit.to_string()),
            "fleet level {level}"
        );
    }
    // Without a fresh fleet level, the configured limit.
    let mut store = MemoryStore::default();
    let moment = Moment::at(MIDNIGHT);
    assert_eq!(until_denied(&limiter, &mut store, moment, alice).0, 8);
}

/// The fleet level is the mean of what the proxies report: one proxy credential can claim
/// anything. A fleet level far above this proxy's own load is not believed, as shedding does
/// not believe it: an idle proxy told `critical` keeps its configured limit; one at 50% believes
/// the fleet up to 80% (elevated: no factor configured here), one at 70% up to 100%.
#[test]
fn one_credential_s_fleet_level_does_not_cut_an_idle_proxy_s_limits() {
    let limiter = limiter(FLEET);
    for (use_milli, burst) in [(0, 8), (500, 8), (700, 1)] {
        let mut store = MemoryStore::default();
        busy(&limiter, &mut store, use_milli);
        let (admitted, _, _) = until_denied(&limiter, &mut store, fleet(1.0), alice);
        assert_eq!(
            admitted, burst,
            "own utilization {use_milli}‰, fleet told 1.0"
        );
    }
}

/// The proxy's level is shedding's, of the request's bulkhead: high there halves the limit.
#[test]
fn the_proxy_level_of_the_request_s_bulkhead_scales_its_limit() {
    let json = r#"{"headers": "both", "shedding": {"bulkheads": [{"name": "api", "limit": {"static": 1000}}]},
        "rules": [{"name": "api", "key": ["header:x-user"], "limits": [{"requests": 6, "per": "minute"}],
        "scale": {"high": 0.5}}]}"#;
    let limiter = limiter(json);
    let gauge_key = limiter.policy().shedding.as_ref().unwrap().bulkheads[0]
        .gauge_key
        .clone();
    for (use_milli, admitted) in [(0, 6), (900, 3)] {
        let mut store = MemoryStore::default();
        let gauge = Gauge {
            use_milli,
            ..Gauge::default()
        };
        assert!(store.set(&gauge_key, &gauge.encode(), 0).unwrap());
        let moment = Moment::at(MIDNIGHT);
        let (n, _, denial) = until_denied(&limiter, &mut store, moment, alice);
        assert_eq!(n, admitted, "utilization {use_milli}‰");
        assert_eq!(
            denial.headers.get("x-ratelimit-limit"),
            Some(&*admitted.to_string())
        );
    }
}

const QUOTA: &str = r#"{"rules": [{"name": "api", "key": ["header:x-user"],
    "match": {"path_prefix": "/api/"}, "quota_path": "/rate_limit", "quota_path_any_key": true,
    "limits": [{"requests": 5, "per": "minute"}]}]}"#;

fn quota(limiter: &Limiter, store: &mut MemoryStore, request: &mut PlainRequest) -> Reply {
    let moment = Moment::at(MIDNIGHT);
    match Exchange::start(limiter, request, None, moment, store).1 {
        Step::Respond(reply) => reply,
        other => panic!("not answered: {other:?}"),
    }
}

/// The quota path answers the caller's own quota, spends nothing, and answers only there.
#[test]
fn the_quota_path_reads_the_caller_s_own_quota_without_spending_it() {
    let limiter = limiter(QUOTA);
    let mut store = MemoryStore::default();
    let moment = Moment::at(MIDNIGHT);
    for _ in 0..2 {
        let (_, step, _) = Exchange::start(&limiter, &mut alice(), None, moment, &mut store);
        assert_eq!(step, Step::Continue);
    }
    let asked = || PlainRequest::get("/rate_limit").with_header("x-user", "alice");
    for _ in 0..20 {
        let reply = quota(&limiter, &mut store, &mut asked());
        assert_eq!(reply.status, 200);
        assert_eq!(reply.headers.get("content-type"), Some("application/json"));
        assert_eq!(
            reply.body,
            r#"{"rules":{"api":{"limit":5,"remaining":3,"reset":24,"resetAt":1699920024,"window":60}}}"#
        );
    }
    // Another caller's key is its own, whole; naming alice in another header reads nothing of hers.
    let bob = &mut PlainRequest::get("/rate_limit")
        .with_header("x-user", "bob")
        .with_header("x-forwarded-user", "alice");
    assert!(quota(&limiter, &mut store, bob)
        .body
        .contains(r#""remaining":5"#));
    // Twenty reads spent nothing: alice still has her 3.
    let (admitted, _, _) = until_denied(&limiter, &mut store, moment, alice);
    assert_eq!(admitted, 3);
    // Only the exact path: not a prefix, not another case, not with a trailing slash; its
    // query does not matter.
    for path in [
        "/rate_limit/",
        "/RATE_LIMIT",
        "/rate_limit2",
        "/api/rate_limit",
    ] {
        let (_, step, _) = Exchange::start(
            &limiter,
            &mut PlainRequest::get(path).with_header("x-user", "carol"),
            None,
            moment,
            &mut store,
        );
        assert_eq!(step, Step::Continue, "{path}");
    }
    let query = &mut PlainRequest::get("/rate_limit?user=alice").with_header("x-user", "dave");
    assert!(quota(&limiter, &mut store, query)
        .body
        .contains(r#""remaining":5"#));
}

/// A rule that does not count the caller (a key part it skips is missing) says so.
#[test]
fn the_quota_path_of_a_rule_that_skips_the_caller_answers_null() {
    let json = QUOTA.replace(r#""quota_path""#, r#""when_missing": "skip", "quota_path""#);
    let limiter = limiter(&json);
    let reply = quota(
        &limiter,
        &mut MemoryStore::default(),
        &mut PlainRequest::get("/rate_limit"),
    );
    assert_eq!(reply.body, r#"{"rules":{"api":null}}"#);
}

/// The quota path reports the limit in force, here the night's.
#[test]
fn the_quota_path_reports_the_scheduled_limit() {
    let json = NIGHT.replace(
        r#""limits": [{"requests": 10"#,
        r#""quota_path": "/rate_limit", "quota_path_any_key": true, "limits": [{"requests": 10"#,
    );
    let limiter = limiter(&json);
    let mut store = MemoryStore::default();
    let moment = Moment::at(MIDNIGHT + 23 * HOUR);
    let request = &mut PlainRequest::get("/rate_limit").with_header("x-user", "alice");
    let Step::Respond(reply) = Exchange::start(&limiter, request, None, moment, &mut store).1
    else {
        panic!("not answered");
    };
    assert!(
        reply.body.contains(r#""limit":3,"remaining":3"#),
        "{}",
        reply.body
    );
}

/// A quota path answers only for a key the caller cannot choose: a rule keyed by anything the
/// caller sends (a header, cookie, query parameter, the path or the method, alone, beside the
/// address or as an alternative) is refused, naming the part and the opt-in, unless it accepts
/// that anyone reads any key's quota (`quota_path_any_key`). The address, its network, a
/// verified claim and a constant need no opt-in.
#[test]
fn a_quota_path_needs_a_key_the_caller_cannot_choose_or_the_opt_in() {
    let config = |key: &str, opt_in: &str| {
        format!(
            r#"{{"rules": [{{"name": "api", "key": {key}, "quota_path": "/rate_limit",{opt_in}
            "limits": [{{"requests": 5, "per": "minute"}}]}}]}}"#
        )
    };
    for (key, part) in [
        (r#"["header:x-user"]"#, "header:x-user"),
        (r#"["client_ip", "cookie:sid"]"#, "cookie:sid"),
        (r#"["query:api_key"]"#, "query:api_key"),
        (r#"["client_ip", "path"]"#, "path"),
        (r#"["client_ip", "method"]"#, "method"),
        (r#"["jwt:sub|header:x-user"]"#, "header:x-user"),
    ] {
        for opt_in in ["", r#" "quota_path_any_key": false,"#] {
            let error = sluice_core::parse(config(key, opt_in).as_bytes()).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "rules[0].quota_path: the key part {part} is sent by the caller, who could read any key's quota (another account's remaining requests, its penalty's end) by naming it: key the rule by client_ip or jwt: claims, or accept that with \"quota_path_any_key\": true"
                ),
                "{key}{opt_in}"
            );
        }
        let accepted =
            sluice_core::parse(config(key, r#" "quota_path_any_key": true,"#).as_bytes());
        assert!(accepted.is_ok(), "{key}: {accepted:?}");
    }
    for key in [
        r#"["client_ip"]"#,
        r#"["client_ip/24"]"#,
        r#"["jwt:sub"]"#,
        r#"["jwt:org", "const:api"]"#,
        r#"["jwt:sub|client_ip"]"#,
    ] {
        let accepted = sluice_core::parse(config(key, "").as_bytes());
        assert!(accepted.is_ok(), "{key}: {accepted:?}");
    }
}

/// A request of the quota path is decided by every other rule that matches it, as any request:
/// a per-address rule spends a token on each probe and denies the probes past its limit with a
/// 429, whatever key the probe names. The rule answering the path reads its key and spends
/// nothing, even where its match takes the path. Answered or denied, a probe gives its
/// bulkhead slot back at once (one slot serves them all).
#[test]
fn quota_path_probes_are_charged_to_a_per_address_rule() {
    let limiter = limiter(
        r#"{"shedding": {"bulkheads": [{"name": "all", "limit": {"static": 1}}]}, "rules": [
        {"name": "per-ip", "key": ["client_ip"], "limits": [{"requests": 3, "per": "minute"}]},
        {"name": "api", "key": ["header:x-user"], "quota_path": "/rate_limit",
         "quota_path_any_key": true, "limits": [{"requests": 5, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let moment = Moment::at(MIDNIGHT);
    let prober: std::net::IpAddr = "203.0.113.7".parse().unwrap();
    let mut statuses = Vec::new();
    for user in ["alice", "bob", "carol", "dave", "erin"] {
        let request = &mut PlainRequest::get("/rate_limit")
            .from_ip("203.0.113.7")
            .with_header("x-user", user);
        let (_, step, _) = Exchange::start(&limiter, request, Some(prober), moment, &mut store);
        let Step::Respond(reply) = step else {
            panic!("not answered: {step:?}");
        };
        if reply.status == 200 {
            assert!(
                reply.body.contains(r#""api":{"limit":5,"remaining":5"#),
                "the answering rule spent nothing: {}",
                reply.body
            );
        } else {
            assert!(reply.body.contains("per-ip"), "{}", reply.body);
        }
        statuses.push(reply.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429], "3 probes an address");
    let gauge_key = &limiter.policy().shedding.as_ref().unwrap().bulkheads[0].gauge_key;
    let (bytes, _) = store.get(gauge_key).unwrap().unwrap();
    assert_eq!(Gauge::decode(&bytes).in_flight, 0, "every slot given back");
    // The prober's address has nothing left for any request; another address is untouched.
    let (_, step, _) = Exchange::start(
        &limiter,
        &mut PlainRequest::get("/api/x")
            .from_ip("203.0.113.7")
            .with_header("x-user", "zed"),
        Some(prober),
        moment,
        &mut store,
    );
    assert!(matches!(step, Step::Respond(r) if r.status == 429));
    let other: std::net::IpAddr = "198.51.100.1".parse().unwrap();
    let request = &mut PlainRequest::get("/rate_limit")
        .from_ip("198.51.100.1")
        .with_header("x-user", "alice");
    let (_, step, _) = Exchange::start(&limiter, request, Some(other), moment, &mut store);
    assert!(
        matches!(&step, Step::Respond(r) if r.status == 200),
        "{step:?}"
    );
}
