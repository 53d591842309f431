//! Two counter-service replicas behind Envoy's cluster `sluice_service` (envoy/sluice-replicas.yaml.tmpl), all
//! real parts on loopback: steady load through Envoy on a cached rule while one replica is killed (SIGKILL). The
//! edge sees no error and no 5xx, and once the syncs have settled the global count in Redis equals the requests
//! Envoy admitted, exactly: a batch lost with the replica is resent to the survivor with its round labels and
//! counted once, whether the dead replica had applied it or not. Before the kill, Redis stalls for half a second
//! (`DEBUG SLEEP`): the syncs queued behind it are applied after the filter's callout timed out, so their answers
//! are lost for certain, and the survivor must take their resends for replays (its `replayed_entries`).
//!
//! `make test` runs one kill over a few seconds; `make test-replicas` runs longer with several kills, each
//! replica killed and restarted in turn (SLUICE_REPLICAS_SECS, SLUICE_REPLICAS_KILLS).
#![cfg(all(feature = "envoy", feature = "redis"))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::envoy::{sustain_until, wasm_path, Envoy, EnvoyOptions, Load, Template};
use sluice_tests::eventually;
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

/// The filter's callout timeout (`service.timeout_ms`).
const TIMEOUT_MS: u64 = 200;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A cached monthly fixed window far above the load: every request is admitted, and the window's count in Redis
/// must end equal to the 200s the edge saw.
fn config(token: &str) -> String {
    json!({
        "service": {
            "cluster": "sluice_service",
            "authority": "sluice_service",
            "token": token,
            "timeout_ms": TIMEOUT_MS,
            "sync_interval_ms": 100,
            "breaker_failures": 3,
            "breaker_cooldown_ms": 1000,
        },
        "rules": [{
            "name": "shared",
            "key": ["const:all"],
            "consistency": "cached",
            "limits": [{"requests": 10_000_000, "per": "month", "algorithm": "fixed_window"}],
            "fallback": {"policy": "fail_open"},
        }],
    })
    .to_string()
}

fn start_envoy(replicas: &[Service; 2]) -> Envoy {
    let port = |s: &Service| s.address().expect("the service listens").port().to_string();
    let template = sluice_tests::envoy::repo_root().join("envoy/sluice-replicas.yaml.tmpl");
    Envoy::start(EnvoyOptions {
        template: Template::File(template),
        plugin_config_json: config(replicas[0].token()),
        concurrency: 2,
        placeholders: vec![
            ("SERVICE_PORT".to_owned(), port(&replicas[0])),
            ("SERVICE_PORT_2".to_owned(), port(&replicas[1])),
            (
                "WASM".to_owned(),
                wasm_path().unwrap().display().to_string(),
            ),
        ],
    })
    .unwrap()
}

#[test]
fn a_replica_killed_under_load_costs_no_error_and_no_count() {
    let secs = env_number("SLUICE_REPLICAS_SECS", 6).max(3);
    let kills = env_number("SLUICE_REPLICAS_KILLS", 1).max(1);
    let redis = Redis::start_with(&["--enable-debug-command", "yes"]).unwrap();
    let mut replicas = [
        Service::start(&redis.url()).unwrap(),
        Service::start(&redis.url()).unwrap(),
    ];
    let envoy = start_envoy(&replicas);

    // Four connections, 2 ms apart each: a few hundred requests a second on a small machine.
    let load = Load {
        max_requests: 200_000,
        pause: Duration::from_millis(2),
        ..Load::new(envoy.url("/api/x"), 4, Duration::from_secs(secs))
    };
    let stop = AtomicBool::new(false);
    let sync_ok = "wasmcustom.sluice.sync.ok";
    let sync_failed = "wasmcustom.sluice.sync.failed";
    // Kill k (0-based) at (k + 1) / (kills + 1) of the run; the replica comes back half a period later.
    let period = Duration::from_secs(secs) / (kills as u32 + 1);
    let mut replayed_by_dead = 0;

    let (run, synced_before_kill, failed_before, killed_at) = std::thread::scope(|scope| {
        let loader = scope.spawn(|| sustain_until(&load, &stop));
        let started = Instant::now();
        let synced = eventually(Duration::from_secs(5), || envoy.stat(sync_ok) > 0);
        let failed_before = envoy.stat(sync_failed);
        // Redis stalls: the callouts waiting on it time out (in doubt), their scripts run after.
        std::thread::sleep((started + period / 2).saturating_duration_since(Instant::now()));
        redis.query(&["DEBUG", "SLEEP", "0.5"]).unwrap();
        let mut killed_at = Vec::new();
        for k in 0..kills {
            let at = started + period * (k as u32 + 1);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            let victim = (k % 2) as usize;
            replayed_by_dead += replicas[victim].metric("replayed_entries");
            replicas[victim].kill();
            killed_at.push(started.elapsed());
            if k + 1 < kills {
                std::thread::sleep(period / 2);
                replicas[victim].restart().unwrap();
            }
        }
        let run = loader.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        (run, synced, failed_before, killed_at)
    });
    let admitted = run.count(200) as u64;
    // After the load: rounds keep going every 100 ms (after the breaker's 1 s cool-down if it opened); whatever
    // was in doubt or waiting reaches the survivor.
    let settled = eventually(Duration::from_secs(15), || {
        redis.only_window_count() == admitted
    });
    let counted = redis.only_window_count();
    let replayed = replayed_by_dead
        + replicas
            .iter()
            .map(|r| r.metric("replayed_entries"))
            .sum::<u64>();
    let stats = envoy.sluice_stats();
    let failed = envoy.stat(sync_failed) - failed_before;
    let statuses = run.statuses();
    let (slowest, slowest_at) = run.slowest().expect("some requests were sent");
    eprintln!(
        "replicas: {secs} s, kills at {killed_at:?}: statuses {statuses:?}, transport errors {}, slowest {slowest:?} \
         (at {slowest_at:?}); admitted {admitted}, counted in Redis {counted}; syncs failed {failed}, ok {}; \
         entries the service took for replays {replayed}",
        run.errors().len(),
        envoy.stat(sync_ok),
    );

    assert!(
        synced_before_kill,
        "no sync succeeded before the kill; {stats:?}"
    );
    assert!(
        run.errors().is_empty(),
        "requests got no answer at all, e.g. {:?}",
        &run.errors()[..run.errors().len().min(3)]
    );
    assert!(
        statuses.keys().all(|s| *s == 200),
        "every request is admitted (the limit is far above the load); statuses: {statuses:?}"
    );
    assert!(admitted > 0);
    assert!(
        replayed > 0,
        "syncs applied after their callout timed out (Redis stalled) were resent: the service must have taken \
         some entries for replays"
    );
    assert!(
        settled,
        "the global count is {counted}, the edge admitted {admitted}: every admitted request must be counted \
         exactly once; {stats:?}"
    );
}
