//! What a hostile client tries, and why it does not work: path tricks, long and repeated key
//! headers, values that are not UTF-8, and evicting its own exhausted record.

use sluice_core::limit::table::{KeyHasher, WAYS};
use sluice_core::limiter::Conditions;
use sluice_core::policy::RuleId;
use sluice_core::{limiter::key, Decision, Limiter, MemoryStore, PlainRequest};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn at(now_us: u64) -> Conditions {
    Conditions {
        now_us,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

fn admitted(limiter: &Limiter, store: &mut MemoryStore, mut req: PlainRequest, now: u64) -> bool {
    matches!(
        limiter.decide(&mut req, at(now), store).decision,
        Decision::Allow { .. }
    )
}

const API_3: &str = r#"{"rules": [{"name": "api", "match": {"path_prefix": "/api/"},
    "key": ["client_ip"], "limits": [{"requests": 3, "per": "minute"}]}]}"#;

#[test]
fn path_tricks_stay_under_the_prefix_rule() {
    let limiter = Limiter::new(sluice_core::parse(API_3.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    let ip = "192.0.2.1";
    for _ in 0..3 {
        assert!(admitted(
            &limiter,
            &mut store,
            PlainRequest::get("/api/x").from_ip(ip),
            T0
        ));
    }
    for trick in [
        "/api/x",
        "//api/x",
        "/./api/x",
        "/x/../api/x",
        "/%61pi/x",
        "/%2e/api/x",
        "/api//x",
        "/x%2f..%2fapi/x",
        "\\api\\x",
        "/%2561pi/x/../../api/x",
    ] {
        assert!(
            !admitted(
                &limiter,
                &mut store,
                PlainRequest::get(trick).from_ip(ip),
                T0
            ),
            "{trick:?} escaped the /api/ rule"
        );
    }
    assert!(
        admitted(
            &limiter,
            &mut store,
            PlainRequest::get("/apix").from_ip(ip),
            T0
        ),
        "another path is not the rule's"
    );
}

const PER_KEY_3: &str = r#"{"rules": [{"name": "per-key", "key": ["header:x-api-key"],
    "limits": [{"requests": 3, "per": "minute"}]}]}"#;

#[test]
fn a_long_key_is_a_fixed_size_digest() {
    let rule = &sluice_core::parse(PER_KEY_3.as_bytes()).unwrap().rules[0];
    let long = "k".repeat(600);
    let keys = key::build(
        rule,
        &mut PlainRequest::get("/").with_header("x-api-key", &long),
    );
    assert_eq!(keys.len(), 1);
    assert!(
        keys[0].len() <= key::MAX_KEY_BYTES,
        "{} bytes",
        keys[0].len()
    );
    assert!(
        keys[0].starts_with("per-key\u{1f}\u{1e}sha256:"),
        "{:?}",
        keys[0]
    );
    let other = "k".repeat(599) + "j";
    let other_keys = key::build(
        rule,
        &mut PlainRequest::get("/").with_header("x-api-key", &other),
    );
    assert_ne!(keys, other_keys, "different values, different keys");
    let short = key::build(
        rule,
        &mut PlainRequest::get("/").with_header("x-api-key", "abc"),
    );
    assert_eq!(
        short,
        vec!["per-key\u{1f}abc".to_string()],
        "short keys are kept as they are"
    );
}

#[test]
fn a_junk_first_value_does_not_escape_an_exhausted_key() {
    let limiter = Limiter::new(sluice_core::parse(PER_KEY_3.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    for _ in 0..3 {
        let req = PlainRequest::get("/").with_header("x-api-key", "real");
        assert!(admitted(&limiter, &mut store, req, T0));
    }
    for i in 0..10 {
        let req = PlainRequest::get("/")
            .with_header("x-api-key", &format!("junk-{i}"))
            .with_header("x-api-key", "real");
        assert!(!admitted(&limiter, &mut store, req, T0), "junk-{i}, real");
    }
    let many = (0..20).fold(PlainRequest::get("/"), |req, i| {
        req.with_header("x-api-key", &format!("j{i}"))
    });
    let many = many.with_header("x-api-key", "real");
    assert!(
        !admitted(&limiter, &mut store, many, T0),
        "twenty junk values before the real one"
    );
}

#[test]
fn values_that_are_not_utf8_keep_their_own_buckets() {
    let a = key::header_value(b"\xff\xfe");
    let b = key::header_value(b"\xfe\xff");
    assert_ne!(a, b);
    assert_ne!(a, String::from_utf8_lossy(b"\xff\xfe"));
    assert_eq!(key::header_value("plain é".as_bytes()), "plain é");
}

/// With the secret known (as a test may), find keys of a set and try the eviction attack:
/// spend a key's 3, then evict it with junk keys of its set, then come back.
#[test]
fn evicting_an_exhausted_key_does_not_refill_it() {
    let config = r#"{"max_keys": 64, "rules": [{"name": "u", "key": ["header:x-user"],
        "limits": [{"requests": 3, "per": "minute"}]}]}"#;
    let secret = [0x1234, 0x5678];
    let limiter = Limiter::with_secret(sluice_core::parse(config.as_bytes()).unwrap(), secret);
    let table = limiter.table(RuleId::new(0)).unwrap();
    let set_of =
        |value: &str| table.set_key(KeyHasher::new(secret).fingerprint(&format!("u\u{1f}{value}")));
    let victim = "victim";
    let junk: Vec<String> = (0..)
        .map(|i| format!("junk-{i}"))
        .filter(|v| set_of(v) == set_of(victim))
        .take(WAYS)
        .collect();
    let mut store = MemoryStore::default();
    let user = |v: &str| PlainRequest::get("/").with_header("x-user", v);
    let mut now = T0;
    for _ in 0..3 {
        assert!(admitted(&limiter, &mut store, user(victim), now));
    }
    let mut victim_admitted = 0;
    for _ in 0..20 {
        for j in &junk {
            now += 1_000;
            admitted(&limiter, &mut store, user(j), now);
        }
        now += 1_000;
        victim_admitted += admitted(&limiter, &mut store, user(victim), now) as u32;
    }
    let refilled = ((now - T0) as f64 / (20.0 * SECOND as f64)).floor() as u32;
    assert!(
        victim_admitted <= refilled,
        "the victim was admitted {victim_admitted} times after eviction in {} ms; refill allows {refilled}",
        (now - T0) / 1_000
    );
}

#[test]
fn without_the_secret_a_public_hash_collision_is_no_collision() {
    let config = r#"{"max_keys": 64, "rules": [{"name": "u", "key": ["header:x-user"],
        "limits": [{"requests": 3, "per": "minute"}]}]}"#;
    let policy = sluice_core::parse(config.as_bytes()).unwrap();
    let public = Limiter::new(policy.clone());
    let keyed = Limiter::with_secret(policy, [7, 11]);
    let key = "u\u{1f}victim";
    let public_table = public.table(RuleId::new(0)).unwrap();
    let keyed_table = keyed.table(RuleId::new(0)).unwrap();
    assert_ne!(
        public_table.fingerprint(key),
        keyed_table.fingerprint(key),
        "the proxy's secret changes where keys go"
    );
}
