//! The per-rule key table: a bounded, set-associative map from key to [`Record`].
//!
//! A rule's keys hash into `max_keys / WAYS` sets; each set is one store entry holding up to
//! `WAYS` records of fixed size. A new key takes a free way or evicts the least recently used
//! record of its set, so memory never grows past `max_keys` records, whatever the traffic.
//! Records are read and written in place in the set's bytes: no per-request decoding of the
//! whole set.
//!
//! A table is named by its rule and its *layout*: what a record holds and means (each limit's
//! algorithm and sliding-log length) and `max_keys`, not the limits' numbers. A change of numbers
//! (a reload, a live override) keeps the table and its counts, which the new limits then read (a
//! bucket never holds more than its new burst). A change of layout takes another table: the
//! layout's own ([`Table::new`]), or, for a live override, the rule's one table for overridden
//! layouts ([`Table::live`]), which a later override of yet another layout takes over. So a rule
//! has at most two tables per configuration, whatever the sequence of overrides (proxy-wasm
//! cannot delete a set's key: every table ever made keeps its keys). Every written set begins with
//! its layout's tag, and a set of another layout reads as empty: a record is never read in a
//! layout it was not written in.
//!
//! Keys are placed by a keyed hash ([`KeyHasher`], SipHash with a secret each proxy draws at
//! start): a client cannot compute which of its keys share a set, so it cannot aim a few junk
//! keys at its own record to evict it. Eviction is made unprofitable as well: a record evicted
//! while its buckets were not full leaves a *ghost* in its set (its fingerprint and when its
//! buckets would be full again), and a key that comes back while its ghost stands starts from
//! that level, not from a full bucket.

use siphasher::sip::SipHasher13;
use std::hash::Hasher;

use crate::limit::algorithm::LimitView;
use crate::limit::token_bucket::LimitState;
use crate::limit::Limit;

/// Records per set.
pub const WAYS: usize = 8;
/// Ghosts per set: fingerprints of records evicted before their buckets were full again.
pub const GHOSTS: usize = 8;
/// Bytes of one ghost: its fingerprint and when its buckets are full again.
const GHOST_LEN: usize = 16;
/// Bytes of a set's layout tag, before its ghosts.
const TAG_LEN: usize = 8;
/// The tag and the ghost area at the start of every written set.
const HEAD: usize = TAG_LEN + GHOST_AREA;
/// The ghosts of a set, after its tag.
const GHOST_AREA: usize = GHOSTS * GHOST_LEN;
/// Most limits one rule may have.
pub use sluice_protocol::MAX_LIMITS;

const HEADER: usize = 64;
/// The version of the record format, part of every layout's tag: a set written in an earlier
/// format reads as empty (2: the header holds `global_token_at_us`; 3: `penalty_until_us`).
const RECORD_FORMAT: u8 = 3;
const PER_LIMIT: usize = 16;

/// Bytes of one record for a rule with `limits` limits whose sliding logs keep `log` timestamps.
pub const fn record_len(limits: usize, log: usize) -> usize {
    HEADER + PER_LIMIT * limits + 8 * log
}

/// Bytes of a full set for a rule with `limits` limits (and `log` timestamps): its layout tag,
/// its ghosts and its records.
pub const fn set_len(limits: usize, log: usize) -> usize {
    HEAD + WAYS * record_len(limits, log)
}

/// One key's state on one proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Hash of the key; 0 marks a free way.
    pub fingerprint: u64,
    /// Last time a request touched the key (for eviction).
    pub seen_us: u64,
    /// Until when `lease` may be spent (cached consistency).
    pub lease_until_us: u64,
    /// Tokens spent since the last sync snapshot.
    pub spent: u32,
    /// Requests denied since the last sync snapshot.
    pub denied: u32,
    /// Tokens left in the lease the counter service granted.
    pub lease: u32,
    /// Tokens left in the global bucket when the lease was granted, less what this proxy
    /// spent since (for rate-limit headers).
    pub global_remaining: u32,
    /// When the global bucket will be full again, as the service said (for headers).
    pub global_reset_at_us: u64,
    /// When every limit of the global state holds a token more than the `remaining` the service
    /// last answered (its grant's `token_ms`): once those are spent, when the next one is back,
    /// whichever limit is short. 0: the service did not say (an older one), and the
    /// wait is worked out from `global_remaining` and `global_reset_at_us`.
    pub global_token_at_us: u64,
    /// Until when the key is denied for having gone over (a rule's `penalty`; 0: it is not).
    pub penalty_until_us: u64,
    /// Local buckets, one per limit: the rule's own limits (local consistency) or its fallback.
    pub buckets: [LimitState; MAX_LIMITS],
    /// The rings of its sliding logs, one after the other in limit order (empty for other
    /// algorithms): [`crate::limit::sliding_log`].
    pub logs: Vec<u64>,
}

impl Record {
    /// Whether the global bucket of `limit` (a token bucket or GCRA) held no token when the
    /// service last answered for this key and has not refilled one since, as far as that answer
    /// said (its reset less `burst - 1` tokens' time, the `Retry-After` of such a denial). A
    /// round brought forward could only bring an empty lease then.
    pub fn globally_empty(&self, limit: &Limit, now_us: u64) -> bool {
        if self.global_token_at_us != 0 {
            // The service said when a token is back, whichever limit is short.
            return self.global_remaining == 0 && now_us < self.global_token_at_us;
        }
        let token_us = limit.period().micros() / limit.requests().max(1);
        let short_of_full_us = limit.burst().saturating_sub(1).saturating_mul(token_us);
        let token_back_us = self.global_reset_at_us.saturating_sub(short_of_full_us);
        self.global_remaining == 0 && now_us < token_back_us
    }

    /// A key seen for the first time: full buckets, no lease.
    pub fn fresh(fingerprint: u64, limits: &[Limit], now_us: u64) -> Record {
        let mut buckets = [LimitState {
            tokens: 0.0,
            stamp_us: 0,
        }; MAX_LIMITS];
        for (bucket, limit) in buckets.iter_mut().zip(limits) {
            *bucket = LimitState::fresh(limit, now_us);
        }
        let log: usize = limits.iter().map(Limit::log_len).sum();
        Record {
            fingerprint,
            seen_us: now_us,
            lease_until_us: 0,
            spent: 0,
            denied: 0,
            lease: 0,
            global_remaining: 0,
            global_reset_at_us: 0,
            global_token_at_us: 0,
            penalty_until_us: 0,
            buckets,
            logs: vec![0; log],
        }
    }

    /// Each limit's state: its bucket and, for a sliding log, its ring.
    pub fn states<'a>(
        &'a mut self,
        limits: &'a [Limit],
    ) -> impl Iterator<Item = (&'a Limit, LimitView<'a>)> + 'a {
        let mut rest: &'a mut [u64] = &mut self.logs;
        self.buckets
            .iter_mut()
            .zip(limits)
            .map(move |(bucket, limit)| {
                let len = limit.log_len().min(rest.len());
                let (ring, tail) = std::mem::take(&mut rest).split_at_mut(len);
                rest = tail;
                (limit, LimitView { bucket, ring })
            })
    }

    /// Whether it holds counts the counter service has not seen yet.
    pub fn unsynced(&self) -> bool {
        self.spent > 0 || self.denied > 0
    }

    /// The ghost to leave when evicted: when every local bucket is full again (`now_us` if
    /// they are), or a windowed limit's encoding of what it has left ([`crate::limit::algorithm`]).
    pub fn full_at_us(&self, limits: &[Limit], now_us: u64) -> u64 {
        if self.logs.is_empty() {
            return self
                .buckets
                .iter()
                .zip(limits)
                .map(|(bucket, limit)| bucket.ghost_us(limit, now_us))
                .max()
                .unwrap_or(now_us);
        }
        let mut record = self.clone();
        record
            .states(limits)
            .map(|(limit, mut state)| state.ghost_us(limit, now_us))
            .max()
            .unwrap_or(now_us)
    }

    /// A key seen again while the ghost of its evicted record stands: its buckets hold what
    /// they would if they had been empty until `full_at_us` minus the time a refill to full takes
    /// (never more than the evicted record had, for the slowest limit; possibly less for faster
    /// ones); windowed limits get back at most what they had left.
    pub fn returning(fingerprint: u64, limits: &[Limit], now_us: u64, full_at_us: u64) -> Record {
        let mut record = Record::fresh(fingerprint, limits, now_us);
        for (limit, mut state) in record.states(limits) {
            state.returning(limit, now_us, full_at_us);
        }
        record
    }

    fn read(bytes: &[u8], limits: usize, log: usize) -> Record {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(b)
        };
        let mut buckets = [LimitState {
            tokens: 0.0,
            stamp_us: 0,
        }; MAX_LIMITS];
        for (i, bucket) in buckets.iter_mut().enumerate().take(limits) {
            let at = HEADER + i * PER_LIMIT;
            *bucket = LimitState {
                tokens: f64::from_bits(u64_at(at)),
                stamp_us: u64_at(at + 8),
            };
        }
        Record {
            fingerprint: u64_at(0),
            seen_us: u64_at(8),
            lease_until_us: u64_at(16),
            spent: u32_at(24),
            denied: u32_at(28),
            lease: u32_at(32),
            global_remaining: u32_at(36),
            global_reset_at_us: u64_at(40),
            global_token_at_us: u64_at(48),
            penalty_until_us: u64_at(56),
            buckets,
            logs: (0..log)
                .map(|i| u64_at(HEADER + limits * PER_LIMIT + 8 * i))
                .collect(),
        }
    }

    fn write(&self, bytes: &mut [u8], limits: usize, log: usize) {
        bytes[0..8].copy_from_slice(&self.fingerprint.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.seen_us.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.lease_until_us.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.spent.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.denied.to_le_bytes());
        bytes[32..36].copy_from_slice(&self.lease.to_le_bytes());
        bytes[36..40].copy_from_slice(&self.global_remaining.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.global_reset_at_us.to_le_bytes());
        bytes[48..56].copy_from_slice(&self.global_token_at_us.to_le_bytes());
        bytes[56..64].copy_from_slice(&self.penalty_until_us.to_le_bytes());
        for (i, bucket) in self.buckets.iter().enumerate().take(limits) {
            let at = HEADER + i * PER_LIMIT;
            bytes[at..at + 8].copy_from_slice(&bucket.tokens.to_bits().to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&bucket.stamp_us.to_le_bytes());
        }
        let logs = HEADER + limits * PER_LIMIT;
        for (i, t) in self.logs.iter().take(log).enumerate() {
            bytes[logs + 8 * i..logs + 8 * i + 8].copy_from_slice(&t.to_le_bytes());
        }
    }
}

/// The keyed hash that places keys: SipHash-1-3 with a 128-bit secret.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyHasher {
    k0: u64,
    k1: u64,
}

impl KeyHasher {
    pub fn new(secret: [u64; 2]) -> KeyHasher {
        KeyHasher {
            k0: secret[0],
            k1: secret[1],
        }
    }

    /// The fingerprint of a key: never 0, which marks a free way.
    pub fn fingerprint(&self, key: &str) -> u64 {
        let mut hasher = SipHasher13::new_with_keys(self.k0, self.k1);
        hasher.write(key.as_bytes());
        hasher.finish().max(1)
    }
}

/// The shape of one rule's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Store key prefix: the rule's name and its layout's tag ([`Table::new`]), or the rule's
    /// table for overridden layouts ([`Table::live`]).
    prefix: String,
    /// The layout's tag, at the start of every set written in it (never 0).
    tag: u64,
    sets: u32,
    limits: usize,
    /// Timestamps of its sliding logs per record.
    log: usize,
    hasher: KeyHasher,
}

impl Table {
    /// The table of `rule`'s layout, whose keys are placed by `hasher`: named by the rule and
    /// the layout ([`Table::layout`]), so limits of other numbers share it (and its counts) and
    /// limits of another layout never read its records.
    pub fn new(rule: &str, limits: &[Limit], max_keys: u32, hasher: KeyHasher) -> Table {
        let tag = Table::layout(limits, max_keys);
        let prefix = format!("sluice/{rule}/{:08x}/", tag as u32);
        Table::named(prefix, tag, limits, max_keys, hasher)
    }

    /// The one table of `rule` for layouts a live override gives it (other than the configured
    /// one's, which keeps [`Table::new`]): every overridden layout of the rule counts in it, so
    /// any sequence of overrides adds at most this table to a rule. Its sets are read only in
    /// the layout they were written in (their tag): a change of layout starts its keys afresh.
    /// Named by `max_keys` too, so configurations of another size never share it.
    pub fn live(rule: &str, limits: &[Limit], max_keys: u32, hasher: KeyHasher) -> Table {
        let tag = Table::layout(limits, max_keys);
        // Never 8 hex digits: no layout's table of any rule has this name.
        let prefix = format!("sluice/{rule}/live-{max_keys}/");
        Table::named(prefix, tag, limits, max_keys, hasher)
    }

    /// The tag of a layout: what a record holds and how it reads (its format, the number of limits, each
    /// one's algorithm and sliding-log length) and the number of sets; not the limits' numbers
    /// (requests, period, burst, shaping), which read the same state. Never 0.
    pub fn layout(limits: &[Limit], max_keys: u32) -> u64 {
        let mut layout = vec![RECORD_FORMAT];
        for limit in limits {
            // The state's meaning changes with the algorithm: a new layout, not a misread one.
            layout.extend_from_slice(limit.algorithm().name().as_bytes());
            layout.push(0);
            layout.extend_from_slice(&(limit.log_len() as u64).to_le_bytes());
        }
        layout.extend_from_slice(&max_keys.to_le_bytes());
        fnv1a(&layout).max(1)
    }

    fn named(
        prefix: String,
        tag: u64,
        limits: &[Limit],
        max_keys: u32,
        hasher: KeyHasher,
    ) -> Table {
        Table {
            prefix,
            tag,
            sets: (max_keys / WAYS as u32).max(1),
            limits: limits.len(),
            log: limits.iter().map(Limit::log_len).sum(),
            hasher,
        }
    }

    /// The tag every set written by this table begins with.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// The fingerprint of a key in this table.
    pub fn fingerprint(&self, key: &str) -> u64 {
        self.hasher.fingerprint(key)
    }

    pub fn sets(&self) -> u32 {
        self.sets
    }

    /// The store key prefix of its sets (the registry of tables in use: [`crate::limit::registry`]).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Bytes of one of its sets when full.
    pub fn set_bytes(&self) -> usize {
        set_len(self.limits, self.log)
    }

    /// The store key of the set a fingerprint belongs to.
    pub fn set_key(&self, fingerprint: u64) -> String {
        // The high bits: the low ones already tell records of a set apart.
        self.set_key_at(((fingerprint >> 32) % self.sets as u64) as u32)
    }

    /// [`set_key`](Self::set_key), written into `key` (emptied first): no allocation once it
    /// has room.
    pub fn set_key_into(&self, fingerprint: u64, key: &mut String) {
        let set = ((fingerprint >> 32) % self.sets as u64) as u32;
        key.clear();
        key.push_str(&self.prefix);
        key.push_str(itoa::Buffer::new().format(set));
    }

    /// The store key of set number `set`.
    pub fn set_key_at(&self, set: u32) -> String {
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(set);
        let mut key = String::with_capacity(self.prefix.len() + digits.len());
        key.push_str(&self.prefix);
        key.push_str(digits);
        key
    }

    fn record_len(&self) -> usize {
        record_len(self.limits, self.log)
    }

    /// Reads the record of `fingerprint`, if the set holds it.
    pub fn find(&self, set: &[u8], fingerprint: u64) -> Option<Record> {
        self.position(set, fingerprint)
            .map(|at| Record::read(&set[at..at + self.record_len()], self.limits, self.log))
    }

    /// The byte offsets of the set's records.
    fn ways(&self, set: &[u8]) -> impl Iterator<Item = usize> {
        let len = self.record_len();
        let count = if self.well_formed(set) {
            (set.len().saturating_sub(HEAD) / len).min(WAYS)
        } else {
            0
        };
        (0..count).map(move |i| HEAD + i * len)
    }

    /// Written by a table of this layout: its tag, its ghosts, whole records.
    fn well_formed(&self, set: &[u8]) -> bool {
        set.len() >= HEAD
            && set[..TAG_LEN] == self.tag.to_le_bytes()
            && (set.len() - HEAD).is_multiple_of(self.record_len())
    }

    fn position(&self, set: &[u8], fingerprint: u64) -> Option<usize> {
        self.ways(set)
            .find(|&at| set[at..at + 8] == fingerprint.to_le_bytes())
    }

    /// The record of `fingerprint`; else, if the key was evicted before its buckets were full
    /// again and its ghost still stands, a record at the level it had; else a fresh one.
    pub fn find_or_fresh(
        &self,
        set: &[u8],
        fingerprint: u64,
        limits: &[Limit],
        now_us: u64,
    ) -> Record {
        if let Some(record) = self.find(set, fingerprint) {
            return record;
        }
        match self.ghost(set, fingerprint) {
            Some(full_at) if full_at > now_us => {
                Record::returning(fingerprint, limits, now_us, full_at)
            }
            _ => Record::fresh(fingerprint, limits, now_us),
        }
    }

    /// When the ghost of `fingerprint` says its buckets are full again, if it has one.
    fn ghost(&self, set: &[u8], fingerprint: u64) -> Option<u64> {
        if !self.well_formed(set) {
            return None;
        }
        set[TAG_LEN..HEAD]
            .chunks_exact(GHOST_LEN)
            .find(|g| g[..8] == fingerprint.to_le_bytes())
            .map(|g| u64_at(g, 8))
    }

    /// Writes `record` into the set: over its own way, into a free way, or over the victim
    /// (a record whose buckets are full first, then the least recently used, records with
    /// counts not yet synced last). Returns the record it evicted, if any (its unsynced counts
    /// are lost to the sync). An evicted record whose buckets were not full leaves a ghost.
    pub fn store(
        &self,
        set: &mut Vec<u8>,
        record: &Record,
        limits: &[Limit],
        now_us: u64,
    ) -> Option<Record> {
        let len = self.record_len();
        if !self.well_formed(set) {
            // New (created empty), emptied, or of another layout (a live table whose layout an
            // override changed): start over.
            set.clear();
            set.extend_from_slice(&self.tag.to_le_bytes());
            set.resize(HEAD, 0);
        }
        if let Some(at) = self.position(set, record.fingerprint) {
            record.write(&mut set[at..at + len], self.limits, self.log);
            return None;
        }
        // A key that comes back takes its ghost's place.
        self.bury(set, record.fingerprint, 0);
        if set.len() < HEAD + WAYS * len {
            let at = set.len();
            set.resize(at + len, 0);
            record.write(&mut set[at..at + len], self.limits, self.log);
            return None;
        }
        let victim_at = self
            .ways(set)
            .min_by_key(|&at| {
                let r = Record::read(&set[at..at + len], self.limits, self.log);
                let costly = r.full_at_us(limits, now_us) > now_us;
                // A key in its penalty is kept over one that is not: evicted, it would lose it.
                let penalized = r.penalty_until_us > now_us;
                (r.unsynced(), penalized, costly, r.seen_us)
            })
            .unwrap_or(HEAD);
        let victim = Record::read(&set[victim_at..victim_at + len], self.limits, self.log);
        record.write(&mut set[victim_at..victim_at + len], self.limits, self.log);
        let full_at = victim.full_at_us(limits, now_us);
        if full_at > now_us {
            self.bury(set, victim.fingerprint, full_at);
        }
        Some(victim)
    }

    /// Sets the ghost of `fingerprint` to `full_at_us`, or removes it (`0`). A new ghost takes
    /// a free or spent slot, else the slot of the ghost that is full soonest, if that is
    /// sooner than this one.
    fn bury(&self, set: &mut [u8], fingerprint: u64, full_at_us: u64) {
        let ghosts = &mut set[TAG_LEN..HEAD];
        let own = ghosts
            .chunks_exact(GHOST_LEN)
            .position(|g| g[..8] == fingerprint.to_le_bytes());
        if full_at_us == 0 {
            if let Some(i) = own {
                ghosts[i * GHOST_LEN..(i + 1) * GHOST_LEN].fill(0);
            }
            return;
        }
        let slot = own.or_else(|| {
            ghosts
                .chunks_exact(GHOST_LEN)
                .enumerate()
                .min_by_key(|(_, g)| u64_at(g, 8))
                .filter(|(_, g)| u64_at(g, 8) < full_at_us)
                .map(|(i, _)| i)
        });
        if let Some(i) = slot {
            let ghost = &mut ghosts[i * GHOST_LEN..(i + 1) * GHOST_LEN];
            ghost[..8].copy_from_slice(&fingerprint.to_le_bytes());
            ghost[8..].copy_from_slice(&full_at_us.to_le_bytes());
        }
    }

    /// Every record in a set.
    pub fn records<'a>(&'a self, set: &'a [u8]) -> impl Iterator<Item = Record> + 'a {
        let len = self.record_len();
        self.ways(set)
            .map(move |at| Record::read(&set[at..at + len], self.limits, self.log))
    }
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

pub use sluice_protocol::fnv1a;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    const SECOND: u64 = 1_000_000;

    fn limits() -> Vec<Limit> {
        vec![
            Limit::new(10, Period::Second, None).unwrap(),
            Limit::new(100, Period::Hour, Some(5)).unwrap(),
        ]
    }

    fn table() -> Table {
        Table::new("r", &limits(), 64, KeyHasher::new([1, 2]))
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let table = table();
        let mut set = Vec::new();
        let mut record = Record::fresh(42, &limits(), 7);
        record.spent = 3;
        record.lease = 9;
        record.lease_until_us = 11;
        record.buckets[1].tokens = 2.5;
        assert_eq!(table.store(&mut set, &record, &limits(), 7), None);
        assert_eq!(set.len(), HEAD + record_len(2, 0));
        assert_eq!(table.find(&set, 42), Some(record));
        assert_eq!(table.find(&set, 43), None);
    }

    #[test]
    fn a_full_set_evicts_the_least_recently_used() {
        let table = table();
        let mut set = Vec::new();
        for fp in 1..=WAYS as u64 {
            let now = 100 + fp;
            table.store(&mut set, &Record::fresh(fp, &limits(), now), &limits(), now);
        }
        assert_eq!(set.len(), HEAD + WAYS * record_len(2, 0), "full, no bigger");
        let evicted = table.store(
            &mut set,
            &Record::fresh(99, &limits(), 1_000),
            &limits(),
            1_000,
        );
        assert_eq!(evicted.map(|r| r.fingerprint), Some(1), "the oldest goes");
        assert_eq!(set.len(), HEAD + WAYS * record_len(2, 0));
        assert!(table.find(&set, 99).is_some());
    }

    #[test]
    fn unsynced_records_are_evicted_last() {
        let table = table();
        let mut set = Vec::new();
        for fp in 1..=WAYS as u64 {
            let mut r = Record::fresh(fp, &limits(), fp);
            r.spent = (fp == 1) as u32;
            table.store(&mut set, &r, &limits(), fp);
        }
        let evicted = table.store(
            &mut set,
            &Record::fresh(99, &limits(), 1_000),
            &limits(),
            1_000,
        );
        assert_eq!(evicted.map(|r| r.fingerprint), Some(2));
    }

    #[test]
    fn records_with_full_buckets_go_before_busy_ones() {
        let table = table();
        let mut set = Vec::new();
        let now = 10 * SECOND;
        for fp in 1..=WAYS as u64 {
            let mut r = Record::fresh(fp, &limits(), now);
            if fp != 5 {
                r.buckets[0].tokens = 1.0; // recently used: not full
            }
            table.store(&mut set, &r, &limits(), now + fp);
        }
        let evicted = table.store(&mut set, &Record::fresh(99, &limits(), now), &limits(), now);
        assert_eq!(
            evicted.map(|r| r.fingerprint),
            Some(5),
            "nothing is lost with it"
        );
    }

    #[test]
    fn an_evicted_denied_key_comes_back_empty_not_full() {
        let table = table();
        let limits = limits();
        let mut set = Vec::new();
        let now = 10 * SECOND;
        let mut victim = Record::fresh(7, &limits, now);
        victim.buckets[0].tokens = 0.0; // 10/s: full again in one second
        victim.buckets[1].tokens = 0.0; // 5 of 100/hour: full again in 180 s
        table.store(&mut set, &victim, &limits, now);
        for fp in 100..100 + WAYS as u64 {
            let t = now + fp;
            let mut junk = Record::fresh(fp, &limits, t);
            junk.buckets[1].tokens = 4.0;
            table.store(&mut set, &junk, &limits, t);
        }
        assert_eq!(table.find(&set, 7), None, "evicted");
        let later = now + 36 * SECOND;
        let back = table.find_or_fresh(&set, 7, &limits, later);
        assert_eq!(
            back.buckets[1].tokens.floor(),
            1.0,
            "one token of the hourly limit came back in 36 s, not five"
        );
        let much_later = now + 181 * SECOND;
        assert_eq!(
            table.find_or_fresh(&set, 7, &limits, much_later),
            Record::fresh(7, &limits, much_later),
            "the ghost is harmless once the buckets would be full"
        );
        let mut set2 = set.clone();
        table.store(&mut set2, &back, &limits, later);
        assert_eq!(
            table.ghost(&set2, 7),
            None,
            "coming back takes the ghost's place"
        );
    }

    #[test]
    fn the_longest_debt_keeps_its_ghost() {
        let table = table();
        let limits = limits();
        let mut set = table.tag().to_le_bytes().to_vec();
        set.resize(HEAD, 0);
        for fp in 1..=GHOSTS as u64 {
            table.bury(&mut set, fp, 1_000 + fp);
        }
        table.bury(&mut set, 50, 500);
        assert_eq!(
            table.ghost(&set, 50),
            None,
            "sooner than every ghost: dropped"
        );
        table.bury(&mut set, 51, 5_000);
        assert_eq!(table.ghost(&set, 51), Some(5_000));
        assert_eq!(table.ghost(&set, 1), None, "the soonest full made room");
        assert_eq!(table.records(&set).count(), 0);
        let _ = limits;
    }

    #[test]
    fn placement_depends_on_the_secret() {
        let a = KeyHasher::new([1, 2]);
        let b = KeyHasher::new([3, 4]);
        assert_ne!(a.fingerprint("r\u{1f}k"), b.fingerprint("r\u{1f}k"));
        assert_eq!(
            a.fingerprint("r\u{1f}k"),
            KeyHasher::new([1, 2]).fingerprint("r\u{1f}k")
        );
    }

    #[test]
    fn a_set_key_written_into_a_buffer_is_the_same() {
        let table = table();
        let mut key = String::from("left over from before");
        for fingerprint in [1, 42, u64::MAX, 7 << 32, 12_345_678_901_234] {
            table.set_key_into(fingerprint, &mut key);
            assert_eq!(key, table.set_key(fingerprint));
        }
    }

    #[test]
    fn a_changed_rule_gets_another_prefix() {
        let a = table();
        let b = Table::new("r", &limits()[..1], 64, KeyHasher::default());
        assert_ne!(a.set_key(5), b.set_key(5));
        assert_eq!(a.sets(), 8);
    }

    /// Live overrides (or reloads) that change only a rule's numbers keep its table: each distinct
    /// limit used to make a new table, whose sets' keys proxy-wasm can never delete.
    #[test]
    fn new_numbers_keep_the_table_and_a_new_layout_takes_another() {
        use crate::limit::{Algorithm, Shaping};
        let hasher = KeyHasher::new([1, 2]);
        let prefix = |limits: &[Limit], max_keys: u32| {
            Table::new("r", limits, max_keys, hasher)
                .prefix()
                .to_owned()
        };
        let base = prefix(&limits(), 64);
        for requests in [1, 7, 99, 1_000_000] {
            let numbers = vec![
                Limit::new(requests, Period::Minute, Some(requests + 3)).unwrap(),
                Limit::new(requests * 2, Period::Day, None).unwrap(),
            ];
            assert_eq!(prefix(&numbers, 64), base, "{requests} requests");
        }
        let leaky = |delay| {
            let shaping = Shaping {
                delay,
                queue: 3,
                max_delay_ms: 100,
            };
            vec![Limit::leaky(5, Period::Second, shaping).unwrap()]
        };
        assert_eq!(prefix(&leaky(1), 64), prefix(&leaky(9), 64));
        // What a record holds or means: another layout, another table.
        let other_layouts = [
            prefix(&limits(), 128),
            prefix(&limits()[..1], 64),
            prefix(&[limits()[0].gcra(), limits()[1]], 64),
            prefix(
                &[Limit::logged(10, Period::Second).unwrap(), limits()[1]],
                64,
            ),
            prefix(
                &[Limit::logged(11, Period::Second).unwrap(), limits()[1]],
                64,
            ),
            prefix(
                &[
                    Limit::windowed(10, Period::Second, Algorithm::FixedWindow).unwrap(),
                    limits()[1],
                ],
                64,
            ),
        ];
        let mut all = other_layouts.to_vec();
        all.push(base);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), other_layouts.len() + 1, "{all:?}");
        // The rule's table for overridden layouts is one, whatever the layout.
        let live = Table::live("r", &limits(), 64, hasher);
        let log = vec![Limit::logged(500, Period::Minute).unwrap()];
        assert_eq!(live.prefix(), Table::live("r", &log, 64, hasher).prefix());
        assert!(!all.iter().any(|p| p == live.prefix()), "{live:?}");
        assert_ne!(
            live.prefix(),
            Table::live("r", &limits(), 128, hasher).prefix()
        );
        assert_ne!(
            live.prefix(),
            Table::live("q", &limits(), 64, hasher).prefix()
        );
    }

    /// A set holds records of one layout: one of another layout, even of a length that would
    /// read as whole records (80-byte records read as 160-byte ones), reads as empty and is
    /// started over when written.
    #[test]
    fn a_set_of_another_layout_reads_as_empty() {
        let hasher = KeyHasher::new([1, 2]);
        let bucket = vec![Limit::new(10, Period::Minute, None).unwrap()];
        // 64 + 16 + 10 × 8 = 160 = 2 × (64 + 16).
        let log = vec![Limit::logged(10, Period::Minute).unwrap()];
        assert_eq!(record_len(1, 10), 2 * record_len(1, 0));
        let old = Table::live("r", &bucket, 64, hasher);
        let new = Table::live("r", &log, 64, hasher);
        assert_eq!(old.set_key(5), new.set_key(5), "one live table");
        let mut set = Vec::new();
        for fp in [42, 43] {
            let mut record = Record::fresh(fp, &bucket, 7);
            record.spent = 5;
            old.store(&mut set, &record, &bucket, 7);
        }
        assert_eq!(old.records(&set).count(), 2);
        assert_eq!(new.find(&set, 42), None, "read in another layout");
        assert_eq!(new.records(&set).count(), 0);
        assert_eq!(
            new.find_or_fresh(&set, 42, &log, 9),
            Record::fresh(42, &log, 9)
        );
        let evicted = new.store(&mut set, &Record::fresh(42, &log, 9), &log, 9);
        assert_eq!(
            evicted, None,
            "nothing of the other layout is taken for a record"
        );
        assert_eq!(set.len(), HEAD + record_len(1, 10));
        assert_eq!(new.find(&set, 42), Some(Record::fresh(42, &log, 9)));
        assert_eq!(old.find(&set, 42), None, "and back");
    }
}
