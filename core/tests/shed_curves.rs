//! The shedding curve, the controller's latency percentile, its re-probe at `min`, and the
//! upstream's saturation report, decided in core on a virtual clock with fixed draws: each
//! counted, never timed.

use sluice_core::shed::admission::{adaptive_limit, gauge};
use sluice_core::shed::controller::{self, ControlState, WindowStats, STUCK_WINDOWS};
use sluice_core::shed::policy::{parse_saturation, Adaptive};
use sluice_core::shed::state::{Gauge, Window};
use sluice_core::shed::{admit, release, tick, Admission, Pressure, Samples, ShedReason, Shedding};
use sluice_core::store::Store;
use sluice_core::worker::ShedWorker;
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest};

const MS: u64 = 1_000;
const T0: u64 = 1_700_000_000_000_000;

fn shedding(json: &str) -> Shedding {
    let policy = sluice_core::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    policy.shedding.expect("a shedding section")
}

/// A fixed stream of uniform draws in [0, 1) (splitmix64): what the host's draw stands for.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as f64 / 2f64.powi(64)
    }
}

fn set_in_flight(s: &Shedding, store: &mut MemoryStore, in_flight: u32) {
    let mut g = gauge(s, 0, store);
    g.in_flight = in_flight;
    let version = store.get("sluice/shed/api").unwrap().map_or(0, |(_, v)| v);
    assert!(store.set("sluice/shed/api", &g.encode(), version).unwrap());
}

/// How many of `n` requests of `class` are shed at `in_flight` of 100, and for which reasons.
fn shed_of(
    s: &Shedding,
    in_flight: u32,
    class: &str,
    n: usize,
    seed: u64,
) -> (usize, Vec<ShedReason>) {
    let mut store = MemoryStore::default();
    set_in_flight(s, &mut store, in_flight);
    let mut draws = Draws(seed);
    let mut shed = 0;
    let mut reasons = Vec::new();
    for _ in 0..n {
        let mut req = PlainRequest::get("/api/x").with_header("x-class", class);
        let pressure = Pressure {
            now_us: T0,
            fleet: None,
            draw: draws.next(),
        };
        match admit(s, &mut req, pressure, &mut store) {
            Admission::Admitted { seat, .. } => release(s, seat, &mut store).unwrap(),
            Admission::Shed { reason, .. } | Admission::Queue { reason, .. } => {
                shed += 1;
                if !reasons.contains(&reason) {
                    reasons.push(reason);
                }
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(gauge(s, 0, &mut store).in_flight, in_flight);
    (shed, reasons)
}

const CURVE: &str = r#"{"shedding": {"class_header": "x-class", "classes": {"basic": 1.0},
  "bulkheads": [{"name": "api", "limit": {"static": 100}, "queue": {"size": 8, "max_wait_ms": 50},
    "curve": [{"at": 0.7, "shed": 0.1}, {"at": 0.85, "shed": 0.5}]}]}}"#;

#[test]
fn the_curve_sheds_its_share_at_random_within_a_binomial_bound() {
    let s = shedding(CURVE);
    // Over 10,000 decisions each, 4 standard deviations either side of n × p.
    let within = |shed: usize, p: f64| {
        let (n, mean) = (10_000.0, 10_000.0 * p);
        let sd = (n * p * (1.0 - p)).sqrt();
        (shed as f64 - mean).abs() <= 4.0 * sd
    };
    let (at_85, reasons) = shed_of(&s, 85, "basic", 10_000, 1);
    assert!(within(at_85, 0.5), "{at_85} of 10000 at 85%");
    assert_eq!(
        reasons,
        vec![ShedReason::Curve],
        "shed at once, never queued"
    );
    let (at_70, _) = shed_of(&s, 70, "basic", 10_000, 2);
    assert!(within(at_70, 0.1), "{at_70} of 10000 at 70%");
    // Halfway between the points: 30%; above the last: its 50%; below the first: none.
    let (at_775, _) = shed_of(&s, 78, "basic", 10_000, 3);
    let p = 0.1 + 0.4 * (0.78 - 0.7) / 0.15;
    assert!(within(at_775, p), "{at_775} of 10000 at 78% ({p})");
    let (at_95, _) = shed_of(&s, 95, "basic", 10_000, 4);
    assert!(within(at_95, 0.5), "{at_95} at 95%");
    assert_eq!(shed_of(&s, 69, "basic", 2_000, 5).0, 0, "below the curve");
    // A class that is never shed is never drawn; one past its threshold is shed by the step.
    assert_eq!(shed_of(&s, 90, "critical", 2_000, 6).0, 0);
    let (free, reasons) = shed_of(&s, 75, "free", 1_000, 7);
    assert_eq!((free, reasons), (1_000, vec![ShedReason::Priority]));
    // The same draws decide the same: a harness can count.
    assert_eq!(
        shed_of(&s, 85, "basic", 1_000, 9),
        shed_of(&s, 85, "basic", 1_000, 9)
    );
}

#[test]
fn the_curve_and_the_success_rate_draw_independently_from_one_draw() {
    // Both read the request's one draw; the curve hashes it. Were it compared as is, a request
    // the rejection spares (draw ≥ p) would be shed by the curve only when draw < share, so at
    // equal shares none would be shed by both and the union would be exact.
    let s = shedding(CURVE);
    let spec = &s.bulkheads[0];
    let mut draws = Draws(11);
    let (mut curve, mut low, mut both) = (0, 0, 0);
    for _ in 0..10_000 {
        let d = draws.next();
        let c = spec.curve_sheds(0.85, d);
        curve += c as u32;
        low += (d < 0.5) as u32;
        both += (c && d < 0.5) as u32;
    }
    assert!((4_800..=5_200).contains(&curve), "{curve}");
    assert!((2_300..=2_700).contains(&both), "{both} of {low} drawn low");
}

/// Windows of 100 requests: 85 answered in 10 ms, 15 in 20 ms (the mean 11.5 ms, p90 about
/// 18 ms), with the bulkhead full. Returns the limits after each window.
fn tail_windows(percentile: f64) -> Vec<u32> {
    let json = format!(
        r#"{{"shedding": {{"bulkheads": [{{"name": "api", "limit": {{"adaptive":
          {{"min": 2, "max": 200, "initial": 50, "tolerance": 1.5, "window_ms": 100,
            "percentile": {percentile}}}}}}}]}}}}"#
    );
    let s = shedding(&json);
    let mut store = MemoryStore::default();
    // The no-load latency is known (10 ms), the next probe far off.
    let w = Window {
        started_us: T0 as f64,
        control: ControlState {
            limit: 50.0,
            baseline_us: 10_000.0,
            next_probe_us: f64::MAX / 2.0,
            ..ControlState::default()
        },
        ..Window::default()
    };
    assert!(store.set("sluice/shed/api/window", &w.encode(), 0).unwrap());
    let mut worker = ShedWorker::new(&s);
    let mut limits = Vec::new();
    for window in 1..=10u64 {
        let limit = adaptive_limit(&s, 0, &mut store);
        set_in_flight(&s, &mut store, limit);
        for i in 0..100 {
            let latency = if i % 20 < 17 { 10 * MS } else { 20 * MS };
            worker.finished(0, latency, 200, None);
        }
        let samples: &mut Vec<Samples> = &mut worker.samples().to_vec();
        tick(&s, samples, T0 + window * 100 * MS, 0.5, &mut store);
        // The worker's samples are folded: start the next window empty.
        worker = ShedWorker::new(&s);
        limits.push(adaptive_limit(&s, 0, &mut store));
    }
    limits
}

#[test]
fn the_controller_measures_a_percentile_so_a_slow_tail_shrinks_the_limit() {
    let mean = tail_windows(0.0);
    assert!(
        mean.iter().zip(mean.iter().skip(1)).all(|(a, b)| b >= a),
        "{mean:?}"
    );
    assert!(
        mean[9] > 50,
        "the mean (11.5 ms) is within 1.5 × 10 ms: it grows, {mean:?}"
    );
    let p90 = tail_windows(90.0);
    assert!(p90[9] < 20, "p90 (about 18 ms) is not: it shrinks, {p90:?}");
}

fn settings() -> Adaptive {
    Adaptive {
        min: 2,
        max: 200,
        initial: 20,
        tolerance: 1.5,
        window_ms: 100,
        probe_interval_ms: 30_000,
        percentile: 90.0,
    }
}

fn full(rtt_us: f64) -> WindowStats {
    WindowStats {
        count: 100.0,
        rtt_us,
        drops: 0.0,
        peak_use: 1.0,
        saturated: false,
    }
}

#[test]
fn a_limit_pinned_at_min_measures_the_no_load_latency_again_within_a_bound() {
    let a = settings();
    // Learned at 10 ms; the upstream is now 40 ms at no load, for good.
    let mut state = ControlState {
        limit: 2.0,
        baseline_us: 10_000.0,
        next_probe_us: (T0 + 3_600_000 * MS) as f64,
        ..ControlState::default()
    };
    let mut now = T0;
    let mut windows_to_baseline = None;
    for w in 1..=40 {
        now += 100 * MS;
        controller::step(&a, &mut state, full(40_000.0), now, 0.5);
        if windows_to_baseline.is_none() && state.baseline_us == 40_000.0 {
            windows_to_baseline = Some(w);
        }
    }
    let windows = windows_to_baseline.expect("measured again before the hourly probe");
    assert!(
        windows as f64 <= STUCK_WINDOWS + 3.0,
        "after {windows} windows"
    );
    assert!(controller::effective(&a, &state) > 2, "{state:?}");

    // An upstream that stays slower than the tolerance whatever the limit: it probes again
    // after each run of windows at min, never more often, and each probe ends.
    let mut state = ControlState {
        limit: 2.0,
        baseline_us: 10_000.0,
        next_probe_us: (T0 + 3_600_000 * MS) as f64,
        ..ControlState::default()
    };
    let (mut probes, mut probing) = (0, false);
    for i in 0..140u64 {
        now += 100 * MS;
        // Each window slower than the last by more than the tolerance: the limit stays pinned.
        controller::step(
            &a,
            &mut state,
            full(40_000.0 * 1.6f64.powi(i as i32)),
            now,
            0.5,
        );
        if state.probe_saved > 0.0 && !probing {
            probes += 1;
        }
        probing = state.probe_saved > 0.0;
        assert_eq!(controller::effective(&a, &state), 2);
    }
    assert!(
        (10..=20).contains(&probes),
        "{probes} probes in 140 windows"
    );
}

/// A window with fewer than 5 answers moves nothing, at `min` too. Where `min` requests at the upstream's slow latency
/// give fewer than 5 answers a window (2 in flight of 200 ms in windows of 100 ms: 1), a limit at `min` never
/// measures the no-load latency again, not even every `probe_interval_ms`, and stays at `min` while the upstream
/// is that slow. With 5 answers a window (2 of 40 ms) it measures again within the bound above.
#[test]
fn a_limit_at_min_with_fewer_than_five_answers_a_window_stays_there() {
    let a = Adaptive {
        probe_interval_ms: 1_000,
        ..settings()
    };
    let pinned = || ControlState {
        limit: 2.0,
        baseline_us: 20_000.0,
        next_probe_us: T0 as f64,
        ..ControlState::default()
    };
    let mut state = pinned();
    let mut now = T0;
    for w in 1..=600 {
        now += 100 * MS;
        let one_answer = WindowStats {
            count: 1.0,
            ..full(200_000.0)
        };
        controller::step(&a, &mut state, one_answer, now, 0.5);
        assert_eq!(controller::effective(&a, &state), 2, "window {w}");
        assert_eq!(state.probe_saved, 0.0, "a probe at window {w}");
    }
    assert_eq!(state.baseline_us, 20_000.0, "{state:?}");

    let mut state = pinned();
    for _ in 1..=10 {
        now += 100 * MS;
        let five_answers = WindowStats {
            count: 5.0,
            ..full(40_000.0)
        };
        controller::step(&a, &mut state, five_answers, now, 0.5);
    }
    assert_eq!(state.baseline_us, 40_000.0, "{state:?}");
}

#[test]
fn saturation_reports_parse_strictly() {
    for (value, parsed) in [
        ("0.85", Some(0.85)),
        ("85%", Some(0.85)),
        (" 1 ", Some(1.0)),
        ("100%", Some(1.0)),
        ("0", Some(0.0)),
        ("0%", Some(0.0)),
        ("1.5", None),
        ("101%", None),
        ("-0.5", None),
        ("+0.5", None),
        ("NaN", None),
        ("inf", None),
        ("1e-3", None),
        ("0x1", None),
        ("", None),
        ("%", None),
        (".", None),
        ("0.5.5", None),
        ("0.5%%", None),
        ("99999999999999999999999%", None),
        ("0,5", None),
    ] {
        assert_eq!(parse_saturation(value), parsed, "{value:?}");
    }
}

const SATURATION: &str = r#"{"shedding": {"class_header": "x-class",
  "bulkheads": [{"name": "api", "limit": {"adaptive": {"min": 2, "max": 200, "initial": 40,
     "window_ms": 100, "probe_interval_ms": 0}},
   "saturation_header": "x-upstream-saturation"}]}}"#;

/// Windows of 50 requests of 10 ms, each response carrying `report` (if any) in the saturation
/// header, through the exchange as the filter drives it. Returns the limits after each window,
/// and whether a `free` request is shed at the end (at 1 in flight).
fn reported(report: Option<&str>) -> (Vec<u32>, bool) {
    let limiter = Limiter::new(sluice_core::parse(SATURATION.as_bytes()).unwrap());
    let s = limiter.policy().shedding.clone().unwrap();
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let mut limits = Vec::new();
    let mut now = T0;
    for _ in 0..20 {
        // Keep the bulkhead busy enough that the window moves the limit.
        let limit = adaptive_limit(&s, 0, &mut store);
        set_in_flight(&s, &mut store, limit);
        for _ in 0..50 {
            // A client's request header of the same name is never read.
            let mut req = PlainRequest::get("/api/x")
                .with_header("x-class", "critical")
                .with_header("x-upstream-saturation", "100%");
            let (mut ex, _, _) =
                Exchange::start(&limiter, &mut req, None, Moment::at(now), &mut store);
            assert_eq!(
                ex.saturation_header(&limiter),
                Some("x-upstream-saturation")
            );
            ex.responded(200, now + 10 * MS);
            if let Some(value) = report {
                if let Some((bulkhead, sat)) = ex.saturation_report(&limiter, value) {
                    worker.reported(bulkhead, sat);
                }
            }
            for e in ex.finish(&limiter, &mut store) {
                if let sluice_core::Effect::Finished {
                    bulkhead,
                    latency_us,
                    status,
                    grpc_status,
                } = e
                {
                    worker.finished(bulkhead, latency_us, status, grpc_status);
                }
            }
        }
        now += 100 * MS;
        let mut samples = worker.samples().to_vec();
        tick(&s, &mut samples, now, 0.5, &mut store);
        worker = ShedWorker::new(&s);
        limits.push(adaptive_limit(&s, 0, &mut store));
    }
    set_in_flight(&s, &mut store, 1);
    let mut req = PlainRequest::get("/api/x").with_header("x-class", "free");
    let pressure = Pressure {
        now_us: now,
        fleet: None,
        draw: 0.5,
    };
    let shed = matches!(
        admit(&s, &mut req, pressure, &mut store),
        Admission::Shed { .. }
    );
    (limits, shed)
}

#[test]
fn the_upstreams_saturation_report_sheds_and_shrinks_and_garbage_never_raises_the_limit() {
    let (quiet, quiet_shed) = reported(None);
    assert!(!quiet_shed, "1 in flight: free is not shed");
    // Reported at 95% (the critical level): free (0.7) is shed with 1 in flight, and
    // the adaptive limit shrinks as for a timeout.
    let (saturated, shed) = reported(Some("95%"));
    assert!(shed, "the report counts as the utilization");
    assert!(saturated[19] <= 4, "{saturated:?}");
    // Low reports and garbage change nothing: never a higher limit than without any report.
    for value in ["0", "0%", "-5", "1e9", "NaN", "9999%", "\u{0}", "0.5.5"] {
        let (limits, shed) = reported(Some(value));
        assert_eq!(limits, quiet, "{value:?}");
        assert!(!shed, "{value:?}");
    }
    // A gauge from before (no saturation known) decodes as it was.
    assert_eq!(Gauge::decode(&Gauge::default().encode()), Gauge::default());
}
