//! The adaptive in-flight limit: a gradient controller with no-load latency probes, and the
//! success-rate rejection probability. Pure arithmetic over one window's statistics.
//!
//! Each window (100 ms by default) the limit moves toward `limit × gradient (+ headroom)`, where
//! `gradient = tolerance × baseline / latency`, clamped to [0.5, 1]: while the upstream answers
//! within `tolerance ×` its no-load latency the limit grows by √limit (a third of the way per
//! window), and as queueing shows in the latency it shrinks in proportion, at once; a window
//! that used less than half the limit leaves it alone (low load tells nothing about it). Timeouts shrink it by a fifth (the
//! latency of a request that never answered is not in the mean). The no-load latency
//! (`baseline`) is the lowest window latency seen (the configured percentile, or the mean),
//! re-measured every `probe_interval_ms` by holding the limit at `min` until the requests
//! admitted before have drained and one more window has passed, as Envoy's
//! `adaptive_concurrency` measures its minRTT: otherwise a baseline learned under load would let
//! queueing in for good. A window with fewer than [`MIN_SAMPLES`] answers moves nothing, at
//! `min` too: where `min` requests of the upstream's latency give fewer a window, a limit at
//! `min` neither probes nor moves until the upstream is faster.

use crate::shed::policy::{Adaptive, SuccessRate};

/// Windows with fewer answered requests than this leave the limit alone.
pub const MIN_SAMPLES: f64 = 5.0;
/// How far one window moves the limit up toward its target.
const SMOOTHING: f64 = 0.3;
/// The limit moves only if the window used at least this much of it.
const USED: f64 = 0.5;
/// Multiplicative decrease on timeouts.
const BACKOFF: f64 = 0.8;
/// A probe never holds the limit at `min` for longer than this many windows.
const PROBE_WINDOWS: f64 = 10.0;
/// After this many busy windows in a row at `min`, the no-load latency is measured again at
/// once (as Envoy's `adaptive_concurrency` does): a limit pinned at `min` usually means the
/// upstream got slower for good, and a baseline that only goes down would keep it there until
/// the next periodic probe.
pub const STUCK_WINDOWS: f64 = 5.0;

/// What one window saw, summed over every worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WindowStats {
    /// Requests that got response headers.
    pub count: f64,
    /// Their latency, request to response headers: the configured percentile, or the mean.
    pub rtt_us: f64,
    /// Requests that timed out (504) or whose upstream reset.
    pub drops: f64,
    /// The highest in flight / limit seen during the window.
    pub peak_use: f64,
    /// The upstream reported itself saturated (its mean report at or above the critical level).
    pub saturated: bool,
}

/// The controller's memory between windows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ControlState {
    /// The limit, fractional (the gauge holds it rounded).
    pub limit: f64,
    /// The no-load latency, 0 until measured.
    pub baseline_us: f64,
    /// When the next probe starts.
    pub next_probe_us: f64,
    /// The limit to return to after the probe in progress; 0: not probing.
    pub probe_saved: f64,
    /// Windows of the probe in progress that ran wholly within its limit, and all of them.
    pub probe_clean: f64,
    pub probe_windows: f64,
    /// Busy windows in a row that ended with the limit at `min` (not probing).
    pub at_min: f64,
}

/// Runs one controller step at the end of a window. `jitter` in [0, 1) spreads the probes of
/// different proxies.
pub fn step(
    settings: &Adaptive,
    state: &mut ControlState,
    stats: WindowStats,
    now_us: u64,
    jitter: f64,
) {
    let (min, max) = (settings.min as f64, settings.max as f64);
    if state.limit < min || state.limit > max || state.limit.is_nan() {
        state.limit = (settings.initial as f64).clamp(min, max);
    }
    let now = now_us as f64;
    let probe_every = settings.probe_interval_ms as f64 * 1_000.0;
    if state.probe_saved > 0.0 {
        // First the requests admitted before the probe drain; the window after the first one
        // that stayed within `min` measures the no-load latency. The probe gives up when the
        // traffic stops (nothing to measure, and no reason to hold the limit down) or after
        // PROBE_WINDOWS, keeping the window's mean only if nothing better is known.
        state.probe_windows += 1.0;
        if stats.peak_use <= 1.0 {
            state.probe_clean += 1.0;
        }
        let measured = state.probe_clean >= 2.0 && stats.count > 0.0;
        let idle = stats.count <= 0.0;
        if !measured && !idle && state.probe_windows < PROBE_WINDOWS {
            return;
        }
        if measured || (state.baseline_us <= 0.0 && stats.count > 0.0) {
            state.baseline_us = stats.rtt_us;
        }
        state.limit = state.probe_saved.clamp(min, max);
        state.probe_saved = 0.0;
        state.probe_clean = 0.0;
        state.probe_windows = 0.0;
        state.next_probe_us = now + probe_every * (1.0 + 0.1 * jitter);
        return;
    }
    // A probe needs traffic: an idle bulkhead keeps its limit (and probes when traffic comes).
    let busy = stats.count >= MIN_SAMPLES;
    let stuck = state.at_min >= STUCK_WINDOWS;
    if settings.probe_interval_ms > 0
        && busy
        && (state.baseline_us <= 0.0 || now >= state.next_probe_us || stuck)
    {
        state.at_min = 0.0;
        state.probe_saved = state.limit;
        state.limit = min;
        return;
    }
    if stats.count < MIN_SAMPLES || stats.rtt_us <= 0.0 {
        return;
    }
    if state.baseline_us <= 0.0 || stats.rtt_us < state.baseline_us {
        state.baseline_us = stats.rtt_us;
    }
    // A window that used less than half the limit says nothing about it: latency noise at
    // low load must not move it (and shedding cannot start before the load comes anyway).
    if stats.peak_use < USED {
        return;
    }
    let target = if stats.drops > 0.0 || stats.saturated {
        state.limit * BACKOFF
    } else {
        let gradient = (settings.tolerance * state.baseline_us / stats.rtt_us).clamp(0.5, 1.0);
        let headroom = if gradient >= 1.0 {
            state.limit.sqrt()
        } else {
            0.0
        };
        state.limit * gradient + headroom
    };
    // Down at once (queueing hurts every request now), up gently.
    let next = if target < state.limit {
        target
    } else {
        state.limit * (1.0 - SMOOTHING) + target * SMOOTHING
    };
    state.limit = next.clamp(min, max);
    state.at_min = if state.limit <= min {
        state.at_min + 1.0
    } else {
        0.0
    };
}

/// The limit requests see: the whole part of the controller's, or `min` while it probes.
pub fn effective(settings: &Adaptive, state: &ControlState) -> u32 {
    let limit = if state.limit > 0.0 {
        state.limit
    } else {
        settings.initial as f64
    };
    (limit.round() as u32).clamp(settings.min, settings.max)
}

/// Envoy `admission_control`'s rejection probability from decayed request and success counts:
/// `max(0, (total − successes / threshold) / (total + 1)) ^ (1 / aggression)`, capped.
pub fn rejection(settings: &SuccessRate, total: f64, successes: f64) -> f64 {
    if total < settings.min_requests as f64 || total <= 0.0 {
        return 0.0;
    }
    let p = ((total - successes / settings.threshold) / (total + 1.0)).max(0.0);
    p.powf(1.0 / settings.aggression)
        .min(settings.max_rejection)
}

/// The factor counts of the success rate fade by over `elapsed_ms`.
pub fn fade(settings: &SuccessRate, elapsed_ms: f64) -> f64 {
    (-elapsed_ms / settings.window_ms as f64).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adaptive() -> Adaptive {
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

    /// An upstream with `workers` slots and a fixed service time, offered more than it can take:
    /// every admitted slot is busy, and latency grows with the queue behind the workers.
    fn saturated(limit: u32, workers: f64, service_us: f64) -> WindowStats {
        let in_flight = limit as f64;
        WindowStats {
            count: 100.0,
            rtt_us: service_us * (in_flight / workers).max(1.0),
            drops: 0.0,
            peak_use: 1.0,
            saturated: false,
        }
    }

    #[test]
    fn converges_near_the_capacity_allowed_by_the_tolerance_under_overload() {
        let settings = adaptive();
        let mut state = ControlState::default();
        let mut now = 0u64;
        let mut limits = Vec::new();
        for _ in 0..600 {
            now += 100_000;
            let limit = effective(&settings, &state);
            let stats = saturated(limit, 8.0, 25_000.0);
            step(&settings, &mut state, stats, now, 0.5);
            limits.push(effective(&settings, &state));
        }
        // The last 10 s: between the workers (no queue) and tolerance × workers (12).
        let tail = &limits[limits.len() - 100..];
        let (lo, hi) = (
            *tail.iter().min().unwrap_or(&0),
            *tail.iter().max().unwrap_or(&0),
        );
        assert!(lo >= 2, "{tail:?}");
        assert!(hi <= 14, "limit ran away: {tail:?}");
        let mean = tail.iter().map(|&l| l as f64).sum::<f64>() / tail.len() as f64;
        assert!((8.0..=13.0).contains(&mean), "mean limit {mean}: {tail:?}");
        assert!((state.baseline_us - 25_000.0).abs() < 1.0, "{state:?}");
    }

    #[test]
    fn a_baseline_learned_under_load_is_corrected_by_the_next_probe() {
        let settings = adaptive();
        // As if the controller started while the upstream was already queueing 4 deep.
        let mut state = ControlState {
            limit: 64.0,
            baseline_us: 100_000.0,
            next_probe_us: 1_000_000.0,
            ..ControlState::default()
        };
        let mut now = 0;
        for _ in 0..20 {
            now += 100_000;
            let limit = effective(&settings, &state);
            step(
                &settings,
                &mut state,
                saturated(limit, 8.0, 25_000.0),
                now,
                0.0,
            );
        }
        assert!((state.baseline_us - 25_000.0).abs() < 1.0, "{state:?}");
    }

    #[test]
    fn grows_when_the_upstream_gets_faster_and_stays_put_when_idle() {
        let settings = adaptive();
        let mut state = ControlState {
            limit: 10.0,
            baseline_us: 25_000.0,
            next_probe_us: f64::MAX,
            ..ControlState::default()
        };
        // Plenty of capacity (64 workers): the limit climbs.
        for i in 0..50 {
            let limit = effective(&settings, &state);
            step(
                &settings,
                &mut state,
                saturated(limit, 64.0, 25_000.0),
                i * 100_000,
                0.0,
            );
        }
        assert!(state.limit > 40.0, "{state:?}");
        // Little traffic, far below the limit: no growth.
        let before = state.limit;
        let idle = WindowStats {
            count: 50.0,
            rtt_us: 25_000.0,
            drops: 0.0,
            peak_use: 0.1,
            saturated: false,
        };
        for i in 50..100 {
            step(&settings, &mut state, idle, i * 100_000, 0.0);
        }
        assert!(
            (state.limit - before).abs() < 1e-6,
            "{} {before}",
            state.limit
        );
    }

    #[test]
    fn an_idle_bulkhead_never_probes_and_keeps_its_initial_limit() {
        let settings = adaptive();
        let mut state = ControlState::default();
        for i in 1..=100 {
            step(
                &settings,
                &mut state,
                WindowStats::default(),
                i * 100_000,
                0.0,
            );
            assert_eq!(effective(&settings, &state), 20, "window {i}");
        }
        // Traffic comes: one probe at min, then back to the limit with a baseline.
        let light = WindowStats {
            count: 10.0,
            rtt_us: 25_000.0,
            drops: 0.0,
            peak_use: 0.2,
            saturated: false,
        };
        let mut at_min = 0;
        for i in 101..=130 {
            step(&settings, &mut state, light, i * 100_000, 0.0);
            at_min += (effective(&settings, &state) == 2) as u32;
        }
        assert!((1..=3).contains(&at_min), "{at_min} windows at min");
        assert_eq!(state.baseline_us, 25_000.0);
        assert_eq!(effective(&settings, &state), 20);
        // The traffic stops during the next probe: it gives up at once.
        state.next_probe_us = 0.0;
        step(&settings, &mut state, light, 140 * 100_000, 0.0);
        assert_eq!(effective(&settings, &state), 2, "probing");
        step(
            &settings,
            &mut state,
            WindowStats::default(),
            141 * 100_000,
            0.0,
        );
        assert_eq!(effective(&settings, &state), 20, "gave up: no traffic");
    }

    #[test]
    fn timeouts_shrink_the_limit() {
        let settings = adaptive();
        let mut state = ControlState {
            limit: 100.0,
            baseline_us: 25_000.0,
            next_probe_us: f64::MAX,
            ..ControlState::default()
        };
        let stats = WindowStats {
            count: 50.0,
            rtt_us: 25_000.0,
            drops: 3.0,
            peak_use: 1.0,
            saturated: false,
        };
        step(&settings, &mut state, stats, 0, 0.0);
        assert!(state.limit < 95.0, "{state:?}");
    }

    #[test]
    fn the_rejection_probability_follows_admission_control() {
        let sr = SuccessRate {
            threshold: 0.95,
            aggression: 1.0,
            min_requests: 20,
            window_ms: 10_000,
            max_rejection: 0.95,
        };
        assert_eq!(rejection(&sr, 100.0, 100.0), 0.0);
        assert_eq!(rejection(&sr, 10.0, 0.0), 0.0, "below min_requests");
        // Half fail: (100 − 50/0.95) / 101 ≈ 0.469.
        let p = rejection(&sr, 100.0, 50.0);
        assert!((p - 0.4689).abs() < 0.001, "{p}");
        // Everything fails: capped.
        assert_eq!(rejection(&sr, 1000.0, 0.0), 0.95);
        let steeper = SuccessRate {
            aggression: 2.0,
            ..sr
        };
        assert!(rejection(&steeper, 100.0, 50.0) > p);
    }
}
