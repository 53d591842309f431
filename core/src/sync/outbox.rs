//! Keys waiting for a sync round, bounded by count and bytes whatever the traffic and however
//! long the counter service stays away.
//!
//! Each worker announces the keys that got unsynced counts; the announcements travel through a
//! shared queue to the worker that wins the round. A worker may put at most
//! [`ANNOUNCE_PER_ROUND`] announcements on the queue per round; beyond that (a flood of new
//! keys, or no rounds at all while the breaker is open) they wait in the worker's own
//! [`Pending`] set, which keeps at most [`MAX_PENDING_KEYS`] keys and [`MAX_PENDING_BYTES`]
//! bytes and forgets the oldest first. A forgotten key's counts are dropped from its record
//! too (see [`crate::sync::proxy::forget`]), so that its next count announces it again: no record is
//! ever left unsynced without an announcement.

use std::collections::{HashSet, VecDeque};

use crate::policy::RuleId;

/// Announcements one worker may put on the shared queue per sync round.
pub const ANNOUNCE_PER_ROUND: u32 = 2_048;
/// Most keys one worker keeps waiting.
pub const MAX_PENDING_KEYS: usize = 8_192;
/// Most bytes of keys one worker keeps waiting.
pub const MAX_PENDING_BYTES: usize = 1 << 20;
/// Most entries in one sync batch.
pub const MAX_BATCH_KEYS: usize = 2_000;
/// Most bytes of JSON in one sync batch, well under the service's default body limit (1 MiB).
pub const MAX_BATCH_BYTES: usize = 512 * 1024;

/// What an entry of `key` with `limits` limits costs in a batch's JSON, at most.
pub fn entry_bytes(key: &str, limits: usize) -> usize {
    // {"key":"…","limits":[…],"spent":N,"denied":N}, with every key byte escaped in the worst
    // case (control characters become \u00XX: six bytes).
    48 + 6 * key.len() + limits * 72
}

/// One worker's waiting keys: deduplicated, oldest first.
#[derive(Debug, Default)]
pub struct Pending {
    keys: VecDeque<(RuleId, String)>,
    seen: HashSet<(RuleId, String)>,
    bytes: usize,
}

impl Pending {
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Bytes of the keys held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds a key (once); returns the keys forgotten to stay within bounds, oldest first.
    pub fn push(&mut self, rule: RuleId, key: String) -> Vec<(RuleId, String)> {
        let entry = (rule, key);
        if self.seen.contains(&entry) {
            return Vec::new();
        }
        self.bytes += entry.1.len();
        self.seen.insert(entry.clone());
        self.keys.push_back(entry);
        let mut forgotten = Vec::new();
        while self.keys.len() > MAX_PENDING_KEYS || self.bytes > MAX_PENDING_BYTES {
            match self.pop() {
                Some(entry) => forgotten.push(entry),
                None => break,
            }
        }
        forgotten
    }

    /// Takes the oldest key.
    pub fn pop(&mut self) -> Option<(RuleId, String)> {
        let entry = self.keys.pop_front()?;
        self.seen.remove(&entry);
        self.bytes -= entry.1.len();
        Some(entry)
    }
}

/// One worker's announcements: the quota of the current round on the shared queue, and the
/// keys waiting beyond it. The host puts a key on the queue when [`Outbox::may_queue`] says so
/// (and reports it with [`Outbox::queued`]); otherwise the key [`Outbox::wait`]s.
#[derive(Debug, Default)]
pub struct Outbox {
    /// The sync round the quota counts for.
    round: u64,
    /// Announcements put on the queue this round.
    announced: u32,
    waiting: Pending,
}

impl Outbox {
    /// Whether an announcement may go on the queue now: nothing is waiting before it, and the
    /// round's quota is not spent.
    pub fn may_queue(&self) -> bool {
        self.waiting.is_empty() && self.announced < ANNOUNCE_PER_ROUND
    }

    /// One announcement went on the queue.
    pub fn queued(&mut self) {
        self.announced = self.announced.saturating_add(1);
    }

    /// The key waits here; returns the keys forgotten to stay within bounds (their counts
    /// must be dropped, see [`crate::sync::proxy::forget`]).
    pub fn wait(&mut self, rule: RuleId, key: String) -> Vec<(RuleId, String)> {
        self.waiting.push(rule, key)
    }

    /// The sync round is `round`: a new one starts the quota again.
    pub fn round(&mut self, round: u64) {
        if self.round != round {
            self.round = round;
            self.announced = 0;
        }
    }

    /// The oldest waiting key, if the round's quota lets it go on the queue.
    pub fn next_to_queue(&mut self) -> Option<(RuleId, String)> {
        if self.announced >= ANNOUNCE_PER_ROUND {
            return None;
        }
        self.waiting.pop()
    }

    /// Every waiting key (the round's winner sends them).
    pub fn take_waiting(&mut self) -> Pending {
        std::mem::take(&mut self.waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_waits_once() {
        let mut pending = Pending::default();
        assert!(pending.push(RuleId::new(0), "a".into()).is_empty());
        assert!(pending.push(RuleId::new(0), "a".into()).is_empty());
        assert!(
            pending.push(RuleId::new(1), "a".into()).is_empty(),
            "another rule's key"
        );
        assert_eq!(pending.len(), 2);
        assert_eq!(pending.pop(), Some((RuleId::new(0), "a".into())));
        assert_eq!(pending.bytes(), 1);
    }

    #[test]
    fn the_queue_takes_a_quota_a_round_and_the_rest_waits_in_order() {
        let mut outbox = Outbox::default();
        outbox.round(1);
        let mut queued = 0;
        for i in 0..ANNOUNCE_PER_ROUND + 3 {
            if outbox.may_queue() {
                outbox.queued();
                queued += 1;
            } else {
                assert!(outbox.wait(RuleId::new(0), format!("k{i}")).is_empty());
            }
        }
        assert_eq!(queued, ANNOUNCE_PER_ROUND);
        assert_eq!(outbox.next_to_queue(), None, "the quota is spent");
        outbox.round(1);
        assert_eq!(outbox.next_to_queue(), None, "the same round");
        outbox.round(2);
        let first = format!("k{ANNOUNCE_PER_ROUND}");
        assert_eq!(
            outbox.next_to_queue(),
            Some((RuleId::new(0), first)),
            "oldest first"
        );
        assert!(
            !outbox.may_queue(),
            "keys still wait: a new one goes behind them"
        );
        assert_eq!(outbox.take_waiting().len(), 2);
        assert!(outbox.may_queue());
    }

    #[test]
    fn a_flood_forgets_the_oldest_and_stays_bounded() {
        let mut pending = Pending::default();
        let mut forgotten = Vec::new();
        for i in 0..100_000 {
            forgotten.extend(pending.push(RuleId::new(0), format!("{i:0>200}")));
        }
        assert!(pending.len() <= MAX_PENDING_KEYS);
        assert!(pending.bytes() <= MAX_PENDING_BYTES, "{}", pending.bytes());
        assert_eq!(
            forgotten.len() + pending.len(),
            100_000,
            "every key is kept or forgotten"
        );
        assert_eq!(
            forgotten[0],
            (RuleId::new(0), format!("{:0>200}", 0)),
            "the oldest go first"
        );
        assert_eq!(pending.pop().map(|(_, k)| k.len()), Some(200));
    }
}
