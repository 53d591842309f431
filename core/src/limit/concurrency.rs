//! Per-key concurrency: at most `concurrent` requests of a key in flight at once, across the
//! workers of a proxy (nginx's `limit_conn`, Traefik's `InFlightReq`).
//!
//! A key's record keeps one place per slot, after its buckets (as a sliding log keeps its
//! ring: [`crate::limit::table`]); a place holds the time its slot lapses (its request's
//! admission plus `max_hold`), 0 when free. A request takes a place whose time has passed and
//! writes its own; the stream's end, however it ends, gives the place back by that time
//! ([`Slots::release`]). A request whose release is lost (a worker crashed, its stream outlived
//! the filter's callbacks) holds its place until `max_hold` has passed, never longer: no key
//! stays full forever. The limit's [`LimitState`] is unused.
//!
//! When a slot frees is not known: a denial says [`RETRY_US`] (`Retry-After: 1`), and the
//! headers' reset is that too while any slot is held.
//!
//! The ghost of an evicted record is the sliding log's: the latest lapse rounded up to a
//! multiple of [`GHOST_STEP`], plus how many places were held. A key seen again while it stands
//! has that many places held until then; a release that finds not its own place (its record
//! was evicted and came back) frees one of those instead.
//!
//! [`LimitState`]: crate::limit::token_bucket::LimitState

use crate::limit::sliding_log::GHOST_STEP;
use crate::limit::token_bucket::{Verdict, CLOCK_STEP_US};
use crate::limit::Limit;

/// What a denial tells the client to wait, and the headers' reset while a slot is held: a
/// slot's release time is unknown, and one second is what clients of a busy key wait between
/// tries (nginx's `limit_conn` answers at once; a second keeps retries from spinning).
pub const RETRY_US: u64 = 1_000_000;
/// `max_hold` when not configured: ten minutes.
pub const DEFAULT_MAX_HOLD_S: u64 = 600;
/// The longest `max_hold`: a day.
pub const MAX_MAX_HOLD_S: u64 = 86_400;

/// One concurrency limit's places in a record.
pub struct Slots<'a> {
    pub places: &'a mut [u64],
}

impl Slots<'_> {
    /// Whether the place holding `lapse` is held at `now_us`: its time has not passed, and is
    /// not further ahead than a fresh slot's could be (a clock stepped back, or a damaged
    /// record: freed rather than held for ever).
    fn held_at(limit: &Limit, lapse: u64, now_us: u64) -> bool {
        let latest = now_us
            .saturating_add(limit.period().micros())
            .saturating_add(CLOCK_STEP_US);
        lapse > now_us && lapse <= latest
    }

    /// Slots held at `now_us`.
    pub fn held(&self, limit: &Limit, now_us: u64) -> usize {
        self.places
            .iter()
            .filter(|&&lapse| Slots::held_at(limit, lapse, now_us))
            .count()
    }

    /// Would `cost` slots be taken at `now_us`? If `spend`, they are when they may be.
    pub fn step(&mut self, limit: &Limit, now_us: u64, cost: u64, spend: bool) -> Verdict {
        let n = self.places.len();
        let held = self.held(limit, now_us);
        let allowed = (cost as usize) <= n.saturating_sub(held);
        let counted = if allowed { held + cost as usize } else { held };
        if allowed && spend {
            self.take(limit, now_us, cost);
        }
        Verdict {
            allowed,
            remaining: n.saturating_sub(counted) as u64,
            retry_after_us: if allowed { 0 } else { RETRY_US },
            reset_us: if counted > 0 { RETRY_US } else { 0 },
            delay_us: 0,
        }
    }

    /// Takes `cost` free places (as many as there are), each lapsing at [`lapse_us`].
    pub fn take(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        // (u64::MAX is no multiple of GHOST_STEP: a saturated lapse is never a ghost's.)
        let lapse = lapse_us(limit, now_us);
        let mut left = cost;
        for place in self.places.iter_mut() {
            if left == 0 {
                break;
            }
            if !Slots::held_at(limit, *place, now_us) {
                *place = lapse;
                left -= 1;
            }
        }
    }

    /// Gives back the place of the request admitted with `lapse` (see [`lapse_us`]): its own;
    /// else, if its record was evicted and came back, one held by the ghost (a multiple of
    /// [`GHOST_STEP`] no sooner than its own); else nothing (its place lapsed and was taken
    /// again: it is another request's).
    pub fn release(&mut self, lapse: u64) {
        if lapse == 0 {
            return;
        }
        let own = self.places.iter().position(|&p| p == lapse);
        let ghost = || {
            self.places
                .iter()
                .position(|&p| p >= lapse && p.is_multiple_of(GHOST_STEP))
        };
        if let Some(at) = own.or_else(ghost) {
            if let Some(place) = self.places.get_mut(at) {
                *place = 0;
            }
        }
    }

    /// The ghost's time: the latest lapse rounded up to a multiple of [`GHOST_STEP`], plus how
    /// many places are held (fewer than `GHOST_STEP`); `now_us` when none is.
    pub fn ghost_us(&self, limit: &Limit, now_us: u64) -> u64 {
        let held = self.held(limit, now_us);
        if held == 0 {
            return now_us;
        }
        let latest = self
            .places
            .iter()
            .copied()
            .filter(|&p| Slots::held_at(limit, p, now_us))
            .max()
            .unwrap_or(now_us)
            .min(u64::MAX - 2 * GHOST_STEP);
        latest.div_ceil(GHOST_STEP) * GHOST_STEP + held as u64
    }

    /// The places of a key seen again while its ghost stands: as many held as the ghost says,
    /// until its time.
    pub fn returning(&mut self, ghost_us: u64) {
        let until = ghost_us - ghost_us % GHOST_STEP;
        let held = (ghost_us % GHOST_STEP) as usize;
        for (i, place) in self.places.iter_mut().enumerate() {
            *place = if i < held { until } else { 0 };
        }
    }
}

/// When the slot of a request admitted at `now_us` lapses: `max_hold` later (a microsecond
/// more if that is a multiple of [`GHOST_STEP`], which only a returning ghost's places are, so
/// a release never takes another request's place for a ghost's). Never 0 (a free place), and
/// what its release names its place by.
pub fn lapse_us(limit: &Limit, now_us: u64) -> u64 {
    let lapse = now_us.saturating_add(limit.period().micros());
    if lapse.is_multiple_of(GHOST_STEP) {
        lapse.saturating_add(1)
    } else {
        lapse
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    const S: u64 = 1_000_000;
    const T: u64 = 1_700_000_000 * S;

    fn limit(n: u64) -> Limit {
        Limit::concurrent(n, Period::Every(600)).unwrap()
    }

    #[test]
    fn n_slots_admit_n_and_a_release_admits_one_more() {
        let l = limit(3);
        let mut places = vec![0; 3];
        let mut slots = Slots {
            places: &mut places,
        };
        let lapses: Vec<u64> = (0..3)
            .map(|i| {
                let v = slots.step(&l, T + i, 1, true);
                assert!(v.allowed, "{i}");
                assert_eq!(v.remaining, 2 - i);
                lapse_us(&l, T + i)
            })
            .collect();
        let denied = slots.step(&l, T + 10, 1, true);
        assert!(!denied.allowed);
        assert_eq!((denied.remaining, denied.retry_after_us), (0, RETRY_US));
        assert_eq!(
            denied.reset_us, RETRY_US,
            "a held slot's release is unknown"
        );
        slots.release(lapses[1]);
        assert_eq!(slots.held(&l, T + 11), 2);
        assert!(slots.step(&l, T + 11, 1, true).allowed);
        assert!(!slots.step(&l, T + 12, 1, true).allowed);
        // A release of a place already given back, or of nothing, frees nothing.
        slots.release(lapses[1]);
        slots.release(0);
        assert_eq!(slots.held(&l, T + 13), 3);
    }

    #[test]
    fn a_lost_release_holds_its_slot_until_max_hold_and_no_longer() {
        let l = limit(1);
        let mut places = vec![0];
        let mut slots = Slots {
            places: &mut places,
        };
        assert!(slots.step(&l, T, 1, true).allowed);
        let lost = lapse_us(&l, T);
        assert!(!slots.step(&l, T + 599 * S, 1, true).allowed);
        let later = T + 600 * S;
        let v = slots.step(&l, later, 1, true);
        assert!(v.allowed, "lapsed after max_hold");
        // The lost request's late release does not free the new request's slot.
        slots.release(lost);
        assert_eq!(slots.held(&l, later + 1), 1);
        slots.release(lapse_us(&l, later));
        assert_eq!(slots.held(&l, later + 1), 0);
    }

    #[test]
    fn damaged_or_stepped_back_places_are_free() {
        let l = limit(2);
        let mut places = vec![u64::MAX, T + 700 * S];
        let mut slots = Slots {
            places: &mut places,
        };
        assert_eq!(slots.held(&l, T), 0, "further ahead than max_hold: free");
        assert!(slots.step(&l, T, 2, true).allowed);
        assert_eq!(
            slots.ghost_us(&l, u64::MAX - 5),
            u64::MAX - 5,
            "no overflow"
        );
    }

    #[test]
    fn an_evicted_key_comes_back_with_its_slots_held_and_releasable() {
        let l = limit(4);
        let mut places = vec![0; 4];
        let mut slots = Slots {
            places: &mut places,
        };
        let a = {
            slots.step(&l, T, 1, true);
            lapse_us(&l, T)
        };
        slots.step(&l, T + 5, 1, true);
        let ghost = slots.ghost_us(&l, T + 10);
        assert_eq!(ghost % GHOST_STEP, 2);
        assert!(ghost - 2 >= lapse_us(&l, T + 5));
        let mut back = vec![0; 4];
        let mut returned = Slots { places: &mut back };
        returned.returning(ghost);
        assert_eq!(returned.held(&l, T + 20), 2, "not a fresh key");
        returned.release(a);
        assert_eq!(returned.held(&l, T + 20), 1, "the release frees a ghost's");
    }
}
