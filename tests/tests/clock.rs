//! Clock trouble. A proxy decides its local buckets, when a lease lapses, its fallback's
//! UTC-aligned windows, its breaker and its sync schedule on its own clock; the counter service
//! decides global state on Redis's (`TIME`), and nothing on the wire carries a time. Here harness
//! proxies (the real filter in wasmtime, each on its own virtual clock) share one cached limit
//! through the real counter service and a real Redis, their clocks skewed by seconds against
//! Redis's and each other's, one jumping forward and one back mid-run; what the fleet admitted is
//! held to README's bound, computed from the configuration, the injected jumps and when each
//! proxy was seen to hold a lease. Local rules run on a jumping virtual clock alone.
//!
//! The short versions run in `make test`; `make test-clock` adds the long ones
//! (`cargo test -p sluice-tests --features wasm,redis --test clock -- --include-ignored`).

use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_core::protocol::SyncResponse;
use sluice_core::{limit::calendar, Limit, LimitState, Period};
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec, VirtualClock,
};
use sluice_tests::redis::Redis;
use sluice_tests::service::Service;

#[path = "support/bridge.rs"]
mod bridge;
use bridge::{Bridge, Rng};

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| FilterModule::load(filter_wasm_path()).expect("build the filter first"))
}

/// The fleet runs play in real time (Redis's clock is the machine's): one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// `at` moved by `us` microseconds, either way.
fn shifted(at: SystemTime, us: i64) -> SystemTime {
    if us >= 0 {
        at + Duration::from_micros(us as u64)
    } else {
        at - Duration::from_micros(us.unsigned_abs())
    }
}

fn epoch_us(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Admitted (the filter let the request through) or not.
fn admitted(proxy: &Proxy, worker: usize) -> bool {
    let exchange = proxy
        .worker(worker)
        .request(RequestSpec::get("/").from("192.0.2.1:1000"))
        .expect("a request");
    let continued = matches!(
        exchange.state().expect("a state"),
        ExchangeState::Continued { .. }
    );
    if continued {
        let _ = exchange.respond(200, &[]);
    }
    let _ = exchange.finish();
    proxy.forget_finished();
    continued
}

// ---- Local rules on a jumping clock ------------------------------------------------------------

/// What one local rule admitted on a clock that ran 20 s, jumping +60 s at 5 s and -30 s at 10 s.
struct LocalRun {
    admitted: u64,
    /// Admitted in the 10 s after the step back.
    after_back: u64,
    /// Windows of `period` the proxy's clock entered (a window entered again counts again).
    windows_entered: u64,
}

const REAL_S: u64 = 20;
const FORWARD_S: u64 = 60;
const BACK_S: u64 = 30;

fn run_local(limit: &str, period: Period) -> LocalRun {
    let config =
        format!(r#"{{"rules": [{{"name": "local", "key": ["const:all"], "limits": [{limit}]}}]}}"#);
    let clock = VirtualClock::new();
    let proxy = Proxy::new(
        module(),
        ProxyOptions {
            workers: 2,
            clock: clock.clone(),
            ..ProxyOptions::new(config)
        },
    )
    .expect("the proxy starts");
    let step = Duration::from_millis(10);
    let steps = REAL_S * 100;
    let (mut total, mut after_back, mut entered) = (0, 0, 0);
    let mut last_window = None;
    for i in 0..steps {
        if i == 500 {
            clock.jump(clock.now() + Duration::from_secs(FORWARD_S));
        }
        if i == 1_000 {
            clock.jump(clock.now() - Duration::from_secs(BACK_S));
        }
        // 200 requests a second offered, far above the limits: every token is asked for.
        for worker in 0..2 {
            let window = calendar::start_us(period, epoch_us(clock.now()));
            if last_window != Some(window) {
                entered += 1;
                last_window = Some(window);
            }
            if admitted(&proxy, worker) {
                total += 1;
                if i >= 1_000 {
                    after_back += 1;
                }
            }
        }
        proxy.advance(step).expect("timers run");
    }
    LocalRun {
        admitted: total,
        after_back,
        windows_entered: entered,
    }
}

/// A token bucket (and GCRA) admits at most `burst + rate × real time`, plus one more burst
/// for the jump forward (its refill is capped at the burst); after the step back it goes on at
/// its rate instead of refusing until the clock is back where it was.
#[test]
fn local_buckets_on_a_jumping_clock_admit_burst_plus_rate_times_elapsed() {
    let (rate, burst) = (10u64, 5u64);
    for algorithm in ["token_bucket", "gcra"] {
        let limit = format!(
            r#"{{"requests": {rate}, "per": "second", "burst": {burst}, "algorithm": "{algorithm}"}}"#
        );
        let run = run_local(&limit, Period::Second);
        let bound = burst + rate * REAL_S + burst.min(rate * FORWARD_S);
        let after_floor = rate * (REAL_S - 10) - 2;
        eprintln!(
            "{algorithm}: admitted {} (bound {bound}), {} in the 10 s after the step back (at least {after_floor})",
            run.admitted, run.after_back
        );
        assert!(
            run.admitted <= bound,
            "{algorithm}: {} > {bound}",
            run.admitted
        );
        assert!(
            run.after_back >= after_floor,
            "{algorithm}: {} admitted after a 30 s step back, expected about {}: it waited for the clock",
            run.after_back,
            rate * 10
        );
    }
}

/// A fixed window follows the proxy's clock: at most `requests` in every window its clock
/// entered, a window entered again (after the step back) included, and every one of them filled.
#[test]
fn a_local_fixed_window_on_a_jumping_clock_admits_requests_per_window_entered() {
    let requests = 20u64;
    let run = run_local(
        &format!(r#"{{"requests": {requests}, "per": "second", "algorithm": "fixed_window"}}"#),
        Period::Second,
    );
    let bound = requests * run.windows_entered;
    eprintln!(
        "fixed_window: admitted {} in {} windows entered (bound {bound})",
        run.admitted, run.windows_entered
    );
    // 20 windows: 5, 5 after the jump forward, 10 after the step back (two of them again).
    assert!(run.windows_entered >= REAL_S, "{}", run.windows_entered);
    assert!(run.admitted <= bound, "{} > {bound}", run.admitted);
    assert!(
        run.admitted >= requests * (run.windows_entered - 2),
        "{} admitted: windows left unfilled",
        run.admitted
    );
}

// ---- A fleet on skewed and jumping clocks, the real service and Redis ------------------------

/// A proxy's clock stepped by `by_ms` at `at_ms` into the run.
#[derive(Clone, Copy)]
struct Jump {
    at_ms: u64,
    proxy: usize,
    by_ms: i64,
}

struct Scenario {
    seconds: u64,
    /// Each proxy's clock against the machine's (Redis's), in milliseconds.
    offsets_ms: Vec<i64>,
    jumps: Vec<Jump>,
    /// Requests offered per second, split evenly between the proxies.
    offered: f64,
}

/// The cached limit: 200 a second, bursts of 50, synced every 100 ms; a fallback of a
/// proxy's share (200 / proxies a second, 50 / proxies at once).
const RATE: u64 = 200;
const BURST: u64 = 50;
const INTERVAL_MS: u64 = 100;

fn fleet_config(token: &str, proxies: u64) -> String {
    format!(
        r#"{{"service": {{"cluster": "sluice_service", "token": "{token}", "timeout_ms": 1000,
             "sync_interval_ms": {INTERVAL_MS}}},
           "rules": [{{"name": "shared", "key": ["const:all"], "consistency": "cached",
             "limits": [{{"requests": {RATE}, "per": "second", "burst": {BURST}}}],
             "fallback": {{"policy": "fail_open",
               "limits": [{{"requests": {}, "per": "second", "burst": {}}}]}}}}]}}"#,
        RATE / proxies,
        BURST / proxies
    )
}

/// A lease as the proxy received it: when (µs into the run), the proxy's offset then, its TTL.
#[derive(Clone, Copy)]
struct Issued {
    at_us: u64,
    offset_us: i64,
    ttl_us: u64,
}

#[derive(Default)]
struct ProxyLog {
    arrivals: u64,
    /// When each admitted request came, µs into the run.
    admitted_us: Vec<u64>,
    leases: Vec<Issued>,
    /// Tokens of every lease, in order.
    granted: Vec<u64>,
    /// Sync answers that were not a lease (an error status, an unreadable body).
    failures_us: Vec<u64>,
    /// (µs into the run, offset from then on) — the first is the initial offset.
    offsets: Vec<(u64, i64)>,
}

impl ProxyLog {
    fn offset_at(&self, t_us: u64) -> i64 {
        self.offsets
            .iter()
            .take_while(|(from, _)| *from <= t_us)
            .last()
            .map_or(0, |(_, o)| *o)
    }
}

struct FleetRun {
    logs: Vec<ProxyLog>,
    /// When the run started on the machine's (Redis's) clock, µs since the epoch.
    start_epoch_us: u64,
    first_us: u64,
    last_us: u64,
    /// What one exact token bucket admits over the same arrivals.
    exact: u64,
    sync_timeouts: u64,
}

/// Poisson arrivals: (µs into the run, proxy).
fn arrivals(s: &Scenario, seed: u64) -> Vec<(u64, usize)> {
    let mut rng = Rng(seed);
    let per_proxy = s.offered / s.offsets_ms.len() as f64;
    let mut all = Vec::new();
    for proxy in 0..s.offsets_ms.len() {
        let mut t = 0.0;
        loop {
            t += -(1.0 - rng.next_f64()).ln() / per_proxy;
            if t >= s.seconds as f64 {
                break;
            }
            all.push(((t * 1e6) as u64, proxy));
        }
    }
    all.sort();
    all
}

fn run_fleet(s: &Scenario, config: fn(&str, u64) -> String) -> FleetRun {
    let redis = Redis::start().expect("redis-server starts");
    let service = Service::start(&redis.url()).expect("the counter service starts");
    let n = s.offsets_ms.len();
    let real_start = SystemTime::now();
    let clocks: Vec<Arc<VirtualClock>> = s
        .offsets_ms
        .iter()
        .map(|o| VirtualClock::starting_at(shifted(real_start, o * 1_000)))
        .collect();
    let proxies: Vec<Proxy> = (0..n)
        .map(|i| {
            Proxy::new(
                module(),
                ProxyOptions {
                    workers: 2,
                    clock: clocks[i].clone(),
                    seed: i as u64 + 1,
                    ..ProxyOptions::new(config(service.token(), n as u64))
                },
            )
            .expect("a proxy starts")
        })
        .collect();
    let mut logs: Vec<ProxyLog> = s
        .offsets_ms
        .iter()
        .map(|o| ProxyLog {
            offsets: vec![(0, o * 1_000)],
            ..ProxyLog::default()
        })
        .collect();

    // Callouts go to the service on a few threads, so a slow answer never stalls arrivals.
    let mut bridge = Bridge::new(&service.url(), service.token(), 3, Duration::from_secs(2));

    let start = Instant::now();
    let since_start = |at: Instant| at.duration_since(start).as_micros() as u64;
    let mut offsets_us: Vec<i64> = s.offsets_ms.iter().map(|o| o * 1_000).collect();
    let mut jumps = s.jumps.clone();
    jumps.sort_by_key(|j| j.at_ms);
    let mut jumps = jumps.into_iter().peekable();

    let mut pump = |logs: &mut Vec<ProxyLog>, offsets_us: &mut Vec<i64>| {
        let now = Instant::now();
        let real = SystemTime::now();
        let t = since_start(now);
        while let Some(j) = jumps.next_if(|j| j.at_ms * 1_000 <= t) {
            offsets_us[j.proxy] += j.by_ms * 1_000;
            clocks[j.proxy].jump(shifted(real, offsets_us[j.proxy]));
            logs[j.proxy].offsets.push((t, offsets_us[j.proxy]));
        }
        for i in 0..proxies.len() {
            // Between jumps a proxy's clock runs with the machine's, at its offset.
            let target = shifted(real, offsets_us[i]);
            if let Ok(ahead) = target.duration_since(clocks[i].now()) {
                clocks[i].advance(ahead);
            }
        }
        // Answers are applied at the time the proxies' clocks were just set to: a lease's
        // expiry is reckoned from it.
        let mut observe = |a: &bridge::Answer, delivered: bool| {
            if a.path != "/v1/sync" {
                return;
            }
            let lease = (a.status == 200)
                .then(|| serde_json::from_slice::<SyncResponse>(&a.body).ok())
                .flatten()
                .and_then(|r| r.grants.into_iter().find(|g| g.refused.is_none()));
            match lease {
                Some(g) if delivered => {
                    logs[a.proxy].granted.push(g.tokens);
                    logs[a.proxy].leases.push(Issued {
                        at_us: t,
                        offset_us: offsets_us[a.proxy],
                        ttl_us: g.ttl_ms * 1_000,
                    });
                }
                // An answer that granted nothing for the key (a batch without it) changes
                // nothing; one that failed counts against the breaker.
                None if a.status == 200 && delivered => {}
                _ => logs[a.proxy].failures_us.push(t),
            }
        };
        bridge
            .pump_observed(&proxies, &|| {}, &mut observe)
            .expect("timers run");
    };

    let arrivals = arrivals(s, 7);
    let limit = Limit::new(RATE, Period::Second, Some(BURST)).expect("a limit");
    let mut exact_bucket: Option<LimitState> = None;
    let mut exact = 0;
    let mut next_worker = vec![0usize; n];
    let (mut first_us, mut last_us) = (None, 0);
    for (at_us, proxy) in &arrivals {
        let due = start + Duration::from_micros(*at_us);
        while Instant::now() < due {
            pump(&mut logs, &mut offsets_us);
            thread::sleep(
                due.saturating_duration_since(Instant::now())
                    .min(Duration::from_micros(500)),
            );
        }
        pump(&mut logs, &mut offsets_us);
        // The exact limiter sees each arrival when the filter saw it, on the machine's clock.
        let t = since_start(Instant::now());
        first_us.get_or_insert(t);
        last_us = t;
        let bucket = exact_bucket.unwrap_or_else(|| LimitState::full(&limit, t));
        let (verdict, next) = bucket.take(&limit, t, 1);
        exact_bucket = Some(next);
        exact += verdict.allowed as u64;
        let worker = next_worker[*proxy];
        next_worker[*proxy] = (worker + 1) % 2;
        logs[*proxy].arrivals += 1;
        if admitted(&proxies[*proxy], worker) {
            logs[*proxy].admitted_us.push(t);
        }
    }
    bridge.finish();
    let sync_timeouts = proxies
        .iter()
        .map(|p| p.metric("sluice.sync.timeout").unwrap_or(0))
        .sum();
    FleetRun {
        logs,
        start_epoch_us: epoch_us(real_start),
        first_us: first_us.unwrap_or(0),
        last_us,
        exact,
        sync_timeouts,
    }
}

/// The stretches (µs into the run, from and until) in which a proxy held no valid lease: before
/// its first, after one lapsed on its clock (as a jump forward makes it), after a failed sync
/// until the next lease. From when the test delivered each lease, its TTL and the proxy's offset
/// at each moment, by the millisecond.
fn without_lease(log: &ProxyLog, from_us: u64, to_us: u64) -> Vec<(u64, u64)> {
    let mut stretches = Vec::new();
    let mut stretch: Option<u64> = None;
    let mut t = from_us;
    while t <= to_us {
        let lease = log.leases.iter().rev().find(|l| l.at_us <= t);
        let failed_since = log
            .failures_us
            .iter()
            .any(|&f| f <= t && lease.is_none_or(|l| f > l.at_us));
        let valid = !failed_since
            && lease.is_some_and(|l| {
                (t as i64 + log.offset_at(t)) < (l.at_us + l.ttl_us) as i64 + l.offset_us
            });
        match (valid, stretch) {
            (false, None) => stretch = Some(t),
            (true, Some(from)) => {
                stretches.push((from, t));
                stretch = None;
            }
            _ => {}
        }
        t += 1_000;
    }
    if let Some(from) = stretch {
        stretches.push((from, to_us));
    }
    stretches
}

/// What a proxy may admit from its token-bucket fallback: over every stretch without a lease,
/// the fallback's burst (once more for each jump forward in it: its refill is capped at the
/// burst) and its rate over the stretch.
fn fallback_allowance(log: &ProxyLog, from_us: u64, to_us: u64, burst: f64, rate: f64) -> f64 {
    without_lease(log, from_us, to_us)
        .into_iter()
        .map(|(from, until)| {
            let forward = log
                .offsets
                .windows(2)
                .filter(|w| w[1].1 > w[0].1 && w[1].0 + 1_000 >= from && w[1].0 <= until)
                .count() as f64;
            burst * (1.0 + forward) + rate * (until - from) as f64 / 1e6
        })
        .sum()
}

fn check_fleet(s: &Scenario) {
    let _serial = serial();
    let n = s.offsets_ms.len() as u64;
    let run = run_fleet(s, fleet_config);
    let admitted: u64 = run.logs.iter().map(|l| l.admitted_us.len() as u64).sum();
    let requests: u64 = run.logs.iter().map(|l| l.arrivals).sum();
    let elapsed_s = (run.last_us - run.first_us) as f64 / 1e6;
    let (fb_rate, fb_burst) = ((RATE / n) as f64, (BURST / n) as f64);
    let fallback: Vec<f64> = run
        .logs
        .iter()
        .map(|l| fallback_allowance(l, run.first_us, run.last_us, fb_burst, fb_rate))
        .collect();
    let steady = BURST as f64 + RATE as f64 * (elapsed_s + 1.5 * INTERVAL_MS as f64 / 1e3);
    let bound = steady + fallback.iter().sum::<f64>();
    eprintln!(
        "{n} proxies, offsets {:?} ms, jumps {:?}: {requests} requests over {elapsed_s:.2} s, \
         exact {}, fleet {admitted}, bound {bound:.0} (burst + rate x (t + 1.5 intervals) = {steady:.0}, \
         fallback allowance per proxy {:?}), per proxy {:?}, leases {:?}, sync failures {:?}, timeouts {}",
        s.offsets_ms,
        s.jumps
            .iter()
            .map(|j| (j.at_ms, j.proxy, j.by_ms))
            .collect::<Vec<_>>(),
        run.exact,
        fallback.iter().map(|f| f.round()).collect::<Vec<_>>(),
        run.logs
            .iter()
            .map(|l| l.admitted_us.len())
            .collect::<Vec<_>>(),
        run.logs.iter().map(|l| l.leases.len()).collect::<Vec<_>>(),
        run.logs
            .iter()
            .map(|l| l.failures_us.len())
            .collect::<Vec<_>>(),
        run.sync_timeouts
    );
    for (i, log) in run.logs.iter().enumerate() {
        let mut per_second = vec![0u64; s.seconds as usize + 2];
        for &t in &log.admitted_us {
            per_second[(t / 1_000_000) as usize] += 1;
        }
        let mut leases = vec![0u64; s.seconds as usize + 2];
        for l in &log.leases {
            leases[(l.at_us / 1_000_000) as usize] += 1;
        }
        eprintln!("  proxy {i}: admitted per second {per_second:?}, leases per second {leases:?}");
    }
    assert!(
        admitted as f64 <= bound,
        "the fleet admitted {admitted}, over the bound {bound:.0}"
    );
    assert!(
        admitted as f64 >= 0.75 * run.exact as f64,
        "the fleet admitted {admitted}, far under the exact {}",
        run.exact
    );
    // A proxy whose clock stepped back keeps syncing (it does not wait for its clock to be
    // back where it was): leases keep coming in the two seconds after the step, one an
    // interval, give or take (hurried syncs bring more). Before the fix it got none for
    // seconds. Leases, not admissions: how the fleet shares the limit between proxies varies
    // from run to run.
    for j in s.jumps.iter().filter(|j| j.by_ms < 0) {
        let from = j.at_ms * 1_000;
        let until = (from + 2_000_000).min(run.last_us);
        let leases = run.logs[j.proxy]
            .leases
            .iter()
            .filter(|l| l.at_us >= from && l.at_us < until)
            .count() as u64;
        let floor = (until - from) / 1_000 / INTERVAL_MS / 4;
        assert!(
            leases >= floor,
            "proxy {} got {leases} leases in the {:.1} s after its clock stepped back {} s (at least {floor})",
            j.proxy,
            (until - from) as f64 / 1e6,
            -j.by_ms / 1_000
        );
    }
}

/// Three proxies at -5 s, 0 and +7 s against Redis; the first jumps 60 s forward, the last
/// 30 s back, mid-run. About 10 s.
#[test]
fn skewed_and_jumping_proxies_stay_within_the_cached_bound() {
    check_fleet(&Scenario {
        seconds: 9,
        offsets_ms: vec![-5_000, 0, 7_000],
        jumps: vec![
            Jump {
                at_ms: 3_000,
                proxy: 0,
                by_ms: 60_000,
            },
            Jump {
                at_ms: 5_000,
                proxy: 2,
                by_ms: -30_000,
            },
        ],
        offered: 2.0 * RATE as f64,
    });
}

/// A cached fixed window of 100 a second, a fallback of a proxy's share in the same window.
const WINDOW: u64 = 100;

fn window_config(token: &str, proxies: u64) -> String {
    format!(
        r#"{{"service": {{"cluster": "sluice_service", "token": "{token}", "timeout_ms": 1000,
             "sync_interval_ms": {INTERVAL_MS}}},
           "rules": [{{"name": "shared", "key": ["const:all"], "consistency": "cached",
             "limits": [{{"requests": {WINDOW}, "per": "second", "algorithm": "fixed_window"}}],
             "fallback": {{"policy": "fail_open",
               "limits": [{{"requests": {}, "per": "second", "algorithm": "fixed_window"}}]}}}}]}}"#,
        WINDOW / proxies
    )
}

/// A cached window whose proxies' clocks are off Redis's by fractions of its length (−5.3 s, 0,
/// +7.6 s), so their fallback windows straddle the service's; the last steps 30 s back at 3 s.
/// Every window of the service's clock admits at most `requests`, plus what the proxies'
/// fallbacks admitted outside a lease: at most the fallback's `requests` each time a proxy's
/// clock entered a window in which it held no lease at some moment.
#[test]
fn skewed_proxies_keep_a_cached_window_within_its_bound() {
    let _serial = serial();
    let s = Scenario {
        seconds: 6,
        offsets_ms: vec![-5_300, 0, 7_600],
        jumps: vec![Jump {
            at_ms: 3_000,
            proxy: 2,
            by_ms: -30_000,
        }],
        offered: 2.0 * WINDOW as f64,
    };
    let n = s.offsets_ms.len() as u64;
    let run = run_fleet(&s, window_config);
    let admitted: u64 = run.logs.iter().map(|l| l.admitted_us.len() as u64).sum();
    let second = |t_us: u64| (run.start_epoch_us + t_us) / 1_000_000;
    let windows = second(run.last_us) - second(run.first_us) + 1;
    // A fallback window admits at most its `requests` each time the proxy's clock enters it (a
    // window entered again, after a step back, counts from zero again): count the entries during
    // which the proxy held no lease at some moment.
    let fallback: Vec<u64> = run
        .logs
        .iter()
        .map(|log| {
            let stretches = without_lease(log, run.first_us, run.last_us);
            let (mut entries, mut current, mut counted) = (0u64, None, false);
            let mut t = run.first_us;
            while t <= run.last_us {
                let window = (run.start_epoch_us as i64 + t as i64 + log.offset_at(t)) / 1_000_000;
                if current != Some(window) {
                    current = Some(window);
                    counted = false;
                }
                if !counted
                    && stretches
                        .iter()
                        .any(|&(from, until)| from <= t && t <= until)
                {
                    entries += 1;
                    counted = true;
                }
                t += 1_000;
            }
            entries * (WINDOW / n)
        })
        .collect();
    let bound = WINDOW * windows + fallback.iter().sum::<u64>();
    eprintln!(
        "cached window of {WINDOW}/s, {n} proxies at {:?} ms, one stepped back 30 s: {admitted} admitted in {windows} windows of the service's clock, bound {bound} ({} + fallback terms {fallback:?}), per proxy {:?}, leases {:?}",
        s.offsets_ms,
        WINDOW * windows,
        run.logs
            .iter()
            .map(|l| l.admitted_us.len())
            .collect::<Vec<_>>(),
        run.logs.iter().map(|l| l.leases.len()).collect::<Vec<_>>()
    );
    assert!(
        admitted <= bound,
        "{admitted} admitted, over the bound {bound}"
    );
    // Twice the limit is offered: the whole windows of the run are at least half filled.
    assert!(
        admitted >= WINDOW * (windows - 2) / 2,
        "{admitted} admitted in {windows} windows"
    );
}

/// The long version (`make test-clock`): four proxies skewed by up to 7 s, a minute's run,
/// jumps forward by a minute and five, back by 30 s and 90 s, one proxy jumping twice.
#[test]
#[ignore = "long: make test-clock"]
fn long_skewed_and_jumping_proxies_stay_within_the_cached_bound() {
    let jump = |at_s: u64, proxy: usize, by_s: i64| Jump {
        at_ms: at_s * 1_000,
        proxy,
        by_ms: by_s * 1_000,
    };
    check_fleet(&Scenario {
        seconds: 60,
        offsets_ms: vec![-5_000, 0, 7_000, 2_500],
        jumps: vec![
            jump(8, 0, 60),
            jump(16, 2, -30),
            jump(24, 1, 300),
            jump(32, 3, -90),
            jump(44, 0, -60),
            jump(52, 2, 45),
        ],
        offered: 2.0 * RATE as f64,
    });
}
