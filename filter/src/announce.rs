//! Announcing keys with unsynced counts to the worker that syncs, within bounds: at most
//! [`ANNOUNCE_PER_ROUND`] a round on the shared queue per worker, the rest in the worker's own
//! bounded [`Pending`] set (see `sluice_core::pending`).

use std::cell::RefCell;

use proxy_wasm::hostcalls;
use sluice_core::pending::{Pending, ANNOUNCE_PER_ROUND};
use sluice_core::policy::RuleId;
use sluice_core::{sync, Limiter};

use crate::host::SharedData;

#[derive(Default)]
struct State {
    /// The sync round the quota counts for.
    round: u64,
    /// Announcements put on the queue this round.
    announced: u32,
    pending: Pending,
}

/// One worker's announcements.
#[derive(Default)]
pub struct Announcer {
    queue: Option<u32>,
    state: RefCell<State>,
}

impl Announcer {
    pub fn new(queue: Option<u32>) -> Announcer {
        Announcer {
            queue,
            state: RefCell::default(),
        }
    }

    /// Announces that `key` of `rule` has unsynced counts. Returns how many waiting keys had
    /// to be forgotten (their counts dropped) to keep the bounds.
    pub fn announce(&self, limiter: &Limiter, rule: RuleId, key: String) -> usize {
        let Ok(mut state) = self.state.try_borrow_mut() else {
            return 0;
        };
        if state.pending.is_empty()
            && state.announced < ANNOUNCE_PER_ROUND
            && self.enqueue(rule, &key)
        {
            state.announced += 1;
            return 0;
        }
        let forgotten = state.pending.push(rule, key);
        drop(state);
        for (rule, key) in &forgotten {
            let _ = sync::forget(limiter, *rule, key, &mut SharedData);
        }
        forgotten.len()
    }

    /// A new round began (or not): the quota starts again, and waiting keys go on the queue
    /// within it.
    pub fn flush(&self, round: u64) {
        let Ok(mut state) = self.state.try_borrow_mut() else {
            return;
        };
        if state.round != round {
            state.round = round;
            state.announced = 0;
        }
        while state.announced < ANNOUNCE_PER_ROUND {
            let Some((rule, key)) = state.pending.pop() else {
                break;
            };
            if !self.enqueue(rule, &key) {
                // Keeps its place as the newest; the host's queue is not there to take it.
                let _ = state.pending.push(rule, key);
                break;
            }
            state.announced += 1;
        }
    }

    /// Takes every announcement off the queue (the round's winner), with this worker's own
    /// waiting keys first, and returns them once each, oldest first, bounded as `Pending` is.
    /// Keys forgotten on the way have their counts dropped.
    pub fn gather(&self, limiter: &Limiter) -> (Pending, usize) {
        let mut gathered = match self.state.try_borrow_mut() {
            Ok(mut state) => std::mem::take(&mut state.pending),
            Err(_) => Pending::default(),
        };
        let mut forgotten = Vec::new();
        if let Some(queue) = self.queue {
            while let Ok(Some(msg)) = hostcalls::dequeue_shared_queue(queue) {
                if let Some((rule, key)) = sync::announced(&msg) {
                    forgotten.extend(gathered.push(rule, key));
                }
            }
        }
        for (rule, key) in &forgotten {
            let _ = sync::forget(limiter, *rule, key, &mut SharedData);
        }
        (gathered, forgotten.len())
    }

    /// Gives back what the winner could not send this round: it waits here, and goes on the
    /// queue within the quota.
    pub fn keep(&self, limiter: &Limiter, left: Pending) {
        let mut left = left;
        while let Some((rule, key)) = left.pop() {
            self.announce(limiter, rule, key);
        }
    }

    fn enqueue(&self, rule: RuleId, key: &str) -> bool {
        match self.queue {
            Some(queue) => {
                hostcalls::enqueue_shared_queue(queue, Some(&sync::announce(rule, key))).is_ok()
            }
            None => false,
        }
    }
}
