//! The counter service through Redis Sentinel (`--redis-sentinel`): three sentinels watch a
//! primary with one replica; the service finds the primary through them, and when the primary is
//! killed it asks them again and follows the promoted replica by itself.

use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::redis::{Redis, Sentinel};
use sluice_tests::service::{Service, ServiceOptions};

const NAME: &str = "sluice-primary";

fn sync_body(key: &str) -> String {
    json!({"proxy": "p1", "interval_ms": 100, "entries": [
        {"key": key, "limits": [{"requests": 1000, "period_ms": 1000, "burst": 1000}], "spent": 1, "denied": 0}]})
    .to_string()
}

/// Waits (bounded) for `condition`.
fn wait(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_service_follows_a_sentinel_failover() {
    let mut primary = Redis::start().unwrap();
    let primary_port = primary.port().to_string();
    let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary_port]).unwrap();
    wait("the replica in sync", Duration::from_secs(20), || {
        replica
            .text(&["INFO", "replication"])
            .is_ok_and(|info| info.contains("master_link_status:up"))
    });
    let sentinels: Vec<Sentinel> = (0..3)
        .map(|_| Sentinel::start(NAME, primary.port(), 2, 1000).unwrap())
        .collect();
    wait(
        "the sentinels to see the replica",
        Duration::from_secs(20),
        || {
            sentinels.iter().all(|s| {
                sluice_tests::redis::query(s.port(), &["SENTINEL", "REPLICAS", NAME]).is_ok_and(
                    |reply| matches!(reply, sluice_tests::redis::Reply::Array(r) if !r.is_empty()),
                )
            })
        },
    );
    let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
    let service = Service::start_with(
        ServiceOptions::new(urls.join(","))
            .arg("--redis-sentinel")
            .arg(NAME)
            .arg("--redis-timeout-ms")
            .arg("500"),
    )
    .unwrap();
    let reply = service.post("/v1/sync", &sync_body("before")).unwrap();
    assert_eq!(reply.status, 200, "{reply:?}\n{}", service.log());
    assert!(
        primary.command_calls("evalsha").unwrap() > 0,
        "the primary answered"
    );

    primary.stop();
    // Sync until the service answers from the promoted replica: only 200s and 503s meanwhile.
    let (mut ok, mut unavailable) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "no failover followed within 60 s: {ok} ok, {unavailable} 503\n{}",
            service.log()
        );
        let reply = service.post("/v1/sync", &sync_body("after")).unwrap();
        match reply.status {
            200 => ok += 1,
            503 => unavailable += 1,
            other => panic!("{other}: {reply:?}"),
        }
        if reply.status == 200 && ok > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(unavailable > 0, "the primary was killed: some syncs failed");
    let promoted = sentinels[0].primary_port(NAME);
    assert_eq!(promoted, Some(replica.port()), "{}", sentinels[0].log());
    let info = replica.text(&["INFO", "replication"]).unwrap();
    assert!(info.contains("role:master"), "{info}");
    let keys = replica.query(&["KEYS", "sluice:*after*"]).unwrap();
    assert!(
        matches!(&keys, sluice_tests::redis::Reply::Array(k) if !k.is_empty()),
        "the sync after the failover was counted on the promoted replica: {keys:?}"
    );
    assert!(service
        .log()
        .contains("asking the sentinels for the primary again"));
}
