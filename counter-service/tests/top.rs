//! Who is being limited, through the service on a real Redis: three proxies of two credentials
//! count their part of a known Zipf workload in the filter's sketches, report them in their
//! syncs, and `GET /admin/v1/top` answers the fleet's top keys within the error bound it states;
//! bad reports and bad queries are refused naming their field.

mod common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, TextFile};
use serde_json::{json, Value};
use sluice_core::limit::table::KeyHasher;
use sluice_core::top::{self, RuleTop};
use sluice_counter_service::AppState;
use sluice_tests::redis::Redis;
use sluice_tests::zipf;

const ADMIN: &str = "admin-token";
const TOKENS: &str = "edge-a token-a\nedge-b token-b\n";

fn state(redis: &Redis) -> (AppState, TextFile, TextFile) {
    let tokens = TextFile::new(TOKENS);
    let admins = TextFile::new(&format!("ops {ADMIN}\n"));
    let settings = common::settings_without_token(
        &redis.url(),
        &[
            "--tokens-file",
            tokens.path(),
            "--admin-tokens-file",
            admins.path(),
        ],
    );
    (AppState::new(settings).unwrap(), tokens, admins)
}

async fn sync(state: &AppState, token: &str, proxy: &str, top: Value) -> common::Answer {
    let body = json!({
        "proxy": proxy,
        "interval_ms": 100,
        "entries": [{"key": "api\u{1f}10.0.0.0", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 1, "denied": 0}],
        "top": top,
    });
    call(
        state,
        "POST",
        "/v1/sync",
        Some(token),
        Body::from(body.to_string()),
    )
    .await
}

async fn top_of(state: &AppState, query: &str) -> common::Answer {
    let path = format!("/admin/v1/top?{query}");
    call(state, "GET", &path, Some(ADMIN), Body::empty()).await
}

#[tokio::test]
async fn a_zipf_workload_through_three_proxies_is_answered_within_its_error_bound() {
    let redis = Redis::start().unwrap();
    let (state, _tokens, _admins) = state(&redis);
    let n = 60_000;
    let k = 16;
    let stream = zipf::stream(0x70b, "api", 3_000, 1.1, n);
    let truth = zipf::counts(&stream);
    // Three proxies (two under one credential), each counting its part in one worker's
    // sketch and reporting it in three syncs.
    let hasher = KeyHasher::new([3, 5]);
    let proxies = [("token-a", "p1"), ("token-a", "p2"), ("token-b", "p3")];
    for (i, (token, proxy)) in proxies.iter().enumerate() {
        for round in 0..3 {
            let mut sketch = RuleTop::new(k);
            for key in stream.iter().skip(i * 3 + round).step_by(9) {
                sketch.denied.offer(hasher.fingerprint(key), key);
            }
            let report = top::report("api", &sketch.take().unwrap());
            let answer = sync(&state, token, proxy, json!([report])).await;
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
            assert_eq!(answer.body["grants"].as_array().unwrap().len(), 1);
        }
    }
    let answer = top_of(&state, "rule=api&window=5m&limit=64").await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let denied = &answer.body["denied"];
    assert_eq!(answer.body["credentials"], 2);
    assert_eq!(denied["total"], n as u64);
    let error = denied["error_bound"].as_u64().unwrap();
    assert!(error <= n as u64 / k as u64, "error bound {error}");
    let listed = denied["keys"].as_array().unwrap();
    assert!(!listed.is_empty() && listed.len() <= 64);
    // Every key answered within the bound: count <= true <= count + error (= at_most).
    for entry in listed {
        let key = entry["key"].as_str().unwrap();
        let (count, at_most) = (
            entry["count"].as_u64().unwrap(),
            entry["at_most"].as_u64().unwrap(),
        );
        let t = truth[key];
        assert!(
            count <= t && t <= at_most,
            "{key:?}: {count} <= {t} <= {at_most}"
        );
        assert_eq!(at_most, count + error);
    }
    // Every key counted more than the error (plus the last count answered, when the list is
    // full) is answered. Not listing the largest counts alone (each credential keeps its own top
    // 32 first), the answer still does here: both credentials see the one workload, so each one's
    // top keys are the fleet's.
    let last = match listed.len() {
        64 => listed[63]["count"].as_u64().unwrap(),
        _ => 0,
    };
    let mut heavy = 0;
    for (key, &t) in &truth {
        if t > error + last {
            heavy += 1;
            assert!(
                listed.iter().any(|e| e["key"] == key.as_str()),
                "{key:?} ({t}) missing"
            );
        }
    }
    assert!(heavy >= 1);
    let heaviest = truth.iter().max_by_key(|(_, &c)| c).unwrap().0;
    assert_eq!(listed[0]["key"], heaviest.as_str());
    // Nothing admitted was reported.
    assert_eq!(answer.body["admitted"]["total"], 0);
}

#[tokio::test]
async fn bad_reports_and_bad_queries_are_refused_naming_their_field() {
    let redis = Redis::start().unwrap();
    let (state, _tokens, _admins) = state(&redis);
    // More rules than a batch may report: the batch is refused, naming `top`.
    let many: Vec<Value> = (0..33)
        .map(|i| json!({"rule": format!("r{i}"), "admitted": {"total": 0, "error": 0}, "denied": {"total": 0, "error": 0}}))
        .collect();
    let answer = sync(&state, "token-a", "p1", json!(many)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(
        answer.body["message"].as_str().unwrap().starts_with("top:"),
        "{answer:?}"
    );
    // A giant key, a count past the bound: the batch's grants are answered, the key left out.
    let giant = format!("api\u{1f}{}", "x".repeat(10_000));
    let report = json!([{"rule": "api", "admitted": {"total": 0, "error": 0},
        "denied": {"total": 5, "error": 0, "keys": [{"key": giant, "count": 4}, {"key": "api\u{1f}ok", "count": 1}]}},
        {"rule": "big", "admitted": {"total": u64::MAX, "error": 0}, "denied": {"total": 0, "error": 0}}]);
    let answer = sync(&state, "token-a", "p1", report).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let shown = top_of(&state, "rule=api&window=1m").await;
    assert_eq!(
        shown.body["denied"]["keys"],
        json!([{"key": "api\u{1f}ok", "count": 1, "at_most": 5}])
    );
    assert_eq!(top_of(&state, "rule=big").await.body["credentials"], 0);
    // The admin token is needed; a query out of bounds is a 400 naming its field.
    let anonymous = call(&state, "GET", "/admin/v1/top?rule=api", None, Body::empty()).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    let proxy = call(
        &state,
        "GET",
        "/admin/v1/top?rule=api",
        Some("token-a"),
        Body::empty(),
    )
    .await;
    assert_eq!(
        proxy.status,
        StatusCode::UNAUTHORIZED,
        "a proxy token is no admin's"
    );
    for (query, field) in [
        ("window=5m", "rule"),
        ("rule=api&window=1h", "window"),
        ("rule=api&limit=1000", "limit"),
        ("rule=a%20b&window=5m", "rule"),
    ] {
        let answer = top_of(&state, query).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{query}");
        assert_eq!(answer.body["error"], "invalid_request");
        let message = answer.body["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{field}:")),
            "{query}: {message}"
        );
    }
}

/// A report of `keys` (name, count) denied under `api`, of `total` denials.
fn denied(keys: &[(String, u64)], total: u64) -> Value {
    let keys: Vec<Value> = keys
        .iter()
        .map(|(key, count)| json!({"key": format!("api\u{1f}{key}"), "count": count}))
        .collect();
    json!([{"rule": "api", "admitted": {"total": 0, "error": 0},
            "denied": {"total": total, "error": 0, "keys": keys}}])
}

fn listed(answer: &common::Answer) -> Vec<String> {
    answer.body["denied"]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["key"].as_str().unwrap().to_owned())
        .collect()
}

/// Attacker's test: credential a reports the abuser it sees (1,000 denials); credential b, a
/// liar, reports 64 made-up keys of 5,000 denials each, as many as a report may hold. The answer
/// keeps a's abuser: each of the C credentials that reported the rule keeps its own top
/// `limit / C` keys (here 32 of 64). With a limit below C, the slots go to the credentials'
/// largest first keys: `limit=1` answers b's. (Before, `limit=64` listed only b's keys.)
#[tokio::test]
async fn one_credentials_made_up_keys_do_not_hide_anothers_abuser() {
    let redis = Redis::start().unwrap();
    let (state, _tokens, _admins) = state(&redis);
    let abuser = vec![("mallory".to_string(), 1_000)];
    let answer = sync(&state, "token-a", "p1", denied(&abuser, 1_000)).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let made_up: Vec<(String, u64)> = (0..64).map(|i| (format!("fake{i:02}"), 5_000)).collect();
    let answer = sync(&state, "token-b", "p2", denied(&made_up, 64 * 5_000)).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");

    let all = top_of(&state, "rule=api&window=5m&limit=64").await;
    assert_eq!(all.status, StatusCode::OK, "{all:?}");
    assert_eq!(all.body["credentials"], 2);
    let keys = listed(&all);
    assert_eq!(keys.len(), 64, "{keys:?}");
    assert!(keys.contains(&"api\u{1f}mallory".to_string()), "{keys:?}");
    // Listed largest first, with the counts summed over the credentials, as before.
    let last = &all.body["denied"]["keys"][63];
    assert_eq!(last["key"], "api\u{1f}mallory");
    assert_eq!(last["count"], 1_000);
    assert_eq!(all.body["denied"]["total"], 1_000 + 64 * 5_000);
    // limit=2, two credentials: one each.
    let two = listed(&top_of(&state, "rule=api&window=5m&limit=2").await);
    assert_eq!(two, ["api\u{1f}fake00", "api\u{1f}mallory"]);
    // limit=1, below the credentials: the largest first key, the liar's.
    let one = listed(&top_of(&state, "rule=api&window=5m&limit=1").await);
    assert_eq!(one, ["api\u{1f}fake00"]);
}
