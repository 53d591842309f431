//! The sliding log: exact. A key keeps, per limit, the times its last `requests` admitted
//! requests stop counting (their arrival plus `period`) in a ring, oldest first from `head`;
//! 0 marks a place never used. A request of cost `c` is admitted when the `c` oldest places no
//! longer count: then fewer than `requests - c + 1` requests were admitted in the last `period`.
//! The ring lives in the key's record after its buckets ([`crate::limit::table`]); the limit's
//! [`LimitState`] holds `head` in `stamp_us`.
//!
//! Times are kept in order: a place is written with the later of its own expiry and the
//! newest's (two workers' clocks may differ by microseconds), so the ring stays sorted and one
//! binary search counts what is in the window.
//!
//! The ghost of an evicted log (see `table`): when its newest request stops counting, rounded
//! up to a multiple of [`GHOST_STEP`], plus how many requests it held (at most
//! [`crate::limit::MAX_LOG`], fewer than `GHOST_STEP`). A key seen again while it stands gets
//! that many requests, all counting until that time: never more room than it had, nor sooner.
//! Limits of one rule record the same requests, so the ghost of the longest window (the
//! latest, which the record keeps) holds at least as many as any shorter one's, until later.

use crate::limit::token_bucket::{LimitState, Verdict};
use crate::limit::Limit;

/// Ghost times are multiples of this; the remainder counts the requests held.
pub const GHOST_STEP: u64 = 1_024;

/// One limit's log in a record.
pub struct Log<'a> {
    pub head: &'a mut u64,
    pub ring: &'a mut [u64],
}

impl Log<'_> {
    fn len(&self) -> usize {
        self.ring.len()
    }

    /// The `i`-th oldest place.
    fn at(&self, i: usize) -> u64 {
        let n = self.len();
        self.ring[(*self.head as usize % n + i) % n]
    }

    fn set(&mut self, i: usize, value: u64) {
        let n = self.len();
        let at = (*self.head as usize % n + i) % n;
        self.ring[at] = value;
    }

    /// Requests that still count at `now_us`: the places from the first that expires later.
    fn held(&self, now_us: u64) -> usize {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.at(mid) <= now_us {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        self.len() - lo
    }

    fn newest(&self) -> u64 {
        self.at(self.len() - 1)
    }

    /// Would `cost` be admitted at `now_us`? If `spend`, it is recorded when it is.
    pub fn step(&mut self, limit: &Limit, now_us: u64, cost: u64, spend: bool) -> Verdict {
        let n = self.len();
        let c = cost as usize;
        let held = self.held(now_us);
        let allowed = c <= n && held + c <= n;
        let expiry = now_us + limit.period().micros();
        let retry_after_us = if allowed {
            0
        } else if c > n {
            // Never: more than the whole log.
            limit.period().micros()
        } else {
            // When the place `c` must take frees; its requests are the oldest that count.
            self.at(c - 1).saturating_sub(now_us).max(1)
        };
        let counted = if allowed { held + c } else { held };
        let newest = if allowed { expiry } else { self.newest() };
        let verdict = Verdict {
            allowed,
            remaining: (n - counted) as u64,
            retry_after_us,
            reset_us: if counted > 0 {
                newest.saturating_sub(now_us)
            } else {
                0
            },
            delay_us: 0,
        };
        if allowed && spend {
            self.record(expiry, c);
        }
        verdict
    }

    /// Writes `c` places over the oldest, expiring at `expiry` (or with the newest, if later).
    fn record(&mut self, expiry: u64, c: usize) {
        let value = expiry.max(self.newest());
        for _ in 0..c.min(self.len()) {
            self.set(0, value);
            // The head is read from shared data: any value, never an overflow.
            *self.head = (*self.head % self.len() as u64 + 1) % self.len() as u64;
        }
    }

    /// Records `cost` whatever the log holds: what a lease admitted (the oldest places go,
    /// which only makes the log wait longer).
    pub fn spend(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        self.record(now_us + limit.period().micros(), cost as usize);
    }

    /// Forgets the newest `cost` requests (admitted, then denied by another rule). The places
    /// they took held requests that no longer counted: they become unused.
    pub fn give_back(&mut self, cost: u64) {
        let n = self.len() as u64;
        for _ in 0..cost.min(n) {
            *self.head = (*self.head % n + n - 1) % n;
            self.set(0, 0);
        }
    }

    /// The ghost's time (see the module): `now_us` when nothing counts.
    pub fn ghost_us(&self, now_us: u64) -> u64 {
        let held = self.held(now_us);
        if held == 0 {
            return now_us;
        }
        // A corrupt newest place (any u64) must not overflow.
        let newest = self.newest().min(u64::MAX - 2 * GHOST_STEP);
        newest.div_ceil(GHOST_STEP) * GHOST_STEP + held as u64
    }

    /// The log of a key seen again while its ghost stands: its requests count until the
    /// ghost's time.
    pub fn returning(&mut self, ghost_us: u64) {
        let until = ghost_us - ghost_us % GHOST_STEP;
        let held = (ghost_us % GHOST_STEP) as usize;
        let n = self.len();
        *self.head = 0;
        for i in 0..n {
            self.ring[i] = if i + held.min(n) >= n { until } else { 0 };
        }
    }
}

/// A log's limit state, before its ring: `head` only.
pub fn fresh() -> LimitState {
    LimitState {
        tokens: 0.0,
        stamp_us: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    const S: u64 = 1_000_000;

    #[test]
    fn admits_requests_per_period_exactly_and_says_when_the_oldest_leaves() {
        let limit = Limit::logged(3, Period::Minute).unwrap();
        let (mut head, mut ring) = (0, [0; 3]);
        let mut l = Log {
            head: &mut head,
            ring: &mut ring,
        };
        let t0 = 100 * S;
        for (i, at) in [0, 10, 20].into_iter().enumerate() {
            let v = l.step(&limit, t0 + at * S, 1, true);
            assert!(v.allowed);
            assert_eq!(v.remaining, 2 - i as u64);
        }
        let v = l.step(&limit, t0 + 59 * S, 1, true);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_us, S, "the first leaves at t0 + 60 s");
        assert!(!l.step(&limit, t0 + 60 * S - 1, 1, true).allowed);
        assert!(l.step(&limit, t0 + 60 * S, 1, true).allowed);
        // Now 10, 20, 60 count: the next place frees at 70.
        let v = l.step(&limit, t0 + 61 * S, 1, true);
        assert_eq!(v.retry_after_us, 9 * S);
        assert_eq!(v.reset_us, 59 * S, "the newest leaves at t0 + 120 s");
    }

    #[test]
    fn a_given_back_request_frees_its_place() {
        let limit = Limit::logged(2, Period::Second).unwrap();
        let (mut head, mut ring) = (0, [0; 2]);
        let mut l = Log {
            head: &mut head,
            ring: &mut ring,
        };
        assert!(l.step(&limit, S, 1, true).allowed);
        assert!(l.step(&limit, S + 1, 1, true).allowed);
        assert!(!l.step(&limit, S + 2, 1, false).allowed);
        l.give_back(1);
        assert!(l.step(&limit, S + 3, 1, true).allowed);
        assert!(!l.step(&limit, S + 4, 1, false).allowed);
        // The first still leaves at 2 s.
        assert!(l.step(&limit, 2 * S, 1, true).allowed);
    }

    #[test]
    fn a_ghost_never_gives_more_room_nor_sooner() {
        let limit = Limit::logged(5, Period::Minute).unwrap();
        let (mut head, mut ring) = (0, [0; 5]);
        let mut l = Log {
            head: &mut head,
            ring: &mut ring,
        };
        for i in 0..3 {
            l.step(&limit, S + i * S, 1, true);
        }
        let ghost = l.ghost_us(10 * S);
        assert!(ghost > 10 * S);
        let (mut back_head, mut back_ring) = (0, [0; 5]);
        let mut back = Log {
            head: &mut back_head,
            ring: &mut back_ring,
        };
        back.returning(ghost);
        let now = 20 * S;
        assert_eq!(back.step(&limit, now, 0, false).remaining, 2);
        assert!(
            back.step(&limit, 61 * S, 0, false).remaining
                <= l.step(&limit, 61 * S, 0, false).remaining
        );
        assert_eq!(
            back.step(&limit, 63 * S + GHOST_STEP, 0, false).remaining,
            5
        );
        assert_eq!(l.ghost_us(70 * S), 70 * S, "nothing left to remember");
    }
}
