//! The validated `shedding` section: bulkheads, classes, levels, as values.

use crate::request::matcher::Matcher;

/// Whether shedding answers 503, or only says what it would shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedMode {
    /// Count what would be shed (metrics) and admit it.
    Monitor,
    /// As `Monitor`, and tell the upstream and the client in a header.
    Warn,
    /// Shed: `503 Service Unavailable`.
    Enforce,
}

impl ShedMode {
    pub fn name(self) -> &'static str {
        match self {
            ShedMode::Monitor => "monitor",
            ShedMode::Warn => "warn",
            ShedMode::Enforce => "enforce",
        }
    }
}

/// A priority class: its name and the utilization above which it is shed.
#[derive(Debug, Clone, PartialEq)]
pub struct Class {
    pub name: String,
    /// Shed when in flight / limit (or the fleet level) is at or above this; `None`: never shed.
    pub threshold: Option<f64>,
}

/// Class index within [`Shedding::classes`].
pub type ClassId = usize;

/// The utilizations at which the degradation level rises.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Levels {
    pub elevated: f64,
    pub high: f64,
    pub critical: f64,
}

impl Default for Levels {
    fn default() -> Levels {
        Levels {
            elevated: 0.70,
            high: 0.85,
            critical: 0.95,
        }
    }
}

/// The load level the upstream is told about in the degradation header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    #[default]
    Normal,
    Elevated,
    High,
    Critical,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Normal => "normal",
            Level::Elevated => "elevated",
            Level::High => "high",
            Level::Critical => "critical",
        }
    }
}

impl Levels {
    pub fn level(&self, utilization: f64) -> Level {
        if utilization >= self.critical {
            Level::Critical
        } else if utilization >= self.high {
            Level::High
        } else if utilization >= self.elevated {
            Level::Elevated
        } else {
            Level::Normal
        }
    }
}

/// How a bulkhead's in-flight limit is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitKind {
    Static(u32),
    Adaptive(Adaptive),
}

/// The adaptive limit's controller settings (see [`crate::shed::controller`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    pub min: u32,
    pub max: u32,
    pub initial: u32,
    /// How much slower than its no-load latency the upstream may get before the limit shrinks.
    pub tolerance: f64,
    /// One controller step per window.
    pub window_ms: u64,
    /// How often the limit drops to `min` for one window to re-measure the no-load latency.
    pub probe_interval_ms: u64,
    /// The latency percentile the controller measures (each window's and the no-load one), in
    /// (0, 100); 0: the mean.
    pub percentile: f64,
}

/// A probabilistic shedding curve: the share of requests shed at a utilization, instead of a
/// step at a class's threshold. Points of (utilization, share), both increasing; nothing is
/// shed below the first point, the share is interpolated linearly between points and stays at
/// the last point's above it.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    pub points: Vec<(f64, f64)>,
}

impl Curve {
    /// The share of requests shed at `utilization`.
    pub fn share(&self, utilization: f64) -> f64 {
        let mut below: Option<(f64, f64)> = None;
        for &(at, share) in &self.points {
            if utilization < at {
                return match below {
                    None => 0.0,
                    Some((a0, s0)) => s0 + (share - s0) * (utilization - a0) / (at - a0),
                };
            }
            below = Some((at, share));
        }
        below.map_or(0.0, |(_, share)| share)
    }
}

/// Parses an upstream's saturation report (a response header's value) strictly: a utilization
/// as a fraction (`0.85`, 0 to 1) or a percentage (`85%`, 0 to 100), digits with at most one
/// point. Anything else (a sign, an exponent, `NaN`, a value out of range, more than 16
/// characters) is no report.
pub fn parse_saturation(value: &str) -> Option<f64> {
    let value = value.trim();
    let (number, percent) = match value.strip_suffix('%') {
        Some(n) => (n, true),
        None => (value, false),
    };
    let digits_ok = !number.is_empty()
        && number.len() <= 16
        && number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && number.bytes().filter(|&b| b == b'.').count() <= 1
        && number.bytes().any(|b| b.is_ascii_digit());
    if !digits_ok {
        return None;
    }
    let n: f64 = number.parse().ok()?;
    let fraction = if percent { n / 100.0 } else { n };
    (fraction.is_finite() && (0.0..=1.0).contains(&fraction)).then_some(fraction)
}

/// Which waiter leaves a full queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    /// The one that waited longest (it is the likeliest to time out anyway).
    Oldest,
    /// The one arriving.
    Newest,
}

/// A bounded wait for a slot instead of an immediate 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePolicy {
    /// Waiters per worker.
    pub size: u32,
    pub max_wait_ms: u64,
    pub drop: Drop,
}

/// Rejection by the recent success rate, as Envoy's `admission_control`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuccessRate {
    /// The success rate below which requests start being rejected, in (0, 1].
    pub threshold: f64,
    /// How steeply the rejection probability rises (1: linear).
    pub aggression: f64,
    /// Fewer requests than this in the window never reject.
    pub min_requests: u32,
    /// How long a result counts (it fades with this time constant).
    pub window_ms: u64,
    /// The rejection probability never goes above this, so some traffic still probes.
    pub max_rejection: f64,
}

/// One bulkhead: the requests to one upstream (cluster or route), limited together.
#[derive(Debug, Clone, PartialEq)]
pub struct Bulkhead {
    pub name: String,
    pub matcher: Matcher,
    pub limit: LimitKind,
    pub queue: Option<QueuePolicy>,
    /// The route's timeout: the deadline of requests that carry none of their own.
    pub timeout_ms: Option<u64>,
    pub success_rate: Option<SuccessRate>,
    /// Requests shed from level `high` up, before any class is.
    pub expensive: Vec<Matcher>,
    /// Whether it sheds, or only says what it would (the shedding's `mode` unless its own).
    pub mode: ShedMode,
    /// In enforce mode, the share of would-be sheds actually shed, in percent (100: all).
    pub ramp_percent: u8,
    /// Each class's threshold in this bulkhead, by [`ClassId`]: the shedding's `classes`, with
    /// the bulkhead's own `classes` over them.
    pub thresholds: Vec<Option<f64>>,
    /// Sheds the classes that can be shed at random below their thresholds, by utilization.
    pub curve: Option<Curve>,
    /// The upstream's response header reporting its own saturation, if it counts.
    pub saturation_header: Option<String>,
    /// Shared-data key of its [`crate::shed::Gauge`].
    pub gauge_key: String,
    /// Shared-data key of its controller window.
    pub window_key: String,
    /// Shared-data key of the upstream's last window's saturation report (with a
    /// `saturation_header`).
    pub saturation_key: String,
}

impl Bulkhead {
    /// The threshold of `class` in this bulkhead; `None`: never shed.
    pub fn threshold(&self, class: ClassId) -> Option<f64> {
        self.thresholds.get(class).copied().flatten()
    }

    /// Whether a would-be shed of this bulkhead is shed: enforce mode, within the ramp's share.
    /// `draw` is the request's uniform draw in [0, 1); the ramp's share is taken from a hash
    /// of it, so that it is independent of the success-rate rejection that compares the same
    /// draw.
    pub fn enforces(&self, draw: f64) -> bool {
        match self.mode {
            ShedMode::Enforce if self.ramp_percent >= 100 => true,
            ShedMode::Enforce => {
                crate::protocol::fnv1a(&draw.to_bits().to_le_bytes()) % 100
                    < self.ramp_percent as u64
            }
            ShedMode::Monitor | ShedMode::Warn => false,
        }
    }

    /// Whether the curve sheds a request of a class that can be shed, at `utilization`, by the
    /// request's uniform `draw` (hashed, so that it is independent of the success-rate
    /// rejection and the ramp, which read the same draw).
    pub fn curve_sheds(&self, utilization: f64, draw: f64) -> bool {
        let Some(curve) = &self.curve else {
            return false;
        };
        let mut bytes = [0u8; 9];
        bytes[..8].copy_from_slice(&draw.to_bits().to_le_bytes());
        bytes[8] = b'c';
        let hashed = (crate::protocol::fnv1a(&bytes) >> 11) as f64 / (1u64 << 53) as f64;
        hashed < curve.share(utilization)
    }

    /// The adaptive controller's window, or a default for static limits (they still measure
    /// latency, errors and utilization).
    pub fn window_ms(&self) -> u64 {
        match self.limit {
            LimitKind::Adaptive(a) => a.window_ms,
            LimitKind::Static(_) => 100,
        }
    }
}

/// Bulkhead index within [`Shedding::bulkheads`].
pub type BulkheadId = usize;

/// The whole `shedding` section.
#[derive(Debug, Clone, PartialEq)]
pub struct Shedding {
    /// The default of every bulkhead's `mode` (each bulkhead's own is in force).
    pub mode: ShedMode,
    /// The request header that names the class (set by a trusted filter).
    pub class_header: Option<String>,
    pub classes: Vec<Class>,
    /// Classes by route, for requests the class header does not name: the first match wins.
    pub class_routes: Vec<(Matcher, ClassId)>,
    pub default_class: ClassId,
    /// Exact paths never shed nor counted (health checks).
    pub never_shed_paths: Vec<String>,
    pub levels: Levels,
    /// The request header that tells the upstream the level; `None`: not sent.
    pub degradation_header: Option<String>,
    /// Whether the fleet level from the counter service counts.
    pub fleet: bool,
    /// How far above a bulkhead's own smoothed utilization the fleet level is believed, in
    /// [0, 1] (1: fully).
    pub fleet_margin: f64,
    pub retry_after_s: u64,
    pub bulkheads: Vec<Bulkhead>,
    /// The policy's `docs_url`, which its 503s name.
    pub docs_url: Option<String>,
    /// Each class's guaranteed share of every bulkhead's limit, by [`ClassId`] (0: none); empty
    /// when no class has one. As Netflix's partitioned limiter: a request of a class under its
    /// share is never shed for `concurrency` or `priority`, even with the bulkhead full.
    pub guaranteed: Vec<f64>,
}

/// The default classes, as in the seed: free, basic, premium, enterprise, critical.
pub fn default_classes() -> Vec<Class> {
    [
        ("free", Some(0.70)),
        ("basic", Some(0.80)),
        ("premium", Some(0.90)),
        ("enterprise", Some(0.95)),
        ("critical", None),
    ]
    .into_iter()
    .map(|(name, threshold)| Class {
        name: name.into(),
        threshold,
    })
    .collect()
}

impl Shedding {
    /// The class a header value names, if it names one.
    pub fn named_class(&self, value: Option<&str>) -> Option<ClassId> {
        value.and_then(|v| {
            let v = v.trim();
            self.classes
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(v))
        })
    }

    /// The slots `class` is guaranteed of `limit`, if it has a share: the share of the limit,
    /// rounded up, at least one.
    pub fn guaranteed_slots(&self, class: ClassId, limit: f64) -> Option<f64> {
        let share = self.guaranteed.get(class).copied().unwrap_or(0.0);
        (share > 0.0).then(|| (share * limit).ceil().max(1.0))
    }

    /// Higher is more important: classes never shed first, then by threshold.
    pub fn rank(&self, class: ClassId) -> f64 {
        self.classes
            .get(class)
            .map_or(0.0, |c| c.threshold.unwrap_or(f64::INFINITY))
    }
}
