//! Login protection: a rule that counts only the requests whose answer matches (`count_when`),
//! a `penalty` that keeps a key denied once it went over, and `cookie:NAME` key parts; and what
//! each refuses of a configuration, naming the field.

use sluice_core::policy::RuleId;
use sluice_core::sync::proxy::{apply_lease, take, Taken};
use sluice_core::{Effect, Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}")))
}

fn login(user: &str) -> PlainRequest {
    PlainRequest::get("/login").with_header("x-user", user)
}

/// Starts a request at `now`: its step, and the exchange.
fn start(
    limiter: &Limiter,
    request: &mut PlainRequest,
    now: u64,
    store: &mut MemoryStore,
) -> (Exchange, Step) {
    let (exchange, step, _) = Exchange::start(limiter, request, None, Moment::at(now), store);
    (exchange, step)
}

/// A request of `user` at `now` answered `status`: whether it went upstream.
fn attempt(
    limiter: &Limiter,
    user: &str,
    status: u32,
    now: u64,
    store: &mut MemoryStore,
) -> Result<(), sluice_core::Reply> {
    let (mut exchange, step) = start(limiter, &mut login(user), now, store);
    match step {
        Step::Continue => {
            exchange.response_status(limiter, status, now, store);
            Ok(())
        }
        Step::Respond(reply) => Err(reply),
        other => panic!("{other:?}"),
    }
}

const FAILED_LOGINS: &str = r#"{"rules": [{"name": "login", "key": ["header:x-user"],
    "count_when": {"statuses": [401, 403]},
    "limits": [{"requests": 5, "per": "minute"}]}]}"#;

#[test]
fn only_the_answers_that_match_are_counted() {
    let limiter = limiter(FAILED_LOGINS);
    let mut store = MemoryStore::default();
    // A hundred successful logins in a second spend nothing.
    for i in 0..100 {
        assert!(attempt(&limiter, "alice", 200, T0 + i, &mut store).is_ok());
    }
    // Five failures are let through and counted; the sixth attempt is denied up front, whatever
    // its answer would have been.
    for i in 0..5 {
        assert!(attempt(&limiter, "alice", 401, T0 + 200 + i, &mut store).is_ok());
    }
    let denied = attempt(&limiter, "alice", 200, T0 + 300, &mut store).unwrap_err();
    assert_eq!(denied.status, 429);
    // Another account is not touched, and a 403 counts as a 401 does.
    for i in 0..5 {
        assert!(attempt(&limiter, "bob", 403, T0 + 400 + i, &mut store).is_ok());
    }
    assert!(attempt(&limiter, "bob", 200, T0 + 500, &mut store).is_err());
    // A minute on, a failure is back (5 a minute: one every 12 s).
    assert!(attempt(&limiter, "alice", 401, T0 + 13 * SECOND, &mut store).is_ok());
    assert!(attempt(&limiter, "alice", 401, T0 + 13 * SECOND + 1, &mut store).is_err());
}

#[test]
fn a_request_without_an_answer_or_denied_by_a_later_rule_is_not_counted() {
    let limiter = limiter(
        r#"{"rules": [
        {"name": "login", "key": ["header:x-user"], "count_when": {"statuses": [401]},
         "limits": [{"requests": 2, "per": "minute"}]},
        {"name": "all", "key": ["const:all"], "limits": [{"requests": 3, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    // Three requests whose streams end without an answer (resets): what each held while it was
    // in flight goes back, so nothing is charged to the key.
    for i in 0..3 {
        let (mut exchange, step) = start(&limiter, &mut login("alice"), T0 + i, &mut store);
        assert_eq!(step, Step::Continue);
        exchange.finish(&limiter, &mut store);
    }
    // The second rule denies now: the first charges nothing for it, even on a 401.
    let (mut exchange, step) = start(&limiter, &mut login("alice"), T0 + 10, &mut store);
    assert!(matches!(step, Step::Respond(_)), "{step:?}");
    assert!(!exchange.counts_by_status(&limiter));
    assert!(exchange
        .response_status(&limiter, 401, T0 + 10, &mut store)
        .is_empty());
}

#[test]
fn the_status_is_counted_once() {
    let limiter = limiter(FAILED_LOGINS);
    let mut store = MemoryStore::default();
    let (mut exchange, step) = start(&limiter, &mut login("alice"), T0, &mut store);
    assert_eq!(step, Step::Continue);
    assert!(exchange.counts_by_status(&limiter));
    let effects = exchange.response_status(&limiter, 401, T0, &mut store);
    assert_eq!(
        effects,
        vec![Effect::Charged {
            rule: RuleId::new(0),
            cost: 1
        }]
    );
    assert!(exchange
        .response_status(&limiter, 401, T0, &mut store)
        .is_empty());
    assert!(!exchange.counts_by_status(&limiter));
}

/// A cached rule counts by the answer too: nothing from the lease up front, the failure reported
/// to the service with the next sync.
#[test]
fn a_cached_rule_reports_what_its_answers_counted() {
    let limiter = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [{"name": "login", "key": ["header:x-user"],
        "consistency": "cached", "count_when": {"statuses": [401]},
        "limits": [{"requests": 5, "per": "minute"}]}]}"#,
    );
    let rule = RuleId::new(0);
    let key = "login\u{1f}alice";
    let mut store = MemoryStore::default();
    for (i, status) in [200, 401, 200, 401, 401].into_iter().enumerate() {
        assert!(attempt(&limiter, "alice", status, T0 + i as u64, &mut store).is_ok());
    }
    let Taken::Entry(entry) = take(&limiter, rule, key, T0 + 10, 100_000, &mut store) else {
        panic!("no entry");
    };
    assert_eq!((entry.spent, entry.denied), (3, 0), "three failures");
}

/// A burst of failed logins in flight at once: each request holds its cost from its admission
/// until its answer, so no more requests of a key reach the backend than its limit, however many
/// arrive before the first answer (20 concurrent streams of one HTTP/2 connection, say).
#[test]
fn a_burst_in_flight_reaches_the_backend_no_more_than_the_limit() {
    let limiter = limiter(FAILED_LOGINS);
    let mut store = MemoryStore::default();
    let mut in_flight = Vec::new();
    let mut denied = 0;
    for i in 0..20 {
        match start(&limiter, &mut login("alice"), T0 + i, &mut store) {
            (exchange, Step::Continue) => in_flight.push(exchange),
            (_, Step::Respond(reply)) => {
                assert_eq!(reply.status, 429);
                denied += 1;
            }
            (_, other) => panic!("{other:?}"),
        }
    }
    assert_eq!(
        (in_flight.len(), denied),
        (5, 15),
        "5 a minute: 5 forwarded"
    );
    // They all fail: the key stays at its limit, the next attempt is denied.
    for mut exchange in in_flight {
        exchange.response_status(&limiter, 401, T0 + 100, &mut store);
        exchange.finish(&limiter, &mut store);
    }
    assert!(attempt(&limiter, "alice", 401, T0 + 200, &mut store).is_err());
}

/// What a request held while in flight goes back when its answer is not one the rule counts, and
/// when its stream ends without an answer: successful logins in flight together never deny the
/// next one once they are answered.
#[test]
fn an_answer_that_does_not_count_gives_its_hold_back() {
    let limiter = limiter(FAILED_LOGINS);
    let mut store = MemoryStore::default();
    let held: Vec<Exchange> = (0..5)
        .map(|i| {
            let (exchange, step) = start(&limiter, &mut login("alice"), T0 + i, &mut store);
            assert_eq!(step, Step::Continue);
            exchange
        })
        .collect();
    // All five held: a sixth in flight is denied.
    assert!(attempt(&limiter, "alice", 200, T0 + 10, &mut store).is_err());
    // Three succeed, two end without an answer (a reset, a timeout before the headers).
    for (i, mut exchange) in held.into_iter().enumerate() {
        if i < 3 {
            assert!(exchange
                .response_status(&limiter, 200, T0 + 20, &mut store)
                .is_empty());
        }
        exchange.finish(&limiter, &mut store);
    }
    // Nothing was counted: five failures are let through again.
    for i in 0..5 {
        assert!(attempt(&limiter, "alice", 401, T0 + 30 + i, &mut store).is_ok());
    }
    assert!(attempt(&limiter, "alice", 401, T0 + 40, &mut store).is_err());
}

/// With a penalty, a burst in flight puts the key in it at the first request that finds its
/// limit held: at most the limit reach the backend, and the key is then out for the penalty.
#[test]
fn a_burst_of_failures_in_flight_starts_the_penalty() {
    let limiter = limiter(
        r#"{"rules": [{"name": "login", "key": ["header:x-user"], "penalty": "10m",
        "count_when": {"statuses": [401]}, "limits": [{"requests": 3, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let mut in_flight = Vec::new();
    let mut retry_after = Vec::new();
    for i in 0..20 {
        match start(&limiter, &mut login("alice"), T0 + i, &mut store) {
            (exchange, Step::Continue) => in_flight.push(exchange),
            (_, Step::Respond(reply)) => {
                retry_after.push(reply.headers.get("retry-after").map(str::to_string))
            }
            (_, other) => panic!("{other:?}"),
        }
    }
    assert_eq!(in_flight.len(), 3);
    assert!(
        retry_after.iter().all(|r| r.as_deref() == Some("600")),
        "{retry_after:?}"
    );
    for mut exchange in in_flight {
        exchange.response_status(&limiter, 401, T0 + 400_000, &mut store);
        exchange.finish(&limiter, &mut store);
    }
    let later = attempt(&limiter, "alice", 401, T0 + 3 + 120 * SECOND, &mut store).unwrap_err();
    assert_eq!(later.headers.get("retry-after"), Some("480"));
}

/// A cached rule's requests hold their cost from the lease while in flight, as a local rule's
/// hold from its buckets: what is given back is back in the lease, and the sync reports only
/// what was kept.
#[test]
fn a_cached_rule_holds_its_lease_while_in_flight() {
    let limiter = limiter(
        r#"{"service": {"cluster": "svc"}, "rules": [{"name": "login", "key": ["header:x-user"],
        "consistency": "cached", "count_when": {"statuses": [401]},
        "limits": [{"requests": 5, "per": "minute"}]}]}"#,
    );
    let rule = RuleId::new(0);
    let key = "login\u{1f}alice";
    let mut store = MemoryStore::default();
    // A failure reported, then a lease of 4 from the service.
    assert!(attempt(&limiter, "alice", 401, T0, &mut store).is_ok());
    let Taken::Entry(_) = take(&limiter, rule, key, T0 + 1, 100_000, &mut store) else {
        panic!("no entry");
    };
    apply_lease(&limiter, rule, key, &answer(4, 4, 0), T0 + 2, &mut store).unwrap();
    let mut in_flight = Vec::new();
    for i in 0..10 {
        if let (exchange, Step::Continue) =
            start(&limiter, &mut login("alice"), T0 + 10 + i, &mut store)
        {
            in_flight.push(exchange);
        }
    }
    assert_eq!(in_flight.len(), 4, "no more in flight than the lease");
    for (i, mut exchange) in in_flight.into_iter().enumerate() {
        let status = if i == 0 { 401 } else { 200 };
        exchange.response_status(&limiter, status, T0 + 30, &mut store);
        exchange.finish(&limiter, &mut store);
    }
    let Taken::Entry(entry) = take(&limiter, rule, key, T0 + 40, 100_000, &mut store) else {
        panic!("no entry");
    };
    assert_eq!(
        entry.spent, 1,
        "the one failure, the three successes given back"
    );
}

const PENALTY: &str = r#"{"headers": "legacy", "rules": [{"name": "login", "key": ["header:x-user"],
    "penalty": "10m", "limits": [{"requests": 3, "per": "minute"}]}]}"#;

#[test]
fn a_key_that_went_over_stays_denied_for_its_penalty() {
    let limiter = limiter(PENALTY);
    let mut store = MemoryStore::default();
    for i in 0..3 {
        assert!(attempt(&limiter, "alice", 200, T0 + i, &mut store).is_ok());
    }
    // Over: denied, told to come back when the penalty ends.
    let first = attempt(&limiter, "alice", 200, T0 + 10, &mut store).unwrap_err();
    assert_eq!(first.headers.get("retry-after"), Some("600"));
    assert_eq!(first.headers.get("x-ratelimit-reset"), Some("600"));
    // A minute later the bucket is full again, but the key is still in its penalty: denied,
    // told the time left.
    let later = attempt(&limiter, "alice", 200, T0 + 10 + 60 * SECOND, &mut store).unwrap_err();
    assert_eq!(later.headers.get("retry-after"), Some("540"));
    // Another key is not.
    assert!(attempt(&limiter, "bob", 200, T0 + 20, &mut store).is_ok());
    // Once it is over, the key has its full limit again.
    let after = T0 + 10 + 600 * SECOND;
    for i in 0..3 {
        assert!(attempt(&limiter, "alice", 200, after + i, &mut store).is_ok());
    }
}

/// The penalty is in the key's record in the shared store: every worker (each its own limiter
/// over the one store) denies the key.
#[test]
fn every_worker_keeps_the_penalty() {
    let mut store = MemoryStore::default();
    let one = limiter(PENALTY);
    let two = limiter(PENALTY);
    for i in 0..4 {
        let _ = attempt(&one, "alice", 200, T0 + i, &mut store);
    }
    let denied = attempt(&two, "alice", 200, T0 + 3 + 120 * SECOND, &mut store).unwrap_err();
    assert_eq!(denied.headers.get("retry-after"), Some("480"));
}

/// A penalty with count_when: the failures that went over start it.
#[test]
fn failed_logins_then_a_penalty() {
    let limiter = limiter(
        r#"{"rules": [{"name": "login", "key": ["header:x-user"], "penalty": 900,
        "count_when": {"statuses": [401]}, "limits": [{"requests": 2, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    assert!(attempt(&limiter, "alice", 401, T0, &mut store).is_ok());
    assert!(attempt(&limiter, "alice", 401, T0 + 1, &mut store).is_ok());
    let denied = attempt(&limiter, "alice", 200, T0 + 2, &mut store).unwrap_err();
    assert_eq!(denied.headers.get("retry-after"), Some("900"));
    assert!(attempt(&limiter, "alice", 200, T0 + 899 * SECOND, &mut store).is_err());
    assert!(attempt(&limiter, "alice", 200, T0 + 901 * SECOND, &mut store).is_ok());
}

#[test]
fn a_cookie_keys_the_rule() {
    let limiter = limiter(
        r#"{"rules": [{"name": "r", "key": ["cookie:sid"], "limits": [{"requests": 1, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let with = |cookies: &[&str], now: u64, store: &mut MemoryStore| {
        let mut request = PlainRequest::get("/");
        for c in cookies {
            request = request.with_header("cookie", c);
        }
        let (_, step) = start(&limiter, &mut request, now, store);
        step == Step::Continue
    };
    assert!(with(&["theme=dark; sid=abc"], T0, &mut store));
    assert!(!with(&["sid=abc; theme=light"], T0 + 1, &mut store));
    // Quoted and spaced as RFC 6265 allows: the same cookie.
    assert!(!with(&["  sid = \"abc\" "], T0 + 2, &mut store));
    // Another value, another bucket; names are case-sensitive.
    assert!(with(&["sid=def"], T0 + 3, &mut store));
    assert!(with(&["SID=abc"], T0 + 4, &mut store), "no sid: missing");
}

/// Attacker's test: whoever sends the request controls the Cookie header. Leaving the cookie out,
/// emptying it, burying it, or sending it twice never escapes the limit of its value.
#[test]
fn a_missing_or_forged_cookie_never_exempts_a_request() {
    use sluice_core::limiter::key::build;
    let policy = sluice_core::parse(
        br#"{"rules": [{"name": "r", "key": ["cookie:sid"], "limits": [{"requests": 1, "per": "minute"}]}]}"#,
    )
    .unwrap();
    let rule = &policy.rules[0];
    let keys = |cookies: &[&str]| {
        let mut request = PlainRequest::get("/");
        for c in cookies {
            request = request.with_header("cookie", c);
        }
        build(rule, &mut request)
    };
    let missing = keys(&[]);
    assert_eq!(missing, vec!["r\u{1f}\u{1e}missing".to_string()]);
    // No value, a pair without `=`, an empty cookie header, another cookie: all missing, one
    // shared bucket (never none).
    for forged in [
        vec!["sid="],
        vec!["sid"],
        vec![""],
        vec!["other=1"],
        vec!["sid=\"\""],
    ] {
        assert_eq!(keys(&forged), missing, "{forged:?}");
    }
    // A duplicate name counts the request against each value: a junk first cookie does not hide
    // the real one.
    assert_eq!(
        keys(&["sid=junk; sid=abc"]),
        vec!["r\u{1f}junk".to_string(), "r\u{1f}abc".to_string()]
    );
    assert_eq!(
        keys(&["sid=junk", "sid=abc"]),
        vec!["r\u{1f}junk".to_string(), "r\u{1f}abc".to_string()]
    );
    // A cookie buried behind thousands of others is still read: it is its own key, never
    // missing. A value as long as the header becomes a digest.
    let many: String = (0..100_000).map(|i| format!("c{i}=v; ")).collect();
    let buried = format!("{many}sid=abc");
    assert_eq!(keys(&[&buried]), vec!["r\u{1f}abc".to_string()]);
    let huge = format!("sid={}", "x".repeat(100_000));
    let key = keys(&[&huge]);
    assert_eq!(key.len(), 1);
    assert!(key[0].len() <= sluice_core::limiter::key::MAX_KEY_BYTES);
    // A value that looks like sluice's own marker is not one.
    assert_ne!(keys(&["sid=\u{1e}missing"]), missing);
}

/// Attacker's test: a client buries its exhausted cookie behind more pairs than sluice keeps
/// (`a=; a=; ...`, then `sid=abc`: the backend still reads `sid`). The request is counted in the
/// cookie's own bucket, under `when_missing: "skip"` as under the default: never exempt, never
/// the missing bucket.
#[test]
fn a_cookie_buried_behind_many_pairs_is_counted_in_its_own_bucket() {
    for when_missing in ["", r#""when_missing": "skip","#] {
        let limiter = limiter(&format!(
            r#"{{"rules": [{{"name": "r", "key": ["cookie:sid"], {when_missing}
                "limits": [{{"requests": 1, "per": "minute"}}]}}]}}"#
        ));
        let mut store = MemoryStore::default();
        let admitted = |cookie: &str, now: u64, store: &mut MemoryStore| {
            let mut request = PlainRequest::get("/").with_header("cookie", cookie);
            start(&limiter, &mut request, now, store).1 == Step::Continue
        };
        assert!(admitted("sid=abc", T0, &mut store));
        assert!(!admitted("sid=abc", T0 + 1, &mut store), "{when_missing}");
        for junk in [256, 257, 20_000] {
            let buried = format!("{}sid=abc", "a=; ".repeat(junk));
            assert!(
                !admitted(&buried, T0 + 2, &mut store),
                "{junk} pairs before sid ({when_missing})"
            );
            // In a second Cookie header (HTTP/2 sends each cookie in its own).
            let mut request = PlainRequest::get("/")
                .with_header("cookie", &"a=; ".repeat(junk))
                .with_header("cookie", "sid=abc");
            assert_ne!(
                start(&limiter, &mut request, T0 + 3, &mut store).1,
                Step::Continue,
                "{junk} pairs in another header ({when_missing})"
            );
        }
        // Another session buried the same way has its own bucket.
        let other = format!("{}sid=def", "a=; ".repeat(256));
        assert!(admitted(&other, T0 + 4, &mut store), "{when_missing}");
        assert!(!admitted(&other, T0 + 5, &mut store), "{when_missing}");
    }
}

/// A Cookie header that is not UTF-8 (a junk cookie of bytes over 0x7f, which Envoy lets
/// through) still yields the cookies around it: it does not hide `sid` from a rule that skips
/// requests without it.
#[test]
fn a_cookie_header_that_is_not_utf8_still_yields_its_cookies() {
    use sluice_core::request::{cookie_values, header_value};
    let header = header_value(b"junk=\xff\xfe; sid=abc; theme=\xc3");
    assert_eq!(cookie_values(&[header], "sid"), vec!["abc".to_string()]);
    // The value itself not UTF-8: a value (never missing), the same for the same bytes.
    let bad = |bytes: &[u8]| cookie_values(&[header_value(bytes)], "sid");
    assert_eq!(bad(b"sid=\xff").len(), 1);
    assert_eq!(bad(b"sid=\xff"), bad(b"x=1; sid=\xff"));
    // Values that are not UTF-8 are keyed by their bytes, never merged: a client cannot put
    // another's session into its penalty by sending some other bytes that are not UTF-8, sent
    // as they are or percent-encoded.
    assert_ne!(bad(b"sid=\xff"), bad(b"sid=\xfe"));
    assert_ne!(bad(b"sid=%FF"), bad(b"sid=%FE"));
    assert_ne!(bad(b"sid=a\xffb"), bad(b"sid=a\xfeb"));
    assert_eq!(bad(b"sid=%FF"), bad(b"sid=\xff"), "encoded or not, one key");
    assert_eq!(bad(b"sid=abc"), vec!["abc".to_string()]);
}

/// Cookie values are percent-decoded as query values are: `sid=%61bc` is `sid=abc` (a backend
/// that decodes cookies sees one session), so re-encoding escapes neither a limit nor a penalty.
/// `+`, `%2B` and `%20` are one (backends differ in which of them they decode).
#[test]
fn a_re_encoded_cookie_is_the_same_key() {
    use sluice_core::limiter::key::build;
    let limiter = limiter(
        r#"{"rules": [{"name": "r", "key": ["cookie:sid"], "when_missing": "skip",
            "limits": [{"requests": 1, "per": "minute"}]}]}"#,
    );
    let mut store = MemoryStore::default();
    let admitted = |cookie: &str, now: u64, store: &mut MemoryStore| {
        let mut request = PlainRequest::get("/").with_header("cookie", cookie);
        start(&limiter, &mut request, now, store).1 == Step::Continue
    };
    assert!(admitted("sid=abc", T0, &mut store));
    // The name too, as query names are: `s%69d` is `sid` to a backend that decodes names.
    for encoded in [
        "sid=%61bc",
        "sid=%61%62%63",
        "sid=\"%61bc\"",
        "sid=ab%63",
        "s%69d=abc",
    ] {
        assert!(!admitted(encoded, T0 + 1, &mut store), "{encoded}");
    }
    let rule = &limiter.policy().rules[0];
    let key = |cookie: &str| {
        build(
            rule,
            &mut PlainRequest::get("/").with_header("cookie", cookie),
        )
    };
    assert_eq!(key("sid=a+b"), key("sid=a%2Bb"));
    assert_eq!(key("sid=a+b"), key("sid=a%20b"));
    assert_eq!(key("sid=%E2%82%AC"), key("sid=\u{20ac}"));
    // Decoded to sluice's own marker, or to nothing: a value of its own, never missing.
    let mut missing_rule = rule.clone();
    missing_rule.when_missing = sluice_core::policy::WhenMissing::Count;
    let missing = build(&missing_rule, &mut PlainRequest::get("/"));
    let counted = |cookie: &str| {
        build(
            &missing_rule,
            &mut PlainRequest::get("/").with_header("cookie", cookie),
        )
    };
    assert_ne!(counted("sid=%1Emissing"), missing);
    assert_eq!(counted("sid=%1Emissing"), counted("sid=\u{1e}missing"));
    assert_eq!(counted("sid=%").len(), 1);
    // Bad escapes stay as written.
    assert_ne!(key("sid=%zz"), key("sid=zz"));
}

fn refused(json: &str, field: &str) {
    match sluice_core::parse(json.as_bytes()) {
        Ok(_) => panic!("accepted: {json}"),
        Err(e) => assert!(e.to_string().contains(field), "{e} does not name {field}"),
    }
}

fn rule(extra: &str) -> String {
    format!(
        r#"{{"service": {{"cluster": "svc"}}, "rules": [{{"name": "r", "key": ["client_ip"], {extra}
        "limits": [{{"requests": 5, "per": "minute"}}]}}]}}"#
    )
}

/// Attacker's test: whoever writes the configuration (or a file it is generated from). The worst
/// values of each new field are refused, naming it.
#[test]
fn what_the_new_fields_refuse() {
    for (extra, field) in [
        (r#""penalty": 0,"#, "rules[0].penalty"),
        (r#""penalty": "0s","#, "rules[0].penalty"),
        (r#""penalty": "1000y","#, "rules[0].penalty"),
        (r#""penalty": 31622401,"#, "rules[0].penalty"),
        (r#""penalty": 18446744073709551615,"#, "rules[0].penalty"),
        (
            r#""penalty": "999999999999999999999d","#,
            "rules[0].penalty",
        ),
        (r#""penalty": -1,"#, "rules[0].penalty"),
        (r#""penalty": 1.5,"#, "rules[0].penalty"),
        (r#""penalty": "month","#, "rules[0].penalty"),
        (r#""penalty": true,"#, "rules[0].penalty"),
        (
            r#""count_when": {"statuses": []},"#,
            "rules[0].count_when.statuses",
        ),
        (
            r#""count_when": {"statuses": [99]},"#,
            "rules[0].count_when.statuses[0]",
        ),
        (
            r#""count_when": {"statuses": [401, 600]},"#,
            "rules[0].count_when.statuses[1]",
        ),
        (
            r#""count_when": {"statuses": [18446744073709551615]},"#,
            "rules[0].count_when.statuses[0]",
        ),
        (r#""count_when": {"status": [401]},"#, "count_when"),
        (
            r#""count_when": {"statuses": [401]}, "consistency": "strict","#,
            "rules[0].count_when",
        ),
        (
            r#""count_when": {"statuses": [401]}, "cost_header": "x-cost","#,
            "rules[0].count_when",
        ),
        (
            r#""count_when": {"statuses": [401]}, "fallback": {"policy": "fail_closed"},"#,
            "rules[0].count_when",
        ),
    ] {
        refused(&rule(extra), field);
    }
    let many: Vec<String> = (100..133).map(|s| s.to_string()).collect();
    refused(
        &rule(&format!(
            r#""count_when": {{"statuses": [{}]}},"#,
            many.join(",")
        )),
        "rules[0].count_when.statuses",
    );
    refused(
        r#"{"rules": [{"name": "r", "key": ["client_ip"], "count_when": {"statuses": [401]},
           "limits": [{"requests": 5, "per": "second", "algorithm": "leaky_bucket"}]}]}"#,
        "rules[0].count_when",
    );
    for bad in [
        "cookie:",
        "cookie:a b",
        "cookie:a;b",
        "cookie:a=b",
        "cookie:\u{e9}",
    ] {
        refused(
            &format!(
                r#"{{"rules": [{{"name": "r", "key": [{bad:?}], "limits": [{{"requests": 5, "per": "minute"}}]}}]}}"#
            ),
            "rules[0].key[0]",
        );
    }
    // The longest penalty and a status of each class are taken; a penalty in every mode (the
    // service keeps it for cached and strict rules).
    for extra in [
        r#""penalty": "366d","#,
        r#""penalty": 1,"#,
        r#""penalty": "10m", "consistency": "strict","#,
        r#""penalty": "10m", "consistency": "cached","#,
        r#""count_when": {"statuses": [100, 599, 401, 401]},"#,
    ] {
        sluice_core::parse(rule(extra).as_bytes()).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
}

// The penalty shared through the counter service: the wire carries the rule's penalty, a lease
// answer's penalty keeps the key denied here, and a lease that merely ran out starts none.

const CACHED_PENALTY: &str = r#"{"headers": "legacy", "service": {"cluster": "svc", "token": "t"},
    "rules": [{"name": "login", "key": ["header:x-user"], "consistency": "cached",
    "penalty": "10m", "limits": [{"requests": 100, "per": "minute"}]}]}"#;

const ALICE: &str = "login\u{1f}alice";

fn up(now: u64) -> sluice_core::limiter::Conditions {
    sluice_core::limiter::Conditions {
        now_us: now,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

/// What one request of `user` gets from the limiter alone (no exchange): `None` when admitted,
/// else its Retry-After in microseconds.
fn decided(limiter: &Limiter, user: &str, now: u64, store: &mut MemoryStore) -> Option<u64> {
    match limiter.decide(&mut login(user), up(now), store).decision {
        sluice_core::Decision::Allow { .. } => None,
        sluice_core::Decision::Deny { retry_after_us, .. } => Some(retry_after_us),
        other => panic!("{other:?}"),
    }
}

fn answer(tokens: u64, remaining: u64, penalty_ms: u64) -> sluice_core::protocol::Lease {
    sluice_core::protocol::Lease {
        tokens,
        ttl_ms: 5_000,
        remaining,
        reset_ms: 1_000,
        token_ms: None,
        refused: None,
        penalty_ms,
    }
}

#[test]
fn the_sync_entry_and_the_strict_check_carry_the_rules_penalty() {
    let limiter = limiter(CACHED_PENALTY);
    let mut store = MemoryStore::default();
    let _ = decided(&limiter, "alice", T0, &mut store);
    let Taken::Entry(entry) = take(&limiter, RuleId::new(0), ALICE, T0, 100_000, &mut store) else {
        panic!("an entry");
    };
    assert_eq!(entry.penalty_ms, 600_000);

    let strict = self::limiter(&CACHED_PENALTY.replace("cached", "strict"));
    let (_, step, effects) = Exchange::start(
        &strict,
        &mut login("alice"),
        None,
        Moment::at(T0),
        &mut MemoryStore::default(),
    );
    assert!(matches!(step, Step::Wait), "{step:?}");
    let checks: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Check { request, .. } => Some(request.penalty_ms),
            _ => None,
        })
        .collect();
    assert_eq!(checks, vec![600_000]);
}

/// A key the service answered in its penalty is denied here until it ends, told the time left,
/// though the lease and the global bucket have room.
#[test]
fn a_penalty_answered_by_the_service_denies_the_key_here() {
    let limiter = limiter(CACHED_PENALTY);
    let mut store = MemoryStore::default();
    let rule = RuleId::new(0);
    apply_lease(&limiter, rule, ALICE, &answer(50, 50, 0), T0, &mut store).unwrap();
    assert_eq!(decided(&limiter, "alice", T0 + 1, &mut store), None);
    // Another proxy's traffic put the key in its penalty: 400 s left.
    apply_lease(
        &limiter,
        rule,
        ALICE,
        &answer(50, 50, 400_000),
        T0 + 2,
        &mut store,
    )
    .unwrap();
    assert_eq!(
        decided(&limiter, "alice", T0 + 2, &mut store),
        Some(400 * SECOND)
    );
    assert_eq!(
        decided(&limiter, "alice", T0 + 2 + 100 * SECOND, &mut store),
        Some(300 * SECOND)
    );
    assert_eq!(decided(&limiter, "bob", T0 + 3, &mut store), None);
}

/// Attacker's test: whoever answers as the service (or a proxy that started a longer penalty
/// there) cannot keep a key out longer than the rule's own penalty, nor penalize a rule that has
/// none.
#[test]
fn an_answered_penalty_never_outlasts_the_rules_own() {
    let limiter = limiter(CACHED_PENALTY);
    let mut store = MemoryStore::default();
    let rule = RuleId::new(0);
    apply_lease(
        &limiter,
        rule,
        ALICE,
        &answer(50, 50, u64::MAX),
        T0,
        &mut store,
    )
    .unwrap();
    assert_eq!(
        decided(&limiter, "alice", T0, &mut store),
        Some(600 * SECOND),
        "the rule's 10 minutes at most"
    );
    assert_eq!(
        decided(&limiter, "alice", T0 + 600 * SECOND, &mut store),
        None
    );

    let plain = self::limiter(&CACHED_PENALTY.replace(r#""penalty": "10m","#, ""));
    let mut store = MemoryStore::default();
    apply_lease(
        &plain,
        rule,
        ALICE,
        &answer(50, 50, 600_000),
        T0,
        &mut store,
    )
    .unwrap();
    assert_eq!(decided(&plain, "alice", T0, &mut store), None, "no penalty");
}

/// A lease that ran out while the service said the key had tokens speaks for this proxy's share
/// only: no penalty here (the service starts one if it sees the key over). One that ran out with
/// the global bucket empty starts it at once.
#[test]
fn a_lease_that_runs_out_starts_a_penalty_only_when_the_key_is_over() {
    let limiter = limiter(CACHED_PENALTY);
    let rule = RuleId::new(0);
    let mut store = MemoryStore::default();
    apply_lease(&limiter, rule, ALICE, &answer(2, 60, 0), T0, &mut store).unwrap();
    assert_eq!(decided(&limiter, "alice", T0, &mut store), None);
    assert_eq!(decided(&limiter, "alice", T0, &mut store), None);
    let short = decided(&limiter, "alice", T0, &mut store).expect("the lease is spent");
    assert!(short < SECOND, "a token's wait, not the penalty: {short}");
    // The next answer has room again: admitted.
    apply_lease(&limiter, rule, ALICE, &answer(5, 58, 0), T0 + 1, &mut store).unwrap();
    assert_eq!(decided(&limiter, "alice", T0 + 1, &mut store), None);

    let mut store = MemoryStore::default();
    apply_lease(&limiter, rule, ALICE, &answer(2, 2, 0), T0, &mut store).unwrap();
    assert_eq!(decided(&limiter, "alice", T0, &mut store), None);
    assert_eq!(decided(&limiter, "alice", T0, &mut store), None);
    assert_eq!(
        decided(&limiter, "alice", T0, &mut store),
        Some(600 * SECOND),
        "the global bucket is empty too: over"
    );
    apply_lease(&limiter, rule, ALICE, &answer(5, 58, 0), T0 + 1, &mut store).unwrap();
    assert!(decided(&limiter, "alice", T0 + 1, &mut store).is_some());
}

// A rule's missing bucket (requests without a key part) is shared by every such client: it is
// limited, but never put into a penalty.

/// A request of `cookie` (none when empty) at `now` answered `status`: its reply when sluice
/// answered it, `None` when it went upstream.
fn with_cookie(
    limiter: &Limiter,
    cookie: &str,
    status: u32,
    now: u64,
    store: &mut MemoryStore,
) -> Option<sluice_core::Reply> {
    let mut request = PlainRequest::get("/login");
    if !cookie.is_empty() {
        request = request.with_header("cookie", cookie);
    }
    let (mut exchange, step) = start(limiter, &mut request, now, store);
    match step {
        Step::Continue => {
            exchange.response_status(limiter, status, now, store);
            None
        }
        Step::Respond(reply) => Some(reply),
        other => panic!("{other:?}"),
    }
}

const SESSION_PENALTY: &str = r#"{"headers": "legacy", "rules": [{"name": "login",
    "key": ["cookie:sid"], "count_when": {"statuses": [401]}, "penalty": "10m",
    "limits": [{"requests": 3, "per": "minute"}]}]}"#;

fn retry_after(reply: &sluice_core::Reply) -> u64 {
    reply.headers.get("retry-after").unwrap().parse().unwrap()
}

/// Attacker's test: a client without the session cookie fails logins until the rule's missing
/// bucket is over. Every cookieless client (every fresh browser) shares that bucket: it is
/// denied while the bucket is over, for the limit's wait, never for the 10-minute penalty; a
/// session that went over still gets its penalty.
#[test]
fn failures_without_the_cookie_never_put_every_cookieless_client_into_a_penalty() {
    let limiter = limiter(SESSION_PENALTY);
    let mut store = MemoryStore::default();
    for (i, cookie) in ["", "theme=dark", "sid=", "sid=\"\""]
        .into_iter()
        .enumerate()
    {
        let i = i as u64;
        if i < 3 {
            assert!(with_cookie(&limiter, cookie, 401, T0 + i, &mut store).is_none());
        } else {
            let denied = with_cookie(&limiter, cookie, 401, T0 + i, &mut store).unwrap();
            assert!(retry_after(&denied) <= 60, "the limit's wait: {denied:?}");
        }
    }
    // A newcomer a minute on: the bucket has room again, and no penalty holds it.
    for (i, cookie) in ["", "theme=light", "sid="].into_iter().enumerate() {
        let at = T0 + 61 * SECOND + i as u64 * 20 * SECOND;
        assert!(
            with_cookie(&limiter, cookie, 200, at, &mut store).is_none(),
            "{cookie:?}: locked out by another client's failures"
        );
    }
    // A session's own failures still start its penalty.
    for i in 0..3 {
        assert!(with_cookie(&limiter, "sid=mallory", 401, T0 + i, &mut store).is_none());
    }
    let denied = with_cookie(&limiter, "sid=mallory", 200, T0 + 3, &mut store).unwrap();
    assert_eq!(retry_after(&denied), 600);
    assert!(with_cookie(&limiter, "sid=mallory", 200, T0 + 300 * SECOND, &mut store).is_some());
}

/// The same through the counter service: a cached rule's missing bucket asks it for no penalty
/// (its sync entry and a strict check carry none, so the service starts none) and takes none it
/// answers; a key whose other parts make it long (replaced by its digest) is still the missing
/// bucket. A session's key carries the rule's penalty.
#[test]
fn a_missing_bucket_asks_the_service_for_no_penalty_and_takes_none() {
    use sluice_core::limiter::key::{build, in_missing_bucket, MAX_KEY_BYTES};
    let json = r#"{"headers": "legacy", "service": {"cluster": "svc", "token": "t"},
        "rules": [{"name": "login", "key": ["header:x-user", "cookie:sid"],
        "consistency": "cached", "penalty": "10m",
        "limits": [{"requests": 100, "per": "minute"}]}]}"#;
    let limiter = limiter(json);
    let rule = RuleId::new(0);
    let long = "a".repeat(MAX_KEY_BYTES);
    for (user, cookie, penalty_ms) in [
        ("alice", "", 0),
        (long.as_str(), "", 0),
        ("alice", "sid=s1", 600_000),
        (long.as_str(), "sid=s1", 600_000),
    ] {
        let what = format!("{} bytes of user, cookie {cookie:?}", user.len());
        let request = || {
            let request = login(user);
            if cookie.is_empty() {
                request
            } else {
                request.with_header("cookie", cookie)
            }
        };
        let keys = build(&limiter.policy().rules[0], &mut request());
        let [key] = keys.as_slice() else {
            panic!("{keys:?}")
        };
        assert!(key.len() <= MAX_KEY_BYTES, "{what}");
        assert_eq!(in_missing_bucket(key), penalty_ms == 0, "{what}: {key:?}");
        let mut store = MemoryStore::default();
        let _ = limiter.decide(&mut request(), up(T0), &mut store);
        let Taken::Entry(entry) = take(&limiter, rule, key, T0, 100_000, &mut store) else {
            panic!("{what}: an entry");
        };
        assert_eq!(entry.penalty_ms, penalty_ms, "{what}: the sync entry");
        // Another proxy's traffic (or an older proxy) put the key in a penalty at the service.
        apply_lease(
            &limiter,
            rule,
            key,
            &answer(50, 50, 400_000),
            T0 + 1,
            &mut store,
        )
        .unwrap();
        let denied = !matches!(
            limiter
                .decide(&mut request(), up(T0 + 2), &mut store)
                .decision,
            sluice_core::Decision::Allow { .. }
        );
        assert_eq!(denied, penalty_ms > 0, "{what}: the answered penalty");

        let strict = self::limiter(&json.replace("cached", "strict"));
        let (_, _, effects) = Exchange::start(
            &strict,
            &mut request(),
            None,
            Moment::at(T0),
            &mut MemoryStore::default(),
        );
        let checks: Vec<_> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Check { request, .. } => Some(request.penalty_ms),
                _ => None,
            })
            .collect();
        assert_eq!(checks, vec![penalty_ms], "{what}: the strict check");
    }
}

/// Attacker's test: a session in its penalty sent as `a=1, sid=victim` (or with white space
/// between the pairs): RFC 6265 reads one cookie `a` of `1, sid=victim`, Python's `http.cookies`
/// reads `sid=victim`. The request is counted against both readings: still in the penalty.
#[test]
fn a_cookie_after_a_comma_or_a_space_is_still_in_its_penalty() {
    let limiter = limiter(SESSION_PENALTY);
    let mut store = MemoryStore::default();
    for i in 0..3 {
        assert!(with_cookie(&limiter, "sid=victim", 401, T0 + i, &mut store).is_none());
    }
    assert!(with_cookie(&limiter, "sid=victim", 200, T0 + 3, &mut store).is_some());
    for (i, cookie) in [
        "a=1, sid=victim",
        "a=1 sid=victim",
        "a=1,sid=victim",
        "a=1\tsid=victim",
        "a=1 ,  sid=victim ",
        "sid=victim, a=1",
        "sid=victim a=1",
        "theme=dark; a=1, sid=\"victim\"",
        "a=1, s%69d=vict%69m",
        "sid=x, sid=victim",
    ]
    .into_iter()
    .enumerate()
    {
        let at = T0 + 60 * SECOND + i as u64;
        assert!(
            with_cookie(&limiter, cookie, 200, at, &mut store).is_some(),
            "{cookie:?} escaped the penalty of sid=victim"
        );
    }
    // Another session spelled so is its own key, not the victim's.
    assert!(with_cookie(&limiter, "a=1, sid=bob", 200, T0 + 70 * SECOND, &mut store).is_none());
}

/// What each reading yields, and a header of many such pairs is read once more at most: the last
/// value is still found behind 100,000 pairs holding commas and spaces.
#[test]
fn the_pairs_inside_a_pair_are_read_too() {
    use sluice_core::request::cookie_values;
    let values = |header: &str| cookie_values(&[header.to_string()], "sid");
    assert_eq!(values("a=1, sid=x"), vec!["x"]);
    assert_eq!(values("sid=x, a=1"), vec!["x, a=1", "x"]);
    assert_eq!(values("sid=x, sid=y"), vec!["x, sid=y", "x", "y"]);
    assert_eq!(values("sid=x y"), vec!["x y", "x"]);
    assert_eq!(values("sid=x,y"), vec!["x,y", "x"]);
    assert_eq!(values("sid=x"), vec!["x"]);
    assert_eq!(values("sid = x"), vec!["x"]);
    assert!(values("a=1, b=2 c=3").is_empty());
    assert!(values("a=1, sid=, sid=\"\"").is_empty());
    let many: String = (0..100_000).map(|i| format!("c{i}=1, d=2 e=3; ")).collect();
    assert_eq!(values(&format!("{many}x=1, sid=abc")), vec!["abc"]);
}
