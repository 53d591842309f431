//! What a worker does for shedding on its tick: folds the samples its requests left into the
//! bulkhead's shared window, and, when the window is over, runs the controller and publishes
//! the new limit, latency, rejection probability and use in the gauge. Whichever worker ends a
//! window runs its step; the window's compare-and-swap makes sure exactly one does.

use crate::protocol::LoadReport;
use crate::shed::admission::limit_of;
use crate::shed::controller::{self, WindowStats};
use crate::shed::histogram::Histogram;
use crate::shed::policy::{LimitKind, Shedding};
use crate::shed::state::{Gauge, Window};
use crate::store::{self, Store};

/// How fast the smoothed use and latency follow (time constant).
const SMOOTH_US: f64 = 1_000_000.0;

/// One worker's samples for one bulkhead since its last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Samples {
    pub count: f64,
    pub sum_rtt_us: f64,
    pub errors: f64,
    pub drops: f64,
    pub offered: f64,
    pub shed: f64,
    /// The upstream's saturation reports (`saturation_header`): their sum and count.
    pub sat_sum: f64,
    pub sat_count: f64,
    /// The latencies, for a controller that measures a percentile (else left empty).
    pub hist: Histogram,
}

/// Whether a gRPC status is a failure of the upstream, as Envoy's `admission_control` counts
/// one by default: every status but OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND,
/// ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED and UNAUTHENTICATED (so
/// DEADLINE_EXCEEDED, PERMISSION_DENIED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE,
/// DATA_LOSS and any unknown code are).
pub fn grpc_failure(code: u32) -> bool {
    !matches!(code, 0 | 1 | 2 | 3 | 5 | 6 | 9 | 11 | 12 | 16)
}

impl Samples {
    /// A response from the upstream (or from Envoy for it: 503 on reset, 504 on timeout), with
    /// the `grpc-status` of a gRPC response (a 200 whose status is a failure is one).
    pub fn answered(&mut self, latency_us: u64, status: u32, grpc_status: Option<u32>) {
        self.count += 1.0;
        self.sum_rtt_us += latency_us as f64;
        if status >= 500 || grpc_status.is_some_and(grpc_failure) {
            self.errors += 1.0;
        }
        if status == 504 {
            self.drops += 1.0;
        }
    }

    /// The upstream reported its saturation (a utilization in [0, 1], parsed strictly).
    pub fn reported(&mut self, saturation: f64) {
        if (0.0..=1.0).contains(&saturation) {
            self.sat_sum += saturation;
            self.sat_count += 1.0;
        }
    }

    /// A request the bulkhead decided; `shed`: it was answered 503.
    pub fn offered(&mut self, shed: bool) {
        self.offered += 1.0;
        if shed {
            self.shed += 1.0;
        }
    }
}

/// Folds `samples` (one per bulkhead, emptied when folded) into the shared windows and ends
/// the windows that are due. Returns each bulkhead's gauge as this tick left it (for metrics).
pub fn tick(
    shedding: &Shedding,
    samples: &mut [Samples],
    now_us: u64,
    jitter: f64,
    store: &mut dyn Store,
) -> Vec<Gauge> {
    let now = now_us as f64;
    let mut gauges = Vec::with_capacity(shedding.bulkheads.len());
    for (id, spec) in shedding.bulkheads.iter().enumerate() {
        let local = samples.get(id).copied().unwrap_or_default();
        let gauge = read_gauge(store, &spec.gauge_key);
        let gauge_limit = limit_of(shedding, id, &gauge).max(1) as f64;
        let in_flight = gauge.in_flight as f64;
        let window_us = spec.window_ms() as f64 * 1_000.0;
        let percentile = match &spec.limit {
            LimitKind::Adaptive(a) => a.percentile,
            LimitKind::Static(_) => 0.0,
        };
        let ended = store::update(store, &spec.window_key, |bytes| {
            let mut w = Window::decode(bytes);
            if w.started_us <= 0.0 || w.started_us > now {
                w.started_us = now;
            }
            // In flight over the limit this window is judged by: an adaptive limit as the window
            // holds it (read with it in one update), not as the gauge read before said. Another
            // worker may have ended the window in between, restoring the limit after a probe: 4
            // in flight over the probe's `min` of 2 would read as a busy window of the restored 20
            // and move it.
            let limit = match &spec.limit {
                LimitKind::Adaptive(a) if w.control.limit > 0.0 => {
                    controller::effective(a, &w.control).max(1) as f64
                }
                _ => gauge_limit,
            };
            let use_now = in_flight / limit;
            w.count += local.count;
            w.sum_rtt_us += local.sum_rtt_us;
            w.errors += local.errors;
            w.drops += local.drops;
            w.report_offered += local.offered;
            w.report_shed += local.shed;
            w.sat_sum += local.sat_sum;
            w.sat_count += local.sat_count;
            if percentile > 0.0 {
                w.hist.merge(&local.hist);
            }
            w.peak_use = w.peak_use.max(use_now);
            let dt = (now - w.use_at_us).max(0.0);
            let alpha = if w.use_at_us <= 0.0 {
                1.0
            } else {
                1.0 - (-dt / SMOOTH_US).exp()
            };
            w.use_ema += alpha * (use_now - w.use_ema);
            w.use_at_us = now;
            if now - w.started_us < window_us {
                *bytes = w.encode();
                return (None, true);
            }
            // The window is over: one controller step, and a fresh window.
            let mean = if w.count > 0.0 {
                w.sum_rtt_us / w.count
            } else {
                0.0
            };
            if mean > 0.0 {
                let a = if w.rtt_ema_us <= 0.0 { 1.0 } else { 0.3 };
                w.rtt_ema_us += a * (mean - w.rtt_ema_us);
            }
            // The upstream's own report, when it made one this window.
            let saturation = (w.sat_count > 0.0).then(|| (w.sat_sum / w.sat_count).clamp(0.0, 1.0));
            if let LimitKind::Adaptive(settings) = &spec.limit {
                let rtt_us = if percentile > 0.0 && !w.hist.is_empty() {
                    w.hist.percentile(percentile)
                } else {
                    mean
                };
                let stats = WindowStats {
                    count: w.count,
                    rtt_us,
                    drops: w.drops,
                    peak_use: w.peak_use,
                    saturated: saturation.is_some_and(|s| s >= shedding.levels.critical),
                };
                controller::step(settings, &mut w.control, stats, now_us, jitter);
            }
            let mut reject = 0.0;
            if let Some(sr) = &spec.success_rate {
                let elapsed_ms = (now - w.started_us) / 1_000.0;
                let fade = controller::fade(sr, elapsed_ms);
                w.sr_total = w.sr_total * fade + w.count;
                w.sr_ok = w.sr_ok * fade + (w.count - w.errors);
                reject = controller::rejection(sr, w.sr_total, w.sr_ok);
            }
            let limit = match &spec.limit {
                LimitKind::Adaptive(settings) => controller::effective(settings, &w.control),
                LimitKind::Static(n) => *n,
            };
            let use_now = w.use_ema.max(saturation.unwrap_or(0.0));
            let published = (limit, w.rtt_ema_us, reject, use_now, saturation);
            w.started_us = now;
            w.count = 0.0;
            w.sum_rtt_us = 0.0;
            w.errors = 0.0;
            w.drops = 0.0;
            w.peak_use = 0.0;
            w.sat_sum = 0.0;
            w.sat_count = 0.0;
            w.hist = Histogram::default();
            *bytes = w.encode();
            (Some(published), true)
        });
        let ended = match ended {
            Ok(ended) => {
                if let Some(s) = samples.get_mut(id) {
                    *s = Samples::default();
                }
                ended
            }
            // Kept for the next tick.
            Err(_) => None,
        };
        let gauge = match ended {
            Some((limit, rtt_us, reject, use_ema, saturation)) => {
                if spec.saturation_header.is_some() {
                    publish_saturation(store, &spec.saturation_key, saturation.unwrap_or(0.0));
                }
                store::update(store, &spec.gauge_key, |bytes| {
                    let mut g = Gauge::decode(bytes);
                    g.limit = limit;
                    g.rtt_us = rtt_us.min(u32::MAX as f64) as u32;
                    g.reject_ppm = (reject * 1e6).clamp(0.0, 1e6) as u32;
                    g.use_milli = (use_ema * 1_000.0).clamp(0.0, 1e6) as u32;
                    *bytes = g.encode();
                    (g, true)
                })
                .unwrap_or(gauge)
            }
            None => gauge,
        };
        gauges.push(gauge);
    }
    gauges
}

/// Publishes the upstream's saturation the window reported (0: none), for admissions.
fn publish_saturation(store: &mut dyn Store, key: &str, saturation: f64) {
    let _ = store::update(store, key, |bytes| {
        *bytes = saturation.to_le_bytes().to_vec();
        ((), true)
    });
}

fn read_gauge(store: &mut dyn Store, key: &str) -> Gauge {
    match store.get(key) {
        Ok(Some((bytes, _))) => Gauge::decode(&bytes),
        _ => Gauge::default(),
    }
}

/// The proxy's load for its sync: in flight over the limits, summed over bulkheads; the share
/// shed since the last report (whose counts it takes); the mean of the smoothed latencies.
pub fn load_report(shedding: &Shedding, store: &mut dyn Store) -> LoadReport {
    let (mut in_flight, mut limits, mut offered, mut shed, mut rtt, mut rtts) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (id, spec) in shedding.bulkheads.iter().enumerate() {
        let gauge = read_gauge(store, &spec.gauge_key);
        in_flight += gauge.in_flight as f64;
        limits += limit_of(shedding, id, &gauge).max(1) as f64;
        if gauge.rtt_us > 0 {
            rtt += gauge.rtt_us as f64;
            rtts += 1.0;
        }
        let taken = store::update(store, &spec.window_key, |bytes| {
            let mut w = Window::decode(bytes);
            let taken = (w.report_offered, w.report_shed);
            w.report_offered = 0.0;
            w.report_shed = 0.0;
            *bytes = w.encode();
            (taken, true)
        });
        if let Ok((o, s)) = taken {
            offered += o;
            shed += s;
        }
    }
    LoadReport {
        utilization: if limits > 0.0 {
            in_flight / limits
        } else {
            0.0
        },
        shed_rate: if offered > 0.0 {
            (shed / offered).clamp(0.0, 1.0)
        } else {
            0.0
        },
        latency_ms: if rtts > 0.0 {
            rtt / rtts / 1_000.0
        } else {
            0.0
        },
    }
}
