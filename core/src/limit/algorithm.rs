//! Every algorithm over the same 16 bytes of state per key and limit ([`LimitState`]): the step a
//! request takes, a refund, an unconditional spend (what a lease already admitted), and the
//! record's ghost (when the state is fresh again, and a state no more generous than the one
//! evicted). What the two fields hold:
//!
//! | algorithm | `tokens` | `stamp_us` |
//! | --- | --- | --- |
//! | `token_bucket` | tokens left | when they were counted |
//! | `gcra` | the theoretical arrival time (µs, fractional) | unused |
//! | `fixed_window` | requests counted in the window | the window's start |
//! | `sliding_window` | requests counted in the current window | previous window's count << 32, current window's number |
//! | `leaky_bucket` | the next free slot's time (µs, fractional) | unused |
//! | `sliding_log` | unused | the ring's head; the ring follows the buckets ([`crate::limit::sliding_log`]) |
//!
//! A sliding log is decided with its ring, through [`LimitView`]; a bucket alone admits
//! nothing of it.
//!
//! Windowed ghosts: a record evicted with `remaining` requests left in a window that ends at
//! `end` leaves the time `end - 1 - remaining` (inside the window, since a window holds fewer
//! requests than half its microseconds). A key seen again in that window gets back at most
//! `remaining`; in a later window of a longer limit's ghost, nothing until its window ends.

use crate::limit::calendar;
use crate::limit::concurrency::Slots;
use crate::limit::sliding_log::{self, Log};
use crate::limit::token_bucket::{LimitState, Verdict};
use crate::limit::{Algorithm, Limit};

/// One limit's state in a record: its bucket, and its ring if it is a sliding log (else empty).
pub struct LimitView<'a> {
    pub bucket: &'a mut LimitState,
    pub ring: &'a mut [u64],
}

impl LimitView<'_> {
    /// A concurrency limit's places ([`crate::limit::concurrency`]).
    fn slots<'s>(&'s mut self, limit: &Limit) -> Option<Slots<'s>> {
        if limit.algorithm() != Algorithm::Concurrency {
            return None;
        }
        Some(Slots {
            places: &mut *self.ring,
        })
    }

    /// A concurrency limit's [`Slots::step`], out of line: the check and admission of the
    /// other limits, on every request, stay small enough to be inlined.
    #[inline(never)]
    fn slot_step(&mut self, limit: &Limit, now_us: u64, cost: u64, admit: bool) -> Verdict {
        Slots {
            places: &mut *self.ring,
        }
        .step(limit, now_us, cost, admit)
    }

    /// Gives back the slot of a request a concurrency limit admitted with `lapse_us`
    /// ([`crate::limit::concurrency::lapse_us`]); other limits give back `cost`.
    pub fn release(&mut self, limit: &Limit, cost: u64, lapse_us: u64) {
        match self.slots(limit) {
            Some(mut slots) => slots.release(lapse_us),
            None => self.give_back(limit, cost),
        }
    }

    fn log(&mut self) -> Option<Log<'_>> {
        if self.ring.is_empty() {
            return None;
        }
        Some(Log {
            head: &mut self.bucket.stamp_us,
            ring: self.ring,
        })
    }

    /// Would `cost` be admitted at `now_us`? Changes nothing, unless the clock was stepped
    /// back: a bucket then keeps the new time (see [`LimitState::refilled`]), so it refills from
    /// there even while it only denies.
    #[inline]
    pub fn check(&mut self, limit: &Limit, now_us: u64, cost: u64) -> Verdict {
        if limit.algorithm() == Algorithm::Concurrency {
            return self.slot_step(limit, now_us, cost, false);
        }
        match self.log() {
            Some(mut log) => log.step(limit, now_us, cost, false),
            None => {
                let (verdict, next) = self.bucket.check(limit, now_us, cost);
                let stepped_back = match limit.algorithm() {
                    Algorithm::TokenBucket => next.stamp_us < self.bucket.stamp_us,
                    Algorithm::Gcra | Algorithm::LeakyBucket => next.tokens < self.bucket.tokens,
                    _ => false,
                };
                if stepped_back {
                    *self.bucket = next;
                }
                verdict
            }
        }
    }

    /// Admits `cost` if it may be, spending it.
    #[inline]
    pub fn admit(&mut self, limit: &Limit, now_us: u64, cost: u64) -> Verdict {
        if limit.algorithm() == Algorithm::Concurrency {
            return self.slot_step(limit, now_us, cost, true);
        }
        if let Some(mut log) = self.log() {
            return log.step(limit, now_us, cost, true);
        }
        let (verdict, next) = self.bucket.admit(limit, now_us, cost);
        *self.bucket = next;
        verdict
    }

    /// See [`LimitState::give_back`]. A concurrency limit gives back by the slot
    /// ([`LimitView::release`]): nothing here.
    pub fn give_back(&mut self, limit: &Limit, cost: u64) {
        if limit.algorithm() == Algorithm::Concurrency {
            return;
        }
        match self.log() {
            Some(mut log) => log.give_back(cost),
            None => *self.bucket = self.bucket.give_back(limit, cost),
        }
    }

    /// See [`LimitState::spend`].
    pub fn spend(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        if let Some(mut slots) = self.slots(limit) {
            return slots.take(limit, now_us, cost);
        }
        match self.log() {
            Some(mut log) => log.spend(limit, now_us, cost),
            None => *self.bucket = self.bucket.spend(limit, now_us, cost),
        }
    }

    /// Charges `cost` after the fact (a response's reported cost): spent whatever is left,
    /// into debt for the counting algorithms, so the next requests wait until it is repaid.
    pub fn charge(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        if let Some(mut slots) = self.slots(limit) {
            // A concurrency rule charges nothing after the fact (refused by the configuration).
            return slots.take(limit, now_us, 0);
        }
        match self.log() {
            Some(mut log) => log.spend(limit, now_us, cost),
            None => *self.bucket = self.bucket.charge(limit, now_us, cost),
        }
    }

    /// See [`LimitState::ghost_us`].
    pub fn ghost_us(&mut self, limit: &Limit, now_us: u64) -> u64 {
        if let Some(slots) = self.slots(limit) {
            return slots.ghost_us(limit, now_us);
        }
        match self.log() {
            Some(log) => log.ghost_us(now_us),
            None => self.bucket.ghost_us(limit, now_us),
        }
    }

    /// See [`LimitState::returning`].
    pub fn returning(&mut self, limit: &Limit, now_us: u64, ghost_us: u64) {
        if let Some(mut slots) = self.slots(limit) {
            return slots.returning(ghost_us);
        }
        match self.log() {
            Some(mut log) => log.returning(ghost_us),
            None => *self.bucket = LimitState::returning(limit, now_us, ghost_us),
        }
    }
}

impl LimitState {
    /// The state of a key seen for the first time: everything available.
    pub fn fresh(limit: &Limit, now_us: u64) -> LimitState {
        match limit.algorithm() {
            Algorithm::TokenBucket => LimitState::full(limit, now_us),
            Algorithm::Gcra | Algorithm::LeakyBucket => LimitState {
                tokens: now_us as f64,
                stamp_us: 0,
            },
            Algorithm::FixedWindow => LimitState {
                tokens: 0.0,
                stamp_us: calendar::start_us(limit.period(), now_us),
            },
            Algorithm::SlidingWindow => Sliding::at(limit, now_us).pack(),
            Algorithm::SlidingLog | Algorithm::Concurrency => sliding_log::fresh(),
        }
    }

    /// Would `cost` be admitted at `now_us`? Changes nothing but the passing of time.
    pub fn check(self, limit: &Limit, now_us: u64, cost: u64) -> (Verdict, LimitState) {
        match limit.algorithm() {
            Algorithm::TokenBucket => self.peek(limit, now_us, cost),
            Algorithm::Gcra => gcra(self, limit, now_us, cost, false),
            Algorithm::LeakyBucket => leaky(self, limit, now_us, cost, false),
            Algorithm::FixedWindow => fixed(self, limit, now_us, cost, false),
            Algorithm::SlidingWindow => sliding(self, limit, now_us, cost, false),
            Algorithm::SlidingLog | Algorithm::Concurrency => (without_ring(limit), self),
        }
    }

    /// Admits `cost` if it may be, spending it; otherwise spends nothing.
    pub fn admit(self, limit: &Limit, now_us: u64, cost: u64) -> (Verdict, LimitState) {
        match limit.algorithm() {
            Algorithm::TokenBucket => self.take(limit, now_us, cost),
            Algorithm::Gcra => gcra(self, limit, now_us, cost, true),
            Algorithm::LeakyBucket => leaky(self, limit, now_us, cost, true),
            Algorithm::FixedWindow => fixed(self, limit, now_us, cost, true),
            Algorithm::SlidingWindow => sliding(self, limit, now_us, cost, true),
            Algorithm::SlidingLog | Algorithm::Concurrency => (without_ring(limit), self),
        }
    }

    /// Gives back `cost` spent by a request another rule then denied.
    pub fn give_back(self, limit: &Limit, cost: u64) -> LimitState {
        match limit.algorithm() {
            Algorithm::TokenBucket => self.refund(limit, cost),
            Algorithm::Gcra | Algorithm::LeakyBucket => LimitState {
                tokens: self.tokens - cost as f64 * interval(limit),
                ..self
            },
            Algorithm::FixedWindow => LimitState {
                tokens: (self.tokens - cost as f64).max(0.0),
                ..self
            },
            Algorithm::SlidingWindow => {
                let mut s = Sliding::unpack(self);
                s.current = (s.current - cost as f64).max(0.0);
                s.pack()
            }
            Algorithm::SlidingLog | Algorithm::Concurrency => self,
        }
    }

    /// Spends `cost` whatever is left (never below empty): what a lease admitted is followed
    /// here, so a lapse of the lease falls back to what is left locally.
    pub fn spend(self, limit: &Limit, now_us: u64, cost: u64) -> LimitState {
        let cost_f = cost as f64;
        match limit.algorithm() {
            Algorithm::TokenBucket => {
                let mut b = self.refilled(limit, now_us);
                b.tokens = (b.tokens - cost_f).max(0.0);
                b
            }
            Algorithm::Gcra | Algorithm::LeakyBucket => {
                let t = interval(limit);
                let tat = self.tokens.max(now_us as f64) + cost_f * t;
                LimitState {
                    tokens: tat.min(now_us as f64 + limit.burst() as f64 * t),
                    ..self
                }
            }
            Algorithm::FixedWindow => {
                let b = fixed_now(self, limit, now_us);
                LimitState {
                    tokens: (b.tokens + cost_f).min(limit.requests() as f64),
                    ..b
                }
            }
            Algorithm::SlidingWindow => {
                let mut s = Sliding::unpack(self).rolled(limit, now_us);
                s.current = (s.current + cost_f).min(limit.requests() as f64);
                s.pack()
            }
            Algorithm::SlidingLog | Algorithm::Concurrency => self,
        }
    }

    /// Spends `cost` with no floor: a token bucket goes below empty, a window's count past its
    /// limit, GCRA's arrival time past its burst.
    pub fn charge(self, limit: &Limit, now_us: u64, cost: u64) -> LimitState {
        let cost_f = cost as f64;
        match limit.algorithm() {
            Algorithm::TokenBucket => {
                let mut b = self.refilled(limit, now_us);
                // Bounded so the arithmetic stays exact: at most a period of refill in debt
                // per charge, and never below minus 2^31 tokens.
                b.tokens = (b.tokens - cost_f).max(-(crate::limit::MAX_TOKENS as f64));
                b
            }
            Algorithm::Gcra | Algorithm::LeakyBucket => LimitState {
                tokens: self.tokens.max(now_us as f64) + cost_f * interval(limit),
                ..self
            },
            Algorithm::FixedWindow => {
                let b = fixed_now(self, limit, now_us);
                LimitState {
                    tokens: b.tokens + cost_f,
                    ..b
                }
            }
            Algorithm::SlidingWindow => {
                let mut s = Sliding::unpack(self).rolled(limit, now_us);
                s.current += cost_f;
                s.pack()
            }
            Algorithm::SlidingLog | Algorithm::Concurrency => self,
        }
    }

    /// The ghost's time: when the state is fresh again (token bucket, GCRA), or the windowed
    /// encoding above; `now_us` when there is nothing to remember.
    pub fn ghost_us(self, limit: &Limit, now_us: u64) -> u64 {
        match limit.algorithm() {
            Algorithm::TokenBucket => {
                let missing = limit.burst() as f64 - self.refilled(limit, now_us).tokens;
                // A corrupt record (tokens far below zero, not a number) must not overflow.
                now_us.saturating_add((missing.max(0.0) * interval(limit)).ceil() as u64)
            }
            Algorithm::Gcra | Algorithm::LeakyBucket => (self.tokens.ceil() as u64).max(now_us),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let (verdict, _) = self.check(limit, now_us, 0);
                let used = limit.requests().saturating_sub(verdict.remaining);
                if used == 0 {
                    return now_us;
                }
                calendar::end_us(limit.period(), now_us) - 1 - verdict.remaining
            }
            Algorithm::SlidingLog | Algorithm::Concurrency => now_us,
        }
    }

    /// A key seen again while its ghost (`ghost_us`, later than `now_us`) stands.
    pub fn returning(limit: &Limit, now_us: u64, ghost_us: u64) -> LimitState {
        let fresh = LimitState::fresh(limit, now_us);
        match limit.algorithm() {
            Algorithm::TokenBucket => {
                let wait_us = ghost_us.saturating_sub(now_us) as f64;
                LimitState {
                    tokens: (limit.burst() as f64 - wait_us / interval(limit)).max(0.0),
                    ..fresh
                }
            }
            Algorithm::Gcra | Algorithm::LeakyBucket => LimitState {
                tokens: ghost_us as f64,
                ..fresh
            },
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let requests = limit.requests();
                let end = calendar::end_us(limit.period(), now_us);
                let used = if ghost_us >= end {
                    // A longer limit's ghost: nothing left in this window.
                    requests
                } else {
                    requests.saturating_sub(end - 1 - ghost_us)
                };
                match limit.algorithm() {
                    Algorithm::FixedWindow => LimitState {
                        tokens: used as f64,
                        ..fresh
                    },
                    _ => {
                        let mut s = Sliding::unpack(fresh);
                        s.current = used as f64;
                        s.pack()
                    }
                }
            }
            Algorithm::SlidingLog | Algorithm::Concurrency => fresh,
        }
    }
}

/// A sliding log asked without its ring: nothing is admitted (never happens: records carry it).
fn without_ring(limit: &Limit) -> Verdict {
    Verdict {
        allowed: false,
        remaining: 0,
        retry_after_us: limit.period().micros(),
        reset_us: 0,
        delay_us: 0,
    }
}

/// Microseconds between two admissions at the steady rate.
fn interval(limit: &Limit) -> f64 {
    limit.period().micros() as f64 / limit.requests() as f64
}

/// A theoretical arrival time (or a next slot) is never more than `capacity` ahead of the clock
/// that set it: further ahead by more than [`crate::limit::token_bucket::CLOCK_STEP_US`], the clock was
/// stepped back, and it is taken as `capacity` ahead (no room now, room again at the rate from
/// now) rather than refusing until the clock is back where it was.
fn stepped_back(tat: f64, now: f64, capacity: f64) -> f64 {
    if tat - now > capacity + crate::limit::token_bucket::CLOCK_STEP_US as f64 {
        now + capacity
    } else {
        tat
    }
}

/// GCRA: admitted when the theoretical arrival time after it is within `burst` intervals.
fn gcra(
    b: LimitState,
    limit: &Limit,
    now_us: u64,
    cost: u64,
    spend: bool,
) -> (Verdict, LimitState) {
    let t = interval(limit);
    let now = now_us as f64;
    let capacity = limit.burst() as f64 * t;
    let tat = stepped_back(b.tokens, now, capacity).max(now);
    let next = tat + cost as f64 * t;
    let allowed = next - now <= capacity;
    let after = if allowed && spend { next } else { tat };
    let used = if allowed { next } else { tat };
    let verdict = Verdict {
        allowed,
        remaining: ((capacity - (used - now)) / t).max(0.0).floor() as u64,
        retry_after_us: if allowed {
            0
        } else {
            (next - capacity - now).ceil() as u64
        },
        reset_us: (used - now).max(0.0).ceil() as u64,
        delay_us: 0,
    };
    (verdict, LimitState { tokens: after, ..b })
}

/// The leaky bucket: each request takes the next slot (one every `period / requests`); it
/// leaves at its slot less `delay` slots (so a burst's first `delay` leave at once). Refused
/// when `delay + queue` slots are taken, or when it would wait longer than `max_delay_ms`.
fn leaky(
    b: LimitState,
    limit: &Limit,
    now_us: u64,
    cost: u64,
    spend: bool,
) -> (Verdict, LimitState) {
    let t = interval(limit);
    let now = now_us as f64;
    let shaping = limit.shaping();
    let capacity = limit.burst() as f64 * t;
    let slot = stepped_back(b.tokens, now, capacity).max(now);
    let next = slot + cost as f64 * t;
    let wait = (slot - shaping.delay as f64 * t - now).max(0.0);
    let max_wait = shaping.max_delay_ms as f64 * 1_000.0;
    let fits = next - now <= capacity;
    let allowed = fits && wait <= max_wait;
    let used = if allowed { next } else { slot };
    let retry_after_us = if allowed {
        0
    } else {
        // Until a slot is free and the wait for it is within bounds.
        let for_room = next - capacity - now;
        let for_wait = slot - shaping.delay as f64 * t - max_wait - now;
        for_room.max(for_wait).max(1.0).ceil() as u64
    };
    let verdict = Verdict {
        allowed,
        remaining: ((capacity - (used - now)) / t).max(0.0).floor() as u64,
        retry_after_us,
        reset_us: (used - now).max(0.0).ceil() as u64,
        delay_us: if allowed { wait.ceil() as u64 } else { 0 },
    };
    let after = if allowed && spend { next } else { slot };
    (verdict, LimitState { tokens: after, ..b })
}

/// The fixed window's state in the window of `now_us` (a new window starts empty).
fn fixed_now(b: LimitState, limit: &Limit, now_us: u64) -> LimitState {
    let start = calendar::start_us(limit.period(), now_us);
    if b.stamp_us == start {
        b
    } else {
        LimitState {
            tokens: 0.0,
            stamp_us: start,
        }
    }
}

fn fixed(
    b: LimitState,
    limit: &Limit,
    now_us: u64,
    cost: u64,
    spend: bool,
) -> (Verdict, LimitState) {
    let mut b = fixed_now(b, limit, now_us);
    let requests = limit.requests() as f64;
    let allowed = b.tokens + cost as f64 <= requests;
    let until_end = calendar::end_us(limit.period(), now_us) - now_us;
    let counted = if allowed {
        b.tokens + cost as f64
    } else {
        b.tokens
    };
    if allowed && spend {
        b.tokens = counted;
    }
    let verdict = Verdict {
        allowed,
        remaining: (requests - counted).max(0.0) as u64,
        retry_after_us: if allowed { 0 } else { until_end },
        reset_us: if counted > 0.0 { until_end } else { 0 },
        delay_us: 0,
    };
    (verdict, b)
}

/// The sliding window's state: the previous window's count, the current one's, and which
/// window is current (its number since the epoch).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sliding {
    previous: f64,
    current: f64,
    number: u64,
}

impl Sliding {
    fn at(limit: &Limit, now_us: u64) -> Sliding {
        Sliding {
            previous: 0.0,
            current: 0.0,
            number: now_us / limit.period().micros(),
        }
    }

    fn unpack(b: LimitState) -> Sliding {
        Sliding {
            previous: (b.stamp_us >> 32) as f64,
            current: b.tokens,
            number: b.stamp_us & 0xffff_ffff,
        }
    }

    fn pack(self) -> LimitState {
        let previous = (self.previous.max(0.0) as u64).min(0xffff_ffff);
        LimitState {
            tokens: self.current,
            stamp_us: (previous << 32) | (self.number & 0xffff_ffff),
        }
    }

    /// Moved to the window of `now_us`.
    fn rolled(self, limit: &Limit, now_us: u64) -> Sliding {
        let number = (now_us / limit.period().micros()) & 0xffff_ffff;
        if number == self.number {
            self
        } else if number == self.number + 1 {
            Sliding {
                previous: self.current,
                current: 0.0,
                number,
            }
        } else {
            Sliding {
                previous: 0.0,
                current: 0.0,
                number,
            }
        }
    }

    /// The previous window's count weighted by its overlap with the last period, plus the
    /// current window's.
    fn weighted(&self, limit: &Limit, now_us: u64) -> f64 {
        let length = limit.period().micros();
        let into = (now_us % length) as f64 / length as f64;
        self.previous * (1.0 - into) + self.current
    }
}

fn sliding(
    b: LimitState,
    limit: &Limit,
    now_us: u64,
    cost: u64,
    spend: bool,
) -> (Verdict, LimitState) {
    let mut s = Sliding::unpack(b).rolled(limit, now_us);
    let requests = limit.requests() as f64;
    let cost = cost as f64;
    let length = limit.period().micros() as f64;
    let start = now_us - now_us % limit.period().micros();
    let weighted = s.weighted(limit, now_us);
    // Counts are whole numbers and the weight is exact to a microsecond: a hair of tolerance
    // keeps a request at exactly the limit from being refused by rounding.
    let allowed = weighted + cost <= requests + 1e-9;
    let counted = if allowed { weighted + cost } else { weighted };
    if allowed && spend {
        s.current += cost;
    }
    // Offsets within the window, in microseconds: small numbers, exact in an f64.
    let elapsed = (now_us - start) as f64;
    let retry_after_us = if allowed {
        0
    } else if s.current + cost <= requests && s.previous > 0.0 {
        // Later in this window, once enough of the previous one has slid out.
        let into = 1.0 - (requests - cost - s.current) / s.previous;
        (into * length - elapsed).ceil().max(1.0) as u64
    } else {
        // In the next window, once enough of this one has slid out.
        let into = 1.0 - (requests - cost) / s.current.max(1.0);
        (length + into.max(0.0) * length - elapsed).ceil() as u64
    };
    let reset_us = if s.current > 0.0 {
        start + 2 * limit.period().micros() - now_us
    } else if s.previous > 0.0 {
        start + limit.period().micros() - now_us
    } else {
        0
    };
    let verdict = Verdict {
        allowed,
        remaining: (requests - counted).max(0.0).floor() as u64,
        retry_after_us,
        reset_us,
        delay_us: 0,
    };
    (verdict, s.pack())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    const S: u64 = 1_000_000;

    #[test]
    fn gcra_after_a_clock_stepped_back_admits_at_its_rate_from_the_new_time() {
        let limit = Limit::new(10, Period::Second, Some(2)).unwrap().gcra();
        let t = 1_700_000_000 * S;
        let mut b = LimitState::fresh(&limit, t);
        for _ in 0..2 {
            let (verdict, next) = b.admit(&limit, t, 1);
            assert!(verdict.allowed);
            b = next;
        }
        assert!(!b.admit(&limit, t, 1).0.allowed, "the burst is spent");
        assert!(
            !b.admit(&limit, t - S / 2, 1).0.allowed,
            "half a second back: as it was"
        );
        let back = t - 86_400 * S;
        let (verdict, b) = b.admit(&limit, back, 1);
        assert!(!verdict.allowed, "a step back frees nothing");
        assert_eq!(verdict.retry_after_us, S / 10, "one interval, not a day");
        assert!(b.admit(&limit, back + S / 10, 1).0.allowed);
    }

    /// Through the limiter, whose denials write nothing back while the key was seen recently:
    /// a key last seen before the clock was stepped back 30 s admits again at its rate.
    #[test]
    fn a_local_key_refills_after_a_step_back_though_it_only_denies() {
        for algorithm in ["token_bucket", "gcra"] {
            let json = format!(
                r#"{{"rules": [{{"name": "r", "key": ["const:k"],
                    "limits": [{{"requests": 10, "per": "second", "burst": 5, "algorithm": "{algorithm}"}}]}}]}}"#
            );
            let limiter = crate::Limiter::new(crate::parse(json.as_bytes()).unwrap());
            let mut store = crate::MemoryStore::default();
            let t = 1_700_000_000 * S;
            let admitted = |from: u64, store: &mut crate::MemoryStore| {
                (0..100)
                    .filter(|i| {
                        let conditions = crate::Conditions {
                            now_us: from + i * 10_000,
                            service_up: true,
                            service_back_us: 0,
                            load: Default::default(),
                        };
                        let e =
                            limiter.decide(&mut crate::PlainRequest::get("/"), conditions, store);
                        matches!(e.decision, crate::Decision::Allow { .. })
                    })
                    .count()
            };
            assert_eq!(
                admitted(t, &mut store),
                5 + 9,
                "{algorithm}: burst and a second's rate"
            );
            let after = admitted(t - 30 * S, &mut store);
            assert!(
                (9..=10).contains(&after),
                "{algorithm}: {after} in the second after the step"
            );
        }
    }
}
