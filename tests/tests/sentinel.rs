//! The counter service through Redis Sentinel (`--redis-sentinel`): three sentinels (Debian's
//! `redis-server --sentinel`, quorum 2, a primary down after 1 s of silence) watch a primary with one
//! replica; the service finds the primary through them, and when the primary is killed it asks them
//! again and follows the promoted replica by itself.
//!
//! - The service alone: syncs sent one after another across the kill answer 200 or 503, then 200 again,
//!   counted on the promoted replica.
//! - Under load at the edge, as `failover.rs` does it for Redis Cluster: two Envoys with the filter
//!   (cached rules per user, a strict one), open-loop load through both, the primary SIGKILLed. No
//!   request fails but by policy (200 or 429), syncs resume on both proxies, what their fallbacks admitted
//!   is debited on the promoted replica, and each user admits no more than the global limit plus the debt
//!   not yet repaid. How long anything took is printed, never asserted; the figures: RELIABILITY.md,
//!   "Redis Sentinel failover".

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::envoy::{latency_quantile, offer_until, Arrivals, Envoy, Sustained};
use sluice_tests::eventually;
use sluice_tests::redis::{query, Redis, Reply, Sentinel};
use sluice_tests::service::{Service, ServiceOptions};

#[path = "support/failover_fleet.rs"]
mod failover_fleet;
use failover_fleet::*;

/// A primary with one replica in sync, watched by three sentinels that see the replica.
struct Watched {
    /// The name the sentinels monitor the primary under: one per test, so that a sentinel of a test
    /// running beside it can never pass for one of this test's (it would not know the name).
    name: &'static str,
    primary: Redis,
    replica: Redis,
    sentinels: Vec<Sentinel>,
}

impl Watched {
    fn start(name: &'static str) -> Watched {
        let primary = Redis::start().unwrap();
        let primary_port = primary.port().to_string();
        let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary_port]).unwrap();
        assert!(
            eventually(Duration::from_secs(20), || replica
                .text(&["INFO", "replication"])
                .is_ok_and(|info| info.contains("master_link_status:up"))),
            "the replica did not sync with its primary within 20 s"
        );
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start(name, primary.port(), 2, 1000).unwrap())
            .collect();
        assert!(
            eventually(Duration::from_secs(20), || sentinels.iter().all(|s| {
                query(s.port(), &["SENTINEL", "REPLICAS", name])
                    .is_ok_and(|reply| matches!(reply, Reply::Array(r) if !r.is_empty()))
            })),
            "the sentinels did not see the replica within 20 s"
        );
        Watched {
            name,
            primary,
            replica,
            sentinels,
        }
    }

    /// The counter service, given the sentinels, with a Redis timeout of `timeout_ms`.
    fn service(&self, timeout_ms: u64) -> Service {
        let urls: Vec<String> = self.sentinels.iter().map(Sentinel::url).collect();
        Service::start_with(
            ServiceOptions::new(urls.join(","))
                .arg("--redis-sentinel")
                .arg(self.name)
                .arg("--redis-timeout-ms")
                .arg(timeout_ms.to_string()),
        )
        .unwrap()
    }

    /// Whether the sentinels name the replica as the primary now, and it says it is one.
    fn replica_promoted(&self) -> bool {
        self.sentinels[0].primary_port(self.name) == Some(self.replica.port())
            && self
                .replica
                .text(&["INFO", "replication"])
                .is_ok_and(|info| info.contains("role:master"))
    }

    /// Every sentinel's log, for a failure message.
    fn sentinel_logs(&self) -> String {
        self.sentinels
            .iter()
            .map(Sentinel::log)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn direct_sync_body(key: &str) -> String {
    json!({"proxy": "p1", "interval_ms": 100, "entries": [
        {"key": key, "limits": [{"requests": 1000, "period_ms": 1000, "burst": 1000}], "spent": 1, "denied": 0}]})
    .to_string()
}

#[test]
fn the_service_follows_a_sentinel_failover() {
    let mut watched = Watched::start("sluice-direct");
    let service = watched.service(500);
    let reply = service
        .post("/v1/sync", &direct_sync_body("before"))
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}\n{}", service.log());
    assert!(
        watched.primary.command_calls("evalsha").unwrap() > 0,
        "the primary answered"
    );

    watched.primary.stop();
    // Sync until the service answers from the promoted replica: only 200s and 503s meanwhile.
    let (mut ok, mut unavailable) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "no failover followed within 60 s: {ok} ok, {unavailable} 503\n{}\n{}",
            service.log(),
            watched.sentinel_logs()
        );
        let reply = service
            .post("/v1/sync", &direct_sync_body("after"))
            .unwrap();
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
    assert!(watched.replica_promoted(), "{}", watched.sentinel_logs());
    let keys = watched.replica.query(&["KEYS", "sluice:*after*"]).unwrap();
    assert!(
        matches!(&keys, Reply::Array(k) if !k.is_empty()),
        "the sync after the failover was counted on the promoted replica: {keys:?}"
    );
    assert!(service
        .log()
        .contains("asking the sentinels for the primary again"));
}

const PROXIES: usize = 2;
const USERS: usize = 3;
/// Each user's requests per second through each proxy: 100/s a user in all, five times the global limit,
/// and over each proxy's fallback.
const USER_RATE_PER_PROXY: f64 = 50.0;
/// The strict user's requests per second through each proxy (its limit 100/s, its fallback 5/s).
const STRICT_RATE_PER_PROXY: f64 = 15.0;

/// The bucket's stored tokens (negative: debt), or `None` when the key is not there.
fn stored_tokens(node: &Redis, user: &str) -> Option<f64> {
    node.text(&["HGET", &bucket_key(user), "tokens"])
        .ok()?
        .parse()
        .ok()
}

/// The lowest stored tokens of each user's bucket on `node`, read every 25 ms for `over`.
fn lowest_tokens_over(node: &Redis, users: &[String], over: Duration) -> Vec<f64> {
    let mut lowest = vec![f64::INFINITY; users.len()];
    let until = Instant::now() + over;
    while Instant::now() < until {
        for (lowest, user) in lowest.iter_mut().zip(users) {
            if let Some(tokens) = stored_tokens(node, user) {
                *lowest = lowest.min(tokens);
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    lowest
}

/// Every answer was 200 or 429: no transport error, no 5xx. (How long they took is printed, not asserted.)
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
    }
}

/// Sets its flag when dropped, on the way out of a scope that failed too.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What happened around the kill, as the test saw it.
struct Outage {
    killed: Instant,
    /// When the sentinels named the replica and it said it was the primary.
    promoted: Option<Instant>,
    /// When both proxies had synced again (three good syncs past the promotion, the breaker closed).
    recovered: Option<Instant>,
    /// Per proxy: its syncs that failed from just before the kill to recovery.
    failed_syncs: Vec<u64>,
    /// Per proxy: whether its breaker was seen open after the promotion.
    breaker_opened: Vec<bool>,
}

#[cfg_attr(not(feature = "envoy"), ignore = "needs Envoy: --features envoy")]
#[test]
fn a_primary_killed_under_load_through_two_envoys_costs_the_edge_nothing() {
    let mut watched = Watched::start("sluice-edge");
    let service = watched.service(TIMEOUT_MS);
    // Started on this thread: an Envoy dies with the thread that started it.
    let proxies: Vec<Envoy> = (0..PROXIES).map(|_| start_envoy(&service)).collect();
    let users: Vec<String> = (0..USERS).map(|i| format!("u{i}")).collect();
    // Open loop, bounded: at most 60 s of arrivals (the test stops them about 12 s in).
    let most_time = Duration::from_secs(60);
    let mut offered: Vec<Arrivals> = Vec::new();
    for envoy in &proxies {
        for user in &users {
            offered.push(Arrivals {
                headers: vec![("x-user".to_owned(), user.clone())],
                ..Arrivals::new(envoy.url("/api/x"), USER_RATE_PER_PROXY, most_time)
            });
        }
        offered.push(Arrivals {
            headers: vec![("x-user".to_owned(), "strict-user".to_owned())],
            ..Arrivals::new(envoy.url("/strict/x"), STRICT_RATE_PER_PROXY, most_time)
        });
    }
    let stat = |envoy: &Envoy, name: &str| envoy.stat(&format!("wasmcustom.sluice.{name}"));
    let stat_each = |name: &str| -> Vec<u64> { proxies.iter().map(|e| stat(e, name)).collect() };
    let steady = Duration::from_secs(3);
    // After recovery: long enough for the debt to show and to be partly repaid.
    let after = Duration::from_secs(5);
    let stop = AtomicBool::new(false);

    let mut control_tokens = Vec::new();
    let mut lowest_tokens = Vec::new();
    let (runs, started, synced, outage) = std::thread::scope(|scope| {
        let threads: Vec<_> = offered
            .iter()
            .map(|arrivals| scope.spawn(|| offer_until(arrivals, &stop)))
            .collect();
        let started = Instant::now();
        // A failed step below stops the load at once rather than after its 60 s.
        let _stop = StopOnDrop(&stop);
        let synced = eventually(Duration::from_secs(10), || {
            stat_each("sync.ok").iter().all(|&ok| ok > 0)
        });
        std::thread::sleep(steady);
        // The control: the lowest tokens per user in steady state, over 1 s before the kill.
        control_tokens = lowest_tokens_over(&watched.primary, &users, Duration::from_secs(1));
        let failed_before = stat_each("sync.failed");
        watched.primary.stop();
        let killed = Instant::now();
        let promoted =
            eventually(Duration::from_secs(30), || watched.replica_promoted()).then(Instant::now);
        let ok_at_promotion = stat_each("sync.ok");
        let mut breaker_opened = vec![false; PROXIES];
        let recovered = eventually(Duration::from_secs(20), || {
            let open = stat_each("breaker.open");
            for (opened, open) in breaker_opened.iter_mut().zip(&open) {
                *opened |= *open == 1;
            }
            let ok = stat_each("sync.ok");
            ok.iter()
                .zip(&ok_at_promotion)
                .all(|(now, then)| *now > then + 2)
                && open.iter().all(|&o| o == 0)
        })
        .then(Instant::now);
        let failed_syncs = stat_each("sync.failed")
            .iter()
            .zip(&failed_before)
            .map(|(now, then)| now - then)
            .collect();
        // The fallbacks' spend arrives with the first syncs after recovery: the buckets, on the
        // promoted replica now, go into debt. The lowest tokens seen per user over the next 1.5 s.
        lowest_tokens = lowest_tokens_over(&watched.replica, &users, Duration::from_millis(1500));
        std::thread::sleep(after.saturating_sub(Duration::from_millis(1500)));
        stop.store(true, Ordering::Relaxed);
        let runs: Vec<Sustained> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let outage = Outage {
            killed,
            promoted,
            recovered,
            failed_syncs,
            breaker_opened,
        };
        (runs, started, synced, outage)
    });
    let stats: Vec<_> = proxies.iter().map(Envoy::sluice_stats).collect();
    let log = service.log();
    let all: Vec<&Sustained> = runs.iter().collect();
    // Per proxy: one run per user, then the strict user's.
    let runs_of = |user: usize| -> Vec<&Sustained> {
        (0..PROXIES)
            .map(|p| &runs[p * (USERS + 1) + user])
            .collect()
    };
    let strict = runs_of(USERS);

    assert!(
        synced,
        "not every proxy synced before the kill; {stats:?}\n{log}"
    );
    let promoted = outage.promoted.unwrap_or_else(|| {
        panic!(
            "the sentinels did not promote the replica within 30 s\n{}",
            watched.sentinel_logs()
        )
    });
    let recovered = outage.recovered.unwrap_or_else(|| {
        panic!(
            "syncs did not succeed again on both proxies (or a breaker stayed open) within 20 s of the \
             promotion; {stats:?}\n{log}"
        )
    });
    let killed = outage.killed;
    let ended = runs.iter().map(|r| r.started + r.elapsed).max().unwrap();
    let elapsed = (ended - started).as_secs_f64();
    let sent: usize = runs.iter().map(|r| r.samples.len()).sum();
    let before = (killed - Duration::from_secs(2), killed);
    let during = (killed, recovered);
    let after_window = (recovered, recovered + Duration::from_secs(2));
    let q = |w: (Instant, Instant), q| latency_quantile(&all, w.0, w.1, q);
    let edge = |w: (Instant, Instant), status| -> usize {
        all.iter().map(|r| r.count_between(status, w.0, w.1)).sum()
    };
    let checks_failed = stat_each("check.failed");
    let strict_during = |status| -> usize {
        strict
            .iter()
            .map(|r| r.count_between(status, killed, recovered))
            .sum()
    };
    let slowest = all
        .iter()
        .filter_map(|r| r.slowest())
        .map(|(latency, _)| latency)
        .max()
        .unwrap_or_default();
    eprintln!(
        "{sent} requests in {elapsed:.1} s ({:.0}/s offered) through {PROXIES} proxies; primary killed \
         {:.1} s in; the replica promoted after {:?}, syncs back on both proxies after {:?} (failed syncs per \
         proxy {:?}, breaker opened {:?}); edge p50/p99 before {:?}/{:?}, during {:?}/{:?}, after {:?}/{:?}, \
         slowest {slowest:?}; 200/429 before {}/{}, during {}/{}; the strict user during the outage 200/429 {}/{} \
         (its fallback: 5/s, burst 5, per proxy), its failed checks per proxy {checks_failed:?}",
        sent as f64 / elapsed,
        (killed - started).as_secs_f64(),
        promoted - killed,
        recovered - killed,
        outage.failed_syncs,
        outage.breaker_opened,
        q(before, 0.5),
        q(before, 0.99),
        q(during, 0.5),
        q(during, 0.99),
        q(after_window, 0.5),
        q(after_window, 0.99),
        edge(before, 200),
        edge(before, 429),
        edge(during, 200),
        edge(during, 429),
        strict_during(200),
        strict_during(429),
    );

    assert_edge_unharmed(&all, "load across the Sentinel failover");
    for (i, failed) in outage.failed_syncs.iter().enumerate() {
        assert!(
            *failed > 0,
            "proxy {i}: no sync failed while the primary was dead: it never had to fall back; {:?}",
            stats[i]
        );
    }
    assert!(
        strict.iter().all(|r| r.count(200) > 0) && checks_failed.iter().all(|&f| f > 0),
        "the strict rule's checks must have failed (and fallen back) on both proxies: {:?}; {stats:?}",
        strict.iter().map(|r| r.statuses()).collect::<Vec<_>>()
    );

    // The service followed the new primary: it said so, and ran its scripts there.
    assert!(
        log.contains("asking the sentinels for the primary again"),
        "the service never asked the sentinels again:\n{log}"
    );
    assert!(
        watched.replica.command_calls("evalsha").unwrap() > 0,
        "the promoted replica ran none of the service's scripts"
    );

    // Reconciled, as in `failover.rs`: what the fallbacks admitted while syncs failed was reported after
    // recovery and debited from the global bucket (on the promoted replica), so over the whole run each user
    // admits no more than the global limit allows (burst + rate × (t + 1.5 intervals), and the bounded leases
    // of the last interval, not yet reported), plus each proxy's fallback burst, plus the debt still owed at
    // the end (read from the promoted replica).
    let interval = INTERVAL_MS as f64 / 1000.0;
    let lease = BURST + RATE * 1.5 * interval;
    let mut fallback_excess = Vec::new();
    for (u, user) in users.iter().enumerate() {
        let user_runs = runs_of(u);
        let debt = stored_tokens(&watched.replica, user).map_or(0.0, |t| (-t).max(0.0));
        let admitted: usize = user_runs.iter().map(|r| r.count(200)).sum();
        let admitted = admitted as f64;
        let most = BURST
            + RATE * (elapsed + 1.5 * interval)
            + debt
            + lease
            + PROXIES as f64 * FALLBACK_BURST;
        let least = 0.6 * RATE * elapsed;
        // What the fallbacks admitted beyond the global limit during the outage: what an undebited
        // fallback would add to the count. It must dwarf the slack above for the check to mean anything.
        let during: usize = user_runs
            .iter()
            .map(|r| r.count_between(200, killed, recovered))
            .sum();
        let during = during as f64;
        let allowed_during = BURST + RATE * (recovered - killed).as_secs_f64();
        fallback_excess.push(during - allowed_during);
        eprintln!(
            "{user}: admitted {admitted} in {elapsed:.1} s (bounds {least:.0}..={most:.0}, debt at the end \
             {debt:.1}); during the outage {during} (the global limit: {allowed_during:.0}; the fallbacks: at \
             most {:.0})",
            PROXIES as f64 * (FALLBACK_BURST + FALLBACK_RATE * (recovered - killed).as_secs_f64())
        );
        assert!(
            admitted <= most,
            "{user}: {admitted} admitted in {elapsed:.1} s, more than the global limit allows ({most:.0} with \
             the {debt:.1} still owed): the fallbacks' spend was not debited; {stats:?}"
        );
        assert!(
            admitted >= least,
            "{user}: only {admitted} admitted in {elapsed:.1} s (at least {least:.0}): starved; {stats:?}"
        );
    }
    let mean_excess = fallback_excess.iter().sum::<f64>() / fallback_excess.len() as f64;
    assert!(
        mean_excess > PROXIES as f64 * FALLBACK_BURST,
        "the fallbacks admitted only {mean_excess:.0} beyond the global limit on average during the outage \
         ({PROXIES} × {FALLBACK_RATE}/s vs {RATE}/s): too little for the debt to show"
    );
    // Counted on the promoted replica: after recovery each user's bucket there went into debt (what the
    // fallbacks admitted beyond the limit, reported and debited), deeper than on the primary before the kill
    // by at least half the excess. A fallback not reported, or a service still writing to the dead primary,
    // leaves the bucket about where it was.
    eprintln!(
        "lowest tokens per user in the 1 s before the kill (primary) {control_tokens:.1?}, in the 1.5 s after \
         recovery (promoted replica) {lowest_tokens:.1?}"
    );
    for ((user, before), after) in users.iter().zip(&control_tokens).zip(&lowest_tokens) {
        assert!(
            *after < before - mean_excess / 2.0,
            "{user}'s bucket went to {after:.1} tokens on the promoted replica after recovery, {before:.1} on the \
             primary before the kill: the fallbacks' spend (about {mean_excess:.0} beyond the limit) was not \
             debited there; {stats:?}"
        );
    }
    assert!(!log.contains("panicked"), "the service panicked:\n{log}");
}
