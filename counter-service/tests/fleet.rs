//! The fleet load level (`lua/fleet.lua`) on a real Redis: a sync that carries its proxy's load is
//! answered the mean over credentials of their fresh reports' mean utilization; a stale report
//! stops counting; an invalid report refuses the sync; a sync without a report gets no level; the
//! level is advisory when Redis fails for it. And what one liar can do: a report is clamped to
//! [0, 1] and stays fresh no longer than the service's cap, whatever interval it names; a
//! credential weighs 1 however many proxy ids it uses, and holds at most so many, so the others'
//! reports are always recorded and cost no more.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, get, post, state, Answer, TextFile};
use serde_json::{json, Value};
use sluice_counter_service::fleet::{self, proxies_key, FLEET_CREDENTIALS_KEY, SHARED_CREDENTIAL};
use sluice_counter_service::scripts::FLEET_LUA;
use sluice_counter_service::AppState;
use sluice_protocol::LoadReport;
use sluice_tests::redis::{Redis, Reply};

const T0_US: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;
/// What a test of a long loop on the tests' clock gives its proxies: an interval of 30 minutes,
/// so each report or share counts 90 minutes (under `--fleet-report-max-age-ms` at its most,
/// [`LONGEST_AGE_MS`], 3 h: a member a few seconds ahead of another's is not dropped as from a
/// clock ahead). The keys' expiry runs on Redis's own clock: with it, it cannot come before the
/// loop ends however slow the machine.
const LONG_INTERVAL_MS: u64 = 1_800_000;
const LONG_WINDOW_MS: u64 = 3 * LONG_INTERVAL_MS;
const LONGEST_AGE_MS: u64 = sluice_counter_service::settings::MAX_FLEET_REPORT_AGE_MS;

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

/// The report of `proxy` under the shared token.
fn stored(redis: &Redis, proxy: &str) -> Option<String> {
    stored_under(redis, SHARED_CREDENTIAL, proxy)
}

fn stored_under(redis: &Redis, credential: &str, proxy: &str) -> Option<String> {
    redis
        .query(&["HGET", &proxies_key(credential), proxy])
        .unwrap()
        .text()
        .map(str::to_owned)
}

/// How many reports the shared token's hash holds.
fn fields(redis: &Redis) -> u64 {
    fields_under(redis, SHARED_CREDENTIAL)
}

fn fields_under(redis: &Redis, credential: &str) -> u64 {
    redis
        .text(&["HLEN", &proxies_key(credential)])
        .unwrap()
        .parse()
        .unwrap()
}

fn assert_near(value: f64, expected: f64, context: &str) {
    assert!(
        (value - expected).abs() < 1e-9,
        "{value} vs {expected}: {context}"
    );
}

/// A state whose proxies hold the credentials of `tokens` (`name token` lines).
///
/// The file is one of its own (`TextFile`): named by the tokens' length, two tests running at
/// once with the same tokens shared one, and one deleted it as the other read it.
fn state_with_tokens(redis: &Redis, tokens: &str, more: &[&str]) -> AppState {
    let file = TextFile::new(tokens);
    let mut args = vec!["--tokens-file", file.path()];
    args.extend_from_slice(more);
    let settings = common::settings_without_token(&redis.url(), &args);
    AppState::new(settings).unwrap()
}

/// A sync of `proxy` under `token`, every `interval_ms`, reporting `load`.
async fn report_as(
    state: &AppState,
    token: &str,
    proxy: &str,
    interval_ms: u64,
    load: Value,
) -> Answer {
    let body = sync_body(proxy, interval_ms, Some(load));
    let answer = call(
        state,
        "POST",
        "/v1/sync",
        Some(token),
        Body::from(body.to_string()),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer
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
    assert_near(level(&first).unwrap(), 0.5, "p1 replaced its own report");
    assert_eq!(first.body["hints"]["next_sync_ms"], 100, "{first:?}");

    // one field per proxy: utilization, shed_rate, latency_ms, window_ms (how long it stays fresh:
    // 3 × 100 ms, at least 1 s), time_ms (Redis TIME)
    assert_eq!(fields(&redis), 2);
    let value = stored(&redis, "p2").unwrap();
    let parts: Vec<&str> = value.split(',').collect();
    assert_eq!(parts[..4], ["0.8", "0", "12.5", "1000"], "{value}");
    let redis_now_ms = redis.query(&["TIME"]).unwrap();
    let Reply::Array(time) = redis_now_ms else {
        panic!("{redis_now_ms:?}")
    };
    let now_ms = time[0].text().unwrap().parse::<u64>().unwrap() * 1000;
    let at: u64 = parts[4].parse().unwrap();
    assert!(now_ms.abs_diff(at) < 5_000, "{at} vs Redis TIME {now_ms}");
    // the keys expire with their freshest report (1 s: 3 × 100 ms is less)
    for key in [
        proxies_key(SHARED_CREDENTIAL),
        FLEET_CREDENTIALS_KEY.to_owned(),
    ] {
        let ttl: u64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
        assert!((1..=1_000).contains(&ttl), "{key}: {ttl}");
    }

    let text = metrics(&state).await;
    assert!(text.contains("sluice_fleet_load_level 0.5"), "{text}");
    assert!(text.contains("sluice_fleet_proxies 2"), "{text}");
    assert!(text.contains("sluice_fleet_credentials 1"), "{text}");
    assert!(
        text.contains("sluice_load_reports_total{outcome=\"recorded\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("sluice_script_calls_total{script=\"fleet\"} 3"),
        "{text}"
    );

    // a report is clamped to [0, 1] before it counts: a brief overload counts as 1
    let over = report(&state, "p3", 100, 2.9).await;
    assert_near(level(&over).unwrap(), 2.0 / 3.0, "(0.2 + 0.8 + 1) / 3");
    assert!(stored(&redis, "p3").unwrap().starts_with("1,0,12.5,1000,"));
}

/// Real time, Redis `TIME`: a proxy syncing every 10 ms is fresh for the floor of 1 s. Its
/// report counts while surely younger, and no longer once surely older than that and the
/// aggregate's refresh (100 ms; the request's own time is the other uncertainty).
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
        } else if asked - recorded >= Duration::from_millis(1_000 + fleet::REFRESH_MS) {
            assert_eq!(level(&answer), Some(0.2), "stale: {answer:?}");
            stale += 1;
            break;
        }
        assert!(sent.elapsed() < Duration::from_secs(4), "never stale");
        // just past the window when it is near, else every 250 ms
        let until_stale =
            Duration::from_millis(1_010 + fleet::REFRESH_MS).saturating_sub(recorded.elapsed());
        tokio::time::sleep(until_stale.min(Duration::from_millis(250))).await;
    }
    assert!(fresh >= 2 && stale == 1, "{fresh} {stale}");
    assert_eq!(stored(&redis, "gone"), None, "a stale report is deleted");
    assert_eq!(fields(&redis), 1);
}

/// With the tests' clock: fresh while younger than 3 intervals, and at least 1 s; noticed stale
/// at the credential's next report once its aggregate is 100 ms old.
#[tokio::test]
async fn freshness_is_three_intervals_and_at_least_a_second() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let at = |ms: u64| T0_US + ms * MS;
    let fleet = |proxy: &'static str, value: f64, interval_ms: u64, now_us: u64| {
        let state = state.clone();
        async move {
            fleet::report(
                &state,
                SHARED_CREDENTIAL,
                proxy,
                &utilization(value),
                interval_ms,
                now_us,
            )
            .await
            .unwrap()
        }
    };
    // `slow` syncs every 1.5 s: fresh for 4.5 s; `fast` every 100 ms: fresh for 1 s (not 300 ms)
    fleet("slow", 1.0, 1_500, at(0)).await;
    fleet("fast", 0.0, 100, at(0)).await;
    let watcher = |ms| fleet("watcher", 0.5, 100, at(ms));
    let seen = watcher(999).await;
    assert_eq!((seen.level, seen.proxies), (0.5, 3), "{seen:?}");
    let seen = watcher(1_099).await;
    assert_eq!(
        (seen.level, seen.proxies),
        (0.75, 2),
        "fast is stale: {seen:?}"
    );
    let seen = watcher(4_499).await;
    assert_eq!((seen.level, seen.proxies), (0.75, 2), "{seen:?}");
    let seen = watcher(4_599).await;
    assert_eq!(
        (seen.level, seen.proxies),
        (0.5, 1),
        "slow is stale: {seen:?}"
    );
    assert!(seen.recorded);
    assert_eq!(fields(&redis), 1, "only the watcher is left");
    assert_eq!(
        stored(&redis, "watcher").unwrap(),
        "0.5,0,1,1000,1700000004599"
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
    let keys = [FLEET_CREDENTIALS_KEY, &proxies_key(SHARED_CREDENTIAL)];
    assert_eq!(redis.text(&["EXISTS", keys[0], keys[1]]).unwrap(), "0");

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
    redis
        .query(&["SET", FLEET_CREDENTIALS_KEY, "not a hash"])
        .unwrap();
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

    redis.query(&["DEL", FLEET_CREDENTIALS_KEY]).unwrap();
    let answer = report(&state, "p1", 100, 0.5).await;
    assert_eq!(level(&answer), Some(0.5), "{answer:?}");
}

/// With `--tokens-file`, the field is the proxy id as the service keeps it, in its credential's
/// hash: one holder cannot replace the report of another's proxy by sending its id.
#[tokio::test]
async fn the_field_is_the_proxy_id_under_its_credential() {
    let redis = Redis::start().unwrap();
    let state = state_with_tokens(&redis, "edge-a tok-a\nedge-b tok-b\n", &[]);
    let a = report_as(&state, "tok-a", "p1", 100, load(0.2)).await;
    assert_eq!(level(&a), Some(0.2));
    let b = report_as(&state, "tok-b", "p1", 100, load(0.6)).await;
    assert_eq!(level(&b), Some(0.4));
    assert!(stored_under(&redis, "edge-a", "edge-a/p1")
        .unwrap()
        .starts_with("0.2,"));
    assert!(stored_under(&redis, "edge-b", "edge-b/p1")
        .unwrap()
        .starts_with("0.6,"));
    assert_eq!(stored(&redis, "p1"), None);
}

/// Every credential weighs 1 however many proxy ids it reports under: the level is the mean of
/// the credentials' means, so one credential's 21 ids at 1.0 move it by at most 1 / credentials.
/// (On a shared token, the one credential, it is the mean over proxies, as before.)
#[tokio::test]
async fn each_credential_weighs_one_however_many_ids_it_uses() {
    let redis = Redis::start().unwrap();
    let state = state_with_tokens(&redis, "edge-a tok-a\nedge-b tok-b\nliar tok-liar\n", &[]);
    // edge-a: three proxies at 0.9; edge-b: one at 0.1. Per proxy the mean would be 0.7.
    for proxy in ["a1", "a2", "a3"] {
        report_as(&state, "tok-a", proxy, 100, load(0.9)).await;
    }
    let b = report_as(&state, "tok-b", "b1", 100, load(0.1)).await;
    assert_near(level(&b).unwrap(), 0.5, "(0.9 + 0.1) / 2");
    let text = metrics(&state).await;
    assert!(text.contains("sluice_fleet_credentials 2"), "{text}");
    assert!(text.contains("sluice_fleet_proxies 4"), "{text}");

    // the liar: 21 ids at 1.0 (and one at 10, clamped), one credential among three
    for i in 0..21 {
        report_as(&state, "tok-liar", &format!("fake-{i}"), 100, load(1.0)).await;
    }
    let lie = report_as(&state, "tok-liar", "fake-x", 60_000, load(10.0)).await;
    assert_near(
        level(&lie).unwrap(),
        (0.9 + 0.1 + 1.0) / 3.0,
        "the liar weighs a third",
    );
    let honest = report_as(&state, "tok-b", "b1", 100, load(0.1)).await;
    let moved = level(&honest).unwrap() - 0.5;
    assert!(
        moved <= (1.0 - 0.5) / 3.0 + 1e-9,
        "one credential of three moved the level by {moved}"
    );
}

/// A liar's `utilization: 10` and `interval_ms: 60000` (the service's longest interval): its report
/// is recorded clamped to 1, and stays fresh for the service's cap (5 s), not 3 minutes.
#[tokio::test]
async fn a_lie_is_clamped_and_stale_after_the_services_cap() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let honest = report(&state, "honest", 100, 0.2).await;
    assert_eq!(level(&honest), Some(0.2));
    let lie = post(
        &state,
        "/v1/sync",
        &sync_body(
            "liar",
            60_000,
            Some(json!({"utilization": 10, "shed_rate": 1, "latency_ms": 0})),
        ),
    )
    .await;
    assert_eq!(lie.status, StatusCode::OK, "{lie:?}");
    assert_near(
        level(&lie).unwrap(),
        0.6,
        "(1 + 0.2) / 2, not (10 + 0.2) / 2",
    );
    let value = stored(&redis, "liar").unwrap();
    assert!(
        value.starts_with("1,1,0,5000,"),
        "clamped, fresh 5 s: {value}"
    );

    // the tests' clock: the service answered the liar 60 s, it stays fresh 5 s
    let at = |ms: u64| T0_US + ms * MS;
    let fleet = |state: AppState, proxy: &'static str, value: f64, interval_ms: u64, now_us| async move {
        fleet::report(
            &state,
            SHARED_CREDENTIAL,
            proxy,
            &utilization(value),
            interval_ms,
            now_us,
        )
        .await
        .unwrap()
    };
    redis.query(&["FLUSHALL"]).unwrap();
    fleet(state.clone(), "liar", 10.0, 60_000, at(0)).await;
    let seen = fleet(state.clone(), "honest", 0.2, 100, at(4_999)).await;
    assert_eq!((seen.level, seen.proxies), (0.6, 2), "{seen:?}");
    let seen = fleet(state.clone(), "honest", 0.2, 100, at(5_099)).await;
    assert_eq!(
        (seen.level, seen.proxies),
        (0.2, 1),
        "the lie is stale 5 s after it was told: {seen:?}"
    );
    assert_eq!(stored(&redis, "liar"), None, "and deleted");

    // a longer cap is the operator's choice, not the proxy's
    let longer = AppState::new(common::settings(
        &redis.url(),
        &["--fleet-report-max-age-ms", "60000"],
    ))
    .unwrap();
    redis.query(&["FLUSHALL"]).unwrap();
    fleet(longer, "slow", 0.5, 30_000, at(0)).await;
    let value = stored(&redis, "slow").unwrap();
    assert!(value.starts_with("0.5,0,1,60000,"), "{value}");
}

/// 10,000 reports under made-up ids of one credential: that credential's hash holds at most
/// --fleet-max-proxies-per-credential of them; a proxy restarting under a new id under another
/// credential is still recorded; the keys an honest proxy's call reads stay as small as before;
/// the level moves by at most 1 / credentials. A proxy already recorded under the liar's own
/// credential still replaces its report, and stale reports make room.
///
/// The reports say every 30 minutes (fresh for 90): the hashes' expiry runs on
/// Redis's own clock, not the test's, and the loop renews nothing once the liar is full. With 1 s
/// (fresh for 3 s) a loop of 10,000 calls slower than 3 s on a busy machine saw the liar's hash
/// expire in its middle (the test failed once in CI); with 20 s it would take a minute.
#[tokio::test]
async fn one_credential_fills_only_its_own_hash() {
    let redis = Redis::start().unwrap();
    let state = state_with_tokens(
        &redis,
        "edge-a tok-a\nedge-b tok-b\nliar tok-liar\n",
        &[
            "--fleet-max-proxies-per-credential",
            "256",
            "--fleet-report-max-age-ms",
            &LONGEST_AGE_MS.to_string(),
        ],
    );
    let at = |ms: u64| T0_US + ms * MS;
    let fleet = |credential: &'static str, proxy: String, value: f64, now_us: u64| {
        let state = state.clone();
        async move {
            let load = utilization(value);
            fleet::report(&state, credential, &proxy, &load, LONG_INTERVAL_MS, now_us)
                .await
                .unwrap()
        }
    };
    fleet("edge-a", "edge-a/p1".into(), 0.2, at(0)).await;
    fleet("edge-b", "edge-b/p1".into(), 0.2, at(0)).await;
    fleet("liar", "liar/real".into(), 1.0, at(0)).await;
    let mut refused = 0;
    for i in 0..10_000u64 {
        let seen = fleet("liar", format!("liar/fake-{i}"), 1.0, at(1 + i / 10)).await;
        refused += u64::from(!seen.recorded);
    }
    assert_eq!(fields_under(&redis, "liar"), 256, "at most 256 ids");
    assert_eq!(refused, 10_000 - 255);
    // the liar's own proxy already recorded still replaces its report
    assert!(
        fleet("liar", "liar/real".into(), 1.0, at(1_001))
            .await
            .recorded
    );

    // a real proxy restarting under a new id, under another credential: recorded
    let restarted = fleet("edge-a", "edge-a/p1-restarted".into(), 0.2, at(1_002)).await;
    assert!(restarted.recorded, "{restarted:?}");
    assert_eq!(restarted.credentials, 3);
    // 0.2, 0.2, 1.0: the liar's credential weighs one third, however many ids
    assert_near(restarted.level, (0.2 + 0.2 + 1.0) / 3.0, "one third");
    assert!(restarted.level - 0.2 <= (1.0 - 0.2) / 3.0 + 1e-9);
    // what an honest call reads: its own credential's hash and the credentials' aggregates
    assert_eq!(fields_under(&redis, "edge-a"), 2);
    let aggregates = redis.text(&["HLEN", FLEET_CREDENTIALS_KEY]).unwrap();
    assert_eq!(aggregates, "4", "three credentials and the totals");

    // 90 minutes on (fresh for 3 intervals of 30), the liar's reports are stale: its hash
    // empties as it reports again, and a new id of its own gets in
    let seen = fleet(
        "liar",
        "liar/fake-new".into(),
        1.0,
        at(LONG_WINDOW_MS + 1_100),
    )
    .await;
    assert!(seen.recorded, "{seen:?}");
    assert_eq!(fields_under(&redis, "liar"), 1);
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

// The fleet's size (`lua/fleet_share.lua`): proxies that divide a fallback among the fleet say
// so (`fleet_share`) and are answered how many such proxies synced recently.

fn count(answer: &Answer) -> Option<u64> {
    answer.body["hints"]["overrides"]["fleet_proxies"].as_u64()
}

/// A sync of `proxy` (under `token`, or the shared one) that asks to be counted (or not).
async fn share_sync(state: &AppState, token: Option<&str>, proxy: &str, counted: bool) -> Answer {
    share_sync_every(state, token, proxy, counted, 100).await
}

/// [`share_sync`] of a proxy that syncs every `interval_ms`.
async fn share_sync_every(
    state: &AppState,
    token: Option<&str>,
    proxy: &str,
    counted: bool,
    interval_ms: u64,
) -> Answer {
    let mut body = sync_body(proxy, interval_ms, None);
    if counted {
        body["fleet_share"] = json!(true);
    }
    let answer = match token {
        Some(token) => {
            call(
                state,
                "POST",
                "/v1/sync",
                Some(token),
                Body::from(body.to_string()),
            )
            .await
        }
        None => post(state, "/v1/sync", &body).await,
    };
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_granted(&answer, interval_ms);
    answer
}

fn members(redis: &Redis, key: &str) -> u64 {
    redis.text(&["ZCARD", key]).unwrap().parse().unwrap()
}

#[tokio::test]
async fn proxies_that_share_a_fallback_are_counted_and_answered_the_count() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let one = share_sync(&state, None, "p1", true).await;
    assert_eq!(count(&one), Some(1), "{one:?}");
    assert_eq!(count(&share_sync(&state, None, "p2", true).await), Some(2));
    assert_eq!(count(&share_sync(&state, None, "p1", true).await), Some(2));
    // a proxy without a share is neither counted nor answered a count (nor is a load report)
    let plain = share_sync(&state, None, "p3", false).await;
    assert_eq!(count(&plain), None, "{plain:?}");
    let loaded = report(&state, "p4", 100, 0.5).await;
    assert_eq!(count(&loaded), None, "{loaded:?}");
    assert_eq!(count(&share_sync(&state, None, "p2", true).await), Some(2));
    assert_eq!(members(&redis, fleet::FLEET_SHARE_KEY), 2);
    assert_eq!(members(&redis, &fleet::share_key(SHARED_CREDENTIAL)), 2);
    // both keys expire with their freshest member (1 s: 3 × 100 ms is less)
    for key in [
        fleet::FLEET_SHARE_KEY.to_owned(),
        fleet::share_key(SHARED_CREDENTIAL),
    ] {
        let ttl: u64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
        assert!((1..=1_000).contains(&ttl), "{key}: {ttl}");
    }
    let text = metrics(&state).await;
    assert!(text.contains("sluice_fleet_share_proxies 2"), "{text}");
    assert!(
        text.contains("sluice_fleet_shares_total{outcome=\"recorded\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("sluice_script_calls_total{script=\"fleet_share\"} 4"),
        "{text}"
    );
}

/// With the tests' clock: a proxy counts for three of the intervals it was answered (at least
/// 1 s), and no longer than `--fleet-report-max-age-ms` (5 s) whatever interval it names.
#[tokio::test]
async fn a_proxy_stops_counting_after_its_window_and_a_long_interval_does_not_stretch_it() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let at = |ms: u64| T0_US + ms * MS;
    let share = |proxy: &'static str, interval_ms: u64, now_us: u64| {
        let state = state.clone();
        async move {
            fleet::share(&state, SHARED_CREDENTIAL, proxy, interval_ms, now_us)
                .await
                .unwrap()
        }
    };
    assert_eq!(share("a", 100, at(0)).await.proxies, 1);
    // b: a 2 s interval would count 6 s, the cap is 5 s; c names the longest interval
    assert_eq!(share("b", 2_000, at(500)).await.proxies, 2);
    assert_eq!(
        share("c", 60_000, at(999)).await.proxies,
        3,
        "a: fresh for 1 s"
    );
    assert_eq!(
        share("d", 100, at(1_000)).await.proxies,
        3,
        "a: stale at 1 s"
    );
    assert_eq!(
        share("d", 100, at(5_499)).await.proxies,
        3,
        "b and c still count"
    );
    assert_eq!(
        share("d", 100, at(5_500)).await.proxies,
        2,
        "b stale, capped at 5 s"
    );
    assert_eq!(
        share("d", 100, at(5_999)).await.proxies,
        1,
        "c stale, capped at 5 s"
    );
    assert_eq!(
        members(&redis, fleet::FLEET_SHARE_KEY),
        1,
        "the stale are deleted"
    );
}

/// 10,000 made-up proxy ids under one credential: it counts at most
/// --fleet-max-proxies-per-credential of them, so it adds at most that to the count; the proxies
/// of the other credentials always count (it cannot take them out); its own id already counted
/// renews; and when it stops, its ids go stale with their window.
///
/// Every share says 30 minutes (counted 90): the keys' expiry runs on Redis's
/// own clock, and the loop renews nothing once the liar is full. With 1 s (counted 3 s) a loop
/// slower than 3 s let the liar's key expire in its middle, and 16 more of its ids got in
/// (9,969 refused, not 9,985: it failed so on a busy machine).
#[tokio::test]
async fn one_credential_adds_at_most_its_cap_and_takes_nothing_from_the_count() {
    let redis = Redis::start().unwrap();
    let max_age = LONGEST_AGE_MS.to_string();
    let state = state_with_tokens(
        &redis,
        "edge-a tok-a\nedge-b tok-b\nliar tok-liar\n",
        &[
            "--fleet-max-proxies-per-credential",
            "16",
            "--fleet-report-max-age-ms",
            &max_age,
        ],
    );
    let at = |ms: u64| T0_US + ms * MS;
    let share = |credential: &'static str, proxy: String, now_us: u64| {
        let state = state.clone();
        async move {
            fleet::share(&state, credential, &proxy, LONG_INTERVAL_MS, now_us)
                .await
                .unwrap()
        }
    };
    share("edge-a", "edge-a/p1".into(), at(0)).await;
    share("edge-b", "edge-b/p1".into(), at(0)).await;
    share("liar", "liar/real".into(), at(0)).await;
    let mut refused = 0;
    let mut most = 0;
    for i in 0..10_000u64 {
        let seen = share("liar", format!("liar/fake-{i}"), at(1 + i / 10)).await;
        refused += u64::from(!seen.recorded);
        most = most.max(seen.proxies);
    }
    assert_eq!(refused, 10_000 - 15);
    assert_eq!(most, 2 + 16, "the two honest proxies and the liar's cap");
    assert_eq!(members(&redis, &fleet::share_key("liar")), 16);
    assert!(share("liar", "liar/real".into(), at(1_001)).await.recorded);
    // another credential's new proxy counts, and the honest ones were never taken out
    let honest = share("edge-a", "edge-a/p2".into(), at(1_002)).await;
    assert!(honest.recorded, "{honest:?}");
    assert_eq!(honest.proxies, 3 + 16);
    // through the HTTP API (Redis TIME, so alone: the made-up times are long past), the same:
    // the liar's sync over its cap is answered, its id not counted. Every minute (counted 3
    // minutes): 17 calls, however slow, end before the first id goes stale.
    let http = |proxy: String| {
        let state = state.clone();
        async move { share_sync_every(&state, Some("tok-liar"), &proxy, true, 60_000).await }
    };
    for i in 0..16 {
        http(format!("http-{i}")).await;
    }
    let answer = http("http-more".into()).await;
    assert_eq!(count(&answer), Some(16), "{answer:?}");
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_fleet_shares_total{outcome=\"full\"} 1"),
        "{text}"
    );
    redis.query(&["FLUSHALL"]).unwrap();
    share("edge-a", "edge-a/p1".into(), at(1_000)).await;
    share("edge-a", "edge-a/p2".into(), at(1_002)).await;
    share("liar", "liar/real".into(), at(1_001)).await;
    share("edge-b", "edge-b/p1".into(), at(0)).await;

    // a window on (90 minutes), the liar stopped: only its renewed id still counts until its own
    // window ends
    let later = share("edge-a", "edge-a/p1".into(), at(LONG_WINDOW_MS + 500)).await;
    assert_eq!(
        later.proxies, 3,
        "edge-a/p1, edge-a/p2, liar/real: {later:?}"
    );
    let later = share("edge-b", "edge-b/p1".into(), at(LONG_WINDOW_MS + 1_100)).await;
    assert_eq!(later.proxies, 2, "edge-a/p1 and edge-b/p1: {later:?}");
}

/// A proxy whose id changes at every sync (restarts, or a liar) counts once per id while each is
/// fresh: at most one window of ids, and never more than its credential's cap.
#[tokio::test]
async fn a_flapping_proxy_id_counts_no_more_than_a_window_of_ids() {
    let redis = Redis::start().unwrap();
    let state = state_with_tokens(
        &redis,
        "edge-a tok-a\nflap tok-flap\n",
        &["--fleet-max-proxies-per-credential", "64"],
    );
    let at = |ms: u64| T0_US + ms * MS;
    let mut last = 0;
    // every 100 ms a new id, for 5 s: each counts for 1 s (three 100 ms intervals, at least 1 s)
    for i in 0..50u64 {
        let seen = fleet::share(&state, "flap", &format!("flap/{i}"), 100, at(i * 100))
            .await
            .unwrap();
        assert!(seen.proxies <= 10, "at {i}: {seen:?}");
        last = seen.proxies;
    }
    assert_eq!(last, 10, "the last second's ids");
    let honest = fleet::share(&state, "edge-a", "edge-a/p1", 100, at(6_000))
        .await
        .unwrap();
    assert_eq!(
        honest.proxies, 1,
        "the flapping ids all went stale: {honest:?}"
    );
}

/// A member dated further ahead than the service's longest window (written before a failover
/// to a node whose clock is behind) is dropped, not counted until the clock catches up.
#[tokio::test]
async fn a_member_from_a_clock_far_ahead_is_dropped() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let now_ms = T0_US / MS;
    let ahead = (now_ms + 3_600_000).to_string();
    let near = (now_ms + 4_000).to_string();
    redis
        .query(&[
            "ZADD",
            fleet::FLEET_SHARE_KEY,
            &ahead,
            "ahead",
            &near,
            "near",
        ])
        .unwrap();
    let seen = fleet::share(&state, SHARED_CREDENTIAL, "p1", 100, T0_US)
        .await
        .unwrap();
    assert_eq!(seen.proxies, 2, "near and p1: {seen:?}");
}

/// The count is advisory: when Redis fails for it, the sync is answered its grants and no
/// count (the proxy keeps its last one).
#[tokio::test]
async fn a_failed_count_still_answers_the_grants() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    redis
        .query(&["SET", fleet::FLEET_SHARE_KEY, "not a sorted set"])
        .unwrap();
    let answer = share_sync(&state, None, "p1", true).await;
    assert_eq!(count(&answer), None, "{answer:?}");
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_fleet_shares_total{outcome=\"error\"} 1"),
        "{text}"
    );
    redis.query(&["DEL", fleet::FLEET_SHARE_KEY]).unwrap();
    assert_eq!(count(&share_sync(&state, None, "p1", true).await), Some(1));
}
