//! The proxy's side of the sync (the service's is `counter-service/src/sync_handler.rs`, the
//! script `lua/sync.lua`): who syncs this round, what goes into the batch, and how the
//! answer becomes leases. Pure steps over [`Store`] values; the filter does the I/O.

use crate::limit::table::Record;
use crate::limit::Limit;
use crate::limiter::{Enforced, Limiter};
use crate::policy::RuleId;
use crate::protocol::{CheckResponse, Lease, LimitSpec, SyncEntry};
use crate::store::{self, Store, StoreError};
use crate::sync::breaker::Breaker;

/// Shared-data key of the proxy's [`SyncState`].
pub const STATE_KEY: &str = "sluice/sync";
/// Shared queue the workers announce keys with unsynced counts on.
pub const QUEUE_NAME: &str = "sluice/unsynced";

/// The proxy-wide sync state, in shared data so every worker sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncState {
    /// When the next round may start.
    pub next_at_us: u64,
    /// A round in flight owns the sync until then (its timeout, plus a margin).
    pub busy_until_us: u64,
    /// The interval the service last asked for (backpressure); 0: the configured one.
    pub interval_ms: u64,
    pub breaker: Breaker,
    /// The service's emergency bypass override.
    pub bypass: bool,
    /// Rounds started, for logs and tests.
    pub rounds: u64,
    /// The fleet level from the service's last answer.
    pub fleet: Fleet,
    /// The version of the live overrides kept in [`crate::overrides::OVERRIDES_KEY`].
    pub overrides_version: u64,
    /// The high half of the round labels ([`SyncState::round_label`]): drawn at the first claim
    /// of a state that starts over (0: not drawn yet), and again when the low half wraps.
    pub epoch: u32,
    /// When the last round was claimed (an exhausted lease hurries the next to a quarter
    /// interval after it).
    pub claimed_at_us: u64,
    /// The proxies the service last counted for fleet-share fallbacks
    /// ([`crate::protocol::Overrides::fleet_proxies`]); 0: none heard since the state started.
    /// Kept however old: while the service is out of reach, the last count stands.
    pub fleet_proxies: u32,
}

/// The fleet load level the counter service last answered, and when.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fleet {
    /// In thousandths; `u32::MAX`: no level.
    pub level_milli: u32,
    pub at_us: u64,
}

impl Fleet {
    pub fn heard(level: Option<f64>, now_us: u64) -> Fleet {
        Fleet {
            level_milli: level
                .filter(|l| l.is_finite())
                .map_or(u32::MAX, |l| (l.clamp(0.0, 1.0) * 1_000.0).round() as u32),
            at_us: now_us,
        }
    }

    /// The level, if heard within `fresh_us`.
    pub fn level(&self, now_us: u64, fresh_us: u64) -> Option<f64> {
        let fresh = self.at_us > 0 && now_us.saturating_sub(self.at_us) <= fresh_us;
        (fresh && self.level_milli <= 1_000).then(|| self.level_milli as f64 / 1_000.0)
    }
}

impl SyncState {
    const LEN: usize = 8 * 5 + 4 + 1 + 4 + 8 + 8 + 4 + 8 + 4;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&self.next_at_us.to_le_bytes());
        b.extend_from_slice(&self.busy_until_us.to_le_bytes());
        b.extend_from_slice(&self.interval_ms.to_le_bytes());
        b.extend_from_slice(&self.breaker.open_until_us.to_le_bytes());
        b.extend_from_slice(&self.rounds.to_le_bytes());
        b.extend_from_slice(&self.breaker.failures.to_le_bytes());
        b.push(self.bypass as u8);
        b.extend_from_slice(&self.fleet.level_milli.to_le_bytes());
        b.extend_from_slice(&self.fleet.at_us.to_le_bytes());
        b.extend_from_slice(&self.overrides_version.to_le_bytes());
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.claimed_at_us.to_le_bytes());
        b.extend_from_slice(&self.fleet_proxies.to_le_bytes());
        b
    }

    /// Decodes; anything malformed (or empty) reads as the initial state.
    pub fn decode(bytes: &[u8]) -> SyncState {
        if bytes.len() != Self::LEN {
            return SyncState::default();
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut f = [0u8; 4];
        f.copy_from_slice(&bytes[40..44]);
        let mut level = [0u8; 4];
        level.copy_from_slice(&bytes[45..49]);
        let mut epoch = [0u8; 4];
        epoch.copy_from_slice(&bytes[65..69]);
        let mut proxies = [0u8; 4];
        proxies.copy_from_slice(&bytes[77..81]);
        SyncState {
            next_at_us: u64_at(0),
            busy_until_us: u64_at(8),
            interval_ms: u64_at(16),
            breaker: Breaker {
                open_until_us: u64_at(24),
                failures: u32::from_le_bytes(f),
            },
            rounds: u64_at(32),
            bypass: bytes[44] != 0,
            fleet: Fleet {
                level_milli: u32::from_le_bytes(level),
                at_us: u64_at(49),
            },
            overrides_version: u64_at(57),
            epoch: u32::from_le_bytes(epoch),
            claimed_at_us: u64_at(69),
            fleet_proxies: u32::from_le_bytes(proxies),
        }
    }

    /// The label of the round last claimed, which the service deduplicates reports by
    /// ([`crate::protocol::SyncEntry::round`]): the epoch in the high 32 bits, the low 32 bits
    /// of the round counter in the low. It increases from round to round while the state lives;
    /// a state that starts over (a new filter build's layout, corrupt shared data) draws another
    /// epoch, which the service takes as new. 0 before any claim: unlabeled.
    pub fn round_label(&self) -> u64 {
        if self.epoch == 0 {
            return 0;
        }
        (u64::from(self.epoch) << 32) | u64::from(self.rounds as u32)
    }

    /// The interval to use: the service's hint, never below the configured one nor above 10×.
    pub fn effective_interval_ms(&self, configured_ms: u64) -> u64 {
        if self.interval_ms == 0 {
            configured_ms
        } else {
            self.interval_ms
                .clamp(configured_ms, configured_ms.saturating_mul(10))
        }
    }

    /// The fleet level the service last answered, while it is fresh: within three sync
    /// intervals (and at least a second) of that answer. Stale, shedding goes by the local
    /// level alone.
    pub fn fresh_fleet_level(&self, configured_interval_ms: u64, now_us: u64) -> Option<f64> {
        let interval_ms = self.effective_interval_ms(configured_interval_ms);
        let fresh_us = interval_ms.saturating_mul(3_000).max(1_000_000);
        self.fleet.level(now_us, fresh_us)
    }
}

/// A count of proxies as the sync state keeps it: at least 1 (the proxy that heard it), at
/// most `u32::MAX` (a fallback divided by so many is at its floor anyway).
pub fn fleet_proxies(answered: u64) -> u32 {
    answered.clamp(1, u32::MAX as u64) as u32
}

/// Reads the sync state.
pub fn read_state(store: &mut dyn Store) -> SyncState {
    match store.get(STATE_KEY) {
        Ok(Some((bytes, _))) => SyncState::decode(&bytes),
        _ => SyncState::default(),
    }
}

/// Changes the sync state atomically.
pub fn update_state<T>(
    store: &mut dyn Store,
    mut step: impl FnMut(&mut SyncState) -> T,
) -> Result<T, StoreError> {
    store::update(store, STATE_KEY, |bytes| {
        let mut state = SyncState::decode(bytes);
        let answer = step(&mut state);
        *bytes = state.encode();
        (answer, true)
    })
}

/// Tries to claim this round for the calling worker: succeeds for exactly one worker per
/// interval. `busy_us` is how long the round may stay in flight.
pub fn claim_round(
    store: &mut dyn Store,
    now_us: u64,
    configured_interval_ms: u64,
    busy_us: u64,
    breaker_threshold: u32,
) -> Option<SyncState> {
    // Most ticks find the round not due: they read and write nothing back.
    store::update(store, STATE_KEY, |bytes| {
        let mut state = SyncState::decode(bytes);
        let interval_us = state.effective_interval_ms(configured_interval_ms) * 1_000;
        // A next round further ahead than an interval (and a second, for workers that read
        // the clock a moment apart): the clock was stepped back since it was set; the round is
        // due now, not when the clock is back where it was.
        let stepped_back = state.next_at_us
            > now_us
                .saturating_add(interval_us)
                .saturating_add(crate::limit::token_bucket::CLOCK_STEP_US);
        let due = (now_us >= state.next_at_us || stepped_back) && now_us >= state.busy_until_us;
        if !due || !state.breaker.may_call(breaker_threshold, now_us) {
            return (None, false);
        }
        state.next_at_us = now_us + interval_us;
        state.claimed_at_us = now_us;
        state.busy_until_us = now_us + busy_us;
        // A counter read from shared data, possibly corrupt: it wraps, never panics.
        state.rounds = state.rounds.wrapping_add(1);
        if state.epoch == 0 || state.rounds as u32 == 0 {
            // Labels must keep increasing: a new epoch, never 0 and not the last one.
            let drawn = crate::limit::table::fnv1a(&now_us.to_le_bytes()) as u32;
            state.epoch = match drawn {
                0 => 1,
                e if e == state.epoch => e.wrapping_add(1).max(1),
                e => e,
            };
        }
        *bytes = state.encode();
        (Some(state), true)
    })
    .ok()
    .flatten()
}

/// Brings the next round forward after a lease ran out, to a quarter interval after the last
/// claim at the earliest: a proxy whose demand outgrew its lease asks again soon instead of
/// denying until the interval is over, and the sync rate stays bounded.
pub fn hurry(store: &mut dyn Store, now_us: u64, configured_interval_ms: u64) {
    let _ = update_state(store, |state| {
        let interval_us = state.effective_interval_ms(configured_interval_ms) * 1_000;
        // From the claim itself, not from the next round: an earlier hurry moved that.
        let earliest = state
            .claimed_at_us
            .saturating_add(interval_us / 4)
            .max(now_us);
        state.next_at_us = state.next_at_us.min(earliest);
    });
}

/// Encodes a queue message announcing that `key` of rule `rule` has unsynced counts.
pub fn announce(rule: RuleId, key: &str) -> Vec<u8> {
    let mut msg = Vec::with_capacity(4 + key.len());
    msg.extend_from_slice(&(rule.index() as u32).to_le_bytes());
    msg.extend_from_slice(key.as_bytes());
    msg
}

/// Decodes a queue message; `None` if malformed.
pub fn announced(msg: &[u8]) -> Option<(RuleId, String)> {
    let rule = u32::from_le_bytes(msg.get(..4)?.try_into().ok()?) as usize;
    let key = std::str::from_utf8(msg.get(4..)?).ok()?;
    Some((RuleId::new(rule), key.to_string()))
}

/// Runs `step` on the record of `key` when the table holds it, and writes the record back when
/// `step` says it changed it; `missing` when the rule or the record is not there (evicted).
fn with_record<T: Clone>(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    store: &mut dyn Store,
    missing: T,
    mut step: impl FnMut(&mut Record) -> (T, bool),
) -> Result<T, StoreError> {
    let Some(Enforced {
        rule: spec, table, ..
    }) = limiter.rule_for(rule, key)
    else {
        return Ok(missing);
    };
    let limits = crate::limiter::bucket_limits(spec);
    let fingerprint = table.fingerprint(key);
    store::update(store, &table.set_key(fingerprint), |set| {
        let Some(mut record) = table.find(set, fingerprint) else {
            return (missing.clone(), false);
        };
        let (answer, changed) = step(&mut record);
        if changed {
            table.store(set, &record, limits, record.seen_us);
        }
        (answer, changed)
    })
}

/// Takes a key's unsynced counts (resetting them) and makes its batch entry.
/// `None` if the key was evicted or has nothing to report.
pub fn snapshot(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    store: &mut dyn Store,
) -> Option<SyncEntry> {
    let (spent, denied) = with_record(limiter, rule, key, store, (0, 0), |record| {
        let counts = (record.spent, record.denied);
        record.spent = 0;
        record.denied = 0;
        (counts, true)
    })
    .ok()?;
    if spent == 0 && denied == 0 {
        return None;
    }
    let spec = limiter.rule_for(rule, key)?.rule;
    Some(SyncEntry {
        key: key.to_string(),
        limits: spec.limits.iter().map(LimitSpec::from).collect(),
        spent: spent as u64,
        denied: denied as u64,
        round: 0,
        penalty_ms: spec.penalty_ms(),
    })
}

/// Whether a key's report may wait for a later round, at `now_us` (the round's claim) with
/// rounds `interval_us` apart, for a rule of one `limit` (a token bucket or GCRA): when it
/// holds denials only, on a lease the service granted empty or that was spent in an earlier
/// round (*starved*), and the global bucket held no token when the service last answered and
/// has not refilled one since, as far as that answer said (its reset less `burst - 1` tokens'
/// time, the `Retry-After` of such a denial). Asking before then only repeats the denials: a
/// hot key denied on every proxy sent an entry per proxy and round for about one admission a
/// round, and more with the early rounds its denials bring. Only while the lease lasts more
/// than another interval and a half, so the report still goes, and its answer comes back,
/// before the lease lapses (never a fallback decision for want of a report), and ends within
/// four intervals (one ending later means the clock was stepped back: report as before). So
/// such a key reports every one and a half to two intervals instead of up to four times an
/// interval, and at once after any spend.
///
/// Not held back: a key whose lease still covers its spend (measured, holding it parked
/// unused leases, the free tokens the service shares out, where demand no longer was: the
/// fleet admitted 1-1.5 points fewer than an exact limiter, `make bench-accuracy`), nor a
/// starved key while the global bucket has tokens (others' leases come back at their syncs:
/// held, it admitted about 0.4 points fewer there).
pub fn may_wait(record: &Record, limit: &Limit, now_us: u64, interval_us: u64) -> bool {
    let left_us = record.lease_until_us.saturating_sub(now_us);
    let lives =
        left_us > interval_us.saturating_mul(3) / 2 && left_us <= interval_us.saturating_mul(4);
    let starved = record.spent == 0 && record.denied > 0 && record.lease == 0;
    lives && starved && record.globally_empty(limit, now_us)
}

/// What a round takes from a key ([`take`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    /// Its batch entry (its counts reset in the record).
    Entry(SyncEntry),
    /// Its report waits for a later round ([`may_wait`]); it must stay announced.
    Held,
    /// Evicted, or nothing to report.
    Nothing,
}

/// [`snapshot`], unless the key's report may wait ([`may_wait`]) at `now_us` with rounds
/// `interval_us` apart. Only a rule of one token bucket (or GCRA) holds reports back, the case
/// measured; a window's leases follow its end, and its rules report every round as before.
pub fn take(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    now_us: u64,
    interval_us: u64,
    store: &mut dyn Store,
) -> Taken {
    let bucket =
        limiter
            .rule_for(rule, key)
            .and_then(|enforced| match enforced.rule.limits.as_slice() {
                [limit] if !limit.algorithm().windowed() => Some(*limit),
                _ => None,
            });
    let counts = with_record(limiter, rule, key, store, None, |record| {
        let wait = bucket.is_some_and(|limit| may_wait(record, &limit, now_us, interval_us));
        if record.unsynced() && wait {
            return (Some(None), false);
        }
        let counts = (record.spent, record.denied);
        record.spent = 0;
        record.denied = 0;
        (Some(Some(counts)), counts != (0, 0))
    });
    match counts {
        Ok(Some(Some((spent, denied)))) => entry(limiter, rule, key, spent, denied),
        Ok(Some(None)) => Taken::Held,
        _ => Taken::Nothing,
    }
}

fn entry(limiter: &Limiter, rule: RuleId, key: &str, spent: u32, denied: u32) -> Taken {
    if spent == 0 && denied == 0 {
        return Taken::Nothing;
    }
    let Some(enforced) = limiter.rule_for(rule, key) else {
        return Taken::Nothing;
    };
    Taken::Entry(SyncEntry {
        key: key.to_string(),
        limits: enforced.rule.limits.iter().map(LimitSpec::from).collect(),
        spent: spent as u64,
        denied: denied as u64,
        round: 0,
        penalty_ms: enforced.rule.penalty_ms(),
    })
}

/// Drops a key's unsynced counts: it could not wait any longer for a round (see
/// [`crate::sync::outbox`]). Its next count announces it again.
pub fn forget(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    store: &mut dyn Store,
) -> Result<(), StoreError> {
    with_record(limiter, rule, key, store, (), |record| {
        if !record.unsynced() {
            return ((), false);
        }
        record.spent = 0;
        record.denied = 0;
        ((), true)
    })
}

/// Puts back the counts of a batch that never reached the service, so the next batch reports
/// them. Returns whether the key must be announced again (it had nothing unsynced since).
pub fn restore(
    limiter: &Limiter,
    rule: RuleId,
    entry: &SyncEntry,
    store: &mut dyn Store,
) -> Result<bool, StoreError> {
    with_record(limiter, rule, &entry.key, store, false, |record| {
        let announce = !record.unsynced();
        record.spent = record
            .spent
            .saturating_add(entry.spent.min(u32::MAX as u64) as u32);
        record.denied = record
            .denied
            .saturating_add(entry.denied.min(u32::MAX as u64) as u32);
        (announce, true)
    })
}

/// Installs a lease (the wire calls it a grant): it replaces the old one, less what this proxy spent while the
/// answer was on its way (that spend is already counted in `spent` for the next sync, and the
/// service sized the lease without it).
pub fn apply_lease(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    grant: &Lease,
    now_us: u64,
    store: &mut dyn Store,
) -> Result<(), StoreError> {
    install_lease(limiter, rule, key, grant, now_us, false, store)
}

/// The lease a check's denial told a cached key's proxy it holds ([`CheckResponse::lease`]):
/// its sync's grant, whose answer may still be on its way. Installed as that answer would
/// install it ([`apply_lease`]), if the key holds no lease yet: the sync's answer, when it comes,
/// installs the same grant less what was spent since its batch was composed, as here, so the
/// grant is spent once.
pub fn apply_told_lease(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    answer: &CheckResponse,
    now_us: u64,
    store: &mut dyn Store,
) -> Result<(), StoreError> {
    let Some(lease) = answer.lease.filter(|_| !answer.allowed) else {
        return Ok(());
    };
    let cached = limiter
        .rule_for(rule, key)
        .is_some_and(|enforced| enforced.rule.consistency == crate::policy::Consistency::Cached);
    if !cached {
        return Ok(());
    }
    let grant = Lease {
        tokens: lease.tokens,
        ttl_ms: lease.ttl_ms,
        remaining: answer.remaining,
        reset_ms: answer.reset_ms,
        token_ms: None,
        refused: None,
        penalty_ms: 0,
    };
    install_lease(limiter, rule, key, &grant, now_us, true, store)
}

/// [`apply_lease`]; `unleased_only`: not over a lease the key still holds.
fn install_lease(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    grant: &Lease,
    now_us: u64,
    unleased_only: bool,
    store: &mut dyn Store,
) -> Result<(), StoreError> {
    let Some(Enforced {
        rule: spec, table, ..
    }) = limiter.rule_for(rule, key)
    else {
        return Ok(());
    };
    let limits = crate::limiter::bucket_limits(spec);
    let fingerprint = table.fingerprint(key);
    store::update(store, &table.set_key(fingerprint), |set| {
        let mut record = table.find_or_fresh(set, fingerprint, limits, now_us);
        if unleased_only && now_us < record.lease_until_us {
            return ((), false);
        }
        let tokens = grant.tokens.min(u32::MAX as u64) as u32;
        record.lease = tokens.saturating_sub(record.spent);
        record.lease_until_us = now_us.saturating_add(grant.ttl_ms.saturating_mul(1_000));
        let remaining = grant.remaining.min(u32::MAX as u64) as u32;
        record.global_remaining = remaining.saturating_sub(record.spent);
        record.global_reset_at_us = now_us.saturating_add(grant.reset_ms.saturating_mul(1_000));
        // 0 when the service does not say; a token due now is due at `now_us` (never 0).
        record.global_token_at_us = grant.token_ms.map_or(0, |ms| {
            now_us.saturating_add(ms.saturating_mul(1_000)).max(1)
        });
        // The service's penalty of the key, fleet-wide: kept as a penalty of this proxy's own,
        // for the rule's `penalty` at most, whatever the answer says.
        if spec.penalty_us > 0 && grant.penalty_ms > 0 {
            let left = grant.penalty_ms.saturating_mul(1_000).min(spec.penalty_us);
            record.penalty_until_us = record.penalty_until_us.max(now_us.saturating_add(left));
        }
        table.store(set, &record, limits, now_us);
        ((), true)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn state_round_trips() {
        let mut s = SyncState {
            next_at_us: 1,
            busy_until_us: 2,
            interval_ms: 3,
            breaker: Breaker {
                failures: 4,
                open_until_us: 5,
            },
            bypass: true,
            rounds: 6,
            fleet: Fleet::heard(Some(0.42), 7),
            overrides_version: 8,
            epoch: 9,
            claimed_at_us: 10,
            fleet_proxies: 11,
        };
        assert_eq!(SyncState::decode(&s.encode()), s);
        assert_eq!(s.fleet.level(8, 10), Some(0.42));
        assert_eq!(s.fleet.level(100, 10), None, "stale");
        // Fresh for three intervals of the service's hint, at least a second.
        let t = 5_000_000_000;
        s.fleet.at_us = t;
        s.interval_ms = 0;
        assert_eq!(s.fresh_fleet_level(100, t + 999_999), Some(0.42));
        assert_eq!(s.fresh_fleet_level(100, t + 1_000_001), None);
        s.interval_ms = 2_000;
        assert_eq!(s.fresh_fleet_level(1_000, t + 6_000_000), Some(0.42));
        assert_eq!(s.fresh_fleet_level(1_000, t + 6_000_001), None);
        assert_eq!(Fleet::heard(None, 7).level(8, 10), None);
        assert_eq!(SyncState::decode(b"junk"), SyncState::default());
    }

    #[test]
    fn one_claim_per_interval() {
        let mut store = MemoryStore::default();
        let t = 1_000_000;
        assert!(claim_round(&mut store, t, 100, 50_000, 3).is_some());
        assert!(
            claim_round(&mut store, t + 10, 100, 50_000, 3).is_none(),
            "another worker, same round"
        );
        // The round finished early, but the interval has not passed.
        update_state(&mut store, |s| s.busy_until_us = 0).unwrap();
        assert!(claim_round(&mut store, t + 99_000, 100, 50_000, 3).is_none());
        assert!(claim_round(&mut store, t + 100_000, 100, 50_000, 3).is_some());
    }

    #[test]
    fn an_exhausted_lease_brings_the_round_forward_but_not_too_far() {
        let mut store = MemoryStore::default();
        let t = 1_000_000;
        assert!(claim_round(&mut store, t, 100, 50_000, 3).is_some());
        update_state(&mut store, |s| s.busy_until_us = 0).unwrap();
        hurry(&mut store, t + 5_000, 100);
        // every worker may hurry: the second must not move it further
        hurry(&mut store, t + 6_000, 100);
        assert_eq!(read_state(&mut store).next_at_us, t + 25_000);
        assert!(
            claim_round(&mut store, t + 20_000, 100, 50_000, 3).is_none(),
            "not before 25 ms"
        );
        assert!(claim_round(&mut store, t + 25_000, 100, 50_000, 3).is_some());
        update_state(&mut store, |s| s.busy_until_us = 0).unwrap();
        hurry(&mut store, t + 30_000, 100);
        assert_eq!(
            read_state(&mut store).next_at_us,
            t + 50_000,
            "a quarter after the claim at 25 ms"
        );
        assert!(claim_round(&mut store, t + 45_000, 100, 50_000, 3).is_none());
        assert!(claim_round(&mut store, t + 50_000, 100, 50_000, 3).is_some());
        update_state(&mut store, |s| s.busy_until_us = 0).unwrap();
        hurry(&mut store, t + 90_000, 100);
        assert_eq!(
            read_state(&mut store).next_at_us,
            t + 90_000,
            "asked late: now, not earlier"
        );
    }

    #[test]
    fn a_clock_stepped_back_claims_now_not_when_it_is_back() {
        let mut store = MemoryStore::default();
        let t = 100_000_000;
        assert!(claim_round(&mut store, t, 100, 50_000, 1).is_some());
        update_state(&mut store, |s| s.busy_until_us = 0).unwrap();
        assert!(
            claim_round(&mut store, t + 50_000, 100, 50_000, 1).is_none(),
            "within the interval"
        );
        assert!(
            claim_round(&mut store, t - 600_000, 100, 50_000, 1).is_none(),
            "back by less than a second: as scheduled"
        );
        let back = t - 30_000_000;
        let claimed = claim_round(&mut store, back, 100, 50_000, 1);
        assert!(claimed.is_some(), "back 30 s: due now");
        assert_eq!(read_state(&mut store).next_at_us, back + 100_000);
    }

    #[test]
    fn an_open_breaker_stops_claims() {
        let mut store = MemoryStore::default();
        update_state(&mut store, |s| s.breaker.failed(1, 0, 1_000_000, 1.0)).unwrap();
        assert!(claim_round(&mut store, 10, 100, 50_000, 1).is_none());
        assert!(
            claim_round(&mut store, 1_000_000, 100, 50_000, 1).is_some(),
            "half-open probe"
        );
    }

    #[test]
    fn a_failed_batch_is_restored() {
        let limiter = Limiter::new(
            crate::parse(
                br#"{"service": {"cluster": "c"}, "rules": [{"name": "r", "key": ["const:k"],
                "limits": [{"requests": 10, "per": "second"}]}]}"#,
            )
            .unwrap(),
        );
        let mut store = MemoryStore::default();
        let now = 1_000_000;
        let c = crate::limiter::Conditions {
            now_us: now,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        for _ in 0..3 {
            limiter.decide(&mut crate::PlainRequest::get("/"), c, &mut store);
        }
        let key = "r\u{1f}k";
        let entry = snapshot(&limiter, RuleId::new(0), key, &mut store).unwrap();
        limiter.decide(&mut crate::PlainRequest::get("/"), c, &mut store);
        assert!(
            !restore(&limiter, RuleId::new(0), &entry, &mut store).unwrap(),
            "still announced"
        );
        assert_eq!(
            snapshot(&limiter, RuleId::new(0), key, &mut store)
                .unwrap()
                .spent,
            4
        );
        let entry = SyncEntry { spent: 2, ..entry };
        assert!(
            restore(&limiter, RuleId::new(0), &entry, &mut store).unwrap(),
            "clean: announce again"
        );
    }

    #[test]
    fn a_report_waits_only_while_starved_on_an_empty_bucket_and_the_lease_lives() {
        // 10 a second, burst 10: a token every 100 ms; full in a second from empty
        let limit = Limit::new(10, crate::limit::Period::Second, Some(10)).unwrap();
        let interval = 100_000;
        let now = 10_000_000;
        let mut record = Record::fresh(1, &[], 0);
        record.lease_until_us = now + 200_000;
        record.global_reset_at_us = now + 1_000_000;
        record.denied = 3;
        assert!(
            may_wait(&record, &limit, now, interval),
            "starved, bucket empty"
        );
        record.global_reset_at_us = now + 900_000;
        assert!(!may_wait(&record, &limit, now, interval), "a token is back");
        record.global_reset_at_us = now + 1_000_000;
        record.global_remaining = 1;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "the bucket had one"
        );
        record.global_remaining = 0;
        record.spent = 1;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "spent since: ask again"
        );
        record.spent = 0;
        record.lease = 1;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "denied with tokens left"
        );
        record.lease = 0;
        record.denied = 0;
        record.spent = 5;
        record.lease = 20;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "covered: not held"
        );
        record.spent = 0;
        record.lease = 0;
        record.denied = 3;
        record.lease_until_us = now + 150_000;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "lapses within 1.5 intervals"
        );
        record.lease_until_us = now + 30_000_000;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "the clock was stepped back"
        );
        record.lease_until_us = 0;
        assert!(
            !may_wait(&record, &limit, now, interval),
            "no lease: fallback decisions go"
        );
    }

    #[test]
    fn announcements_round_trip() {
        assert_eq!(
            announced(&announce(RuleId::new(3), "a\u{1f}b")),
            Some((RuleId::new(3), "a\u{1f}b".to_string()))
        );
        assert_eq!(announced(b"ab"), None);
    }
}
