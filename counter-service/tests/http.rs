//! The HTTP surface, through `app()` without a socket, on a real Redis; and once through the
//! built binary.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use common::{call, call_authorized, get, post, state, TOKEN};
use serde_json::{json, Value};
use sluice_counter_service::scripts::{CHECK_LUA, SYNC_LUA};
use sluice_counter_service::{keys, AppState};
use sluice_protocol::LimitSpec;
use sluice_tests::redis::{Redis, Reply};
use sluice_tests::service::Service;

fn sync_body(entries: Value) -> Value {
    json!({"proxy": "p1", "interval_ms": 100, "entries": entries})
}

/// A 10/s limit with burst 10, and 100 denied over the (first) 100 ms interval: 1000/s of demand.
/// On a new key, alone, the grant is the whole free bucket plus the refill due before the next
/// sync (1.5 intervals): floor(10 - 0 + 10 × 0.1 × 1.5 × 1) = 11.
fn ten_per_second(key: &str) -> Value {
    json!({"key": key, "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 0, "denied": 100})
}

fn assert_error(answer: &common::Answer, status: StatusCode, error: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(answer.body["error"], error, "{answer:?}");
    assert!(answer.body["message"].is_string(), "{answer:?}");
}

#[tokio::test]
async fn sync_answers_grants_in_order_with_hints() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = sync_body(json!([ten_per_second("a"), ten_per_second("b")]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(
        answer.body,
        json!({
            "grants": [
                {"tokens": 11, "ttl_ms": 300, "remaining": 10, "reset_ms": 0, "token_ms": 100},
                {"tokens": 11, "ttl_ms": 300, "remaining": 10, "reset_ms": 0, "token_ms": 100}
            ],
            "hints": {"next_sync_ms": 100, "overrides": {"bypass": false}}
        })
    );
    let metrics = get(&state, "/metrics").await;
    let text = metrics.body.as_str().unwrap();
    assert!(text.contains("sluice_syncs_total 1"), "{text}");
    assert!(text.contains("sluice_sync_entries_total 2"), "{text}");
    assert!(
        text.contains("sluice_script_calls_total{script=\"sync\"} 1"),
        "{text}"
    );
    assert!(text.contains("sluice_redis_seconds_bucket"), "{text}");
}

#[tokio::test]
async fn a_missing_or_wrong_token_is_401() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = || Body::from(sync_body(json!([])).to_string());
    let answer = call(&state, "POST", "/v1/sync", None, body()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(&state, "POST", "/v1/sync", Some("wrong"), body()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(
        &state,
        "POST",
        "/v1/check",
        Some(&format!("{TOKEN}x")),
        body(),
    )
    .await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), body()).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
}

#[tokio::test]
async fn malformed_json_is_400_with_the_reason() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = call(
        &state,
        "POST",
        "/v1/sync",
        Some(TOKEN),
        Body::from("{\"proxy\":"),
    )
    .await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    let body = json!({"proxy": "p", "interval_ms": "soon", "entries": []});
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("malformed JSON: interval_ms: invalid type"),
        "{message}"
    );
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let big = format!("{{\"proxy\":\"{}\"}}", "x".repeat(2 << 20));
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), Body::from(big)).await;
    assert_error(&answer, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
}

#[tokio::test]
async fn out_of_bounds_values_are_400_naming_the_field() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = post(&state, "/v1/check", &json!({"key": "k", "limits": []})).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "limits: must have at least one limit"
    );
    let long = "k".repeat(513);
    let check = json!({"key": long, "limits": [{"requests": 1, "period_ms": 1000, "burst": 1}]});
    let answer = post(&state, "/v1/check", &check).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(answer.body["message"], "key: longer than 512 bytes");
    let answer = post(
        &state,
        "/v1/sync",
        &json!({"proxy": "", "interval_ms": 100, "entries": []}),
    )
    .await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(answer.body["message"], "proxy: must not be empty");

    let state = AppState::new(common::settings(&redis.url(), &["--max-batch", "2"])).unwrap();
    let body = sync_body(json!([
        ten_per_second("a"),
        ten_per_second("b"),
        ten_per_second("c")
    ]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "entries: more than 2 entries in one batch"
    );
}

/// One bad entry used to refuse the whole batch (400), so one odd request stopped a proxy's
/// sync. Now it is refused alone, and the rest of the batch is applied.
#[tokio::test]
async fn a_bad_entry_is_refused_alone() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let good = json!({"key": "good", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 3, "denied": 100});
    let long = ten_per_second(&"k".repeat(600));
    let zero = json!({"key": "zero", "limits": [{"requests": 0, "period_ms": 1000, "burst": 1}], "spent": 5, "denied": 0});
    let body = sync_body(json!([long, good, zero, ten_per_second("after")]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let grants = answer.body["grants"].as_array().unwrap();
    assert_eq!(grants.len(), 4, "one grant per entry: {answer:?}");
    assert_eq!(
        grants[0],
        json!({"tokens": 0, "ttl_ms": 0, "remaining": 0, "reset_ms": 0,
               "refused": "entries[0].key: longer than 512 bytes"})
    );
    assert_eq!(
        grants[2],
        json!({"tokens": 0, "ttl_ms": 0, "remaining": 0, "reset_ms": 0,
               "refused": "entries[2].limits[0].requests: must be between 1 and 2147483648"})
    );
    // the good entries are applied: 3 spent from a new key (full an interval ago: min(10 + 3,
    // 10 + 1) - 3 = 8), and a lease of floor(8 + 1.5) = 9
    assert_eq!(
        grants[1],
        json!({"tokens": 9, "ttl_ms": 300, "remaining": 8, "reset_ms": 200, "token_ms": 100})
    );
    assert_eq!(grants[3]["tokens"], 11, "{answer:?}");
    assert!(grants[3].get("refused").is_none());
    let good_key = keys::limit_key("good", &LimitSpec::token_bucket(10, 1_000, 10));
    assert_eq!(redis.text(&["HGET", &good_key, "tokens"]).unwrap(), "8");
    assert_eq!(
        redis.text(&["DBSIZE"]).unwrap(),
        "2",
        "nothing stored for the refused entries"
    );
    let text = metrics(&state).await;
    assert!(text.contains("sluice_refused_entries_total 2"), "{text}");
    assert!(text.contains("sluice_sync_entries_total 2"), "{text}");
}

/// A proxy reported `spent: 2^53`: the key went 9e15 tokens into debt with a TTL of decades.
/// Now a report is cut to what the limit allows over the time it can cover (the lease, 300 ms,
/// plus a minute: 10 + 10 × 60.3 = 613 for 10/s), and the debt stops there.
#[tokio::test]
async fn reported_counts_are_bounded_by_the_limit() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let huge: u64 = 1 << 53;
    let lie = json!({"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": huge, "denied": huge});
    for _ in 0..3 {
        let answer = post(&state, "/v1/sync", &sync_body(json!([lie]))).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.body["grants"][0]["tokens"], 0, "{answer:?}");
    }
    let key = keys::limit_key("k", &LimitSpec::token_bucket(10, 1_000, 10));
    let tokens: f64 = redis
        .text(&["HGET", &key, "tokens"])
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (-613.0..-600.0).contains(&tokens),
        "the debt stops at -(burst + 60.3 s of refill): {tokens}"
    );
    let ttl: i64 = redis.text(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        (1..=64_000).contains(&ttl),
        "the refill from the floor (62.3 s), the lease and a second: {ttl} ms"
    );
    // the proxy's lease: grant, expiry, demand, last sync and its round, packed
    let demand = common::lease(&redis, &key, "p1").expect("a lease")[2];
    assert!(
        demand <= 1_226_000.0,
        "(613 + 613) over at least 1 ms: {demand}"
    );
    let text = metrics(&state).await;
    assert!(text.contains("sluice_capped_entries_total 3"), "{text}");
}

/// `interval_ms: 3600000` with a large `denied` won a 3-hour lease of 54,010 tokens on a 10/s
/// key. The service clamps the interval (60 s by default) and answers it in the hints.
#[tokio::test]
async fn the_service_decides_the_interval() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = json!({"proxy": "p1", "interval_ms": 3_600_000, "entries": [
        {"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}], "spent": 0, "denied": 1_000_000_000u64}
    ]});
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let grant = &answer.body["grants"][0];
    let tokens = grant["tokens"].as_u64().unwrap();
    assert!(
        tokens <= 10 + 10 * 60 * 3 / 2,
        "at most burst + rate × 1.5 × 60 s: {answer:?}"
    );
    assert_eq!(tokens, 910, "a new key, alone: {answer:?}");
    assert_eq!(grant["ttl_ms"], 180_000, "3 intervals of 60 s");
    assert_eq!(answer.body["hints"]["next_sync_ms"], 60_000);

    let fast = json!({"proxy": "p2", "interval_ms": 1, "entries": [ten_per_second("other")]});
    let answer = post(&state, "/v1/sync", &fast).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.body["hints"]["next_sync_ms"], 10, "{answer:?}");
    assert_eq!(answer.body["grants"][0]["ttl_ms"], 30, "{answer:?}");

    let narrow = AppState::new(common::settings(
        &redis.url(),
        &[
            "--min-sync-interval-ms",
            "200",
            "--max-sync-interval-ms",
            "500",
        ],
    ))
    .unwrap();
    let answer = post(
        &narrow,
        "/v1/sync",
        &sync_body(json!([ten_per_second("third")])),
    )
    .await;
    assert_eq!(answer.body["hints"]["next_sync_ms"], 200, "{answer:?}");
    assert_eq!(answer.body["grants"][0]["ttl_ms"], 600, "{answer:?}");
}

#[tokio::test]
async fn check_refuses_a_cost_of_zero() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body =
        json!({"key": "k", "limits": [{"requests": 3, "period_ms": 60000, "burst": 3}], "cost": 0});
    let answer = post(&state, "/v1/check", &body).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "cost: must be between 1 and 2147483648"
    );
}

#[tokio::test]
async fn wrong_methods_are_json_405() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = call(&state, "GET", "/v1/sync", Some(TOKEN), Body::empty()).await;
    assert_error(
        &answer,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
    assert_eq!(
        answer.body["message"],
        "method GET not allowed on this endpoint (see the Allow header)"
    );
    assert_eq!(answer.headers["allow"], "POST");
    assert_eq!(answer.headers["content-type"], "application/json");
    let answer = call(&state, "DELETE", "/v1/check", Some(TOKEN), Body::empty()).await;
    assert_error(
        &answer,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
    let answer = call(&state, "DELETE", "/v1/check", None, Body::empty()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    let answer = call(&state, "POST", "/healthz", None, Body::empty()).await;
    assert_error(
        &answer,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
    assert!(answer.headers["allow"].to_str().unwrap().contains("GET"));
    let text = metrics(&state).await;
    assert!(
        text.contains("sluice_errors_total{kind=\"method_not_allowed\"} 3"),
        "{text}"
    );
}

#[tokio::test]
async fn the_bearer_scheme_is_any_case_and_the_token_exact() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body = || Body::from(sync_body(json!([])).to_string());
    for good in [
        format!("Bearer {TOKEN}"),
        format!("bearer {TOKEN}"),
        format!("BEARER {TOKEN}"),
    ] {
        let answer = call_authorized(&state, "POST", "/v1/sync", Some(&good), body()).await;
        assert_eq!(answer.status, StatusCode::OK, "{good:?}: {answer:?}");
    }
    for bad in [
        format!("Bearer  {TOKEN}"),
        format!("Bearer {TOKEN} "),
        format!("Bearer\t{TOKEN}"),
        format!("Bearer {TOKEN}\t"),
        format!("Basic {TOKEN}"),
        format!("Bearer{TOKEN}"),
        TOKEN.to_owned(),
    ] {
        let answer = call_authorized(&state, "POST", "/v1/sync", Some(&bad), body()).await;
        assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");
    }
}

/// A path in the system's temporary directory, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str, content: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("sluice-{}-{name}", std::process::id()));
        std::fs::write(&path, content).unwrap();
        TempFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test]
async fn the_token_can_come_from_a_file() {
    let redis = Redis::start().unwrap();
    let file = TempFile::new("token", "from-a-file\n");
    let settings = common::settings_without_token(&redis.url(), &["--token-file", file.path()]);
    let state = AppState::new(settings).unwrap();
    let body = || Body::from(sync_body(json!([])).to_string());
    let answer = call(&state, "POST", "/v1/sync", Some("from-a-file"), body()).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), body()).await;
    assert_error(&answer, StatusCode::UNAUTHORIZED, "unauthorized");

    let both = common::settings(&redis.url(), &["--token-file", file.path()]);
    let error = AppState::new(both).err().unwrap().to_string();
    assert!(error.starts_with("give only one of --token"), "{error}");
    let missing =
        common::settings_without_token(&redis.url(), &["--token-file", "/nonexistent/token"]);
    let error = AppState::new(missing).err().unwrap().to_string();
    assert!(
        error.starts_with("--token-file /nonexistent/token: "),
        "{error}"
    );
    let blank = TempFile::new("blank", "\n");
    let settings = common::settings_without_token(&redis.url(), &["--token-file", blank.path()]);
    let error = AppState::new(settings).err().unwrap().to_string();
    assert!(error.ends_with("the token is empty"), "{error}");
}

/// With `--tokens-file`, a proxy id is kept under its credential's name: the holder of one
/// token cannot replace the lease of another's proxy by sending its id.
#[tokio::test]
async fn per_proxy_tokens_keep_each_holder_to_its_own_proxies() {
    let redis = Redis::start().unwrap();
    let file = TempFile::new("tokens", "# name token\nedge-a tok-a\nedge-b tok-b\n");
    let settings = common::settings_without_token(&redis.url(), &["--tokens-file", file.path()]);
    let state = AppState::new(settings).unwrap();
    let sync = |token: &'static str| {
        let state = state.clone();
        async move {
            let body = Body::from(sync_body(json!([ten_per_second("k")])).to_string());
            call(&state, "POST", "/v1/sync", Some(token), body).await
        }
    };
    let a = sync("tok-a").await;
    assert_eq!(a.body["grants"][0]["tokens"], 11, "{a:?}");
    // b claims the same proxy id, "p1": it gets its own record, and a's lease stands
    let b = sync("tok-b").await;
    assert_eq!(b.status, StatusCode::OK, "{b:?}");
    let b_tokens = b.body["grants"][0]["tokens"].as_u64().unwrap();
    assert!(b_tokens <= 1, "a holds the bucket: {b:?}");
    let key = keys::limit_key("k", &LimitSpec::token_bucket(10, 1_000, 10));
    // each proxy's lease is one field: grant, expiry, demand, last sync and its round, packed
    let grant = |proxy: &str| common::lease(&redis, &key, proxy).map(|lease| lease[0] as u64);
    assert_eq!(grant("edge-a/p1"), Some(11));
    assert_eq!(grant("edge-b/p1"), Some(b_tokens));
    assert_eq!(grant("p1"), None);
    let nobody = sync("tok-c").await;
    assert_error(&nobody, StatusCode::UNAUTHORIZED, "unauthorized");
}

/// A cached key's check names its proxy: a denial that the proxy's own lease covers answers
/// that lease (its sync's answer may still be on its way), under its own credential only. The
/// holder of another token naming the same proxy id, a check naming no proxy, and one naming a
/// proxy without a lease are told none; a proxy id that is empty or too long is refused, naming
/// the field.
#[tokio::test]
async fn a_denied_check_tells_the_asking_proxy_its_own_lease_only() {
    let redis = Redis::start().unwrap();
    let file = TempFile::new("tokens", "edge-a tok-a\nedge-b tok-b\n");
    let settings = common::settings_without_token(&redis.url(), &["--tokens-file", file.path()]);
    let state = AppState::new(settings).unwrap();
    let body = Body::from(sync_body(json!([ten_per_second("k")])).to_string());
    let a = call(&state, "POST", "/v1/sync", Some("tok-a"), body).await;
    assert_eq!(a.body["grants"][0]["tokens"], 11, "{a:?}");
    let check = |token: &'static str, proxy: Value| {
        let state = state.clone();
        let mut body =
            json!({"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}]});
        if !proxy.is_null() {
            body["proxy"] = proxy;
        }
        async move {
            call(
                &state,
                "POST",
                "/v1/check",
                Some(token),
                Body::from(body.to_string()),
            )
            .await
        }
    };
    let mine = check("tok-a", json!("p1")).await;
    assert_eq!(mine.status, StatusCode::OK, "{mine:?}");
    assert_eq!(mine.body["allowed"], false, "a holds the bucket: {mine:?}");
    assert_eq!(mine.body["lease"]["tokens"], 11, "{mine:?}");
    let ttl = mine.body["lease"]["ttl_ms"].as_u64().unwrap();
    assert!((1..=10_000).contains(&ttl), "{mine:?}");
    for (token, proxy) in [
        ("tok-b", json!("p1")),
        ("tok-a", json!("p2")),
        ("tok-a", Value::Null),
    ] {
        let other = check(token, proxy.clone()).await;
        assert_eq!(other.body["allowed"], false, "{proxy}: {other:?}");
        assert_eq!(other.body.get("lease"), None, "{token} {proxy}: {other:?}");
    }
    for proxy in [json!(""), json!("p".repeat(600))] {
        let refused = check("tok-a", proxy).await;
        assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(
            refused.body["message"].as_str().unwrap().contains("proxy"),
            "{refused:?}"
        );
    }
}

/// A 1 MB body nested 500,000 deep in an unknown field was parsed (skipped) in full; now the
/// nesting is measured first, in one pass over the bytes.
#[tokio::test]
async fn a_deeply_nested_body_is_refused_fast() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let n = 500_000;
    let body = format!(
        "{{\"x\":{}{},\"proxy\":\"p\",\"interval_ms\":100,\"entries\":[]}}",
        "[".repeat(n),
        "]".repeat(n)
    );
    let started = Instant::now();
    let answer = call(&state, "POST", "/v1/sync", Some(TOKEN), Body::from(body)).await;
    let elapsed = started.elapsed();
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    assert_eq!(
        answer.body["message"],
        "malformed JSON: body: nested deeper than 32 levels"
    );
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    eprintln!("a 1 MB body nested {n} deep refused in {elapsed:?}");
}

async fn metrics(state: &AppState) -> String {
    get(state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn check_allows_up_to_the_limit_then_denies() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let body =
        json!({"key": "login:alice", "limits": [{"requests": 3, "period_ms": 60000, "burst": 3}]});
    for left in [2, 1, 0] {
        let answer = post(&state, "/v1/check", &body).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.body["allowed"], true, "{answer:?}");
        assert_eq!(answer.body["remaining"], left, "{answer:?}");
    }
    let answer = post(&state, "/v1/check", &body).await;
    assert_eq!(answer.body["allowed"], false, "{answer:?}");
    assert_eq!(answer.body["remaining"], 0);
    let retry = answer.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        (19_000..=20_000).contains(&retry),
        "one token every 20 s: {retry}"
    );
    let text = get(&state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("sluice_checks_total{decision=\"denied\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn check_respects_the_proxies_leases() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let synced = post(&state, "/v1/sync", &sync_body(json!([ten_per_second("k")]))).await;
    assert_eq!(synced.body["grants"][0]["tokens"], 11);
    let check = json!({"key": "k", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}]});
    let answer = post(&state, "/v1/check", &check).await;
    assert_eq!(
        answer.body["allowed"], false,
        "the proxy holds the whole bucket and more: {answer:?}"
    );
}

/// Whether Redis holds the script of this SHA.
fn script_exists(redis: &Redis, sha: &str) -> bool {
    let reply = redis.query(&["SCRIPT", "EXISTS", sha]).unwrap();
    reply == Reply::Array(vec![Reply::Integer(1)])
}

#[tokio::test]
async fn the_scripts_run_by_the_sha_of_prelude_and_script_and_reload_after_a_flush() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let sync = state.scripts.sync.get_hash().to_owned();
    let check = state.scripts.check.get_hash().to_owned();
    let sync_body = sync_body(json!([ten_per_second("k")]));
    let check_body =
        json!({"key": "c", "limits": [{"requests": 10, "period_ms": 1000, "burst": 10}]});
    for round in 0..2 {
        assert!(!script_exists(&redis, &sync) && !script_exists(&redis, &check));
        let answer = post(&state, "/v1/sync", &sync_body).await;
        assert_eq!(answer.status, StatusCode::OK, "round {round}: {answer:?}");
        let answer = post(&state, "/v1/check", &check_body).await;
        assert_eq!(answer.status, StatusCode::OK, "round {round}: {answer:?}");
        assert_eq!(answer.body["allowed"], true, "round {round}: {answer:?}");
        // loaded on NOSCRIPT, under the SHA the service computed: Redis hashed the same text
        assert!(script_exists(&redis, &sync) && script_exists(&redis, &check));
        for (sha, text) in [(&sync, SYNC_LUA), (&check, CHECK_LUA)] {
            let loaded = redis.query(&["SCRIPT", "LOAD", text]).unwrap();
            assert_eq!(
                loaded.text(),
                Some(sha.as_str()),
                "prelude and script, as one"
            );
        }
        redis.query(&["SCRIPT", "FLUSH"]).unwrap();
    }
}

#[tokio::test]
async fn redis_down_is_503_with_retry_after_and_recovers() {
    let mut redis = Redis::start().unwrap();
    let state = AppState::new(common::settings(
        &redis.url(),
        &["--redis-timeout-ms", "200"],
    ))
    .unwrap();
    let body = sync_body(json!([ten_per_second("k")]));
    assert_eq!(post(&state, "/v1/sync", &body).await.status, StatusCode::OK);
    assert_eq!(get(&state, "/readyz").await.status, StatusCode::OK);

    redis.stop();
    let started = Instant::now();
    let answer = post(&state, "/v1/sync", &body).await;
    assert_error(
        &answer,
        StatusCode::SERVICE_UNAVAILABLE,
        "redis_unavailable",
    );
    assert_eq!(answer.retry_after.as_deref(), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(2), "never a hang");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        !message.contains("127.0.0.1"),
        "internals stay out: {message}"
    );
    let check = json!({"key": "k", "limits": [{"requests": 1, "period_ms": 1000, "burst": 1}]});
    let answer = post(&state, "/v1/check", &check).await;
    assert_error(
        &answer,
        StatusCode::SERVICE_UNAVAILABLE,
        "redis_unavailable",
    );
    let ready = get(&state, "/readyz").await;
    assert_error(&ready, StatusCode::SERVICE_UNAVAILABLE, "redis_unavailable");
    assert_eq!(
        get(&state, "/healthz").await.status,
        StatusCode::OK,
        "alive all the same"
    );

    redis.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&state, "/readyz").await.status != StatusCode::OK {
        assert!(Instant::now() < deadline, "readyz did not recover");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let text = get(&state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("sluice_errors_total{kind=\"redis_unavailable\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn unknown_paths_are_json_404() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let answer = get(&state, "/v2/nothing").await;
    assert_error(&answer, StatusCode::NOT_FOUND, "not_found");
}

/// The real binary: listens, syncs over TCP, refuses a wrong token, drains on SIGTERM.
#[test]
fn the_binary_serves_and_stops_on_sigterm() {
    let redis = Redis::start().unwrap();
    let mut service = Service::start(&redis.url()).unwrap();
    let body = sync_body(json!([ten_per_second("a")])).to_string();
    let reply = service.post("/v1/sync", &body).unwrap();
    assert_eq!(reply.status, 200, "{reply:?} {}", service.log());
    assert_eq!(reply.json().unwrap()["grants"][0]["tokens"], 11);
    let reply = service
        .post_with_token("/v1/sync", &body, Some("nope"))
        .unwrap();
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json().unwrap()["error"], "unauthorized");
    assert_eq!(service.get("/readyz").unwrap().status, 200);
    let status = service.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}: {}", service.log());
}

/// Milliseconds from now until the next 00:00 UTC.
fn ms_to_midnight() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    86_400_000 - now % 86_400_000
}

#[tokio::test]
async fn windows_are_checked_on_keys_of_their_own_and_expire_with_their_window() {
    let redis = Redis::start().unwrap();
    let state = state(&redis.url());
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();

    // An algorithm the service does not know: 400, naming the field.
    let unknown = json!({"key": "k", "limits": [{"requests": 2, "period_ms": 86400000, "burst": 2, "algorithm": "fifo"}]});
    let answer = post(&state, "/v1/check", &unknown).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "malformed_json");
    let message = answer.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("malformed JSON: limits[0].algorithm: unknown variant `fifo`"),
        "{message}"
    );
    // A sliding log beyond its bound, or in a sync (it is never leased): 400, naming the field.
    let long = json!({"key": "k", "limits": [{"requests": 1001, "period_ms": 3600000, "burst": 1001, "algorithm": "sliding_log"}]});
    let answer = post(&state, "/v1/check", &long).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "limits[0].requests: a sliding_log keeps one member per request: at most 1000"
    );
    // A sliding log is a sorted set of its own, expiring a second after its newest request
    // stops counting.
    let login = json!({"key": "k", "limits": [{"requests": 2, "period_ms": 60000, "burst": 2, "algorithm": "sliding_log"}]});
    let mut allowed = Vec::new();
    for _ in 0..3 {
        allowed.push(post(&state, "/v1/check", &login).await.body["allowed"].clone());
    }
    assert_eq!(allowed, [json!(true), json!(true), json!(false)]);
    let log_key = format!("sluice:{{{}}}:k:2/60000/2/sliding_log", keys::hash_tag("k"));
    let members: u64 = redis::cmd("ZCARD").arg(&log_key).query(&mut con).unwrap();
    assert_eq!(members, 2, "one member per admitted request");
    let ttl: i64 = redis::cmd("PTTL").arg(&log_key).query(&mut con).unwrap();
    assert!((59_000..=61_000).contains(&ttl), "ttl {ttl} ms");
    // Out of a window's bounds: 400, naming the field.
    let bursty = json!({"key": "k", "limits": [{"requests": 2, "period_ms": 86400000, "burst": 5, "algorithm": "fixed_window"}]});
    let answer = post(&state, "/v1/check", &bursty).await;
    assert_error(&answer, StatusCode::BAD_REQUEST, "invalid_request");
    assert_eq!(
        answer.body["message"],
        "limits[0].burst: fixed_window has no burst: it must equal requests"
    );

    // 2 a day on the real clock: the third waits until 00:00 UTC.
    let daily = json!({"key": "k", "limits": [{"requests": 2, "period_ms": 86400000, "burst": 2, "algorithm": "fixed_window"}]});
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(post(&state, "/v1/check", &daily).await);
    }
    let allowed: Vec<_> = answers.iter().map(|a| a.body["allowed"].clone()).collect();
    assert_eq!(
        allowed,
        [json!(true), json!(true), json!(false)],
        "{answers:?}"
    );
    let until_midnight = ms_to_midnight();
    let retry = answers[2].body["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry.abs_diff(until_midnight) <= 2_000,
        "retry after {retry} ms, midnight in {until_midnight} ms"
    );
    assert_eq!(answers[2].body["reset_ms"].as_u64().unwrap(), retry);
    assert_eq!(answers[1].body["remaining"], 0);

    // The token bucket of the same numbers on the same key counts apart.
    let bucket =
        json!({"key": "k", "limits": [{"requests": 2, "period_ms": 86400000, "burst": 2}]});
    let answer = post(&state, "/v1/check", &bucket).await;
    assert_eq!(answer.body["allowed"], true, "{answer:?}");

    // The window's key lives until the window is over, plus a second.
    let window_key = keys::limit_key(
        "k",
        &LimitSpec::window(sluice_protocol::AlgorithmSpec::FixedWindow, 2, 86_400_000),
    );
    assert!(
        window_key.ends_with(":2/86400000/2/fixed_window"),
        "{window_key}"
    );
    let fields: Vec<String> = redis::cmd("HMGET")
        .arg(&window_key)
        .arg("n")
        .arg("w")
        .query(&mut con)
        .unwrap();
    assert_eq!(fields[0], "2");
    let pttl: i64 = redis::cmd("PTTL").arg(&window_key).query(&mut con).unwrap();
    assert!(
        (pttl - 1_000 - ms_to_midnight() as i64).abs() <= 2_000,
        "PTTL {pttl} ms, midnight in {} ms",
        ms_to_midnight()
    );

    // A sliding minute: its key outlives the next minute, which still weighs its count.
    let sliding = json!({"key": "s", "limits": [{"requests": 5, "period_ms": 60000, "burst": 5, "algorithm": "sliding_window"}]});
    let answer = post(&state, "/v1/check", &sliding).await;
    assert_eq!(answer.body["allowed"], true, "{answer:?}");
    assert_eq!(answer.body["remaining"], 4, "{answer:?}");
    let reset = answer.body["reset_ms"].as_u64().unwrap();
    assert!((60_000..=120_000).contains(&reset), "reset {reset}");
    let sliding_key = keys::limit_key(
        "s",
        &LimitSpec::window(sluice_protocol::AlgorithmSpec::SlidingWindow, 5, 60_000),
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&sliding_key)
        .query(&mut con)
        .unwrap();
    assert!(
        (pttl - 1_000 - reset as i64).abs() <= 2_000,
        "PTTL {pttl}, reset {reset}"
    );

    // A sync leases windows too: on the same key as the strict checks, which it sees. The
    // sliding key counted 1 request; a proxy wanting more gets the 4 left, until the minute ends.
    let body = sync_body(json!([
        ten_per_second("a"),
        {"key": "s", "limits": [{"requests": 5, "period_ms": 60000, "burst": 5, "algorithm": "sliding_window"}], "spent": 0, "denied": 50}
    ]));
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let window = &answer.body["grants"][1];
    assert!(window["refused"].is_null(), "{answer:?}");
    assert_eq!(window["tokens"], 4, "{answer:?}");
    assert_eq!(window["remaining"], 4, "{answer:?}");
    let ttl = window["ttl_ms"].as_u64().unwrap();
    assert!((1..=300).contains(&ttl), "{answer:?}");
}
