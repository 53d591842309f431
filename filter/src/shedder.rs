//! Shedding, worker side: the metrics of each bulkhead, the samples requests leave for the
//! tick, and the wait queue. The root's tick folds the samples ([`sluice_core::shed::tick`]),
//! seats waiters that found a slot and sheds those whose wait ran out. Only the root acts on
//! other requests' streams: an HTTP context that did would re-enter the SDK's dispatcher.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use sluice_core::reply::{overloaded, Protocol};
use sluice_core::shed::admission::{level, limit_of};
use sluice_core::shed::policy::BulkheadId;
use sluice_core::shed::{self, Samples, Seat, ShedReason, Shedding, WaitQueue, Waiter};
use sluice_core::Reply;

use crate::host::{self, SharedData};

/// Metric ids of one bulkhead.
#[derive(Debug, Clone, Default)]
struct BulkheadMetrics {
    admitted: u32,
    queued: u32,
    shed: HashMap<&'static str, u32>,
    would_shed: HashMap<&'static str, u32>,
    class_shed: Vec<u32>,
    in_flight: u32,
    limit: u32,
    use_pct: u32,
    latency_ms: u32,
    rtt_ms: u32,
}

fn define(kind: MetricType, name: &str) -> u32 {
    hostcalls::define_metric(kind, name).unwrap_or(0)
}

/// How a wait in the queue ended, for the request to learn when it next runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    Seated { at_us: u64 },
    Shed,
}

/// What a worker keeps for shedding.
#[derive(Debug, Default)]
pub struct Shedder {
    metrics: Vec<BulkheadMetrics>,
    samples: RefCell<Vec<Samples>>,
    queue: RefCell<WaitQueue>,
    ended: RefCell<HashMap<u32, WaitEnd>>,
    /// Waiters a newer one pushed out of a full queue, shed by the next tick.
    evicted: RefCell<Vec<Waiter>>,
    /// The waiters that are gRPC requests: shed, they get a gRPC answer.
    grpc: RefCell<HashSet<u32>>,
    /// The fleet level, if fresh (the tick refreshes it from the sync state).
    pub fleet: Cell<Option<f64>>,
}

impl Shedder {
    pub fn new(shedding: &Shedding) -> Shedder {
        let metrics = shedding
            .bulkheads
            .iter()
            .map(|b| {
                let name = &b.name;
                let counter = |n: String| define(MetricType::Counter, &n);
                let reasons = |what: &str| {
                    ShedReason::ALL
                        .iter()
                        .map(|r| {
                            let id = counter(format!("sluice.shed.{name}.{what}.{}", r.name()));
                            (r.name(), id)
                        })
                        .collect()
                };
                BulkheadMetrics {
                    admitted: counter(format!("sluice.shed.{name}.admitted")),
                    queued: counter(format!("sluice.shed.{name}.queued")),
                    shed: reasons("shed"),
                    would_shed: reasons("would_shed"),
                    class_shed: shedding
                        .classes
                        .iter()
                        .map(|c| counter(format!("sluice.shed.{name}.class.{}.shed", c.name)))
                        .collect(),
                    in_flight: define(MetricType::Gauge, &format!("sluice.shed.{name}.in_flight")),
                    limit: define(MetricType::Gauge, &format!("sluice.shed.{name}.limit")),
                    use_pct: define(
                        MetricType::Gauge,
                        &format!("sluice.shed.{name}.utilization_pct"),
                    ),
                    rtt_ms: define(MetricType::Gauge, &format!("sluice.shed.{name}.rtt_ms")),
                    latency_ms: define(
                        MetricType::Histogram,
                        &format!("sluice.shed.{name}.latency_ms"),
                    ),
                }
            })
            .collect();
        Shedder {
            metrics,
            samples: RefCell::new(vec![Samples::default(); shedding.bulkheads.len()]),
            ..Shedder::default()
        }
    }

    fn with_samples(&self, bulkhead: BulkheadId, f: impl FnOnce(&mut Samples)) {
        if let Some(s) = self.samples.borrow_mut().get_mut(bulkhead) {
            f(s);
        }
    }

    pub fn admitted(&self, seat: Seat, queued: bool) {
        self.with_samples(seat.bulkhead, |s| s.offered(false));
        if let Some(m) = self.metrics.get(seat.bulkhead) {
            bump(if queued { m.queued } else { m.admitted });
        }
    }

    /// A request shed (or, `would`, one monitor or warn mode let through).
    pub fn shed(&self, seat: Seat, reason: ShedReason, would: bool) {
        let Some(m) = self.metrics.get(seat.bulkhead) else {
            return;
        };
        if would {
            bump(m.would_shed.get(reason.name()).copied().unwrap_or(0));
            return;
        }
        self.with_samples(seat.bulkhead, |s| {
            // Queued requests were offered when they queued.
            if matches!(reason, ShedReason::QueueFull | ShedReason::QueueTimeout) {
                s.shed += 1.0;
            } else {
                s.offered(true);
            }
        });
        bump(m.shed.get(reason.name()).copied().unwrap_or(0));
        bump(m.class_shed.get(seat.class).copied().unwrap_or(0));
    }

    pub fn finished(
        &self,
        bulkhead: BulkheadId,
        latency_us: u64,
        status: u32,
        grpc_status: Option<u32>,
    ) {
        self.with_samples(bulkhead, |s| s.answered(latency_us, status, grpc_status));
        if let Some(m) = self.metrics.get(bulkhead) {
            let _ = hostcalls::record_metric(m.latency_ms, latency_us / 1_000);
        }
    }

    /// Offers a request to the queue: `false` when the queue is full and keeps its waiters
    /// (shed the request now). An older waiter pushed out is shed by the next tick.
    pub fn enqueue(
        &self,
        shedding: &Shedding,
        id: u32,
        seat: Seat,
        now_us: u64,
        wait_budget_us: Option<u64>,
        protocol: Protocol,
    ) -> bool {
        let queued = self.queue.borrow_mut().push(
            shedding,
            id,
            seat,
            now_us,
            wait_budget_us,
            &mut SharedData,
        );
        if protocol == Protocol::Grpc && queued != shed::Queued::Full {
            self.grpc.borrow_mut().insert(id);
        }
        match queued {
            shed::Queued::Waiting => true,
            shed::Queued::Evicted(old) => {
                // Its wait is over: the next tick sheds it.
                self.evicted.borrow_mut().push(old);
                true
            }
            shed::Queued::Full => false,
        }
    }

    /// How a request's wait ended, if it did; forgets it. A request still waiting leaves the
    /// queue (its stream ended).
    pub fn wait_end(&self, shedding: &Shedding, id: u32) -> Option<WaitEnd> {
        self.grpc.borrow_mut().remove(&id);
        let end = self.ended.borrow_mut().remove(&id);
        if end.is_none() {
            self.queue
                .borrow_mut()
                .remove(shedding, id, &mut SharedData);
            self.evicted.borrow_mut().retain(|w| w.id != id);
        }
        end
    }

    /// The root's tick: fold samples, publish gauges, seat waiters, shed expired ones.
    pub fn tick(&self, shedding: &Shedding) {
        let now = host::now_us();
        let gauges = {
            let mut samples = self.samples.borrow_mut();
            shed::tick(
                shedding,
                &mut samples,
                now,
                host::draw(now),
                &mut SharedData,
            )
        };
        for ((id, gauge), m) in gauges.iter().enumerate().zip(&self.metrics) {
            let limit = limit_of(shedding, id, gauge);
            let _ = hostcalls::record_metric(m.in_flight, gauge.in_flight as u64);
            let _ = hostcalls::record_metric(m.limit, limit as u64);
            let _ = hostcalls::record_metric(m.use_pct, gauge.use_milli as u64 / 10);
            let _ = hostcalls::record_metric(m.rtt_ms, gauge.rtt_us as u64 / 1_000);
        }
        let fleet = self.fleet.get();
        // Decide everything first, then act: acting on a stream can call back into this VM.
        let (seated, mut gone) = {
            let mut queue = self.queue.borrow_mut();
            let expired = queue.expired(shedding, now, &mut SharedData);
            let seated = queue.admit(shedding, fleet, &mut SharedData);
            (seated, expired)
        };
        let mut evicted: Vec<Waiter> = self.evicted.borrow_mut().drain(..).collect();
        {
            let mut ended = self.ended.borrow_mut();
            for w in &seated {
                ended.insert(w.id, WaitEnd::Seated { at_us: now });
            }
            for w in gone.iter().chain(&evicted) {
                ended.insert(w.id, WaitEnd::Shed);
            }
        }
        // The gRPC requests among those shed now; none of them waits any more.
        let mut grpc_shed = HashSet::new();
        {
            let mut grpc = self.grpc.borrow_mut();
            for w in seated.iter().chain(&gone).chain(&evicted) {
                if grpc.remove(&w.id) {
                    grpc_shed.insert(w.id);
                }
            }
        }
        for w in seated {
            if hostcalls::set_effective_context(w.id).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
        let mut shed: Vec<(Waiter, ShedReason)> = gone
            .drain(..)
            .map(|w| (w, ShedReason::QueueTimeout))
            .collect();
        shed.extend(evicted.drain(..).map(|w| (w, ShedReason::QueueFull)));
        for (w, reason) in shed {
            self.shed(w.seat, reason, false);
            let gauge = shed::admission::gauge(shedding, w.seat.bulkhead, &mut SharedData);
            let reply = overloaded(
                shedding,
                w.seat,
                level(shedding, &gauge, fleet),
                reason,
                host::draw(now),
                match grpc_shed.contains(&w.id) {
                    true => Protocol::Grpc,
                    false => Protocol::Http,
                },
            );
            if hostcalls::set_effective_context(w.id).is_ok() {
                respond(&reply);
            }
        }
    }
}

/// Sends a local reply on the effective context.
pub fn respond(reply: &Reply) {
    crate::host::respond(reply);
}

fn bump(id: u32) {
    if id != 0 {
        let _ = hostcalls::increment_metric(id, 1);
    }
}
