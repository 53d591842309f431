//! Redis Cluster failover and Redis restarted empty, with every part real on loopback: Debian's
//! `redis-server` (a cluster of 3 primaries with a replica each, `cluster-node-timeout` 1 s), the
//! counter service, and Envoy (the pinned wheel) with the filter.
//!
//! - A primary is killed: the service answers 503 `redis_unavailable` with `Retry-After` for the keys
//!   of its slots only, until its replica is promoted; then they answer again, with nothing restarted.
//! - The same under load at the edge (cached rules over keys on every primary, a strict rule on the
//!   killed one): no request fails but by policy (200 or 429, none slower than a second), the proxy
//!   falls back and recovers, and what its fallbacks admitted is debited afterwards: over the whole
//!   run each key admits no more than the global limit plus the debt not yet repaid at the end.
//! - Redis emptied under load (`FLUSHALL`, then a restart without persistence): leases and debts
//!   rebuild from the next syncs without a flood of admissions or of syncs.
//!
//! The short versions run in `make test` (about a minute); `make test-failover` runs them longer, with
//! more keys and a second failover (`SLUICE_FAILOVER_LONG=1`). Results: RELIABILITY.md. The tests take
//! turns (one lock): they measure rates and latencies on a small machine.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::envoy::{latency_quantile, sustain_until, Envoy, Load, Sustained};
use sluice_tests::eventually;
use sluice_tests::redis::{ClusterOptions, Redis, RedisCluster};
use sluice_tests::service::{Service, ServiceOptions};

#[path = "support/failover_fleet.rs"]
mod failover_fleet;
use failover_fleet::*;

/// No request at the edge may take this long (the callout timeout plus a wide margin).
const SLOWEST_ALLOWED: Duration = Duration::from_secs(1);

static MACHINE: Mutex<()> = Mutex::new(());

fn machine() -> MutexGuard<'static, ()> {
    MACHINE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `make test-failover`: longer phases, more keys, a second failover.
fn long() -> bool {
    std::env::var_os("SLUICE_FAILOVER_LONG").is_some_and(|v| !v.is_empty() && v != "0")
}

fn check_body(key: &str) -> String {
    json!({"key": key, "limits": [{"requests": 1_000_000, "period_ms": 1000, "burst": 1_000_000}]})
        .to_string()
}

fn sync_body(keys: &[&String]) -> String {
    let entries: Vec<Value> = keys
        .iter()
        .map(|key| json!({"key": key, "limits": [{"requests": 100, "period_ms": 1000, "burst": 100}], "spent": 1, "denied": 0}))
        .collect();
    json!({"proxy": "failover-direct", "interval_ms": 100, "entries": entries}).to_string()
}

#[test]
fn a_dead_primary_is_a_503_for_its_slots_only_until_its_replica_takes_over() {
    let _machine = machine();
    let mut cluster = RedisCluster::start_with(ClusterOptions::with_replicas(3, 1)).unwrap();
    // A Redis timeout of 200 ms (not 50): a live primary's key may not fail for a busy machine's sake.
    let service = Service::start_with(
        ServiceOptions::new(cluster.url_list())
            .arg("--redis-timeout-ms")
            .arg("200"),
    )
    .unwrap();
    // The live overrides are read with every sync: kill a primary that does not hold them.
    let overrides = cluster
        .primary_of(cluster.slot("{overrides}").unwrap())
        .unwrap();
    let keys: Vec<String> = (0..48).map(|i| format!("user:{i}")).collect();
    let owners: BTreeMap<&String, usize> = keys
        .iter()
        .map(|k| {
            let slot = cluster.slot(&hash_tag(k)).unwrap();
            (k, cluster.primary_of(slot).unwrap())
        })
        .collect();
    let victim = *owners.values().find(|&&o| o != overrides).unwrap();
    let affected: Vec<&String> = keys.iter().filter(|k| owners[k] == victim).collect();
    let unaffected: Vec<&String> = keys.iter().filter(|k| owners[k] != victim).collect();
    assert!(affected.len() >= 3 && unaffected.len() >= 3, "{owners:?}");
    for key in &keys {
        let reply = service.post("/v1/check", &check_body(key)).unwrap();
        assert_eq!(reply.status, 200, "{key} before the kill: {reply:?}");
    }

    let slots = cluster.slots_of(victim).unwrap();
    cluster.kill(victim);
    let killed = Instant::now();
    // Until the replica is promoted: the dead primary's keys get 503, the others 200.
    let mut refused = Vec::new();
    let mut unaffected_statuses = BTreeMap::new();
    let mut unaffected_syncs = BTreeMap::new();
    let mut mixed_syncs = BTreeMap::new();
    let promoted = loop {
        for (i, key) in affected.iter().enumerate().take(3) {
            let reply = service.post("/v1/check", &check_body(key)).unwrap();
            if reply.status != 200 {
                refused.push(reply);
            }
            let other = unaffected[i];
            let reply = service.post("/v1/check", &check_body(other)).unwrap();
            *unaffected_statuses.entry(reply.status).or_insert(0) += 1;
        }
        let reply = service.post("/v1/sync", &sync_body(&unaffected)).unwrap();
        *unaffected_syncs.entry(reply.status).or_insert(0) += 1;
        let reply = service
            .post("/v1/sync", &sync_body(&keys.iter().collect::<Vec<_>>()))
            .unwrap();
        *mixed_syncs.entry(reply.status).or_insert(0) += 1;
        if let Ok(index) = cluster.wait_for_failover(victim, &slots, Duration::ZERO) {
            break Some(index);
        }
        if killed.elapsed() > Duration::from_secs(20) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let promoted_after = killed.elapsed();
    let log = service.log();
    let promoted = promoted.unwrap_or_else(|| {
        panic!(
            "no replica took over within 20 s: {:?}",
            cluster.view_from(overrides)
        )
    });
    assert_ne!(promoted, victim);

    // After the promotion, the dead primary's keys answer again without a restart (the cluster
    // client finds the new primary); give it a few seconds on a noisy machine.
    let back = Instant::now();
    let recovered = eventually(Duration::from_secs(10), || {
        affected.iter().all(|key| {
            service
                .post("/v1/check", &check_body(key))
                .is_ok_and(|r| r.status == 200)
        })
    });
    let back_after = back.elapsed();
    let sync_after = service
        .post("/v1/sync", &sync_body(&keys.iter().collect::<Vec<_>>()))
        .unwrap();
    eprintln!(
        "killed primary {victim}: promoted {promoted} after {promoted_after:?}; {} refused check(s) on its \
         keys meanwhile; unaffected checks {unaffected_statuses:?}, syncs of unaffected keys \
         {unaffected_syncs:?}, of every key {mixed_syncs:?}; all its keys answered {back_after:?} after the \
         promotion was seen",
        refused.len()
    );

    assert!(
        !refused.is_empty(),
        "no check on the dead primary's keys was refused: the kill did not reach the service"
    );
    for reply in &refused {
        assert_eq!(reply.status, 503, "{reply:?}");
        assert_eq!(
            reply.json().unwrap()["error"],
            "redis_unavailable",
            "{reply:?}"
        );
        assert!(
            reply
                .header("retry-after")
                .is_some_and(|v| v.trim().parse::<u64>().is_ok_and(|s| s >= 1)),
            "a 503 says when to retry: {reply:?}"
        );
    }
    assert_eq!(
        unaffected_statuses.keys().copied().collect::<Vec<_>>(),
        vec![200],
        "keys of the live primaries must keep answering during the failover: {unaffected_statuses:?}\n{log}"
    );
    assert_eq!(
        unaffected_syncs.keys().copied().collect::<Vec<_>>(),
        vec![200],
        "a sync of keys on the live primaries only must keep answering: {unaffected_syncs:?}\n{log}"
    );
    assert!(
        recovered,
        "the dead primary's keys still fail 10 s after its replica was promoted\n{}",
        service.log()
    );
    assert_eq!(sync_after.status, 200, "{sync_after:?}");
    assert!(!service.log().contains("panicked"));
}

/// Every answer was 200 or 429 (no 5xx, no connection error), and none took [`SLOWEST_ALLOWED`].
fn assert_edge_unharmed(runs: &[&Sustained], what: &str) {
    for run in runs {
        let errors = run.errors();
        assert!(
            errors.is_empty(),
            "{what}: {} request(s) got no answer, e.g. {:?}",
            errors.len(),
            &errors[..errors.len().min(3)]
        );
        let statuses = run.statuses();
        assert!(
            statuses.keys().all(|s| *s == 200 || *s == 429),
            "{what}: only 200 and 429 are allowed at the edge; statuses: {statuses:?}"
        );
        if let Some((slowest, sent_at)) = run.slowest() {
            assert!(
                slowest < SLOWEST_ALLOWED,
                "{what}: a request took {slowest:?} (sent {sent_at:?} into the run)"
            );
        }
    }
}

/// One connection per user on `/api/x` (up to about 65 a second each: over the fallback's 40), and one on
/// `/strict/x` as `strict_user` (about 30 a second), for at most `duration`.
fn loads(envoy: &Envoy, users: &[String], strict_user: &str, duration: Duration) -> Vec<Load> {
    let mut loads: Vec<Load> = users
        .iter()
        .map(|user| Load {
            headers: vec![("x-user".to_owned(), user.clone())],
            max_requests: 5_000,
            pause: Duration::from_millis(15),
            ..Load::new(envoy.url("/api/x"), 1, duration)
        })
        .collect();
    loads.push(Load {
        headers: vec![("x-user".to_owned(), strict_user.to_owned())],
        max_requests: 5_000,
        pause: Duration::from_millis(33),
        ..Load::new(envoy.url("/strict/x"), 1, duration)
    });
    loads
}

/// The lowest stored tokens of each user's bucket, read every 25 ms for `over`.
fn lowest_tokens_over(cluster: &RedisCluster, users: &[String], over: Duration) -> Vec<f64> {
    let mut lowest: Vec<f64> = vec![f64::INFINITY; users.len()];
    let until = Instant::now() + over;
    while Instant::now() < until {
        for (i, user) in users.iter().enumerate() {
            let Ok(slot) = cluster.slot(&hash_tag(&entry_key("users", user))) else {
                continue;
            };
            let Ok(node) = cluster.primary_of(slot) else {
                continue;
            };
            if let Some(tokens) = stored_tokens(&cluster.nodes()[node], &bucket_key(user)) {
                lowest[i] = lowest[i].min(tokens);
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    lowest
}

/// The bucket's stored tokens (negative: debt), or `None` when the key is not there.
fn stored_tokens(node: &Redis, key: &str) -> Option<f64> {
    node.text(&["HGET", key, "tokens"]).ok()?.parse().ok()
}

#[test]
fn a_primary_killed_under_load_costs_the_edge_nothing_and_the_fallback_is_debited() {
    let _machine = machine();
    let long = long();
    let mut cluster = RedisCluster::start_with(ClusterOptions::with_replicas(3, 1)).unwrap();
    let service = Service::start_with(ServiceOptions::new(cluster.url_list())).unwrap();
    let overrides = cluster
        .primary_of(cluster.slot("{overrides}").unwrap())
        .unwrap();
    let primary_of_entry = |cluster: &RedisCluster, entry: &str| {
        cluster
            .primary_of(cluster.slot(&hash_tag(entry)).unwrap())
            .unwrap()
    };
    // Users on every primary; the strict rule's user on the one to be killed (not the overrides').
    let candidates: Vec<String> = (0..200).map(|i| format!("u{i}")).collect();
    let victim = candidates
        .iter()
        .map(|u| primary_of_entry(&cluster, &entry_key("users", u)))
        .find(|&p| p != overrides)
        .unwrap();
    let per_primary = if long { 4 } else { 2 };
    let mut users: Vec<String> = Vec::new();
    let mut taken = BTreeMap::new();
    for user in &candidates {
        let primary = primary_of_entry(&cluster, &entry_key("users", user));
        let count = taken.entry(primary).or_insert(0);
        if *count < per_primary {
            *count += 1;
            users.push(user.clone());
        }
    }
    assert_eq!(users.len(), 3 * per_primary, "{taken:?}");
    let strict_user = candidates
        .iter()
        .find(|u| primary_of_entry(&cluster, &entry_key("strict", u)) == victim)
        .unwrap()
        .clone();

    let envoy = start_envoy(&service);
    let steady = Duration::from_secs(if long { 10 } else { 3 });
    // After recovery, long enough for the debt to be repaid (it withholds leases meanwhile).
    let after = Duration::from_secs(if long { 15 } else { 6 });
    let loads = loads(&envoy, &users, &strict_user, Duration::from_secs(120));
    let stop = AtomicBool::new(false);
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.sluice.{name}"));

    let rounds = if long { 2 } else { 1 };
    let mut lowest_tokens: Vec<Vec<f64>> = Vec::new();
    let mut control_tokens: Vec<Vec<f64>> = Vec::new();
    let (runs, events) = std::thread::scope(|scope| {
        let threads: Vec<_> = loads
            .iter()
            .map(|load| scope.spawn(|| sustain_until(load, &stop)))
            .collect();
        let started = Instant::now();
        let mut events = Vec::new();
        let synced = eventually(Duration::from_secs(10), || stat("sync.ok") > 0);
        std::thread::sleep(steady);
        let mut victim = victim;
        for round in 0..rounds {
            // The control: the lowest tokens per user in steady state, over 1 s before the kill.
            control_tokens.push(lowest_tokens_over(&cluster, &users, Duration::from_secs(1)));
            let failed_before = stat("sync.failed");
            let slots = cluster.slots_of(victim).unwrap();
            cluster.kill(victim);
            let killed = Instant::now();
            let promoted = cluster.wait_for_failover(victim, &slots, Duration::from_secs(30));
            let promoted_at = Instant::now();
            let mut breaker_opened = false;
            let ok_at_promotion = stat("sync.ok");
            let recovered = eventually(Duration::from_secs(20), || {
                breaker_opened |= stat("breaker.open") == 1;
                stat("sync.ok") > ok_at_promotion + 2 && stat("breaker.open") == 0
            });
            let recovered_at = Instant::now();
            let failed_after = stat("sync.failed");
            // The fallback's spend arrives with the first syncs after recovery: the buckets go
            // into debt. The lowest tokens seen per user over the next 1.5 s (25 ms apart).
            lowest_tokens.push(lowest_tokens_over(
                &cluster,
                &users,
                Duration::from_millis(1500),
            ));
            events.push((
                round,
                victim,
                killed,
                promoted.ok().map(|p| (p, promoted_at)),
                recovered.then_some(recovered_at),
                failed_after - failed_before,
                breaker_opened,
            ));
            std::thread::sleep(after.saturating_sub(Duration::from_millis(1500)));
            if round + 1 < rounds {
                // The old primary comes back (empty) as a replica of the new one; kill the new one.
                cluster.nodes_mut()[victim].restart().unwrap();
                let promoted = events[round].3.as_ref().map(|(p, _)| *p).unwrap_or(victim);
                let rejoined = eventually(Duration::from_secs(20), || {
                    cluster.nodes()[victim]
                        .text(&["INFO", "replication"])
                        .is_ok_and(|i| i.contains("master_link_status:up"))
                });
                assert!(rejoined, "the old primary did not rejoin as a replica");
                std::thread::sleep(steady);
                victim = promoted;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let runs: Vec<Sustained> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        events.push((
            usize::MAX,
            0,
            started,
            None,
            synced.then_some(started),
            0,
            false,
        ));
        (runs, events)
    });
    let stats = envoy.sluice_stats();
    let log = service.log();
    let (_, _, started, _, synced, _, _) = *events.last().unwrap();
    assert!(
        synced.is_some(),
        "no sync succeeded before the kill; {stats:?}\n{log}"
    );
    let ended = runs.iter().map(|r| r.started + r.elapsed).max().unwrap();
    let elapsed = (ended - started).as_secs_f64();
    let all: Vec<&Sustained> = runs.iter().collect();
    let cached: Vec<&Sustained> = runs[..users.len()].iter().collect();
    let strict = &runs[users.len()];

    for &(round, victim, killed, ref promoted, recovered, failed, breaker) in
        &events[..events.len() - 1]
    {
        let (promoted_index, promoted_at) = promoted.unwrap_or_else(|| {
            panic!("round {round}: no replica took over from node {victim} within 30 s")
        });
        let recovered_at = recovered.unwrap_or_else(|| {
            panic!(
                "round {round}: syncs did not succeed again (or the breaker stayed open) within 20 s of the \
                 promotion; {stats:?}\n{log}"
            )
        });
        let before = (killed - Duration::from_secs(2), killed);
        let during = (killed, recovered_at);
        let after_window = (recovered_at, recovered_at + Duration::from_secs(2));
        let p = |w: (Instant, Instant), q| latency_quantile(&all, w.0, w.1, q);
        let edge = |w: (Instant, Instant), status| -> usize {
            all.iter().map(|r| r.count_between(status, w.0, w.1)).sum()
        };
        eprintln!(
            "round {round}: killed node {victim}, node {promoted_index} promoted after {:?}, syncs back after {:?} \
             ({failed} failed syncs, breaker opened: {breaker}); edge p50/p99 before {:?}/{:?}, during {:?}/{:?}, \
             after {:?}/{:?}; 200/429 before {}/{}, during {}/{}",
            promoted_at - killed,
            recovered_at - killed,
            p(before, 0.5),
            p(before, 0.99),
            p(during, 0.5),
            p(during, 0.99),
            p(after_window, 0.5),
            p(after_window, 0.99),
            edge(before, 200),
            edge(before, 429),
            edge(during, 200),
            edge(during, 429),
        );
        assert!(
            failed > 0,
            "round {round}: no sync failed while a primary holding synced keys was dead: the proxy never \
             had to fall back; {stats:?}"
        );
    }
    assert_edge_unharmed(&all, "load across the failover");
    assert!(
        strict.count(200) > 0 && stat_sum(&envoy, "check.failed") > 0,
        "the strict rule's checks on the dead primary's slot must have failed (and fallen back): strict \
         {:?}; {stats:?}",
        strict.statuses()
    );

    // Reconciled: every admission the fallbacks made while the service could not answer was reported
    // after recovery and debited from the global bucket, so over the whole run each user admits no
    // more than the global limit allows (burst + rate × (t + 1.5 intervals), and the bounded lease of
    // the last interval, not yet reported) plus the debt still owed at the end (read from Redis).
    let interval = INTERVAL_MS as f64 / 1000.0;
    let mut fallback_excess = Vec::new();
    for (user, run) in users.iter().zip(&cached) {
        let key = bucket_key(user);
        let node = primary_of_entry(&cluster, &entry_key("users", user));
        let debt = stored_tokens(&cluster.nodes()[node], &key).map_or(0.0, |t| (-t).max(0.0));
        let admitted = run.count(200) as f64;
        let lease = BURST + RATE * 1.5 * interval;
        let most = BURST + RATE * (elapsed + 1.5 * interval) + debt + lease + FALLBACK_BURST;
        let least = 0.6 * RATE * elapsed;
        // What the fallback admitted beyond the global limit during the outage: what an undebited
        // fallback would add to the count. It must dwarf the slack above for the check to mean anything.
        let (_, _, killed, _, recovered, _, _) = events[0];
        let recovered = recovered.unwrap();
        let during = run.count_between(200, killed, recovered) as f64;
        let allowed_during = BURST + RATE * (recovered - killed).as_secs_f64();
        fallback_excess.push(during - allowed_during);
        eprintln!(
            "{user}: admitted {admitted} in {elapsed:.1} s (bounds {least:.0}..={most:.0}, debt at the end \
             {debt:.1}); during the outage {during} (the global limit: {allowed_during:.0})"
        );
        assert!(
            admitted <= most,
            "{user}: {admitted} admitted in {elapsed:.1} s, more than the global limit allows ({most:.0} with \
             the {debt:.1} still owed): the fallback's spend was not debited; {stats:?}"
        );
        assert!(
            admitted >= least,
            "{user}: only {admitted} admitted in {elapsed:.1} s (at least {least:.0}): starved; {stats:?}"
        );
    }
    let mean_excess = fallback_excess.iter().sum::<f64>() / fallback_excess.len() as f64;
    assert!(
        mean_excess > FALLBACK_BURST,
        "the fallbacks admitted only {mean_excess:.0} beyond the global limit on average during the outage \
         (fallback {FALLBACK_RATE}/s vs {RATE}/s): too little for the debt to show"
    );
    // Reconciled, in Redis: after recovery each user's bucket went into debt (what its fallback
    // admitted beyond the limit, reported and debited), deeper than before the kill by at least half
    // the excess. A fallback not reported, or lost with the dead primary, leaves the bucket about
    // where it was before the kill.
    for (round, (control, lowest)) in control_tokens.iter().zip(&lowest_tokens).enumerate() {
        eprintln!(
            "round {round}: lowest tokens per user in the 1 s before the kill {control:.1?}, in the 1.5 s after \
             recovery {lowest:.1?}"
        );
        for ((user, before), after) in users.iter().zip(control).zip(lowest) {
            assert!(
                *after < before - mean_excess / 2.0,
                "round {round}: {user}'s bucket went to {after:.1} tokens after recovery, {before:.1} before the \
                 kill: the fallback's spend (about {mean_excess:.0} beyond the limit) was not debited; {stats:?}"
            );
        }
    }
    assert!(!log.contains("panicked"), "the service panicked:\n{log}");
}

fn stat_sum(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(&format!("wasmcustom.sluice.{name}"))
}

#[test]
fn redis_emptied_under_load_rebuilds_leases_and_debts_without_a_flood() {
    let _machine = machine();
    let long = long();
    let mut redis = Redis::start().unwrap();
    let service = Service::start(&redis.url()).unwrap();
    let envoy = start_envoy(&service);
    let users: Vec<String> = (0..if long { 8 } else { 4 })
        .map(|i| format!("r{i}"))
        .collect();
    // About 100 a second per user, five times the limit: a flood would show.
    let loads: Vec<Load> = users
        .iter()
        .map(|user| Load {
            headers: vec![("x-user".to_owned(), user.clone())],
            max_requests: 20_000,
            pause: Duration::from_millis(10),
            ..Load::new(envoy.url("/api/x"), 1, Duration::from_secs(120))
        })
        .collect();
    let stop = AtomicBool::new(false);
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.sluice.{name}"));
    let window = Duration::from_secs(if long { 6 } else { 3 });
    let steady = Duration::from_secs(if long { 6 } else { 2 });

    // (what, when, syncs sent in the `steady` before, in the `window` after, ok syncs after, first ok sync after)
    let (runs, events) = std::thread::scope(|scope| {
        let threads: Vec<_> = loads
            .iter()
            .map(|load| scope.spawn(|| sustain_until(load, &stop)))
            .collect();
        let synced = eventually(Duration::from_secs(10), || stat("sync.ok") > 0);
        let mut events = Vec::new();
        for what in ["FLUSHALL", "restart"] {
            let sent_at_start = stat("sync.sent");
            std::thread::sleep(steady);
            let sent_before = stat("sync.sent") - sent_at_start;
            let ok_before = stat("sync.ok");
            let at = Instant::now();
            match what {
                "FLUSHALL" => {
                    redis.query(&["FLUSHALL"]).unwrap();
                }
                _ => redis.restart().unwrap(),
            }
            let sent_at_event = stat("sync.sent");
            let back = eventually(window, || stat("sync.ok") > ok_before);
            let back_after = at.elapsed();
            std::thread::sleep((at + window).saturating_duration_since(Instant::now()));
            let sent_after = stat("sync.sent") - sent_at_event;
            events.push((
                what,
                at,
                sent_before,
                sent_after,
                back.then_some(back_after),
            ));
        }
        stop.store(true, Ordering::Relaxed);
        let runs: Vec<Sustained> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(synced, "no sync succeeded before Redis was emptied");
        (runs, events)
    });
    let stats = envoy.sluice_stats();
    let log = service.log();
    let all: Vec<&Sustained> = runs.iter().collect();
    assert_edge_unharmed(&all, "load while Redis was emptied");

    let interval = INTERVAL_MS as f64 / 1000.0;
    let secs = window.as_secs_f64();
    for (what, at, sent_before, sent_after, back) in events {
        let back = back.unwrap_or_else(|| {
            panic!("{what}: no sync succeeded within {window:?} after Redis was emptied; {stats:?}\n{log}")
        });
        // A new bucket starts full (burst) and refills; the proxy still holds its last lease (at most
        // burst + 1.5 intervals of refill); its fallback decides until a sync answers (burst, and its
        // rate for as long as that took). Nothing else: the first syncs report the spend, which the
        // new bucket debits, and the leases that follow are sized from it.
        let lease = BURST + RATE * 1.5 * interval;
        let outage = back.as_secs_f64();
        let most = BURST
            + RATE * (secs + 1.5 * interval)
            + lease
            + FALLBACK_BURST
            + FALLBACK_RATE * outage;
        let offered_most = runs
            .iter()
            .map(|r| {
                r.samples
                    .iter()
                    .filter(|s| s.at >= at && s.at < at + window)
                    .count()
            })
            .min()
            .unwrap_or(0);
        let admitted: Vec<usize> = runs
            .iter()
            .map(|r| r.count_between(200, at, at + window))
            .collect();
        let before_rate = sent_before as f64 / steady.as_secs_f64();
        let after_rate = sent_after as f64 / secs;
        eprintln!(
            "{what}: syncs back after {back:?}; admitted per user in the {secs} s after {admitted:?} (bound \
             {most:.0}, offered at least {offered_most}); syncs {before_rate:.1}/s before, {after_rate:.1}/s after"
        );
        // Offered enough that a flood would go over the bound (1.2 ×: a busy machine sends fewer
        // while the restart's outage, and so the fallback's term of the bound, grows).
        assert!(
            offered_most as f64 > 1.2 * most,
            "{what}: only {offered_most} requests offered per user in {secs} s: too few for a flood to show \
             over the bound {most:.0}"
        );
        for (user, admitted) in users.iter().zip(&admitted) {
            assert!(
                (*admitted as f64) <= most,
                "{what}: {user} admitted {admitted} in the {secs} s after Redis was emptied; the bound is \
                 {most:.0} (a new bucket's burst and refill, the lease held, the fallback while syncs failed); \
                 {stats:?}"
            );
        }
        // The sync rate does not spike: new buckets and new leases, the same syncs as before.
        assert!(
            after_rate <= 1.5 * before_rate + 2.0,
            "{what}: {after_rate:.1} syncs/s after Redis was emptied, {before_rate:.1}/s before (at most 1.5 × \
             before + 2); {stats:?}"
        );
    }
    assert!(!log.contains("panicked"), "the service panicked:\n{log}");
}
