//! What one worker keeps for shedding between its requests and its ticks: the samples its
//! requests leave, its wait queue, the waiters pushed out or timed out, and how each wait ended.
//! The host carries out what [`ShedWorker::tick`] returns (gauges to publish, waiters to resume,
//! replies to send) and bumps the metrics it names; it decides nothing itself.

use std::collections::{HashMap, HashSet};

use crate::reply::{overloaded, Protocol, Reply};
use crate::shed::admission::{self, level, limit_of, Seat, ShedReason};
use crate::shed::policy::{BulkheadId, LimitKind, Shedding};
use crate::shed::queue::{Queued, WaitQueue, Waiter};
use crate::shed::state::Gauge;
use crate::shed::tick::{self, Samples};
use crate::store::Store;

/// How a request's wait in the queue ended, for the request to learn when it next runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    Seated { at_us: u64 },
    Shed,
}

/// One bulkhead's gauge as a tick left it, with the limit in force: what the host publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    pub gauge: Gauge,
    pub limit: u32,
}

/// A waiter shed by a tick: its reply goes to its stream, its shed to the metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct ShedWaiter {
    pub id: u32,
    pub seat: Seat,
    pub reason: ShedReason,
    pub reply: Reply,
}

/// What a tick decided, for the host to carry out in this order: publish the gauges, resume
/// the seated waiters, send the shed ones their replies. Acting on a stream can call back into
/// the VM, so everything is decided before anything is done.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TickPlan {
    /// One per bulkhead, in order.
    pub published: Vec<Published>,
    /// Waiters that found a slot: resume them.
    pub resume: Vec<u32>,
    /// Waiters whose wait ran out (`QueueTimeout`) or that a newer waiter pushed out of a full
    /// queue (`QueueFull`).
    pub shed: Vec<ShedWaiter>,
}

/// A worker's shedding state.
#[derive(Debug, Default)]
pub struct ShedWorker {
    samples: Vec<Samples>,
    queue: WaitQueue,
    ended: HashMap<u32, WaitEnd>,
    /// Waiters a newer one pushed out of a full queue, shed by the next tick.
    evicted: Vec<Waiter>,
    /// The waiters that are gRPC requests: shed, they get a gRPC answer.
    grpc: HashSet<u32>,
    /// By bulkhead: whether its controller measures a latency percentile (its latencies go
    /// into a histogram).
    percentiles: Vec<bool>,
}

impl ShedWorker {
    pub fn new(shedding: &Shedding) -> ShedWorker {
        ShedWorker {
            samples: vec![Samples::default(); shedding.bulkheads.len()],
            percentiles: shedding
                .bulkheads
                .iter()
                .map(|b| matches!(b.limit, LimitKind::Adaptive(a) if a.percentile > 0.0))
                .collect(),
            ..ShedWorker::default()
        }
    }

    fn samples_of(&mut self, bulkhead: BulkheadId) -> Option<&mut Samples> {
        self.samples.get_mut(bulkhead)
    }

    /// The samples left since the last tick, one per bulkhead.
    pub fn samples(&self) -> &[Samples] {
        &self.samples
    }

    /// Requests waiting in this worker's queue.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// A request the bulkhead admitted (at once or from the queue).
    pub fn admitted(&mut self, seat: Seat) {
        if let Some(s) = self.samples_of(seat.bulkhead) {
            s.offered(false);
        }
    }

    /// A request shed. Monitor and warn modes' "would shed" leave no sample: the request went on.
    pub fn shed(&mut self, seat: Seat, reason: ShedReason, would: bool) {
        if would {
            return;
        }
        if let Some(s) = self.samples_of(seat.bulkhead) {
            // Queued requests were offered when they queued.
            if matches!(reason, ShedReason::QueueFull | ShedReason::QueueTimeout) {
                s.shed += 1.0;
            } else {
                s.offered(true);
            }
        }
    }

    /// A response from the upstream (or from the host for it), as a sample for the controller.
    pub fn finished(
        &mut self,
        bulkhead: BulkheadId,
        latency_us: u64,
        status: u32,
        grpc_status: Option<u32>,
    ) {
        let percentile = self.percentiles.get(bulkhead).copied().unwrap_or(false);
        if let Some(s) = self.samples_of(bulkhead) {
            s.answered(latency_us, status, grpc_status);
            if percentile {
                s.hist.add(latency_us);
            }
        }
    }

    /// The upstream reported its saturation on a response (`saturation_header`, parsed).
    pub fn reported(&mut self, bulkhead: BulkheadId, saturation: f64) {
        if let Some(s) = self.samples_of(bulkhead) {
            s.reported(saturation);
        }
    }

    /// Offers a request to the queue: `false` when the queue is full and keeps its waiters
    /// (shed the request now). An older waiter pushed out is shed by the next tick.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &mut self,
        shedding: &Shedding,
        id: u32,
        seat: Seat,
        now_us: u64,
        wait_budget_us: Option<u64>,
        protocol: Protocol,
        store: &mut dyn Store,
    ) -> bool {
        let queued = self
            .queue
            .push(shedding, id, seat, now_us, wait_budget_us, store);
        if protocol == Protocol::Grpc && queued != Queued::Full {
            self.grpc.insert(id);
        }
        match queued {
            Queued::Waiting => true,
            Queued::Evicted(old) => {
                self.evicted.push(old);
                true
            }
            Queued::Full => false,
        }
    }

    /// How a request's wait ended, if it did; forgets it. A request still waiting leaves the
    /// queue (its stream ended), and out of the shared count.
    pub fn wait_end(
        &mut self,
        shedding: &Shedding,
        id: u32,
        store: &mut dyn Store,
    ) -> Option<WaitEnd> {
        self.grpc.remove(&id);
        let end = self.ended.remove(&id);
        if end.is_none() {
            self.queue.remove(shedding, id, store);
            self.evicted.retain(|w| w.id != id);
        }
        end
    }

    /// The worker's tick at `now_us`: folds the samples into the shared windows (the controller
    /// steps when one ends), seats waiters that found a slot, and sheds those whose wait ran out
    /// or that were pushed out. `jitter` is the controller's draw, `draw` the replies'.
    pub fn tick(
        &mut self,
        shedding: &Shedding,
        now_us: u64,
        jitter: f64,
        draw: f64,
        fleet: Option<f64>,
        store: &mut dyn Store,
    ) -> TickPlan {
        let gauges = tick::tick(shedding, &mut self.samples, now_us, jitter, store);
        let published = gauges
            .into_iter()
            .enumerate()
            .map(|(id, gauge)| Published {
                limit: limit_of(shedding, id, &gauge),
                gauge,
            })
            .collect();
        let expired = self.queue.expired(shedding, now_us, store);
        let seated = self.queue.admit(shedding, fleet, store);
        let evicted = std::mem::take(&mut self.evicted);
        let mut plan = TickPlan {
            published,
            ..TickPlan::default()
        };
        for w in seated {
            self.grpc.remove(&w.id);
            self.ended.insert(w.id, WaitEnd::Seated { at_us: now_us });
            plan.resume.push(w.id);
        }
        let gone = expired
            .into_iter()
            .map(|w| (w, ShedReason::QueueTimeout))
            .chain(evicted.into_iter().map(|w| (w, ShedReason::QueueFull)));
        for (w, reason) in gone {
            let protocol = match self.grpc.remove(&w.id) {
                true => Protocol::Grpc,
                false => Protocol::Http,
            };
            self.ended.insert(w.id, WaitEnd::Shed);
            self.shed(w.seat, reason, false);
            let gauge = admission::gauge(shedding, w.seat.bulkhead, store);
            let level = level(shedding, &gauge, fleet);
            plan.shed.push(ShedWaiter {
                id: w.id,
                seat: w.seat,
                reason,
                reply: overloaded(shedding, w.seat, level, reason, draw, protocol)
                    .linking(shedding.docs_url.as_deref()),
            });
        }
        plan
    }
}
