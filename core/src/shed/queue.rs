//! The bounded wait of one worker: requests that found no slot wait here, paused, until a slot
//! frees (the most important class first, then the longest waiting), their wait runs out, or a
//! newer waiter pushes them out of a full queue.

use crate::shed::admission::{admit_waiter, count_waiter, Seat};
use crate::shed::policy::{Drop, Shedding};
use crate::store::Store;

/// One paused request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waiter {
    /// The host's id for the request (its context).
    pub id: u32,
    pub seat: Seat,
    pub since_us: u64,
    /// When it stops waiting and is shed.
    pub until_us: u64,
}

/// What became of a request offered to the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Queued {
    /// It waits.
    Waiting,
    /// It waits, and this older waiter was pushed out (to be shed).
    Evicted(Waiter),
    /// The queue is full and keeps its waiters: shed the new one.
    Full,
}

/// A worker's waiters, over all bulkheads.
#[derive(Debug, Default)]
pub struct WaitQueue {
    waiters: Vec<Waiter>,
}

impl WaitQueue {
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Waiting in one bulkhead.
    pub fn waiting(&self, bulkhead: usize) -> usize {
        self.waiters
            .iter()
            .filter(|w| w.seat.bulkhead == bulkhead)
            .count()
    }

    /// Offers a request to its bulkhead's queue. `wait_budget_us` shortens the wait to what its
    /// own deadline leaves. Every waiter is counted in the bulkhead's shared gauge from here
    /// until it leaves the queue, however it leaves.
    pub fn push(
        &mut self,
        shedding: &Shedding,
        id: u32,
        seat: Seat,
        now_us: u64,
        wait_budget_us: Option<u64>,
        store: &mut dyn Store,
    ) -> Queued {
        let queued = self.place(shedding, id, seat, now_us, wait_budget_us);
        match queued {
            Queued::Waiting => {
                let _ = count_waiter(shedding, seat, 1, store);
            }
            Queued::Evicted(old) => {
                let _ = count_waiter(shedding, old.seat, -1, store);
                let _ = count_waiter(shedding, seat, 1, store);
            }
            Queued::Full => {}
        }
        queued
    }

    fn place(
        &mut self,
        shedding: &Shedding,
        id: u32,
        seat: Seat,
        now_us: u64,
        wait_budget_us: Option<u64>,
    ) -> Queued {
        let Some(policy) = shedding.bulkheads.get(seat.bulkhead).and_then(|b| b.queue) else {
            return Queued::Full;
        };
        let wait_us = (policy.max_wait_ms * 1_000).min(wait_budget_us.unwrap_or(u64::MAX));
        if wait_us == 0 {
            return Queued::Full;
        }
        let waiter = Waiter {
            id,
            seat,
            since_us: now_us,
            until_us: now_us.saturating_add(wait_us),
        };
        if self.waiting(seat.bulkhead) < policy.size as usize {
            self.waiters.push(waiter);
            return Queued::Waiting;
        }
        match policy.drop {
            Drop::Newest => Queued::Full,
            Drop::Oldest => {
                let oldest = self
                    .waiters
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| w.seat.bulkhead == seat.bulkhead)
                    .min_by_key(|(_, w)| w.since_us)
                    .map(|(at, _)| at);
                match oldest {
                    Some(at) => {
                        let evicted = self.waiters.remove(at);
                        self.waiters.push(waiter);
                        Queued::Evicted(evicted)
                    }
                    None => Queued::Full,
                }
            }
        }
    }

    /// Takes a request out (its stream ended while it waited).
    pub fn remove(
        &mut self,
        shedding: &Shedding,
        id: u32,
        store: &mut dyn Store,
    ) -> Option<Waiter> {
        let at = self.waiters.iter().position(|w| w.id == id)?;
        let waiter = self.waiters.remove(at);
        let _ = count_waiter(shedding, waiter.seat, -1, store);
        Some(waiter)
    }

    /// Takes out the waiters whose wait ran out.
    pub fn expired(
        &mut self,
        shedding: &Shedding,
        now_us: u64,
        store: &mut dyn Store,
    ) -> Vec<Waiter> {
        let (gone, kept): (Vec<Waiter>, _) =
            self.waiters.drain(..).partition(|w| w.until_us <= now_us);
        self.waiters = kept;
        for w in &gone {
            let _ = count_waiter(shedding, w.seat, -1, store);
        }
        gone
    }

    /// Gives slots to waiters while there are any: by class (most important first), then by
    /// age. Returns the admitted, taken out of the queue (and out of the shared count).
    pub fn admit(
        &mut self,
        shedding: &Shedding,
        fleet: Option<f64>,
        store: &mut dyn Store,
    ) -> Vec<Waiter> {
        let mut order: Vec<Waiter> = self.waiters.clone();
        order.sort_by(|a, b| {
            shedding
                .rank(b.seat.class)
                .total_cmp(&shedding.rank(a.seat.class))
                .then(a.since_us.cmp(&b.since_us))
        });
        let mut full = Vec::new();
        let mut admitted = Vec::new();
        for waiter in order {
            if full.contains(&waiter.seat.bulkhead) {
                continue;
            }
            match admit_waiter(shedding, waiter.seat, fleet, store) {
                Ok(true) => admitted.push(waiter),
                // The most important waiter found no room: nobody after it in this bulkhead
                // will (their share is no larger).
                _ => full.push(waiter.seat.bulkhead),
            }
        }
        self.waiters
            .retain(|w| !admitted.iter().any(|a| a.id == w.id));
        admitted
    }
}
