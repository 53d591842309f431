//! Announcing keys with unsynced counts to the worker that syncs: the host's shared queue,
//! within the bounds core's [`Outbox`] keeps (`sluice_core::sync::outbox`).

use std::cell::RefCell;

use proxy_wasm::hostcalls;
use sluice_core::policy::RuleId;
use sluice_core::sync::outbox::{Outbox, Pending};
use sluice_core::{sync::proxy, Limiter};

use crate::host::SharedData;

/// One worker's announcements.
#[derive(Default)]
pub struct Announcer {
    queue: Option<u32>,
    outbox: RefCell<Outbox>,
}

impl Announcer {
    pub fn new(queue: Option<u32>) -> Announcer {
        Announcer {
            queue,
            outbox: RefCell::default(),
        }
    }

    /// Announces that `key` of `rule` has unsynced counts. Returns how many waiting keys had
    /// to be forgotten (their counts dropped) to keep the bounds.
    pub fn announce(&self, limiter: &Limiter, rule: RuleId, key: String) -> usize {
        let Ok(mut outbox) = self.outbox.try_borrow_mut() else {
            return 0;
        };
        if outbox.may_queue() && self.enqueue(rule, &key) {
            outbox.queued();
            return 0;
        }
        let forgotten = outbox.wait(rule, key);
        drop(outbox);
        forget(limiter, &forgotten)
    }

    /// The sync round is `round`: waiting keys go on the queue within its quota.
    pub fn flush(&self, round: u64) {
        let Ok(mut outbox) = self.outbox.try_borrow_mut() else {
            return;
        };
        outbox.round(round);
        while let Some((rule, key)) = outbox.next_to_queue() {
            if !self.enqueue(rule, &key) {
                // Keeps its place as the newest; the host's queue is not there to take it.
                let _ = outbox.wait(rule, key);
                break;
            }
            outbox.queued();
        }
    }

    /// Takes every announcement off the queue (the round's winner), with this worker's own
    /// waiting keys first, and returns them once each, oldest first, bounded as `Pending` is.
    /// Keys forgotten on the way have their counts dropped.
    pub fn gather(&self, limiter: &Limiter) -> (Pending, usize) {
        let mut gathered = match self.outbox.try_borrow_mut() {
            Ok(mut outbox) => outbox.take_waiting(),
            Err(_) => Pending::default(),
        };
        let mut forgotten = Vec::new();
        if let Some(queue) = self.queue {
            while let Ok(Some(msg)) = hostcalls::dequeue_shared_queue(queue) {
                if let Some((rule, key)) = proxy::announced(&msg) {
                    forgotten.extend(gathered.push(rule, key));
                }
            }
        }
        (gathered, forget(limiter, &forgotten))
    }

    /// Gives back what the winner could not send this round: it goes on the queue within the
    /// quota, or waits here.
    pub fn keep(&self, limiter: &Limiter, mut left: Pending) {
        while let Some((rule, key)) = left.pop() {
            self.announce(limiter, rule, key);
        }
    }

    fn enqueue(&self, rule: RuleId, key: &str) -> bool {
        match self.queue {
            Some(queue) => {
                hostcalls::enqueue_shared_queue(queue, Some(&proxy::announce(rule, key))).is_ok()
            }
            None => false,
        }
    }
}

/// Drops the counts of keys that could not wait any longer; how many.
fn forget(limiter: &Limiter, forgotten: &[(RuleId, String)]) -> usize {
    for (rule, key) in forgotten {
        let _ = proxy::forget(limiter, *rule, key, &mut SharedData);
    }
    forgotten.len()
}
