//! The per-rule key table: a bounded, set-associative map from key to [`Record`].
//!
//! A rule's keys hash into `max_keys / WAYS` sets; each set is one store entry holding up to
//! `WAYS` records of fixed size. A new key takes a free way or evicts the least recently used
//! record of its set, so memory never grows past `max_keys` records, whatever the traffic.
//! Records are read and written in place in the set's bytes: no per-request decoding of the
//! whole set.

use crate::bucket::Bucket;
use crate::limit::Limit;

/// Records per set.
pub const WAYS: usize = 8;
/// Most limits one rule may have.
pub const MAX_LIMITS: usize = 8;

const HEADER: usize = 48;
const PER_LIMIT: usize = 16;

/// Bytes of one record for a rule with `limits` limits.
pub const fn record_len(limits: usize) -> usize {
    HEADER + PER_LIMIT * limits
}

/// One key's state on one proxy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Record {
    /// Hash of the key; 0 marks a free way.
    pub fingerprint: u64,
    /// Last time a request touched the key (for eviction).
    pub seen_us: u64,
    /// Until when `grant` may be spent (cached consistency).
    pub grant_until_us: u64,
    /// Tokens spent since the last sync snapshot.
    pub spent: u32,
    /// Requests denied since the last sync snapshot.
    pub denied: u32,
    /// Tokens left in the lease granted by the counter service.
    pub grant: u32,
    /// Tokens left in the global bucket when the lease was granted, less what this proxy
    /// spent since (for rate-limit headers).
    pub global_remaining: u32,
    /// When the global bucket will be full again, as the service said (for headers).
    pub global_reset_at_us: u64,
    /// Local buckets, one per limit: the rule's own limits (local consistency) or its fallback.
    pub buckets: [Bucket; MAX_LIMITS],
}

impl Record {
    /// A key seen for the first time: full buckets, no lease.
    pub fn fresh(fingerprint: u64, limits: &[Limit], now_us: u64) -> Record {
        let mut buckets = [Bucket {
            tokens: 0.0,
            stamp_us: 0,
        }; MAX_LIMITS];
        for (bucket, limit) in buckets.iter_mut().zip(limits) {
            *bucket = Bucket::full(limit, now_us);
        }
        Record {
            fingerprint,
            seen_us: now_us,
            grant_until_us: 0,
            spent: 0,
            denied: 0,
            grant: 0,
            global_remaining: 0,
            global_reset_at_us: 0,
            buckets,
        }
    }

    /// Whether it holds counts the counter service has not seen yet.
    pub fn unsynced(&self) -> bool {
        self.spent > 0 || self.denied > 0
    }

    fn read(bytes: &[u8], limits: usize) -> Record {
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
        let mut buckets = [Bucket {
            tokens: 0.0,
            stamp_us: 0,
        }; MAX_LIMITS];
        for (i, bucket) in buckets.iter_mut().enumerate().take(limits) {
            let at = HEADER + i * PER_LIMIT;
            *bucket = Bucket {
                tokens: f64::from_bits(u64_at(at)),
                stamp_us: u64_at(at + 8),
            };
        }
        Record {
            fingerprint: u64_at(0),
            seen_us: u64_at(8),
            grant_until_us: u64_at(16),
            spent: u32_at(24),
            denied: u32_at(28),
            grant: u32_at(32),
            global_remaining: u32_at(36),
            global_reset_at_us: u64_at(40),
            buckets,
        }
    }

    fn write(&self, bytes: &mut [u8], limits: usize) {
        bytes[0..8].copy_from_slice(&self.fingerprint.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.seen_us.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.grant_until_us.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.spent.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.denied.to_le_bytes());
        bytes[32..36].copy_from_slice(&self.grant.to_le_bytes());
        bytes[36..40].copy_from_slice(&self.global_remaining.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.global_reset_at_us.to_le_bytes());
        for (i, bucket) in self.buckets.iter().enumerate().take(limits) {
            let at = HEADER + i * PER_LIMIT;
            bytes[at..at + 8].copy_from_slice(&bucket.tokens.to_bits().to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&bucket.stamp_us.to_le_bytes());
        }
    }
}

/// The shape of one rule's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Store key prefix: the rule's name and a hash of its shape, so a changed rule never
    /// reads records of another layout.
    prefix: String,
    sets: u32,
    limits: usize,
}

impl Table {
    pub fn new(rule: &str, limits: &[Limit], max_keys: u32) -> Table {
        let mut shape = Vec::new();
        for limit in limits {
            shape.extend_from_slice(&limit.requests().to_le_bytes());
            shape.extend_from_slice(&limit.period().seconds().to_le_bytes());
            shape.extend_from_slice(&limit.burst().to_le_bytes());
        }
        shape.extend_from_slice(&max_keys.to_le_bytes());
        Table {
            prefix: format!("sluice/{rule}/{:08x}/", fnv1a(&shape) as u32),
            sets: (max_keys / WAYS as u32).max(1),
            limits: limits.len(),
        }
    }

    pub fn sets(&self) -> u32 {
        self.sets
    }

    /// The store key of the set a fingerprint belongs to.
    pub fn set_key(&self, fingerprint: u64) -> String {
        self.set_key_at((fingerprint % self.sets as u64) as u32)
    }

    /// The store key of set number `set`.
    pub fn set_key_at(&self, set: u32) -> String {
        format!("{}{set}", self.prefix)
    }

    fn record_len(&self) -> usize {
        record_len(self.limits)
    }

    /// Reads the record of `fingerprint`, if the set holds it.
    pub fn find(&self, set: &[u8], fingerprint: u64) -> Option<Record> {
        self.position(set, fingerprint)
            .map(|at| Record::read(&set[at..at + self.record_len()], self.limits))
    }

    fn position(&self, set: &[u8], fingerprint: u64) -> Option<usize> {
        let len = self.record_len();
        (0..set.len() / len)
            .map(|i| i * len)
            .find(|&at| set[at..at + 8] == fingerprint.to_le_bytes())
    }

    /// The record of `fingerprint`, or a fresh one that will take a free way or the least
    /// recently used one (preferring records with nothing left to sync).
    pub fn find_or_fresh(
        &self,
        set: &[u8],
        fingerprint: u64,
        limits: &[Limit],
        now_us: u64,
    ) -> Record {
        self.find(set, fingerprint)
            .unwrap_or_else(|| Record::fresh(fingerprint, limits, now_us))
    }

    /// Writes `record` into the set: over its own way, into a free way, or over the victim.
    /// Returns the record it evicted, if any (its unsynced counts are lost to the sync).
    pub fn store(&self, set: &mut Vec<u8>, record: &Record) -> Option<Record> {
        let len = self.record_len();
        if !set.len().is_multiple_of(len) {
            // A set of another layout (cannot happen with the shape in the prefix): start over.
            set.clear();
        }
        if let Some(at) = self.position(set, record.fingerprint) {
            record.write(&mut set[at..at + len], self.limits);
            return None;
        }
        if set.len() < WAYS * len {
            let at = set.len();
            set.resize(at + len, 0);
            record.write(&mut set[at..at + len], self.limits);
            return None;
        }
        let victim_at = (0..WAYS)
            .map(|i| i * len)
            .min_by_key(|&at| {
                let r = Record::read(&set[at..at + len], self.limits);
                (r.unsynced(), r.seen_us)
            })
            .unwrap_or(0);
        let victim = Record::read(&set[victim_at..victim_at + len], self.limits);
        record.write(&mut set[victim_at..victim_at + len], self.limits);
        Some(victim)
    }

    /// Every record in a set.
    pub fn records<'a>(&'a self, set: &'a [u8]) -> impl Iterator<Item = Record> + 'a {
        let len = self.record_len();
        set.chunks_exact(len)
            .map(move |chunk| Record::read(chunk, self.limits))
    }
}

/// FNV-1a, 64 bits: a stable hash every worker and proxy computes alike.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The fingerprint of a key: never 0, which marks a free way.
pub fn fingerprint(key: &str) -> u64 {
    fnv1a(key.as_bytes()).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Period;

    fn limits() -> Vec<Limit> {
        vec![
            Limit::new(10, Period::Second, None).unwrap(),
            Limit::new(100, Period::Hour, Some(5)).unwrap(),
        ]
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let table = Table::new("r", &limits(), 64);
        let mut set = Vec::new();
        let mut record = Record::fresh(42, &limits(), 7);
        record.spent = 3;
        record.grant = 9;
        record.grant_until_us = 11;
        record.buckets[1].tokens = 2.5;
        assert_eq!(table.store(&mut set, &record), None);
        assert_eq!(set.len(), record_len(2));
        assert_eq!(table.find(&set, 42), Some(record));
        assert_eq!(table.find(&set, 43), None);
    }

    #[test]
    fn a_full_set_evicts_the_least_recently_used() {
        let table = Table::new("r", &limits(), 64);
        let mut set = Vec::new();
        for fp in 1..=WAYS as u64 {
            table.store(&mut set, &Record::fresh(fp, &limits(), 100 + fp));
        }
        assert_eq!(set.len(), WAYS * record_len(2), "full, and no bigger");
        let evicted = table.store(&mut set, &Record::fresh(99, &limits(), 1_000));
        assert_eq!(evicted.map(|r| r.fingerprint), Some(1), "the oldest goes");
        assert_eq!(set.len(), WAYS * record_len(2));
        assert!(table.find(&set, 99).is_some());
    }

    #[test]
    fn unsynced_records_are_evicted_last() {
        let table = Table::new("r", &limits(), 64);
        let mut set = Vec::new();
        for fp in 1..=WAYS as u64 {
            let mut r = Record::fresh(fp, &limits(), fp);
            r.spent = (fp == 1) as u32;
            table.store(&mut set, &r);
        }
        let evicted = table.store(&mut set, &Record::fresh(99, &limits(), 1_000));
        assert_eq!(evicted.map(|r| r.fingerprint), Some(2));
    }

    #[test]
    fn a_changed_rule_gets_another_prefix() {
        let a = Table::new("r", &limits(), 64);
        let b = Table::new("r", &limits()[..1], 64);
        assert_ne!(a.set_key(5), b.set_key(5));
        assert_eq!(a.sets(), 8);
    }
}
