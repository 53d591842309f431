//! A worker's shedding state between requests and ticks ([`ShedWorker`]): what a tick seats,
//! sheds and answers, in which order, and the samples each outcome leaves for the controller.
//! The filter only carries the plan out, so all of this is decided here.

use sluice_core::reply::Protocol;
use sluice_core::shed::admission::gauge;
use sluice_core::shed::{Seat, ShedReason, Shedding};
use sluice_core::worker::{ShedWorker, WaitEnd};
use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};

const MS: u64 = 1_000;
const T0: u64 = 1_700_000_000_000_000;

fn limiter(queue: &str) -> Limiter {
    let json = format!(
        r#"{{"shedding": {{"class_header": "x-class", "classes": {{"high": 0.9, "low": 0.7}},
            "bulkheads": [{{"name": "api", "limit": {{"static": 2}}, "queue": {queue}}}]}}}}"#
    );
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap())
}

fn shedding(limiter: &Limiter) -> Shedding {
    limiter.policy().shedding.clone().unwrap()
}

/// Requests counted as waiting in the bulkhead's shared gauge, over every class.
fn waiting(s: &Shedding, store: &mut MemoryStore) -> u32 {
    let g = gauge(s, 0, store);
    (0..8).map(|class| g.waiting(class)).sum()
}

/// Starts a request of `class`; returns its exchange and the seat it asks to wait for, if any.
fn start(
    limiter: &Limiter,
    store: &mut MemoryStore,
    class: &str,
    now: u64,
) -> (Exchange, Option<(Seat, Option<u64>)>) {
    let mut req = PlainRequest::get("/api/x").with_header("x-class", class);
    let (ex, step, _) = Exchange::start(limiter, &mut req, None, Moment::at(now), store);
    let queue = match step {
        Step::Queue {
            seat,
            wait_budget_us,
            ..
        } => Some((seat, wait_budget_us)),
        _ => None,
    };
    (ex, queue)
}

/// Fills both slots, then queues `waiters` (id, class) in order, one microsecond apart.
fn queued(
    limiter: &Limiter,
    worker: &mut ShedWorker,
    store: &mut MemoryStore,
    waiters: &[(u32, &str, Protocol)],
) -> (Vec<Exchange>, Vec<bool>) {
    let s = shedding(limiter);
    let held = (0..2)
        .map(|_| start(limiter, store, "critical", T0).0)
        .collect::<Vec<_>>();
    let mut accepted = Vec::new();
    for &(id, class, protocol) in waiters {
        let now = T0 + id as u64;
        let (_, queue) = start(limiter, store, class, now);
        let (seat, budget) = queue.expect("the bulkhead is full: the request asks to wait");
        accepted.push(worker.enqueue(&s, id, seat, now, budget, protocol, store));
    }
    (held, accepted)
}

#[test]
fn a_tick_seats_the_most_important_waiter_first_then_the_oldest() {
    let limiter = limiter(r#"{"size": 4, "max_wait_ms": 500}"#);
    let s = shedding(&limiter);
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let waiters = [
        (1, "low", Protocol::Http),
        (2, "high", Protocol::Http),
        (3, "high", Protocol::Http),
    ];
    let (mut held, accepted) = queued(&limiter, &mut worker, &mut store, &waiters);
    assert_eq!(accepted, vec![true; 3]);
    assert_eq!(worker.waiting(), 3);
    // Nothing frees: the tick seats nobody and sheds nobody.
    let plan = worker.tick(&s, T0 + 10 * MS, 0.5, 0.5, None, &mut store);
    assert!(plan.resume.is_empty() && plan.shed.is_empty(), "{plan:?}");
    // One slot frees: the older of the two high waiters gets it, not the older low one.
    held.remove(0).finish(&limiter, &mut store);
    let plan = worker.tick(&s, T0 + 20 * MS, 0.5, 0.5, None, &mut store);
    assert_eq!(plan.resume, vec![2]);
    assert_eq!(
        worker.wait_end(&s, 2, &mut store),
        Some(WaitEnd::Seated {
            at_us: T0 + 20 * MS
        })
    );
    // Learned once: the wait is forgotten.
    assert_eq!(worker.wait_end(&s, 2, &mut store), None);
    assert_eq!(worker.waiting(), 2);
    assert_eq!(plan.published.len(), 1);
    assert_eq!(plan.published[0].limit, 2);
}

#[test]
fn a_tick_sheds_the_expired_and_the_pushed_out_with_the_reply_of_their_protocol() {
    let limiter = limiter(r#"{"size": 2, "max_wait_ms": 50, "drop": "oldest"}"#);
    let s = shedding(&limiter);
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let waiters = [
        (1, "high", Protocol::Grpc),
        (2, "high", Protocol::Http),
        (3, "high", Protocol::Grpc),
    ];
    let (_held, accepted) = queued(&limiter, &mut worker, &mut store, &waiters);
    // The third pushed the oldest out of the full queue: all three were taken in.
    assert_eq!(accepted, vec![true; 3]);
    assert_eq!(waiting(&s, &mut store), 2);
    let plan = worker.tick(&s, T0 + 10 * MS, 0.5, 0.5, None, &mut store);
    assert!(plan.resume.is_empty());
    let shed: Vec<_> = plan.shed.iter().map(|w| (w.id, w.reason)).collect();
    assert_eq!(shed, vec![(1, ShedReason::QueueFull)]);
    let reply = &plan.shed[0].reply;
    assert_eq!(
        reply.grpc_status,
        Some(14),
        "a gRPC waiter gets a gRPC answer"
    );
    assert_eq!(worker.wait_end(&s, 1, &mut store), Some(WaitEnd::Shed));
    // The others wait out their 50 ms: an HTTP 503 and a gRPC 14, in the order they queued.
    let plan = worker.tick(&s, T0 + 60 * MS, 0.5, 0.5, None, &mut store);
    let shed: Vec<_> = plan
        .shed
        .iter()
        .map(|w| (w.id, w.reason, w.reply.status, w.reply.grpc_status))
        .collect();
    assert_eq!(
        shed,
        vec![
            (2, ShedReason::QueueTimeout, 503, None),
            (3, ShedReason::QueueTimeout, 503, Some(14)),
        ]
    );
    assert!(plan.shed[0].reply.body.contains("\"error\":\"overloaded\""));
    assert_eq!(worker.waiting(), 0);
    assert_eq!(waiting(&s, &mut store), 0);
}

#[test]
fn a_full_queue_that_keeps_its_waiters_refuses_the_newcomer() {
    let limiter = limiter(r#"{"size": 1, "max_wait_ms": 50, "drop": "newest"}"#);
    let s = shedding(&limiter);
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let waiters = [(1, "high", Protocol::Http), (2, "high", Protocol::Grpc)];
    let (_held, accepted) = queued(&limiter, &mut worker, &mut store, &waiters);
    assert_eq!(accepted, vec![true, false]);
    // The refused one is the caller's to shed: no tick answers it.
    let plan = worker.tick(&s, T0 + 60 * MS, 0.5, 0.5, None, &mut store);
    assert_eq!(plan.shed.iter().map(|w| w.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(worker.wait_end(&s, 2, &mut store), None);
}

#[test]
fn a_stream_that_ends_while_it_waits_leaves_the_queue_and_the_shared_count() {
    let limiter = limiter(r#"{"size": 4, "max_wait_ms": 500}"#);
    let s = shedding(&limiter);
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let waiters = [(1, "high", Protocol::Http), (2, "high", Protocol::Http)];
    let (mut held, _) = queued(&limiter, &mut worker, &mut store, &waiters);
    assert_eq!(waiting(&s, &mut store), 2);
    // The first waiter's client went away: it never learns an end, and leaves the queue.
    assert_eq!(worker.wait_end(&s, 1, &mut store), None);
    assert_eq!(waiting(&s, &mut store), 1);
    // A slot frees: the one still waiting gets it, and nobody is resumed twice.
    held.remove(0).finish(&limiter, &mut store);
    let plan = worker.tick(&s, T0 + 20 * MS, 0.5, 0.5, None, &mut store);
    assert_eq!(plan.resume, vec![2]);
    let plan = worker.tick(&s, T0 + 600 * MS, 0.5, 0.5, None, &mut store);
    assert!(plan.resume.is_empty() && plan.shed.is_empty(), "{plan:?}");
}

#[test]
fn samples_count_a_queued_request_offered_once_and_a_would_shed_not_at_all() {
    let limiter = limiter(r#"{"size": 4, "max_wait_ms": 50}"#);
    let s = shedding(&limiter);
    let mut store = MemoryStore::default();
    let mut worker = ShedWorker::new(&s);
    let seat = Seat {
        bulkhead: 0,
        class: 0,
    };
    worker.admitted(seat);
    worker.shed(seat, ShedReason::Concurrency, false);
    worker.shed(seat, ShedReason::Concurrency, true);
    worker.shed(seat, ShedReason::QueueTimeout, false);
    worker.finished(0, 2_000, 503, None);
    worker.finished(0, 1_000, 200, Some(13));
    worker.finished(0, 1_000, 200, Some(5));
    // A bulkhead that does not exist leaves nothing and does not panic.
    worker.admitted(Seat {
        bulkhead: 9,
        class: 0,
    });
    worker.finished(9, 1, 500, None);
    let samples = worker.samples()[0];
    assert_eq!(
        samples.offered, 2.0,
        "admitted + shed up front; the queued one offered when queued"
    );
    assert_eq!(samples.shed, 2.0);
    assert_eq!(samples.count, 3.0);
    assert_eq!(
        samples.errors, 2.0,
        "a 503 and gRPC INTERNAL; NOT_FOUND is the client's"
    );
    assert_eq!(samples.sum_rtt_us, 4_000.0);
    // The tick folds them into the shared window and starts afresh.
    worker.tick(&s, T0, 0.5, 0.5, None, &mut store);
    assert_eq!(worker.samples()[0].offered, 0.0);
}
