//! `GET /v1/status` on a real Redis: answered without credentials, cacheable, bounded in rate;
//! `operational` with Redis up, `bypassed` with the emergency bypass on, `degraded` when the fleet
//! is at the `high` level or Redis is gone; and nothing in it a client could not already know.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, get, post, Answer, TextFile};
use serde_json::{json, Value};
use sluice_counter_service::status::STATUS_TTL;
use sluice_counter_service::AppState;
use sluice_tests::redis::Redis;

const ADMINS: &str = "alice alice-admin-token\n";

/// A state with the admin API on (the bypass is set through it); the admins file lives as long as
/// the state is used.
fn state_with(redis_url: &str, more: &[&str]) -> (AppState, TextFile) {
    let admins = TextFile::new(ADMINS);
    let mut args = vec!["--admin-tokens-file", admins.path()];
    args.extend_from_slice(more);
    let state = AppState::new(common::settings(redis_url, &args)).unwrap();
    (state, admins)
}

async fn status(state: &AppState) -> Answer {
    let answer = get(state, "/v1/status").await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer
}

/// Waits out the built status every caller shares.
async fn next_status(state: &AppState) -> Answer {
    tokio::time::sleep(STATUS_TTL + Duration::from_millis(50)).await;
    status(state).await
}

fn fields(body: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    names.sort_unstable();
    names
}

#[tokio::test]
async fn without_credentials_it_says_operational_and_may_be_cached() {
    let redis = Redis::start().unwrap();
    let (state, _admins) = state_with(&redis.url(), &[]);
    let answer = status(&state).await;
    assert_eq!(answer.body["status"], "operational", "{answer:?}");
    assert_eq!(answer.body["limiter"], "up");
    assert_eq!(answer.body["bypass"], false);
    assert_eq!(
        answer.body["fleet"],
        Value::Null,
        "no proxy reported its load"
    );
    assert!(answer.body["as_of_ms"].as_u64().unwrap() > 1_700_000_000_000);
    assert_eq!(
        answer.headers.get("cache-control").unwrap(),
        "public, max-age=2"
    );
    // Nothing a client does not already know: no rule, key, token or proxy id.
    assert_eq!(
        fields(&answer.body),
        ["as_of_ms", "bypass", "fleet", "limiter", "status"]
    );
    // A proxy token changes nothing, a wrong one is not refused (no credentials are read).
    let with_token = call(&state, "GET", "/v1/status", Some("wrong"), Body::empty()).await;
    assert_eq!(with_token.status, StatusCode::OK, "{with_token:?}");
}

#[tokio::test]
async fn the_bypass_and_a_loaded_fleet_show_and_clear() {
    let redis = Redis::start().unwrap();
    let (state, _admins) = state_with(&redis.url(), &[]);
    assert_eq!(status(&state).await.body["status"], "operational");

    let on = call(
        &state,
        "PUT",
        "/admin/v1/overrides/bypass",
        Some("alice-admin-token"),
        Body::from(json!({"enabled": true, "reason": "incident 7"}).to_string()),
    )
    .await;
    assert_eq!(on.status, StatusCode::OK, "{on:?}");
    let bypassed = next_status(&state).await;
    assert_eq!(bypassed.body["status"], "bypassed", "{bypassed:?}");
    assert_eq!(bypassed.body["bypass"], true);
    let off = call(
        &state,
        "DELETE",
        "/admin/v1/overrides/bypass",
        Some("alice-admin-token"),
        Body::empty(),
    )
    .await;
    assert_eq!(off.status, StatusCode::OK, "{off:?}");

    // Two proxies at 0.8 and 1.0: the fleet is at 0.9, past `high` (0.85).
    for (proxy, utilization) in [("p1", 0.8), ("p2", 1.0)] {
        let sync = post(
            &state,
            "/v1/sync",
            &json!({"proxy": proxy, "interval_ms": 100, "entries": [],
                    "load": {"utilization": utilization, "shed_rate": 0.0, "latency_ms": 5.0}}),
        )
        .await;
        assert_eq!(sync.status, StatusCode::OK, "{sync:?}");
    }
    let loaded = next_status(&state).await;
    assert_eq!(loaded.body["status"], "degraded", "{loaded:?}");
    assert_eq!(loaded.body["bypass"], false);
    let utilization = loaded.body["fleet"]["utilization"].as_f64().unwrap();
    assert!((utilization - 0.9).abs() < 1e-9, "{loaded:?}");
    assert_eq!(loaded.body["fleet"]["proxies"], 2);
}

#[tokio::test]
async fn with_redis_gone_it_says_degraded_not_an_error() {
    let redis = Redis::start().unwrap();
    let (state, _admins) = state_with(&redis.url(), &["--redis-timeout-ms", "200"]);
    assert_eq!(status(&state).await.body["limiter"], "up");
    drop(redis);
    let gone = next_status(&state).await;
    assert_eq!(gone.body["status"], "degraded", "{gone:?}");
    assert_eq!(gone.body["limiter"], "down");
    assert_eq!(gone.body["bypass"], Value::Null, "unknown, not false");
}

/// Attacker's test: one client floods the endpoint far past `--status-rate-per-s` (50 calls
/// between each of a status page's polls, against a rate of 5); the status page is answered
/// every time, never 429: past the rate, the last status built, as it is, with its `Age`. And
/// whoever asks, one Redis read per status built: as many reads as the answers show statuses.
/// (Before, past the rate it was 429: a poller every 0.5 s beside a client at 100 a second was
/// refused 8 times of 8.)
#[tokio::test]
async fn a_flood_past_the_rate_refuses_no_status_page_and_costs_one_read_a_status() {
    let redis = Redis::start().unwrap();
    let (state, _admins) = state_with(&redis.url(), &["--status-rate-per-s", "5"]);
    // The service's connection and its scripts set up.
    let first = status(&state).await;
    let before = script_calls(&redis);
    let mut answers = Vec::new();
    let mut polls = Vec::new();
    for _ in 0..8 {
        for _ in 0..50 {
            answers.push(get(&state, "/v1/status").await);
        }
        polls.push(get(&state, "/v1/status").await);
    }
    let refused = |answers: &[Answer]| {
        answers
            .iter()
            .filter(|a| a.status != StatusCode::OK)
            .count()
    };
    assert_eq!(refused(&polls), 0, "{polls:?}");
    assert_eq!(refused(&answers), 0, "the flood itself is answered");
    answers.extend(polls);
    for answer in &answers {
        assert_eq!(
            answer.headers.get("cache-control").unwrap(),
            "public, max-age=2"
        );
        assert_eq!(answer.body["status"], "operational", "{answer:?}");
    }
    // One read per status built, however many asked: each built for its caller (no `Age`), or
    // answered as it was built before (an `Age` in whole seconds).
    let mut built: Vec<u64> = answers
        .iter()
        .map(|a| a.body["as_of_ms"].as_u64().unwrap())
        .filter(|&at| at != first.body["as_of_ms"].as_u64().unwrap())
        .collect();
    built.sort_unstable();
    built.dedup();
    let fresh = answers.iter().filter(|a| a.headers.get("age").is_none());
    assert_eq!(fresh.count(), built.len(), "answers built for their caller");
    for answer in &answers {
        if let Some(age) = answer.headers.get("age") {
            age.to_str().unwrap().parse::<u64>().unwrap();
        }
    }
    assert_eq!(
        script_calls(&redis) - before,
        built.len() as u64,
        "script calls for {} status calls",
        answers.len()
    );
}

/// How many scripts Redis ran (EVALSHA and EVAL calls, INFO commandstats).
fn script_calls(redis: &Redis) -> u64 {
    let info = redis.query(&["INFO", "commandstats"]).unwrap();
    let text = info.text().unwrap().to_owned();
    text.lines()
        .filter(|line| line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:"))
        .filter_map(|line| {
            line.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[test]
fn the_rate_flag_is_bounded() {
    for (value, error) in [
        ("0", "--status-rate-per-s must be at least 1"),
        ("10001", "--status-rate-per-s must be at most 10000"),
    ] {
        let settings = common::settings("redis://127.0.0.1:1", &["--status-rate-per-s", value]);
        assert_eq!(settings.validate().unwrap_err(), error);
    }
}
