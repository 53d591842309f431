//! Who and how much, in a real Envoy: users keyed by the claims Envoy's `jwt_authn` verified (against a JWKS this
//! test makes), tiers from a claim, a forged token that selects nothing, the methods matcher with method and path
//! keys, static and response-reported costs, and monitor, warn and a ramp.
//! Run with `make test` (needs the built filter and Envoy from the project's virtualenv).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use sluice_tests::envoy::{agent, get, Envoy, EnvoyOptions, Reply, Template};

/// The test's signing key, published in the JWKS Envoy verifies with.
const KEY: &[u8] = b"sluice-test-signing-key-0123456789abcdef";
/// Another key: tokens signed with it are forged.
const OTHER_KEY: &[u8] = b"not-the-published-key-0123456789abcdefgh";

fn jwks() -> String {
    json!({"keys": [{"kty": "oct", "alg": "HS256", "kid": "test", "k": URL_SAFE_NO_PAD.encode(KEY)}]}).to_string()
}

/// An HS256 token with `claims` (plus issuer and a day of validity), signed with `key`.
fn token(key: &[u8], claims: Value) -> String {
    let header =
        URL_SAFE_NO_PAD.encode(json!({"alg": "HS256", "typ": "JWT", "kid": "test"}).to_string());
    let mut claims = claims;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    claims["iss"] = json!("https://issuer.test");
    claims["exp"] = json!(now + 86_400);
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signing = format!("{header}.{payload}");
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(signing.as_bytes());
    format!(
        "{signing}.{}",
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    )
}

fn start(rules: Value, concurrency: u32) -> Envoy {
    let plugin = json!({"headers": "both", "rules": rules}).to_string();
    Envoy::start(EnvoyOptions {
        template: Template::File(
            sluice_tests::envoy::repo_root().join("envoy/sluice-jwt.yaml.tmpl"),
        ),
        plugin_config_json: plugin,
        concurrency,
        placeholders: vec![
            ("JWKS".to_owned(), jwks()),
            (
                "WASM".to_owned(),
                sluice_tests::envoy::wasm_path()
                    .unwrap()
                    .display()
                    .to_string(),
            ),
        ],
    })
    .unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// Statuses of `n` requests to `path` with `headers`, one after the other.
fn statuses(envoy: &Envoy, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    let client = agent();
    (0..n)
        .map(|_| get(&client, &envoy.url(path), headers).unwrap().status)
        .collect()
}

/// The status of one `method path` request (raw HTTP/1.1, empty body).
fn status_of(envoy: &Envoy, method: &str, path: &str) -> u16 {
    use std::io::{Read, Write};
    let url = envoy.url("/");
    let authority = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut stream = std::net::TcpStream::connect(&authority).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

fn policy_header(reply: &Reply) -> String {
    reply
        .header("ratelimit-policy")
        .unwrap_or_default()
        .to_string()
}

#[test]
fn verified_claims_key_the_user_and_pick_the_tier_and_a_forged_token_picks_nothing() {
    let envoy = start(
        json!([{
            "name": "api",
            "key": ["jwt:sub|client_ip"],
            "tiers": {"from": "jwt:plan", "default": "free", "limits": {
                "free": [{"requests": 2, "per": "minute"}],
                "pro": [{"requests": 5, "per": "minute"}]}},
        }]),
        2,
    );
    let alice = bearer(&token(KEY, json!({"sub": "alice", "plan": "pro"})));
    let bob = bearer(&token(KEY, json!({"sub": "bob", "plan": "free"})));
    let alice_statuses = statuses(&envoy, "/x", &[("authorization", &alice)], 8);
    assert_eq!(
        count(&alice_statuses, 200),
        5,
        "pro: 5 a minute; {alice_statuses:?}"
    );
    let bob_statuses = statuses(&envoy, "/x", &[("authorization", &bob)], 5);
    assert_eq!(
        count(&bob_statuses, 200),
        2,
        "free: 2 a minute, bob's own; {bob_statuses:?}"
    );
    let client = agent();
    let reply = get(&client, &envoy.url("/x"), &[("authorization", &alice)]).unwrap();
    assert!(
        policy_header(&reply).contains("api/pro"),
        "the headers describe the tier: {reply:?}"
    );

    // No token: the client address, the default tier.
    let anonymous = statuses(&envoy, "/x", &[], 4);
    assert_eq!(count(&anonymous, 200), 2, "{anonymous:?}");
    // A token signed with another key claiming a fresh user on the pro plan: jwt_authn lets it through unverified
    // (allow_missing_or_failed) and writes nothing, so sluice sees an anonymous request from the same address,
    // whose bucket is spent.
    let forged = bearer(&token(OTHER_KEY, json!({"sub": "mallory", "plan": "pro"})));
    let reply = get(&client, &envoy.url("/x"), &[("authorization", &forged)]).unwrap();
    assert_eq!(reply.status, 429, "a forged token is anonymous: {reply:?}");
    assert!(policy_header(&reply).contains("api/free"), "{reply:?}");
    // A claim sent as a header selects nothing either.
    let reply = get(
        &client,
        &envoy.url("/x"),
        &[("x-jwt-sub", "carol"), ("x-plan", "pro")],
    )
    .unwrap();
    assert_eq!(reply.status, 429, "{reply:?}");
    let stats = envoy.sluice_stats();
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.api/pro.allowed", 5),
        5,
        "{stats:?}"
    );
    assert!(
        envoy.stat("http.edge.jwt_authn.allowed") >= 1,
        "jwt_authn verified tokens; {:?}",
        envoy.stats()
    );
}

#[test]
fn the_methods_matcher_and_method_and_path_keys_count_each_endpoint() {
    let envoy = start(
        json!([{
            "name": "writes",
            "match": {"methods": ["POST", "DELETE"], "path_templates": ["/users/{id}/export"]},
            "key": ["method", "path"],
            "limits": [{"requests": 2, "per": "minute"}],
        }]),
        2,
    );
    let send = |method: &str, path: &str| status_of(&envoy, method, path) == 200;
    // GET is not matched: never limited.
    for _ in 0..4 {
        assert!(send("GET", "/users/1/export"));
    }
    let posts: Vec<bool> = (0..3).map(|_| send("POST", "/users/1/export")).collect();
    assert_eq!(
        posts,
        [true, true, false],
        "2 POSTs a minute for /users/1/export"
    );
    // Another method, another path: other keys.
    assert!(send("DELETE", "/users/1/export"));
    assert!(send("POST", "/users/2/export"));
    // Not the template: not matched.
    for _ in 0..3 {
        assert!(send("POST", "/users/1/import"));
    }
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.writes.denied", 1),
        1
    );
}

#[test]
fn costs_static_and_reported_by_the_upstream_are_charged() {
    let envoy = start(
        json!([
            {"name": "export", "match": {"path_prefix": "/export"}, "key": ["header:x-user"], "cost": 10,
             "limits": [{"requests": 25, "per": "minute"}]},
            {"name": "llm", "match": {"path_prefix": "/llm"}, "key": ["header:x-user"], "cost_header": "x-tokens-used",
             "limits": [{"requests": 100, "per": "minute"}]},
        ]),
        2,
    );
    let exports = statuses(&envoy, "/export", &[("x-user", "alice")], 4);
    assert_eq!(exports, [200, 200, 429, 429], "an export costs 10 of 25");
    // Each /llm answer says it used 40 tokens: 1 + 40, twice, then 1 + 40 more into debt.
    let llm = statuses(&envoy, "/llm", &[("x-user", "alice")], 5);
    assert_eq!(
        llm,
        [200, 200, 200, 429, 429],
        "the debt of reported costs limits the next requests"
    );
    let client = agent();
    let denied = get(&client, &envoy.url("/llm"), &[("x-user", "alice")]).unwrap();
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    // 123 spent of 100: 24 tokens to repay at 100 a minute, about 14 s.
    assert!(
        (10..=16).contains(&retry),
        "retry-after {retry}: {denied:?}"
    );
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.llm.charged_tokens", 120),
        120
    );
    assert_eq!(
        statuses(&envoy, "/llm", &[("x-user", "bob")], 1),
        [200],
        "another user has their own budget"
    );
}

#[test]
fn monitor_and_warn_admit_and_say_so_and_a_ramp_denies_its_share() {
    let envoy = start(
        json!([
            {"name": "watch", "match": {"path_prefix": "/monitor"}, "key": ["const:m"], "mode": "monitor",
             "limits": [{"requests": 1, "per": "hour"}]},
            {"name": "told", "match": {"path_prefix": "/warn"}, "key": ["const:w"], "mode": "warn",
             "limits": [{"requests": 1, "per": "hour"}]},
            {"name": "ramp", "match": {"path_prefix": "/ramp"}, "key": ["const:r"], "ramp_percent": 50,
             "limits": [{"requests": 1, "per": "hour"}]},
        ]),
        2,
    );
    assert_eq!(statuses(&envoy, "/monitor", &[], 5), [200; 5]);
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.watch.shadow_denied", 4),
        4
    );
    let client = agent();
    let first = get(&client, &envoy.url("/warn"), &[]).unwrap();
    assert_eq!(first.header("x-sluice-warn"), None, "{first:?}");
    let second = get(&client, &envoy.url("/warn"), &[]).unwrap();
    assert_eq!(second.status, 200);
    assert_eq!(second.header("x-sluice-warn"), Some("told"), "{second:?}");
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.told.warned", 1),
        1
    );
    let log = envoy.log();
    assert!(
        log.contains("rule told (warn) would deny key \"told:w\""),
        "the operator's log line; log tail: {}",
        &log[log.len().saturating_sub(2_000)..]
    );
    let ramp = statuses(&envoy, "/ramp", &[], 201);
    let denied = count(&ramp, 429);
    assert!(
        (60..=140).contains(&denied),
        "{denied} of 200 would-be denials denied at 50%"
    );
    assert_eq!(
        envoy.stat_reaching(
            "wasmcustom.sluice.rule.ramp.shadow_denied",
            (200 - denied) as u64
        ) as usize,
        200 - denied
    );
}

/// A claim of any JSON type keys its users, read through the real `jwt_authn` (which hands a number over as a
/// double): each value its own bucket of 3, and a token without the claim in the rule's one missing bucket.
#[test]
fn claims_of_every_json_type_key_their_users_and_a_missing_claim_is_counted() {
    let envoy = start(
        json!([{"name": "uid", "key": ["jwt:uid"], "limits": [{"requests": 3, "per": "minute"}]}]),
        2,
    );
    let values = [
        json!(12345),
        json!(12346),
        json!(1.5),
        json!(null),
        json!(true),
        json!(0),
        json!({"org": "acme", "id": 7}),
        json!(["a", "b"]),
        json!("12345678"),
    ];
    for (n, uid) in values.iter().enumerate() {
        // Two tokens per value (another subject, another issue time): the same user, one bucket.
        let first = bearer(&token(KEY, json!({"sub": format!("s{n}"), "uid": uid})));
        let again = bearer(&token(KEY, json!({"sub": format!("t{n}"), "uid": uid})));
        let mut got = statuses(&envoy, "/x", &[("authorization", &first)], 3);
        got.extend(statuses(&envoy, "/x", &[("authorization", &again)], 3));
        assert_eq!(
            got,
            [200, 200, 200, 429, 429, 429],
            "uid {uid}: a limit of 3 admits 3 of 6; {:?}",
            envoy.sluice_stats()
        );
    }
    // No uid in the token, or no token: one bucket for all of them, never unlimited.
    let without = bearer(&token(KEY, json!({"sub": "nouid"})));
    let other = bearer(&token(KEY, json!({"sub": "nouid-2"})));
    let mut missing = statuses(&envoy, "/x", &[("authorization", &without)], 4);
    missing.extend(statuses(&envoy, "/x", &[("authorization", &other)], 1));
    missing.extend(statuses(&envoy, "/x", &[], 1));
    assert_eq!(missing, [200, 200, 200, 429, 429, 429], "{missing:?}");
    let stats = envoy.sluice_stats();
    assert_eq!(
        envoy.stat_reaching("wasmcustom.sluice.rule.uid.allowed", 30),
        30,
        "3 for each of 9 values and 3 for the missing claim; {stats:?}"
    );
}

/// A rule for authenticated users only says so (`when_missing: skip`): requests without the claim pass it, and the
/// users still have their buckets.
#[test]
fn a_rule_that_skips_a_missing_claim_counts_only_the_users() {
    let envoy = start(
        json!([{"name": "users", "key": ["jwt:uid"], "when_missing": "skip",
                "limits": [{"requests": 2, "per": "minute"}]}]),
        2,
    );
    let user = bearer(&token(KEY, json!({"sub": "u", "uid": 42})));
    assert_eq!(
        statuses(&envoy, "/x", &[("authorization", &user)], 3),
        [200, 200, 429]
    );
    assert_eq!(statuses(&envoy, "/x", &[], 4), [200; 4], "skipped");
}

/// Login protection as a user writes it: failed logins (401) counted per session cookie, a
/// success never; once over, the cookie's key is denied for its 10-minute penalty (Retry-After
/// says so), across Envoy's two workers; a request without the cookie is counted with every
/// such request, never exempt, and never put into the penalty.
#[test]
fn failed_logins_are_counted_by_the_answer_then_a_penalty_keeps_the_key_out() {
    let envoy = start(
        json!([
            {"name": "login", "match": {"path_prefix": "/login"}, "key": ["cookie:sid"],
             "count_when": {"statuses": [401, 403]}, "penalty": "10m",
             "limits": [{"requests": 3, "per": "minute"}]},
        ]),
        2,
    );
    let right = [("cookie", "theme=dark; sid=alice"), ("x-password", "right")];
    let wrong = [("cookie", "theme=dark; sid=alice"), ("x-password", "wrong")];
    assert_eq!(
        statuses(&envoy, "/login", &right, 10),
        [200; 10],
        "successful logins are not counted"
    );
    assert_eq!(statuses(&envoy, "/login", &wrong, 3), [401; 3]);
    // Over: denied up front, even with the right password, for the penalty.
    let client = agent();
    let denied = get(&client, &envoy.url("/login"), &right).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((590..=600).contains(&retry), "retry-after {retry}");
    assert_eq!(statuses(&envoy, "/login", &right, 4), [429; 4]);
    // The cookie buried behind 256 junk pairs (the backend still reads it), or re-encoded
    // (`%61` is `a` to a backend that decodes cookies), is the same key, still in its penalty.
    let buried = format!("{}sid=alice", "a=; ".repeat(256));
    let encoded = "theme=dark; sid=%61lic%65";
    for (what, cookie) in [("re-encoded", encoded), ("buried", buried.as_str())] {
        let headers = [("cookie", cookie), ("x-password", "right")];
        assert_eq!(statuses(&envoy, "/login", &headers, 2), [429; 2], "{what}");
    }
    // Another session is not touched; no cookie at all is one shared key, not a way out.
    let other = [("cookie", "sid=bob"), ("x-password", "right")];
    assert_eq!(statuses(&envoy, "/login", &other, 2), [200; 2]);
    let anonymous = [("x-password", "wrong")];
    assert_eq!(
        statuses(&envoy, "/login", &anonymous, 5),
        [401, 401, 401, 429, 429]
    );
    // That shared key is denied for the limit's wait, never put into the penalty: every client without
    // the cookie (every fresh browser) is in it.
    let denied = get(&client, &envoy.url("/login"), &anonymous).unwrap();
    assert_eq!(denied.status, 429, "{denied:?}");
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!(retry <= 60, "the missing bucket in a penalty: {denied:?}");
}

/// A rule's limit read from the verified token (`limits_from`): each user gets the claim's number, at most `max`;
/// a claim that is no whole number, a forged token and a claim sent as a header get the rule's own limit.
#[test]
fn a_limit_read_from_the_verified_token_is_bounded_and_never_exempts() {
    let envoy = start(
        json!([{
            "name": "api",
            "key": ["jwt:sub|client_ip"],
            "limits": [{"requests": 2, "per": "minute"}],
            "limits_from": {"from": "jwt:rate_per_minute", "max": 5},
        }]),
        2,
    );
    let admitted =
        |headers: &[(&str, &str)], n: usize| count(&statuses(&envoy, "/x", headers, n), 200);
    let user =
        |sub: &str, rate: Value| bearer(&token(KEY, json!({"sub": sub, "rate_per_minute": rate})));
    assert_eq!(
        admitted(&[("authorization", &user("alice", json!(4)))], 6),
        4
    );
    assert_eq!(
        admitted(&[("authorization", &user("bob", json!(1_000_000)))], 7),
        5,
        "at most max"
    );
    for (sub, rate) in [
        ("carol", json!("lots")),
        ("dave", json!(2.5)),
        ("erin", json!(-7)),
        ("frank", json!(null)),
    ] {
        assert_eq!(
            admitted(&[("authorization", &user(sub, rate.clone()))], 4),
            2,
            "{rate}"
        );
    }
    // A forged token claiming a high limit is anonymous: the client address, the rule's own 2.
    let forged = bearer(&token(
        OTHER_KEY,
        json!({"sub": "mallory", "rate_per_minute": 5}),
    ));
    assert_eq!(
        admitted(
            &[("authorization", &forged), ("x-jwt-rate_per_minute", "5")],
            4
        ),
        2
    );
}
