//! One key through the admin API, on a real Redis: its state (counts, tokens, debts, every
//! proxy's lease, its live override) as `GET /admin/v1/keys/{rule}?key=…` answers it, and its
//! reset (`DELETE`), which removes its counts, debts and leases at once and nothing else; every
//! malformed or hostile request refused naming its field; the leases answered bounded; the
//! rule's limits from `--policy`; a Redis Cluster.

mod common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, post, Answer, TOKEN};
use serde_json::{json, Value};
use sluice_counter_service::{keys, overrides, AppState};
use sluice_protocol::{AlgorithmSpec, LimitSpec};
use sluice_tests::redis::{Redis, RedisCluster, Reply};

const ALICE: &str = "alice-admin-token";
const ADMINS: &str = "alice alice-admin-token\n";
/// 10 a minute, as the configuration writes it, and as the proxies send it.
const TEN_A_MINUTE: &str = "%5B%7B%22requests%22%3A10%2C%22per%22%3A%22minute%22%7D%5D";
const TEN: LimitSpec = LimitSpec::token_bucket(10, 60_000, 10);

use common::TextFile;

fn admin_state(redis_url: &str, more: &[&str]) -> AppState {
    let file = TextFile::new(ADMINS);
    let mut args = vec!["--admin-tokens-file", file.path()];
    args.extend_from_slice(more);
    AppState::new(common::settings(redis_url, &args)).unwrap()
}

async fn admin(state: &AppState, method: &str, path: &str) -> Answer {
    call(state, method, path, Some(ALICE), Body::empty()).await
}

/// An admin call that must succeed: its answer.
async fn ok(state: &AppState, method: &str, path: &str) -> Value {
    let answer = admin(state, method, path).await;
    assert_eq!(answer.status, StatusCode::OK, "{method} {path}: {answer:?}");
    answer.body
}

/// One proxy's sync of one entry: its grant. Syncs of 10 s: the leases live 30 s, longer than
/// any test here takes to read them.
async fn sync(state: &AppState, proxy: &str, key: &str, limits: &[LimitSpec], spent: u64) -> Value {
    let body = json!({
        "proxy": proxy,
        "interval_ms": 10_000,
        "entries": [{"key": key, "limits": limits, "spent": spent, "denied": 0}],
    });
    let answer = post(state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer.body["grants"][0].clone()
}

fn assert_refused(answer: &Answer, status: StatusCode, message: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    let text = answer.body["message"].as_str().unwrap_or_default();
    assert!(
        text.starts_with(message),
        "{text:?} should start with {message:?}"
    );
}

fn exists(redis: &Redis, key: &str) -> bool {
    redis.text(&["EXISTS", key]).unwrap() == "1"
}

/// Every key in Redis but the audit log (a reset writes to it), sorted.
fn all_keys(redis: &Redis) -> Vec<String> {
    let Reply::Array(keys) = redis.query(&["KEYS", "*"]).unwrap() else {
        panic!("KEYS answered no array")
    };
    let mut keys: Vec<String> = keys
        .iter()
        .map(|k| k.text().unwrap().to_owned())
        .filter(|k| k != overrides::AUDIT_KEY)
        .collect();
    keys.sort();
    keys
}

#[tokio::test]
async fn a_key_shows_its_count_every_lease_and_its_override_and_resets_alone() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    let alice = "api\u{1f}alice";
    let p1 = sync(&state, "p1", alice, &[TEN], 4).await;
    let p2 = sync(&state, "p2", alice, &[TEN], 1).await;
    // neighbours: another key of the rule, the same key of another rule
    let bob = sync(&state, "p1", "api\u{1f}bob", &[TEN], 3).await;
    sync(&state, "p1", "web\u{1f}alice", &[TEN], 3).await;
    let block = json!({"key": ["alice"], "action": "block", "ttl_s": 600, "reason": "abuse"});
    let set = call(
        &state,
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(ALICE),
        Body::from(block.to_string()),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{set:?}");

    let path = format!("/admin/v1/keys/api?key=alice&limits={TEN_A_MINUTE}");
    let seen = ok(&state, "GET", &path).await;
    assert_eq!(seen["rule"], "api");
    assert_eq!(seen["key"], json!(["alice"]));
    let limit = &seen["limits"][0];
    assert_eq!(limit["source"], "request");
    assert_eq!(limit["limit"], json!(TEN));
    assert_eq!(limit["exists"], true);
    // what the last sync answered (less the 5 reported), and a few ms of refill at 10 a minute
    let tokens = limit["tokens"].as_f64().unwrap();
    let remaining = p2["remaining"].as_f64().unwrap();
    assert!(
        remaining < 10.0 && tokens >= remaining && tokens < remaining + 1.01,
        "{seen} {p2}"
    );
    assert_eq!(limit["debt"], 0);
    let reset_ms = limit["reset_ms"].as_f64().unwrap();
    assert!(reset_ms >= (10.0 - tokens) * 6_000.0 - 1.0, "{seen}");
    let leases = limit["leases"].as_array().unwrap();
    let proxies: Vec<&str> = leases
        .iter()
        .map(|l| l["proxy"].as_str().unwrap())
        .collect();
    assert_eq!(proxies, ["p1", "p2"]);
    assert_eq!(leases[0]["tokens"], p1["tokens"], "{seen}");
    assert_eq!(leases[1]["tokens"], p2["tokens"], "{seen}");
    assert!(p1["tokens"].as_u64().unwrap() > 0, "{p1}");
    assert!(leases[0]["expires_in_ms"].as_u64().unwrap() <= 30_000);
    assert_eq!(limit["leases_total"], 2);
    assert_eq!(limit["leases_cut"], false);
    assert_eq!(seen["override"]["action"], "block");
    assert_eq!(seen["override"]["who"], "alice");
    assert_eq!(seen["override"]["reason"], "abuse");
    assert!(seen["override"]["ttl_ms"].as_u64().unwrap() <= 600_000);

    // A GET reads: the same state again, nothing written.
    let before = all_keys(&redis);
    let again = ok(&state, "GET", &path).await;
    let held = |answer: &Value| -> Vec<(Value, Value)> {
        answer["limits"][0]["leases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| (l["proxy"].clone(), l["tokens"].clone()))
            .collect()
    };
    assert_eq!(held(&again), held(&seen));
    assert_eq!(all_keys(&redis), before);

    // The reset answers the state it removed, and removes the key's own Redis key only.
    let own = keys::limit_key(alice, &TEN);
    assert!(exists(&redis, &own));
    let reset = ok(&state, "DELETE", &path).await;
    assert_eq!(reset["deleted"], 1);
    assert_eq!(reset["limits"][0]["leases_total"], 2);
    assert!(!exists(&redis, &own));
    let mut left = before.clone();
    left.retain(|k| *k != own);
    assert_eq!(all_keys(&redis), left, "only the key's own Redis key went");
    assert_eq!(
        redis
            .text(&["HGET", overrides::KEYS_KEY, "api\u{1f}alice"])
            .unwrap(),
        "block"
    );
    for other in ["api\u{1f}bob", "web\u{1f}alice"] {
        assert!(exists(&redis, &keys::limit_key(other, &TEN)), "{other}");
    }
    // the audit log says who reset what
    let audit = ok(&state, "GET", "/admin/v1/audit?limit=1").await;
    let entry = &audit["entries"][0];
    assert_eq!(entry["action"], "reset key", "{audit}");
    assert_eq!(entry["who"], "alice");
    assert_eq!(entry["target"], "api");
    assert_eq!(entry["value"], json!({"key": ["alice"], "deleted": 1}));
    assert_eq!(entry["at_ms"], reset["now_ms"]);
    assert_eq!(entry["version"], set.body["version"]);
    // the override is not the key's counts: it stays
    assert_eq!(
        ok(&state, "GET", &path).await["override"]["action"],
        "block"
    );

    // Afterwards the key is new: no count, no lease, a full bucket; a second reset deletes
    // nothing; the next sync of a proxy starts it afresh (only its new report counted).
    let fresh = ok(&state, "GET", &path).await;
    assert_eq!(fresh["limits"][0]["exists"], false);
    assert_eq!(fresh["limits"][0]["tokens"], 10);
    assert_eq!(fresh["limits"][0]["leases"], json!([]));
    assert_eq!(ok(&state, "DELETE", &path).await["deleted"], 0);
    let next = sync(&state, "p1", alice, &[TEN], 1).await;
    let new = sync(&state, "p1", "api\u{1f}zed", &[TEN], 1).await;
    assert_eq!(
        next["remaining"], new["remaining"],
        "as a key never seen: {next} {new}"
    );
    let bob_now = sync(&state, "p1", "api\u{1f}bob", &[TEN], 0).await;
    assert_eq!(
        bob_now["remaining"], bob["remaining"],
        "bob's count was kept"
    );
}

#[tokio::test]
async fn a_debt_is_shown_and_goes_with_the_reset() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    // 30 reported against a burst of 10 (cut to what one report can hold): a debt, repaid at
    // 10 a minute
    sync(&state, "p1", "api\u{1f}alice", &[TEN], 30).await;
    let path = format!("/admin/v1/keys/api?key=alice&limits={TEN_A_MINUTE}");
    let seen = ok(&state, "GET", &path).await;
    let limit = &seen["limits"][0];
    let tokens = limit["tokens"].as_f64().unwrap();
    assert!(tokens < -9.0, "{seen}");
    assert_eq!(limit["debt"].as_f64().unwrap(), -tokens);
    assert!(limit["reset_ms"].as_u64().unwrap() > 114_000, "{seen}");
    assert_eq!(limit["leases"][0]["tokens"], 0, "nothing to lease: {seen}");
    let owed = sync(&state, "p2", "api\u{1f}alice", &[TEN], 0).await;
    assert_eq!(owed["remaining"], 0);

    ok(&state, "DELETE", &path).await;
    let fresh = sync(&state, "p2", "api\u{1f}alice", &[TEN], 0).await;
    assert_eq!(fresh["remaining"], 10, "{fresh}");
    assert!(fresh["tokens"].as_u64().unwrap() > 0, "{fresh}");
}

#[tokio::test]
async fn windows_and_logs_show_their_counts_and_reset() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    let hourly = LimitSpec::window(AlgorithmSpec::FixedWindow, 100, 3_600_000);
    let sliding = LimitSpec::window(AlgorithmSpec::SlidingWindow, 100, 3_600_000);
    let log = LimitSpec::window(AlgorithmSpec::SlidingLog, 5, 60_000);
    sync(&state, "p1", "api\u{1f}alice", &[hourly], 7).await;
    sync(&state, "p1", "slide\u{1f}alice", &[sliding], 6).await;
    for _ in 0..3 {
        let check = json!({"key": "log\u{1f}alice", "limits": [log], "cost": 1});
        let answer = post(&state, "/v1/check", &check).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    }

    let encode = |limits: &str| limits.replace('"', "%22").replace(' ', "");
    let fixed_path = format!(
        "/admin/v1/keys/api?key=alice&limits={}",
        encode(r#"[{"requests":100,"per":"hour","algorithm":"fixed_window"}]"#)
    );
    let fixed = ok(&state, "GET", &fixed_path).await;
    let limit = &fixed["limits"][0];
    assert_eq!(limit["count"], 7, "{fixed}");
    assert_eq!(limit["leases"][0]["proxy"], "p1");
    let now_ms = fixed["now_ms"].as_u64().unwrap();
    let start = limit["window_start_ms"].as_u64().unwrap();
    assert_eq!(start % 3_600_000, 0, "aligned to the hour");
    assert_eq!(limit["reset_ms"], start + 3_600_000 - now_ms);

    let sliding_path = format!(
        "/admin/v1/keys/slide?key=alice&limits={}",
        encode(r#"[{"requests":100,"per":"hour","algorithm":"sliding_window"}]"#)
    );
    let seen = ok(&state, "GET", &sliding_path).await;
    assert_eq!(seen["limits"][0]["current"], 6, "{seen}");
    assert_eq!(seen["limits"][0]["count"], 6, "{seen}");

    let log_path = format!(
        "/admin/v1/keys/log?key=alice&limits={}",
        encode(r#"[{"requests":5,"per":"minute","algorithm":"sliding_log"}]"#)
    );
    let seen = ok(&state, "GET", &log_path).await;
    assert_eq!(seen["limits"][0]["count"], 3, "{seen}");
    assert!(
        seen["limits"][0].get("leases").is_none(),
        "a log has no leases"
    );

    for path in [&fixed_path, &sliding_path, &log_path] {
        assert_eq!(ok(&state, "DELETE", path).await["deleted"], 1, "{path}");
    }
    assert_eq!(all_keys(&redis), Vec::<String>::new());
    let check = json!({"key": "log\u{1f}alice", "limits": [log], "cost": 1});
    let answer = post(&state, "/v1/check", &check).await;
    assert_eq!(answer.body["remaining"], 4, "a fresh log: {answer:?}");
}

#[tokio::test]
async fn many_leases_are_answered_bounded_and_say_so() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    let big = LimitSpec::token_bucket(100_000, 60_000, 100_000);
    for proxy in 0..105 {
        sync(&state, &format!("p{proxy:03}"), "api\u{1f}alice", &[big], 1).await;
    }
    let path = "/admin/v1/keys/api?key=alice&limits=%5B%7B%22requests%22%3A100000%2C%22per%22%3A%22minute%22%7D%5D";
    let seen = ok(&state, "GET", path).await;
    let limit = &seen["limits"][0];
    assert_eq!(limit["leases_total"], 105);
    assert_eq!(limit["leases_cut"], true);
    let leases = limit["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 100);
    assert_eq!(leases[0]["proxy"], "p000");
    assert_eq!(leases[99]["proxy"], "p099");
    let reset = ok(&state, "DELETE", path).await;
    assert_eq!(reset["deleted"], 1);
    assert_eq!(
        ok(&state, "GET", path).await["limits"][0]["leases_total"],
        0
    );
}

/// The proxies' configuration: a cached rule keyed on the user, a rule with tiers, a local
/// rule, one keyed on the user or the client's network, and one keyed on the address.
const POLICY: &str = r#"{"service": {"cluster": "sluice_service"}, "rules": [
    {"name": "api", "key": ["header:x-user"], "consistency": "cached",
     "limits": [{"requests": 10, "per": "minute"}]},
    {"name": "plans", "key": ["header:x-user"], "tiers": {"from": "header:x-plan", "default": "free",
     "limits": {"free": [{"requests": 5, "per": "minute"}], "pro": [{"requests": 50, "per": "minute"}]}}},
    {"name": "local", "key": ["header:x-user"], "consistency": "local",
     "limits": [{"requests": 5, "per": "minute"}]},
    {"name": "net", "key": ["jwt:sub|client_ip/24", "method"], "limits": [{"requests": 5, "per": "minute"}]},
    {"name": "ip", "key": ["client_ip"], "limits": [{"requests": 5, "per": "minute"}]}
]}"#;

#[tokio::test]
async fn with_the_policy_the_rules_limits_are_known_and_impossible_keys_refused() {
    let redis = Redis::start().unwrap();
    let policy = TextFile::new(POLICY);
    let state = admin_state(&redis.url(), &["--policy", policy.path()]);
    sync(&state, "p1", "api\u{1f}alice", &[TEN], 2).await;

    let seen = ok(&state, "GET", "/admin/v1/keys/api?key=alice").await;
    assert_eq!(seen["limits"].as_array().unwrap().len(), 1, "{seen}");
    assert_eq!(seen["limits"][0]["source"], "policy");
    assert_eq!(seen["limits"][0]["limit"], json!(TEN));
    assert_eq!(seen["limits"][0]["exists"], true);

    // A live limit override: its limits are read and reset too.
    let twenty = LimitSpec::token_bucket(20, 60_000, 20);
    let body = json!({"limits": [{"requests": 20, "per": "minute"}]});
    let set = call(
        &state,
        "PUT",
        "/admin/v1/overrides/limits/api",
        Some(ALICE),
        Body::from(body.to_string()),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{set:?}");
    sync(&state, "p1", "api\u{1f}alice", &[twenty], 3).await;
    let seen = ok(&state, "GET", "/admin/v1/keys/api?key=alice").await;
    let sources: Vec<&str> = seen["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["source"].as_str().unwrap())
        .collect();
    assert_eq!(sources, ["policy", "override"], "{seen}");
    assert_eq!(seen["limits"][1]["limit"], json!(twenty));
    assert_eq!(seen["limits"][1]["exists"], true);
    let reset = ok(&state, "DELETE", "/admin/v1/keys/api?key=alice").await;
    assert_eq!(reset["deleted"], 2);
    assert_eq!(
        all_keys(&redis)
            .iter()
            .filter(|k| k.starts_with("sluice:{") && !k.starts_with("sluice:{overrides}"))
            .count(),
        0
    );

    // A tier is named as the filter names it; its own limits.
    sync(
        &state,
        "p1",
        "plans/pro\u{1f}alice",
        &[LimitSpec::token_bucket(50, 60_000, 50)],
        5,
    )
    .await;
    let tier = ok(&state, "GET", "/admin/v1/keys/plans/pro?key=alice").await;
    assert_eq!(tier["limits"][0]["limit"]["requests"], 50);
    assert_eq!(tier["limits"][0]["exists"], true);
    // a first-present part names the alternative that supplied it
    let net = ok(
        &state,
        "GET",
        "/admin/v1/keys/net?key=client_ip%2F24%2F64%3D203.0.113.0%2F24%1FGET",
    )
    .await;
    assert_eq!(net["key"], json!(["client_ip/24/64=203.0.113.0/24", "GET"]));

    for (path, message) in [
        (
            "/admin/v1/keys/nope?key=alice",
            "rule: no rule named \"nope\"",
        ),
        (
            "/admin/v1/keys/plans?key=alice",
            "rule: \"plans\" has tiers, and each counts its own keys: name one, as plans/free",
        ),
        (
            "/admin/v1/keys/plans/gold?key=alice",
            "rule: no rule named \"plans/gold\"",
        ),
        ("/admin/v1/keys/local?key=alice", "rule: \"local\" is local"),
        // a key of another rule: its parts are not this rule's
        (
            "/admin/v1/keys/api?key=alice%1FGET",
            "key: rule \"api\" is keyed by 1 part(s)",
        ),
        (
            "/admin/v1/keys/ip?key=alice",
            "key[0]: the part is client_ip",
        ),
        (
            "/admin/v1/keys/net?key=203.0.113.0%2F24%1FGET",
            "key[0]: the part is first-present",
        ),
    ] {
        let answer = admin(&state, "GET", path).await;
        assert_refused(&answer, StatusCode::BAD_REQUEST, message);
        assert_eq!(answer.body["error"], "invalid_request");
        let answer = admin(&state, "DELETE", path).await;
        assert_refused(&answer, StatusCode::BAD_REQUEST, message);
    }
}

#[tokio::test]
async fn every_hostile_request_is_a_json_4xx_naming_its_field_and_changes_nothing() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    sync(&state, "p1", "api\u{1f}alice", &[TEN], 2).await;
    let before = all_keys(&redis);
    let path = format!("/admin/v1/keys/api?key=alice&limits={TEN_A_MINUTE}");

    // No token, a wrong one, a proxy's: 401. One proxy's credential must not move the fleet.
    for token in [None, Some("alice-admin-tokeN"), Some(TOKEN)] {
        for method in ["GET", "DELETE"] {
            let answer = call(&state, method, &path, token, Body::empty()).await;
            assert_refused(
                &answer,
                StatusCode::UNAUTHORIZED,
                "missing or invalid bearer token",
            );
            assert_eq!(answer.body["error"], "unauthorized");
        }
    }
    // Without --admin-tokens-file: 404 admin_disabled.
    let disabled = common::state(&redis.url());
    for token in [ALICE, TOKEN] {
        let answer = call(&disabled, "DELETE", &path, Some(token), Body::empty()).await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{answer:?}");
        assert_eq!(answer.body["error"], "admin_disabled");
    }

    let huge = "k".repeat(10_000);
    let long = "k".repeat(253);
    let cases: Vec<(String, &str)> = vec![
        ("/admin/v1/keys/api".into(), "key: missing"),
        ("/admin/v1/keys/api?key=".into(), "key: must not be empty"),
        (format!("/admin/v1/keys/api?key={huge}"), "key: the rule's key would be 10004 bytes"),
        (format!("/admin/v1/keys/api?key={long}"), "key: the rule's key would be 257 bytes"),
        ("/admin/v1/keys/api?key=%FF%FE".into(), "key: is not UTF-8"),
        ("/admin/v1/keys/api?key=%C0%AF".into(), "key: is not UTF-8"),
        ("/admin/v1/keys/api?key=a%1F".into(), "key[1]: must not be empty"),
        ("/admin/v1/keys/api?key=%1Fa".into(), "key[0]: must not be empty"),
        ("/admin/v1/keys/api?key=a&key=b".into(), "key: given twice"),
        ("/admin/v1/keys/api?key=a&rule=b".into(), "query: unknown parameter \"rule\""),
        ("/admin/v1/keys/api?key=alice".into(), "limits: missing: the service runs without --policy"),
        ("/admin/v1/keys/api?key=alice&limits=%5B".into(), "limits: must be a JSON array"),
        ("/admin/v1/keys/api?key=alice&limits=%5B%5D".into(), "limits: must hold 1 to 8"),
        ("/admin/v1/keys/api?key=alice&limits=%5B%7B%22requests%22%3A0%2C%22per%22%3A%22minute%22%7D%5D".into(), "limits[0].requests"),
        // the path: traversal, a tier too many, not UTF-8, empty
        ("/admin/v1/keys/../overrides?key=a".into(), "rule: must be a rule's name"),
        ("/admin/v1/keys/%2e%2e%2Foverrides?key=a".into(), "rule: must be a rule's name"),
        ("/admin/v1/keys/api/a/b?key=a".into(), "rule: must be a rule's name"),
        ("/admin/v1/keys/sluice:%7Boverrides%7D?key=a".into(), "rule: must be a rule's name"),
        ("/admin/v1/keys/%FF?key=a".into(), "rule: must be a rule's name"),
        ("/admin/v1/keys/api%1Falice?key=a".into(), "rule: must be a rule's name"),
    ];
    for (path, message) in &cases {
        for method in ["GET", "DELETE"] {
            let answer = admin(&state, method, path).await;
            assert_refused(&answer, StatusCode::BAD_REQUEST, message);
            assert_eq!(answer.body["error"], "invalid_request", "{path}");
        }
    }
    // `/admin/v1/keys/` names no rule: no route
    let answer = admin(&state, "DELETE", "/admin/v1/keys/?key=a").await;
    assert!(answer.status.is_client_error(), "{answer:?}");
    assert!(answer.body["error"].is_string(), "{answer:?}");
    assert_eq!(
        all_keys(&redis),
        before,
        "no refused request changed anything"
    );

    // Control characters are a key's bytes: a key holding them is its own key, answered as
    // JSON (the filter marks its own values with U+001E: a missing part is U+001E missing).
    let odd = "api\u{1f}\u{1e}missing\u{1f}a\nb\u{0}";
    sync(&state, "p1", odd, &[TEN], 4).await;
    let odd_path = format!("/admin/v1/keys/api?key=%1Emissing%1Fa%0Ab%00&limits={TEN_A_MINUTE}");
    let seen = ok(&state, "GET", &odd_path).await;
    assert_eq!(seen["key"], json!(["\u{1e}missing", "a\nb\u{0}"]));
    assert_eq!(seen["limits"][0]["exists"], true, "{seen}");
    assert_eq!(ok(&state, "DELETE", &odd_path).await["deleted"], 1);
    assert_eq!(all_keys(&redis), before);
}

/// A key whose text names a Redis key of something else (the live overrides, another entry's
/// bucket, a glob) is only its own key: the reset deletes the Redis keys named from it and
/// nothing else.
#[tokio::test]
async fn a_key_naming_another_redis_key_touches_only_its_own() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    sync(&state, "p1", "api\u{1f}alice", &[TEN], 2).await;
    sync(&state, "p1", "api\u{1f}bob", &[TEN], 2).await;
    let bypass = call(
        &state,
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(ALICE),
        Body::from(r#"{"enabled": false}"#),
    )
    .await;
    assert_eq!(bypass.status, StatusCode::OK, "{bypass:?}");
    redis.query(&["SET", "unrelated", "1"]).unwrap();
    let before = all_keys(&redis);
    assert!(before.len() >= 5, "{before:?}");

    let alice_key = keys::limit_key("api\u{1f}alice", &TEN);
    let hostile = [
        "*".to_owned(),
        "alice*".to_owned(),
        "unrelated".to_owned(),
        "sluice:{overrides}:bypass".to_owned(),
        "}{overrides}".to_owned(),
        "alice:10/60000/10".to_owned(),
        alice_key.clone(),
        alice_key.replace('\u{1f}', ""),
    ];
    for key in hostile {
        let encoded: String = key.bytes().map(|b| format!("%{b:02X}")).collect();
        let path = format!("/admin/v1/keys/api?key={encoded}&limits={TEN_A_MINUTE}");
        let seen = ok(&state, "GET", &path).await;
        assert_eq!(seen["key"], json!(key.split('\u{1f}').collect::<Vec<_>>()));
        assert_eq!(seen["limits"][0]["exists"], false, "{key}: {seen}");
        let reset = ok(&state, "DELETE", &path).await;
        assert_eq!(reset["deleted"], 0, "{key}");
        assert_eq!(all_keys(&redis), before, "{key}");
    }
}

#[tokio::test]
async fn a_key_is_shown_and_reset_on_a_redis_cluster_in_one_call() {
    let cluster = RedisCluster::start(3).unwrap();
    let file = TextFile::new(ADMINS);
    let state = AppState::new(common::settings(
        &cluster.url_list(),
        &["--admin-tokens-file", file.path()],
    ))
    .unwrap();
    assert!(state.backend.is_cluster());
    let two = [TEN, LimitSpec::token_bucket(100, 3_600_000, 100)];
    let mut first = Vec::new();
    for user in ["alice", "bob", "carol"] {
        first.push(sync(&state, "p1", &format!("api\u{1f}{user}"), &two, 3).await);
    }
    let limits = "%5B%7B%22requests%22%3A10%2C%22per%22%3A%22minute%22%7D%2C%7B%22requests%22%3A100%2C%22per%22%3A%22hour%22%7D%5D";
    let path = format!("/admin/v1/keys/api?key=alice&limits={limits}");
    // warm up: the script loaded on every node
    ok(&state, "GET", &path).await;
    cluster.reset_stats().unwrap();
    let seen = ok(&state, "GET", &path).await;
    let exists: Vec<bool> = seen["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["exists"].as_bool().unwrap())
        .collect();
    assert_eq!(exists, [true, true], "{seen}");
    assert_eq!(seen["limits"][1]["leases"][0]["proxy"], "p1");
    let reset = ok(&state, "DELETE", &path).await;
    assert_eq!(reset["deleted"], 2);
    assert_eq!(
        cluster.command_calls("evalsha").unwrap(),
        2,
        "one script call each, every key of it in one slot"
    );
    let fresh = ok(&state, "GET", &path).await;
    assert!(fresh["limits"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l["exists"] == false));
    for (i, user) in [(1, "bob"), (2, "carol")] {
        let grant = sync(&state, "p1", &format!("api\u{1f}{user}"), &two, 0).await;
        assert_eq!(
            grant["remaining"], first[i]["remaining"],
            "{user}'s count was kept"
        );
    }
}

/// A key in its penalty (a rule's `penalty`, started by the service: the proxy spent the lease it
/// was granted and was denied more) shows when it started and ends; the reset clears it with the
/// counts, so the next sync grants again.
#[tokio::test]
async fn a_penalty_is_shown_and_goes_with_the_reset() {
    let redis = Redis::start().unwrap();
    let state = admin_state(&redis.url(), &[]);
    let lease = json!({
        "proxy": "p1",
        "interval_ms": 10_000,
        "entries": [{"key": "api\u{1f}alice", "limits": [TEN], "spent": 0, "denied": 30,
            "penalty_ms": 600_000}],
    });
    let leased = post(&state, "/v1/sync", &lease).await;
    assert!(
        leased.body["grants"][0]["tokens"].as_u64() >= Some(10),
        "{leased:?}"
    );
    let body = json!({
        "proxy": "p1",
        "interval_ms": 10_000,
        "entries": [{"key": "api\u{1f}alice", "limits": [TEN], "spent": 30, "denied": 4,
            "penalty_ms": 600_000}],
    });
    let over = post(&state, "/v1/sync", &body).await;
    assert_eq!(over.body["grants"][0]["penalty_ms"], 600_000, "{over:?}");
    let path = format!("/admin/v1/keys/api?key=alice&limits={TEN_A_MINUTE}");
    let seen = ok(&state, "GET", &path).await;
    let penalty = &seen["penalty"];
    let now_ms = seen["now_ms"].as_u64().unwrap();
    let until = penalty["until_ms"].as_u64().unwrap();
    assert!(
        until > now_ms + 590_000 && until <= now_ms + 600_001,
        "{seen}"
    );
    assert!(penalty["from_ms"].as_u64().unwrap() <= now_ms, "{seen}");
    assert!(penalty["ttl_ms"].as_u64().unwrap() > 590_000, "{seen}");
    let penalty_key = format!("{}:penalty", keys::limit_key("api\u{1f}alice", &TEN));
    assert!(exists(&redis, &penalty_key));

    let reset = ok(&state, "DELETE", &path).await;
    assert_eq!(reset["deleted"], 2, "the bucket and its penalty: {reset}");
    assert!(!exists(&redis, &penalty_key));
    assert_eq!(ok(&state, "GET", &path).await["penalty"], Value::Null);
    let again = post(
        &state,
        "/v1/sync",
        &json!({
            "proxy": "p2", "interval_ms": 10_000,
            "entries": [{"key": "api\u{1f}alice", "limits": [TEN], "spent": 0, "denied": 0,
                "penalty_ms": 600_000}],
        }),
    )
    .await;
    let grant = &again.body["grants"][0];
    assert!(grant["tokens"].as_u64().unwrap() > 0, "{again:?}");
    assert_eq!(grant.get("penalty_ms"), None, "{again:?}");
}
