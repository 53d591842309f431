//! Shedding, worker side: the metric ids of each bulkhead, and core's [`ShedWorker`] (the
//! samples, the wait queue, how each wait ended). The root's tick asks core for a plan and
//! carries it out: gauges published, seated waiters resumed, shed ones answered. Only the root
//! acts on other requests' streams: an HTTP context that did would re-enter the SDK's dispatcher.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use sluice_core::reply::Protocol;
use sluice_core::shed::policy::BulkheadId;
use sluice_core::shed::{Seat, ShedReason, Shedding};
use sluice_core::worker::{ShedWorker, WaitEnd};
use sluice_core::{Policy, Reply};

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

/// What a worker keeps for shedding: the metric ids, and core's state of the worker.
#[derive(Debug, Default)]
pub struct Shedder {
    metrics: Vec<BulkheadMetrics>,
    worker: RefCell<ShedWorker>,
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
            worker: RefCell::new(ShedWorker::new(shedding)),
            fleet: Cell::new(None),
        }
    }

    pub fn admitted(&self, seat: Seat, queued: bool) {
        self.worker.borrow_mut().admitted(seat);
        if let Some(m) = self.metrics.get(seat.bulkhead) {
            bump(if queued { m.queued } else { m.admitted });
        }
    }

    /// A request shed (or, `would`, one monitor or warn mode let through).
    pub fn shed(&self, seat: Seat, reason: ShedReason, would: bool) {
        self.worker.borrow_mut().shed(seat, reason, would);
        self.count_shed(seat, reason, would);
    }

    fn count_shed(&self, seat: Seat, reason: ShedReason, would: bool) {
        let Some(m) = self.metrics.get(seat.bulkhead) else {
            return;
        };
        if would {
            bump(m.would_shed.get(reason.name()).copied().unwrap_or(0));
            return;
        }
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
        self.worker
            .borrow_mut()
            .finished(bulkhead, latency_us, status, grpc_status);
        if let Some(m) = self.metrics.get(bulkhead) {
            let _ = hostcalls::record_metric(m.latency_ms, latency_us / 1_000);
        }
    }

    /// The upstream reported its saturation on a response (see [`ShedWorker::reported`]).
    pub fn reported(&self, bulkhead: BulkheadId, saturation: f64) {
        self.worker.borrow_mut().reported(bulkhead, saturation);
    }

    /// See [`ShedWorker::enqueue`].
    pub fn enqueue(
        &self,
        shedding: &Shedding,
        id: u32,
        seat: Seat,
        now_us: u64,
        wait_budget_us: Option<u64>,
        protocol: Protocol,
    ) -> bool {
        self.worker.borrow_mut().enqueue(
            shedding,
            id,
            seat,
            now_us,
            wait_budget_us,
            protocol,
            &mut SharedData,
        )
    }

    /// See [`ShedWorker::wait_end`].
    pub fn wait_end(&self, shedding: &Shedding, id: u32) -> Option<WaitEnd> {
        self.worker
            .borrow_mut()
            .wait_end(shedding, id, &mut SharedData)
    }

    /// The root's tick: core decides ([`ShedWorker::tick`]); this publishes the gauges, resumes
    /// the seated waiters and answers the shed ones.
    pub fn tick(&self, shedding: &Shedding, policy: &Policy) {
        let now = host::now_us();
        let draw = host::draw(now);
        let plan = self.worker.borrow_mut().tick(
            shedding,
            now,
            draw,
            draw,
            self.fleet.get(),
            &mut SharedData,
        );
        for (p, m) in plan.published.iter().zip(&self.metrics) {
            let _ = hostcalls::record_metric(m.in_flight, p.gauge.in_flight as u64);
            let _ = hostcalls::record_metric(m.limit, p.limit as u64);
            let _ = hostcalls::record_metric(m.use_pct, p.gauge.use_milli as u64 / 10);
            let _ = hostcalls::record_metric(m.rtt_ms, p.gauge.rtt_us as u64 / 1_000);
        }
        for id in plan.resume {
            if hostcalls::set_effective_context(id).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
        for w in plan.shed {
            self.count_shed(w.seat, w.reason, false);
            if hostcalls::set_effective_context(w.id).is_ok() {
                respond(&w.reply, policy);
            }
        }
    }
}

/// Sends a local reply on the effective context.
pub fn respond(reply: &Reply, policy: &Policy) {
    crate::host::respond(reply, policy);
}

fn bump(id: u32) {
    if id != 0 {
        let _ = hostcalls::increment_metric(id, 1);
    }
}
