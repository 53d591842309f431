//! The fleet load level (`lua/fleet.lua`) on a real Redis: a sync that carries its proxy's load is
//! answered the mean utilization of the proxies whose report is fresh; a stale report stops
//! counting; an invalid report refuses the sync; a sync without a report gets no level; the level
//! is advisory when Redis fails for it; the hash is capped.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, get, post, state, Answer};
use serde_json::{json, Value};
use sluice_counter_service::fleet::{self, FLEET_KEY, MAX_FLEET_PROXIES};
use sluice_counter_service::scripts::FLEET_LUA;
use sluice_counter_service::AppState;
use sluice_protocol::LoadReport;
use sluice_tests::redis::{Redis, Reply};

const T0_US: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;

fn sync_body(proxy: &str, interval_ms: u64, load: Option<Value>) -> Value {
    let mut body = json!({
        "proxy": proxy,
        "interval_ms": interval_ms,
        "entries": [{"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 1, "denied": 0}]
    });
    if let Some(load) = load {
        body["load"] = load;
    }
    body
}

fn load(utilization: f64) -> Value {
    json!({"utilization": utilization, "shed_rate": 0.0, "latency_ms": 12.5})
}

/// A sync of `proxy` every `interval_ms`, reporting `utilization`.
async fn report(state: &AppState, proxy: &str, interval_ms: u64, utilization: f64) -> Answer {
    let answer = post(
        state,
        "/v1/sync",
        &sync_body(proxy, interval_ms, Some(load(utilization))),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_granted(&answer, interval_ms);
    answer
}

/// The sync's one entry was applied and leased (for the default 3 intervals).
fn assert_granted(answer: &Answer, interval_ms: u64) {
    let grant = &answer.body["grants"][0];
    assert!(grant.get("refused").is_none(), "{answer:?}");
    assert_eq!(grant["ttl_ms"], 3 * interval_ms, "{answer:?}");
}

fn level(answer: &Answer) -> Option<f64> {
    answer.body["hints"]["overrides"]["load_level"].as_f64()
}

async fn metrics(state: &AppState) -> String {
    get(state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned()
}

fn stored(redis: &Redis, proxy: &str) -> Option<String> {
    redis
        .query(&["HGET", FLEET_KEY, proxy])
        .unwrap()
        .text()
        .map(str::to_owned)
}

fn fields(redis: &Redis) -> u64 {
    redis.text(&["HLEN", FLEET_KEY]).unwrap().parse().unwrap()
}

fn utilization(value: f64) -> LoadReport {
    LoadReport {
        utilization: value,
        shed_rate: 0.0,
        latency_ms: 1.0,
    }
}

#[tokio::test]
async fn two_proxies_at_0_2_and_0_8_are_both_answered_0_5() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let alone = report(&state, "p1", 100, 0.2).await;
    assert_eq!(level(&alone), Some(0.2), "{alone:?}");
    let second = report(&state, "p2", 100, 0.8).await;
    assert_eq!(level(&second), Some(0.5), "{second:?}");
    let first = report(&state, "p1", 100, 0.2).await;
    assert_eq!(level(&first), Some(0.5), "{first:?}");
    assert_eq!(first.body["hints"]["next_sync_ms"], 100, "{first:?}");

    // one field per proxy: utilization, shed_rate, latency_ms, interval_ms, time_ms (Redis TIME)
    assert_eq!(fields(&redis), 2);
    let value = stored(&redis, "p2").unwrap();
    let parts: Vec<&str> = value.split(',').collect();
    assert_eq!(parts[..4], ["0.8", "0", "12.5", "100"], "{value}");
    let redis_now_ms = redis.query(&["TIME"]).unwrap();
    let Reply::Array(time) = redis_now_ms else {
        panic!("{redis_now_ms:?}")
    };
    let now_ms = time[0].text().unwrap().parse::<u64>().unwrap() * 1000;
    let at: u64 = parts[4].parse().unwrap();
    assert!(now_ms.abs_diff(at) < 5_000, "{at} vs Redis TIME {now_ms}");
    // the key expires with its freshest report (1 s: 3 × 100 ms is less)
    let ttl: u64 = redis.text(&["PTTL", FLEET_KEY]).unwrap().parse().unwrap();
    assert!((1..=1_000).contains(&ttl), "{ttl}");

    let text = metrics(&state).await;
    assert!(text.contains("sluice_fleet_load_level 0.5"), "{text}");
    assert!(text.contains("sluice_fleet_proxies 2"), "{text}");
    assert!(
        text.contains("sluice_load_reports_total{outcome=\"recorded\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("sluice_script_calls_total{script=\"fleet\"} 3"),
        "{text}"
    );

    // the level is a mean clamped to [0, 1]: a brief overload counts in full, up to 1
    let over = report(&state, "p3", 100, 2.9).await;
    assert_eq!(level(&over), Some(1.0), "(0.2 + 0.8 + 2.9) / 3: {over:?}");
}

/// Real time, Redis `TIME`: a proxy syncing every 10 ms is fresh for the floor of 1 s. Its
/// report counts while surely younger, and no longer once surely older (the request's own time
/// is the only uncertainty).
#[tokio::test]
async fn a_stale_report_stops_counting_after_its_freshness_window() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let sent = Instant::now();
    report(&state, "gone", 10, 0.8).await;
    let recorded = Instant::now();
    let (mut fresh, mut stale) = (0, 0);
    loop {
        let asked = Instant::now();
        let answer = report(&state, "alive", 10, 0.2).await;
        let answered = Instant::now();
        if answered - sent < Duration::from_millis(1_000) {
            assert_eq!(level(&answer), Some(0.5), "still fresh: {answer:?}");
            fresh += 1;
        } else if asked - recorded >= Duration::from_millis(1_000) {
            assert_eq!(level(&answer), Some(0.2), "stale: {answer:?}");
            stale += 1;
            break;
        }
        assert!(sent.elapsed() < Duration::from_secs(4), "never stale");
        // just past the window when it is near, else every 250 ms
        let until_stale = Duration::from_millis(1_010).saturating_sub(recorded.elapsed());
        tokio::time::sleep(until_stale.min(Duration::from_millis(250))).await;
    }
    assert!(fresh >= 2 && stale == 1, "{fresh} {stale}");
    assert_eq!(stored(&redis, "gone"), None, "a stale report is deleted");
    assert_eq!(fields(&redis), 1);
}

/// With the tests' clock: fresh while younger than 3 intervals, and at least 1 s.
#[tokio::test]
async fn freshness_is_three_intervals_and_at_least_a_second() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let at = |ms: u64| T0_US + ms * MS;
    let fleet = |proxy: &'static str, value: f64, interval_ms: u64, now_us: u64| {
        let state = state.clone();
        async move {
            fleet::report(&state, proxy, &utilization(value), interval_ms, now_us)
                .await
                .unwrap()
        }
    };
    // `slow` syncs every 2 s: fresh for 6 s; `fast` every 100 ms: fresh for 1 s (not 300 ms)
    fleet("slow", 1.0, 2_000, at(0)).await;
    fleet("fast", 0.0, 100, at(0)).await;
    let watcher = |ms| fleet("watcher", 0.5, 100, at(ms));
    let seen = watcher(999).await;
    assert_eq!((seen.level, seen.proxies), (0.5, 3), "{seen:?}");
    let seen = watcher(1_000).await;
    assert_eq!(
        (seen.level, seen.proxies),
        (0.75, 2),
        "fast is stale: {seen:?}"
    );
    let seen = watcher(5_999).await;
    assert_eq!((seen.level, seen.proxies), (0.75, 2), "{seen:?}");
    let seen = watcher(6_000).await;
    assert_eq!(
        (seen.level, seen.proxies),
        (0.5, 1),
        "slow is stale: {seen:?}"
    );
    assert!(seen.recorded);
    assert_eq!(fields(&redis), 1, "only the watcher is left");
    assert_eq!(
        stored(&redis, "watcher").unwrap(),
        "0.5,0,1,100,1700000006000"
    );
}

#[tokio::test]
async fn an_invalid_report_is_400_naming_the_field() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let cases = [
        (
            json!({"utilization": 10.5, "shed_rate": 0.0, "latency_ms": 1.0}),
            "load.utilization: must be a number between 0 and 10",
        ),
        (
            json!({"utilization": 0.5, "shed_rate": -0.25, "latency_ms": 1.0}),
            "load.shed_rate: must be a number between 0 and 1",
        ),
        (
            json!({"utilization": 0.5, "shed_rate": 0.5, "latency_ms": 3_600_001.0}),
            "load.latency_ms: must be a number between 0 and 3600000",
        ),
    ];
    for (load, message) in cases {
        let answer = post(&state, "/v1/sync", &sync_body("p1", 100, Some(load))).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
        assert_eq!(answer.body["error"], "invalid_request", "{answer:?}");
        assert_eq!(answer.body["message"], message, "{answer:?}");
    }
    // JSON has no NaN or infinity; a number too large for a double does not parse
    let body = sync_body("p1", 100, None).to_string().replace(
        "\"proxy\"",
        "\"load\":{\"utilization\":1e999,\"shed_rate\":0,\"latency_ms\":0},\"proxy\"",
    );
    let answer = call(
        &state,
        "POST",
        "/v1/sync",
        Some(common::TOKEN),
        Body::from(body),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
    assert_eq!(answer.body["error"], "malformed_json", "{answer:?}");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("malformed JSON: load.utilization: "),
        "{message}"
    );
    // the whole sync is refused: neither its counts nor the report were applied
    assert_eq!(redis.text(&["DBSIZE"]).unwrap(), "0");
}

#[tokio::test]
async fn a_sync_without_load_works_and_gets_no_level() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = post(&state, "/v1/sync", &sync_body("old", 100, None)).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(
        answer.body["hints"],
        json!({"next_sync_ms": 100, "overrides": {"bypass": false}}),
        "no load_level: {answer:?}"
    );
    assert_granted(&answer, 100);
    assert_eq!(redis.text(&["EXISTS", FLEET_KEY]).unwrap(), "0");

    // nor while other proxies report: the hash is not touched, no level is answered
    report(&state, "new", 100, 0.4).await;
    let before = stored(&redis, "new");
    let answer = post(&state, "/v1/sync", &sync_body("old", 100, None)).await;
    assert!(
        answer.body["hints"]["overrides"]
            .get("load_level")
            .is_none(),
        "{answer:?}"
    );
    assert_eq!(stored(&redis, "new"), before);
    assert_eq!(fields(&redis), 1);
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_script_calls_total{script=\"fleet\"} 1"),
        "{text}"
    );
}

/// The level is advisory: when Redis fails for it (here the key holds a string, so the script
/// errors), the sync is answered its grants, without a level.
#[tokio::test]
async fn a_failed_fleet_call_still_answers_the_grants() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    redis.query(&["SET", FLEET_KEY, "not a hash"]).unwrap();
    let answer = report(&state, "p1", 100, 0.5).await;
    assert_eq!(level(&answer), None, "{answer:?}");
    assert_eq!(answer.body["hints"]["next_sync_ms"], 100, "{answer:?}");
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_load_reports_total{outcome=\"error\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("sluice_redis_seconds_count{op=\"fleet\",outcome=\"error\"} 1"),
        "{text}"
    );

    redis.query(&["DEL", FLEET_KEY]).unwrap();
    let answer = report(&state, "p1", 100, 0.5).await;
    assert_eq!(level(&answer), Some(0.5), "{answer:?}");
}

/// With `--tokens-file`, the field is the proxy id as the service keeps it: one holder cannot
/// replace the report of another's proxy by sending its id.
#[tokio::test]
async fn the_field_is_the_proxy_id_under_its_credential() {
    let redis = Redis::start().unwrap();
    let file = std::env::temp_dir().join(format!("sluice-{}-fleet-tokens", std::process::id()));
    std::fs::write(&file, "edge-a tok-a\nedge-b tok-b\n").unwrap();
    let settings =
        common::settings_without_token(&redis.url(), &["--tokens-file", file.to_str().unwrap()]);
    let state = AppState::new(settings).unwrap();
    std::fs::remove_file(&file).unwrap();
    let sync = |token: &'static str, utilization: f64| {
        let state = state.clone();
        async move {
            let body = sync_body("p1", 100, Some(load(utilization)));
            call(
                &state,
                "POST",
                "/v1/sync",
                Some(token),
                Body::from(body.to_string()),
            )
            .await
        }
    };
    assert_eq!(level(&sync("tok-a", 0.2).await), Some(0.2));
    assert_eq!(level(&sync("tok-b", 0.6).await), Some(0.4));
    assert!(stored(&redis, "edge-a/p1").unwrap().starts_with("0.2,"));
    assert!(stored(&redis, "edge-b/p1").unwrap().starts_with("0.6,"));
    assert_eq!(stored(&redis, "p1"), None);
}

/// At most MAX_FLEET_PROXIES reports: a newcomer is refused (and answered the others' level)
/// while every report is fresh; a proxy in the hash still replaces its own; a stale report
/// makes room.
#[tokio::test]
async fn a_full_hash_refuses_newcomers_not_the_running_proxies() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    // MAX_FLEET_PROXIES - 1 proxies at 0.5 reported at T0, syncing every second (fresh for 3 s)
    let t0_ms = (T0_US / MS).to_string();
    let value = format!("0.5,0,1,1000,{t0_ms}");
    let names: Vec<String> = (1..MAX_FLEET_PROXIES)
        .map(|i| format!("proxy-{i}"))
        .collect();
    let mut hset = vec!["HSET", FLEET_KEY];
    for name in &names {
        hset.push(name);
        hset.push(&value);
    }
    redis.query(&hset).unwrap();
    let report = |proxy: &'static str, value: f64, ms: u64| {
        let state = state.clone();
        async move {
            fleet::report(&state, proxy, &utilization(value), 1_000, T0_US + ms * MS)
                .await
                .unwrap()
        }
    };
    let last = report("last", 0.5, 100).await;
    assert!(last.recorded, "{last:?}");
    assert_eq!(last.proxies, MAX_FLEET_PROXIES);
    let newcomer = report("newcomer", 1.0, 200).await;
    assert!(!newcomer.recorded, "{newcomer:?}");
    assert_eq!((newcomer.level, newcomer.proxies), (0.5, MAX_FLEET_PROXIES));
    assert_eq!(stored(&redis, "newcomer"), None);
    assert_eq!(fields(&redis), MAX_FLEET_PROXIES);
    let again = report("last", 0.5, 300).await;
    assert!(
        again.recorded,
        "a proxy in the hash replaces its own report: {again:?}"
    );

    // 3 s after T0, the prefilled reports are stale: deleted, and the newcomer gets in
    let newcomer = report("newcomer", 1.0, 3_000).await;
    assert!(newcomer.recorded, "{newcomer:?}");
    assert_eq!((newcomer.level, newcomer.proxies), (0.75, 2));
    assert_eq!(fields(&redis), 2);

    // one script call each
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_script_calls_total{script=\"fleet\"} 4"),
        "{text}"
    );
}

/// The fleet script runs by the SHA of prelude and script, and is loaded again after a flush.
#[tokio::test]
async fn the_fleet_script_reloads_after_a_flush() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let sha = state.scripts.fleet.get_hash().to_owned();
    for round in 0..2 {
        let answer = report(&state, "p1", 100, 0.3).await;
        assert_eq!(level(&answer), Some(0.3), "round {round}: {answer:?}");
        let loaded = redis.query(&["SCRIPT", "LOAD", FLEET_LUA]).unwrap();
        assert_eq!(loaded.text(), Some(sha.as_str()));
        redis.query(&["SCRIPT", "FLUSH"]).unwrap();
    }
}
