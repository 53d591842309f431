//! Against a local 3-master Redis Cluster: a batch whose keys span several hash slots is applied
//! with one script call per slot, each call's keys in one slot.

mod common;

use std::collections::HashSet;

use axum::http::StatusCode;
use common::{get, post, settings};
use serde_json::json;
use sluice_counter_service::{fleet, keys, AppState};
use sluice_protocol::LimitSpec;
use sluice_tests::redis::{RedisCluster, Reply};

#[tokio::test]
async fn a_batch_over_many_slots_makes_one_call_per_slot() {
    let cluster = RedisCluster::start(3).unwrap();
    // every sync reads the live overrides (one call each, counted below)
    let state = AppState::new(settings(
        &cluster.url_list(),
        &["--overrides-refresh-ms", "0"],
    ))
    .unwrap();
    assert!(state.backend.is_cluster());
    let limits = [
        LimitSpec::token_bucket(10, 1_000, 10),
        LimitSpec::token_bucket(100, 60_000, 20),
    ];
    // 40 entries; "user:3" twice, so two entries share a slot
    let mut names: Vec<String> = (0..39).map(|i| format!("user:{i}")).collect();
    names.push("user:3".into());
    let entries: Vec<_> = names
        .iter()
        .map(|key| json!({"key": key, "limits": limits, "spent": 0, "denied": 1000}))
        .collect();
    let body = json!({"proxy": "p1", "interval_ms": 100, "entries": entries});

    // warm up: load the script on every node, so that NOSCRIPT retries do not count below
    let warm = post(&state, "/v1/sync", &body).await;
    assert_eq!(warm.status, StatusCode::OK, "{warm:?}");
    cluster.reset_stats().unwrap();

    let mut slots = HashSet::new();
    for name in &names {
        let tag = format!("{{{}}}", keys::hash_tag(name));
        let slot = cluster.slot(&tag).unwrap();
        for limit in &limits {
            assert_eq!(cluster.slot(&keys::limit_key(name, limit)).unwrap(), slot);
        }
        slots.insert(slot);
    }
    assert_eq!(
        slots.len(),
        39,
        "39 distinct keys, 39 slots (no collision among these)"
    );

    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let grants = answer.body["grants"].as_array().unwrap();
    assert_eq!(grants.len(), 40);
    assert_eq!(grants[0]["remaining"], 10, "the tighter limit holds 10");

    assert_eq!(
        cluster.command_calls("evalsha").unwrap(),
        slots.len() as u64 + 1,
        "one EVALSHA per slot, and the live overrides' one"
    );
    let text = get(&state, "/metrics")
        .await
        .body
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains("sluice_script_calls_total{script=\"sync\"} 78"),
        "two batches of 39 calls: {text}"
    );
    let holding = cluster
        .nodes()
        .iter()
        .filter(|node| node.text(&["DBSIZE"]).unwrap() != "0")
        .count();
    assert_eq!(holding, 3, "the keys are spread over every master");

    // a strict check is routed to its slot too
    let check = json!({"key": "user:0", "limits": limits});
    let answer = post(&state, "/v1/check", &check).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(readyz(&state).await, StatusCode::OK);

    // every master forgets the scripts: each loads them again on NOSCRIPT (prelude and script
    // as one text, under the SHA the service computed over both)
    for node in cluster.nodes() {
        node.query(&["SCRIPT", "FLUSH"]).unwrap();
    }
    let answer = post(&state, "/v1/sync", &body).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let answer = post(&state, "/v1/check", &check).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    let sha = state.scripts.sync.get_hash();
    for node in cluster.nodes() {
        let exists = node.query(&["SCRIPT", "EXISTS", sha]).unwrap();
        assert_eq!(
            exists,
            Reply::Array(vec![Reply::Integer(1)]),
            "{}",
            node.url()
        );
    }
}

async fn readyz(state: &AppState) -> StatusCode {
    get(state, "/readyz").await.status
}

/// The fleet's load reports live in keys of one hash slot: on a cluster, one `EVALSHA` on the node of
/// that slot.
#[tokio::test]
async fn load_reports_meet_in_one_hash_slot_on_a_cluster() {
    let cluster = RedisCluster::start(3).unwrap();
    // every sync reads the live overrides (one call each, counted below)
    let state = AppState::new(settings(
        &cluster.url_list(),
        &["--overrides-refresh-ms", "0"],
    ))
    .unwrap();
    let body = |proxy: &str, utilization: f64| {
        json!({"proxy": proxy, "interval_ms": 100, "entries": [],
               "load": {"utilization": utilization, "shed_rate": 0.0, "latency_ms": 5.0}})
    };
    let first = post(&state, "/v1/sync", &body("p1", 0.2)).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert_eq!(first.body["hints"]["overrides"]["load_level"], 0.2);
    cluster.reset_stats().unwrap();
    let second = post(&state, "/v1/sync", &body("p2", 0.8)).await;
    assert_eq!(second.body["hints"]["overrides"]["load_level"], 0.5);
    // the fleet's call, and the live overrides' one
    assert_eq!(cluster.command_calls("evalsha").unwrap(), 2);
    let proxies = fleet::proxies_key(fleet::SHARED_CREDENTIAL);
    let holding: Vec<_> = cluster
        .nodes()
        .iter()
        .filter(|node| {
            node.text(&["EXISTS", fleet::FLEET_CREDENTIALS_KEY, &proxies])
                .unwrap_or_default()
                == "2"
        })
        .collect();
    assert_eq!(holding.len(), 1, "both keys, on one master");
    assert_eq!(holding[0].text(&["HLEN", &proxies]).unwrap(), "2");
}
