//! The shedding decision of one request, and the in-flight slot it holds until its stream ends.
//!
//! A request matches at most one bulkhead (the first whose matcher matches). Its class comes
//! from the class header, else from the first class route it matches, else the default. Then, in this order, it is shed when:
//! 1. `degraded`: the level is `high` or above and the request is one of the bulkhead's
//!    expensive ones;
//! 2. `fleet`: the fleet level from the counter service, as far as it is believed (at most the
//!    bulkhead's own utilization plus `fleet_margin`), is at or above its class's threshold;
//! 3. `errors`: a draw falls under the success-rate rejection probability;
//! 4. `deadline`: its own deadline is shorter than the upstream's current latency;
//! 5. `concurrency` / `priority`: in flight is at the limit, or at its class's share of it.
//!    These two may wait in the bulkhead's queue instead. Neither sheds a request whose class
//!    is under its guaranteed share of the limit (`guaranteed`, as Netflix's partitioned limiter).
//!
//! A class without a threshold (`critical`) is never shed, but counted in flight. Paths in
//! `never_shed_paths` and requests of no bulkhead are neither shed nor counted.

use crate::request::RequestView;
use crate::shed::policy::{Bulkhead, BulkheadId, ClassId, Level, LimitKind, Shedding};
use crate::shed::state::Gauge;
use crate::store::{self, Store, StoreError};

/// Why a request was (or would have been) shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShedReason {
    Concurrency,
    Priority,
    Deadline,
    Errors,
    Degraded,
    Fleet,
    QueueFull,
    QueueTimeout,
}

impl ShedReason {
    pub const ALL: [ShedReason; 8] = [
        ShedReason::Concurrency,
        ShedReason::Priority,
        ShedReason::Deadline,
        ShedReason::Errors,
        ShedReason::Degraded,
        ShedReason::Fleet,
        ShedReason::QueueFull,
        ShedReason::QueueTimeout,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ShedReason::Concurrency => "concurrency",
            ShedReason::Priority => "priority",
            ShedReason::Deadline => "deadline",
            ShedReason::Errors => "errors",
            ShedReason::Degraded => "degraded",
            ShedReason::Fleet => "fleet",
            ShedReason::QueueFull => "queue_full",
            ShedReason::QueueTimeout => "queue_timeout",
        }
    }

    /// Whether waiting for a slot could help.
    fn queueable(self) -> bool {
        matches!(self, ShedReason::Concurrency | ShedReason::Priority)
    }
}

/// What the host knows besides the request, for shedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    pub now_us: u64,
    /// The fleet level from the counter service's last answer, if fresh.
    pub fleet: Option<f64>,
    /// A uniform draw in [0, 1), for the success-rate rejection.
    pub draw: f64,
}

/// A request's place in its bulkhead: what it holds and who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub bulkhead: BulkheadId,
    pub class: ClassId,
}

/// The shedding decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Not governed: no bulkhead, a never-shed path, or no shedding configured.
    Exempt { level: Level },
    /// Holds a slot until [`release`]. `would_shed`: what monitor and warn modes (or an enforce
    /// mode's ramp, outside its share) let through.
    Admitted {
        seat: Seat,
        level: Level,
        would_shed: Option<ShedReason>,
    },
    /// May wait for a slot ([`admit_waiter`]); holds none yet.
    Queue {
        seat: Seat,
        level: Level,
        reason: ShedReason,
        /// How long it may wait before it would miss its own deadline, if it has one.
        wait_budget_us: Option<u64>,
    },
    Shed {
        seat: Seat,
        level: Level,
        reason: ShedReason,
    },
}

/// A request's own deadline, in microseconds from now: `x-envoy-expected-rq-timeout-ms`,
/// `grpc-timeout`, or the bulkhead's `timeout_ms`.
pub fn deadline_us(request: &mut dyn RequestView, fallback_ms: Option<u64>) -> Option<u64> {
    let envoy = request
        .header("x-envoy-expected-rq-timeout-ms")
        .first()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|ms| ms.saturating_mul(1_000));
    let grpc = || {
        request
            .header("grpc-timeout")
            .first()
            .and_then(|v| grpc_timeout_us(v))
    };
    envoy
        .or_else(grpc)
        .or(fallback_ms.map(|ms| ms.saturating_mul(1_000)))
}

/// Parses a gRPC `grpc-timeout` value (1 to 8 digits and a unit: H, M, S, m, u, n).
pub fn grpc_timeout_us(value: &str) -> Option<u64> {
    let value = value.trim();
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => n.saturating_mul(3_600_000_000),
        "M" => n.saturating_mul(60_000_000),
        "S" => n.saturating_mul(1_000_000),
        "m" => n.saturating_mul(1_000),
        "u" => n,
        "n" => n / 1_000,
        _ => return None,
    })
}

/// The limit requests of `bulkhead` see now.
pub fn limit_of(shedding: &Shedding, bulkhead: BulkheadId, gauge: &Gauge) -> u32 {
    match shedding.bulkheads.get(bulkhead).map(|b| b.limit) {
        Some(LimitKind::Static(n)) => n,
        Some(LimitKind::Adaptive(a)) => {
            if gauge.limit == 0 {
                a.initial
            } else {
                gauge.limit.clamp(a.min, a.max)
            }
        }
        None => 1,
    }
}

/// The fleet level a bulkhead acts on: the counter service's (`None` if `fleet` is off), but
/// never above the bulkhead's own smoothed utilization plus `fleet_margin`. The service's level
/// is the mean of what the proxies report, so whoever holds a proxy credential can push it up; a
/// level far above what this proxy measures itself is not believed.
pub fn believed_fleet(shedding: &Shedding, gauge: &Gauge, fleet: Option<f64>) -> Option<f64> {
    let fleet = fleet.filter(|f| shedding.fleet && !f.is_nan())?;
    Some(
        fleet
            .clamp(0.0, 1.0)
            .min(gauge.utilization() + shedding.fleet_margin),
    )
}

/// The level from the smoothed local use and the fleet level (as far as it is believed).
pub fn level(shedding: &Shedding, gauge: &Gauge, fleet: Option<f64>) -> Level {
    let fleet = believed_fleet(shedding, gauge, fleet).unwrap_or(0.0);
    shedding.levels.level(gauge.utilization().max(fleet))
}

/// The bulkhead a request belongs to and its class; `None` when shedding does not govern it (a
/// never-shed path, no bulkhead matches).
pub fn classify(shedding: &Shedding, request: &mut dyn RequestView) -> Option<Seat> {
    let path = request.path();
    if shedding.never_shed_paths.iter().any(|p| p == path) {
        return None;
    }
    let bulkhead = shedding
        .bulkheads
        .iter()
        .position(|b| b.matcher.matches(request))?;
    let named = shedding.class_header.as_ref().and_then(|header| {
        let values = request.header(header);
        shedding.named_class(values.first().map(String::as_str))
    });
    let class = named
        .or_else(|| {
            shedding
                .class_routes
                .iter()
                .find(|(m, _)| m.matches(request))
                .map(|&(_, class)| class)
        })
        .unwrap_or(shedding.default_class);
    Some(Seat { bulkhead, class })
}

/// Decides one request, taking its slot when it is admitted. In monitor and warn modes (and an
/// enforce mode's ramp, outside its share) a would-be shed is admitted with `would_shed`.
pub fn admit(
    shedding: &Shedding,
    request: &mut dyn RequestView,
    pressure: Pressure,
    store: &mut dyn Store,
) -> Admission {
    let Some(seat) = classify(shedding, request) else {
        return Admission::Exempt {
            level: Level::Normal,
        };
    };
    let Some(spec) = shedding.bulkheads.get(seat.bulkhead) else {
        return Admission::Exempt {
            level: Level::Normal,
        };
    };
    let (bulkhead, class) = (seat.bulkhead, seat.class);
    let threshold = spec.threshold(class);
    let expensive = spec.expensive.iter().any(|m| m.matches(request));
    let deadline = deadline_us(request, spec.timeout_ms);

    let decided = store::update(store, &spec.gauge_key, |bytes| {
        let mut gauge = Gauge::decode(bytes);
        let fleet = believed_fleet(shedding, &gauge, pressure.fleet);
        let level = level(shedding, &gauge, pressure.fleet);
        let limit = limit_of(shedding, bulkhead, &gauge) as f64;
        let in_flight = gauge.in_flight as f64;
        // Under its guaranteed share, a class takes a slot even from a full bulkhead.
        let under_guarantee = shedding
            .guaranteed_slots(class, limit)
            .is_some_and(|g| (gauge.class_in_flight(class) as f64) < g);
        let reason = threshold.and_then(|t| {
            if expensive && level >= Level::High {
                Some(ShedReason::Degraded)
            } else if fleet.is_some_and(|f| f >= t) {
                Some(ShedReason::Fleet)
            } else if pressure.draw < gauge.reject_ppm as f64 / 1e6 {
                Some(ShedReason::Errors)
            } else if deadline.is_some_and(|d| gauge.rtt_us > 0 && d < gauge.rtt_us as u64) {
                Some(ShedReason::Deadline)
            } else if in_flight >= limit && !under_guarantee {
                Some(ShedReason::Concurrency)
            } else if in_flight >= t * limit && !under_guarantee {
                Some(ShedReason::Priority)
            } else {
                None
            }
        });
        let enforce = spec.enforces(pressure.draw);
        // A slot a waiter of this class or a more important one could take now is theirs:
        // the newcomer queues behind them (waiters are seated on their worker's tick).
        let behind = reason.is_none()
            && !under_guarantee
            && threshold.is_some()
            && spec.queue.is_some()
            && waiter_ahead(shedding, spec, &gauge, class, in_flight, limit);
        let reason = if behind {
            Some(ShedReason::Concurrency)
        } else {
            reason
        };
        match reason {
            Some(reason) if enforce => {
                let admission = if reason.queueable() && spec.queue.is_some() {
                    Admission::Queue {
                        seat,
                        level,
                        reason,
                        wait_budget_us: deadline.map(|d| d.saturating_sub(gauge.rtt_us as u64)),
                    }
                } else {
                    Admission::Shed {
                        seat,
                        level,
                        reason,
                    }
                };
                (admission, false)
            }
            would_shed => {
                gauge.in_flight = gauge.in_flight.saturating_add(1);
                if !shedding.guaranteed.is_empty() {
                    gauge.add_class_in_flight(class, 1);
                }
                *bytes = gauge.encode();
                let admitted = Admission::Admitted {
                    seat,
                    level,
                    would_shed,
                };
                (admitted, true)
            }
        }
    });
    // Shared data that cannot be used must not take the upstream's traffic down with it.
    decided.unwrap_or(Admission::Exempt {
        level: Level::Normal,
    })
}

/// Takes a slot for a waiter if its class may have one now.
pub fn admit_waiter(
    shedding: &Shedding,
    seat: Seat,
    fleet: Option<f64>,
    store: &mut dyn Store,
) -> Result<bool, StoreError> {
    let Some(spec) = shedding.bulkheads.get(seat.bulkhead) else {
        return Ok(false);
    };
    let threshold = spec.threshold(seat.class).unwrap_or(1.0);
    store::update(store, &spec.gauge_key, |bytes| {
        let mut gauge = Gauge::decode(bytes);
        let fleet = believed_fleet(shedding, &gauge, fleet);
        let limit = limit_of(shedding, seat.bulkhead, &gauge) as f64;
        let under_guarantee = shedding
            .guaranteed_slots(seat.class, limit)
            .is_some_and(|g| (gauge.class_in_flight(seat.class) as f64) < g);
        let room = (gauge.in_flight as f64) < threshold * limit && (gauge.in_flight as f64) < limit;
        if !(room || under_guarantee) || fleet.is_some_and(|f| f >= threshold && threshold < 1.0) {
            return (false, false);
        }
        gauge.in_flight = gauge.in_flight.saturating_add(1);
        if !shedding.guaranteed.is_empty() {
            gauge.add_class_in_flight(seat.class, 1);
        }
        gauge.add_waiting(seat.class, -1);
        *bytes = gauge.encode();
        (true, true)
    })
}

/// Counts a waiter in (`delta` 1) or out (-1) of the bulkhead's shared waiting counts.
pub fn count_waiter(
    shedding: &Shedding,
    seat: Seat,
    delta: i64,
    store: &mut dyn Store,
) -> Result<(), StoreError> {
    let Some(spec) = shedding.bulkheads.get(seat.bulkhead) else {
        return Ok(());
    };
    store::update(store, &spec.gauge_key, |bytes| {
        let mut gauge = Gauge::decode(bytes);
        gauge.add_waiting(seat.class, delta);
        *bytes = gauge.encode();
        ((), true)
    })
}

/// Whether a waiter of `class` or of a more important class could take a slot now.
fn waiter_ahead(
    shedding: &Shedding,
    spec: &Bulkhead,
    gauge: &Gauge,
    class: ClassId,
    in_flight: f64,
    limit: f64,
) -> bool {
    let rank = shedding.rank(class);
    gauge.waiting.iter().enumerate().any(|(w, &n)| {
        n > 0 && shedding.rank(w) >= rank && {
            let t = spec.threshold(w).unwrap_or(1.0);
            in_flight < t * limit && in_flight < limit
        }
    })
}

/// Gives a slot back when the stream ends, however it ends.
pub fn release(shedding: &Shedding, seat: Seat, store: &mut dyn Store) -> Result<(), StoreError> {
    let Some(spec) = shedding.bulkheads.get(seat.bulkhead) else {
        return Ok(());
    };
    store::update(store, &spec.gauge_key, |bytes| {
        let mut gauge = Gauge::decode(bytes);
        gauge.in_flight = gauge.in_flight.saturating_sub(1);
        // Counted by class while some class was guaranteed a share (a reload may have removed
        // it since: the counts still come down).
        if !gauge.class_in_flight.is_empty() {
            gauge.add_class_in_flight(seat.class, -1);
        }
        *bytes = gauge.encode();
        ((), true)
    })
}

/// Reads a bulkhead's gauge.
pub fn gauge(shedding: &Shedding, bulkhead: BulkheadId, store: &mut dyn Store) -> Gauge {
    let Some(spec) = shedding.bulkheads.get(bulkhead) else {
        return Gauge::default();
    };
    match store.get(&spec.gauge_key) {
        Ok(Some((bytes, _))) => Gauge::decode(&bytes),
        _ => Gauge::default(),
    }
}

/// The controller's current limit in effect for an adaptive bulkhead (for tests and tools).
pub fn adaptive_limit(shedding: &Shedding, bulkhead: BulkheadId, store: &mut dyn Store) -> u32 {
    let g = gauge(shedding, bulkhead, store);
    limit_of(shedding, bulkhead, &g)
}
