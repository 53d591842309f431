//! What a bulkhead keeps in shared data, so every worker sees it: the [`Gauge`] that requests
//! read and update (in flight, and what the last window decided), and the [`Window`] that
//! workers fold their samples into on their ticks.

use crate::shed::controller::ControlState;
use crate::shed::histogram::{self, Histogram};

/// The hot state of one bulkhead: one read and one compare-and-swap per admission and per
/// release.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauge {
    pub in_flight: u32,
    /// The in-flight limit the last window set (adaptive limits); 0: not set yet.
    pub limit: u32,
    /// Smoothed latency of the upstream, request to response headers; 0: unknown.
    pub rtt_us: u32,
    /// Success-rate rejection probability, in millionths.
    pub reject_ppm: u32,
    /// Smoothed in flight / limit, in thousandths.
    pub use_milli: u32,
    /// Requests waiting in the workers' queues, by class: a new request does not take a slot
    /// a waiter of its class or a more important one could take.
    pub waiting: Vec<u32>,
    /// Requests in flight by class, kept only by a bulkhead whose shedding guarantees some
    /// class a share of the slots (`guaranteed`); empty otherwise.
    pub class_in_flight: Vec<u32>,
}

impl Gauge {
    const LEN: usize = 20;
    /// At most this many classes (the configuration's bound).
    const MAX_CLASSES: usize = 32;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN + 4 * self.waiting.len());
        for v in [
            self.in_flight,
            self.limit,
            self.rtt_us,
            self.reject_ppm,
            self.use_milli,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        // Trailing zeros are not written: an idle queue keeps the gauge at 20 bytes.
        let used = |counts: &[u32]| counts.iter().rposition(|&w| w > 0).map_or(0, |i| i + 1);
        let by_class = used(&self.class_in_flight);
        // With counts by class, every class's waiting count is written first (32 of them), so
        // that the length tells the two layouts apart.
        let waiting = if by_class > 0 {
            Self::MAX_CLASSES
        } else {
            used(&self.waiting)
        };
        for class in 0..waiting {
            b.extend_from_slice(&self.waiting(class).to_le_bytes());
        }
        for n in self.class_in_flight.iter().take(by_class) {
            b.extend_from_slice(&n.to_le_bytes());
        }
        b
    }

    /// In flight in `class`, as counted by class.
    pub fn class_in_flight(&self, class: usize) -> u32 {
        self.class_in_flight.get(class).copied().unwrap_or(0)
    }

    /// Changes the count in flight in `class` by `delta` (never below zero).
    pub fn add_class_in_flight(&mut self, class: usize, delta: i64) {
        add(&mut self.class_in_flight, class, delta);
    }

    /// Waiting in `class`.
    pub fn waiting(&self, class: usize) -> u32 {
        self.waiting.get(class).copied().unwrap_or(0)
    }

    /// Changes the count waiting in `class` by `delta` (never below zero).
    pub fn add_waiting(&mut self, class: usize, delta: i64) {
        add(&mut self.waiting, class, delta);
    }

    /// Decodes; anything malformed (or empty) reads as the initial gauge.
    pub fn decode(bytes: &[u8]) -> Gauge {
        let extra = bytes.len().wrapping_sub(Self::LEN);
        if bytes.len() < Self::LEN || extra % 4 != 0 || extra / 4 > 2 * Self::MAX_CLASSES {
            return Gauge::default();
        }
        let words = extra / 4;
        let (waiting, by_class) = if words > Self::MAX_CLASSES {
            (Self::MAX_CLASSES, words - Self::MAX_CLASSES)
        } else {
            (words, 0)
        };
        let at = |i: usize| {
            bytes
                .get(i * 4..i * 4 + 4)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u32::from_le_bytes)
        };
        Gauge {
            in_flight: at(0),
            limit: at(1),
            rtt_us: at(2),
            reject_ppm: at(3),
            use_milli: at(4),
            waiting: (0..waiting).map(|i| at(5 + i)).collect(),
            class_in_flight: (0..by_class).map(|i| at(5 + waiting + i)).collect(),
        }
    }

    pub fn utilization(&self) -> f64 {
        self.use_milli as f64 / 1_000.0
    }
}

/// Changes `counts[class]` by `delta`, within [0, u32::MAX]; a class past the configuration's
/// bound is not counted.
fn add(counts: &mut Vec<u32>, class: usize, delta: i64) {
    if class >= Gauge::MAX_CLASSES {
        return;
    }
    if counts.len() <= class {
        counts.resize(class + 1, 0);
    }
    if let Some(w) = counts.get_mut(class) {
        *w = (*w as i64 + delta).clamp(0, u32::MAX as i64) as u32;
    }
}

/// The bulkhead's window: samples since the window started, and the controller's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    pub started_us: f64,
    /// Requests that got response headers, their summed latency, 5xx among them, and timeouts.
    pub count: f64,
    pub sum_rtt_us: f64,
    pub errors: f64,
    pub drops: f64,
    /// The highest in flight / limit a tick saw.
    pub peak_use: f64,
    pub control: ControlState,
    /// Success-rate counts, fading with the success-rate window.
    pub sr_total: f64,
    pub sr_ok: f64,
    /// Smoothed in flight / limit, and when it was last sampled.
    pub use_ema: f64,
    pub use_at_us: f64,
    /// Smoothed latency.
    pub rtt_ema_us: f64,
    /// Requests offered and shed since the last load report.
    pub report_offered: f64,
    pub report_shed: f64,
    /// The upstream's saturation reports in the window (`saturation_header`): their sum and
    /// count.
    pub sat_sum: f64,
    pub sat_count: f64,
    /// The window's latencies, for a controller that measures a percentile (else empty).
    pub hist: Histogram,
}

impl Window {
    const FIELDS: usize = 22;
    /// The layout before `at_min` and the saturation reports, read as they were.
    const OLD_FIELDS: usize = 19;

    fn fields(&self) -> [f64; Self::FIELDS] {
        [
            self.started_us,
            self.count,
            self.sum_rtt_us,
            self.errors,
            self.drops,
            self.peak_use,
            self.control.limit,
            self.control.baseline_us,
            self.control.next_probe_us,
            self.control.probe_saved,
            self.sr_total,
            self.sr_ok,
            self.use_ema,
            self.use_at_us,
            self.rtt_ema_us,
            self.report_offered,
            self.report_shed,
            self.control.probe_clean,
            self.control.probe_windows,
            self.control.at_min,
            self.sat_sum,
            self.sat_count,
        ]
    }

    /// The fields, then the histogram if it holds any latency.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::FIELDS * 8 + histogram::BYTES);
        for f in self.fields() {
            out.extend_from_slice(&f.to_le_bytes());
        }
        if !self.hist.is_empty() {
            self.hist.encode_into(&mut out);
        }
        out
    }

    /// Decodes; anything malformed (or empty) reads as a fresh window. A value that is not
    /// finite reads as 0.
    pub fn decode(bytes: &[u8]) -> Window {
        let fields = Self::FIELDS * 8;
        let hist = match bytes.len() {
            n if n == Self::OLD_FIELDS * 8 || n == fields => Histogram::default(),
            n if n == fields + histogram::BYTES => {
                Histogram::decode(bytes.get(fields..).unwrap_or_default())
            }
            _ => return Window::default(),
        };
        let f = |i: usize| {
            let v = bytes
                .get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0.0, f64::from_le_bytes);
            if v.is_finite() {
                v
            } else {
                0.0
            }
        };
        Window {
            started_us: f(0),
            count: f(1),
            sum_rtt_us: f(2),
            errors: f(3),
            drops: f(4),
            peak_use: f(5),
            control: ControlState {
                limit: f(6),
                baseline_us: f(7),
                next_probe_us: f(8),
                probe_saved: f(9),
                probe_clean: f(17),
                probe_windows: f(18),
                at_min: f(19),
            },
            sr_total: f(10),
            sr_ok: f(11),
            use_ema: f(12),
            use_at_us: f(13),
            rtt_ema_us: f(14),
            report_offered: f(15),
            report_shed: f(16),
            sat_sum: f(20),
            sat_count: f(21),
            hist,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauge_and_window_round_trip_and_garbage_reads_as_fresh() {
        let g = Gauge {
            in_flight: 3,
            limit: 12,
            rtt_us: 25_000,
            reject_ppm: 10,
            use_milli: 900,
            waiting: vec![0, 3],
            class_in_flight: Vec::new(),
        };
        assert_eq!(Gauge::decode(&g.encode()), g);
        let mut by_class = g.clone();
        by_class.add_class_in_flight(4, 2);
        let bytes = by_class.encode();
        assert_eq!(
            bytes.len(),
            20 + 4 * 32 + 4 * 5,
            "every waiting count, then by class"
        );
        let back = Gauge::decode(&bytes);
        assert_eq!((back.waiting(1), back.class_in_flight(4)), (3, 2));
        by_class.add_class_in_flight(4, -9);
        assert_eq!(
            by_class.encode(),
            g.encode(),
            "none in flight by class: the old layout"
        );
        assert_eq!(Gauge::decode(&[0; 20 + 4 * 65]), Gauge::default());
        let mut idle = g.clone();
        idle.add_waiting(1, -5);
        assert_eq!(idle.encode().len(), 20, "no waiter, no bytes for them");
        assert_eq!(Gauge::decode(&idle.encode()).waiting(1), 0);
        assert_eq!(Gauge::decode(b"short"), Gauge::default());
        let w = Window {
            count: 4.0,
            control: ControlState {
                limit: 12.5,
                ..ControlState::default()
            },
            report_shed: 2.0,
            ..Window::default()
        };
        assert_eq!(Window::decode(&w.encode()), w);
        let mut nan = w.encode();
        nan[8..16].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(Window::decode(&nan).count, 0.0);
        assert_eq!(Window::decode(&[1, 2, 3]), Window::default());
        // With latencies for a percentile, they follow; a window of the layout before reads on.
        let mut with_hist = w;
        with_hist.hist.add(25_000);
        with_hist.sat_sum = 0.5;
        with_hist.sat_count = 1.0;
        let bytes = with_hist.encode();
        assert_eq!(bytes.len(), 22 * 8 + histogram::BYTES);
        assert_eq!(Window::decode(&bytes), with_hist);
        assert_eq!(Window::decode(&bytes[..bytes.len() - 1]), Window::default());
        assert_eq!(Window::decode(&w.encode()[..19 * 8]), w);
    }
}
