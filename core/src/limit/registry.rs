//! The proxy-wide registry of key tables, and when an old one is emptied.
//!
//! A rule's key table lives in shared data under a prefix naming the rule and its layout
//! ([`crate::limit::table`]). A configuration that changes a rule's layout makes a new table (a live
//! override, the rule's one table for overridden layouts); proxy-wasm cannot delete the old one's
//! sets, but it can overwrite them with nothing, which frees their records (the host keeps only
//! the keys).
//!
//! Every root context stamps the tables its configuration uses (a heartbeat, at most every
//! [`HEARTBEAT_EVERY_US`]); a root context lives as long as a filter chain using its
//! configuration, draining ones included. A table nobody stamped for [`GRACE_US`] is emptied a
//! batch at a time (at most [`SWEEP_BATCH`] sets and [`SWEEP_BYTES`] of full sets a tick, so a
//! worker never copies a whole large table between two requests): a root context claims the next
//! batch in the registry (so two workers never empty the same sets), then empties each set by
//! compare-and-swap. A table stamped
//! again while being emptied is live again; a late request to an emptied set finds it as a new
//! table's set: a fresh record.
//!
//! The registry is one shared-data value of at most [`MAX_TABLES`] entries: an emptied table
//! leaves it, and a table that finds it full is not tracked until room is made (it is then never
//! emptied by mistake: only a registered table can be). A root context whose tables are not all
//! tracked says so ([`Registry::untracked`]): a table that falls out of use untracked keeps its
//! records until the proxy restarts. A configuration uses at most two tables a rule whatever the
//! live overrides, so the registry fills only with more than 128 rules in the configurations in
//! use at once (the current one and those still draining).

/// The shared-data key of the registry.
pub const REGISTRY_KEY: &str = "sluice/tables";
/// A root context stamps its tables at most this often.
pub const HEARTBEAT_EVERY_US: u64 = 1_000_000;
/// A table without a stamp for this long is emptied. Several heartbeats, so a busy worker's late
/// tick never empties a live table; a draining filter chain's root context keeps stamping, so
/// this needs not cover Envoy's drain time.
pub const GRACE_US: u64 = 10_000_000;
/// Most sets one root context empties a tick.
pub const SWEEP_BATCH: u32 = 2_048;
/// Most bytes of full sets one root context empties a tick (at least one set): copying them
/// takes the worker a few milliseconds.
pub const SWEEP_BYTES: u64 = 8 << 20;
/// Most tables the registry tracks.
pub const MAX_TABLES: usize = 256;
/// Longest prefix the registry keeps (longer ones are not tracked).
const MAX_PREFIX: usize = 512;

/// One table: its prefix, how many sets it has and the bytes of a full one, when it was last
/// stamped, and how many of its sets a sweep claimed so far (0 while live).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub prefix: String,
    pub sets: u32,
    pub set_bytes: u32,
    pub stamped_us: u64,
    pub claimed: u32,
}

/// A table in use by this root context: its prefix, its number of sets and the bytes of a full
/// set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InUse<'a> {
    pub prefix: &'a str,
    pub sets: u32,
    pub set_bytes: u32,
}

/// Sets to empty now: `prefix` followed by each number of `from..to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sweep {
    pub prefix: String,
    pub from: u32,
    pub to: u32,
    /// Bytes the claimed sets hold at most.
    pub bytes: u64,
    /// The claim took the table's last sets: it left the registry.
    pub last: bool,
}

/// The registry's entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    pub entries: Vec<Entry>,
}

impl Registry {
    /// Reads the registry's bytes; what cannot be read is left out (an unreadable registry is an
    /// empty one: nothing is emptied until live tables stamp it again).
    pub fn decode(bytes: &[u8]) -> Registry {
        let mut entries = Vec::new();
        let mut at = 0;
        while entries.len() < MAX_TABLES {
            let Some(len) = bytes.get(at..at + 2) else {
                break;
            };
            let len = u16::from_le_bytes([len[0], len[1]]) as usize;
            let end = at + 2 + len + 20;
            let Some(entry) = bytes.get(at + 2..end) else {
                break;
            };
            let Ok(prefix) = std::str::from_utf8(&entry[..len]) else {
                break;
            };
            let u32_at =
                |i: usize| u32::from_le_bytes([entry[i], entry[i + 1], entry[i + 2], entry[i + 3]]);
            let mut stamp = [0u8; 8];
            stamp.copy_from_slice(&entry[len + 4..len + 12]);
            entries.push(Entry {
                prefix: prefix.to_owned(),
                sets: u32_at(len),
                stamped_us: u64::from_le_bytes(stamp),
                claimed: u32_at(len + 12),
                set_bytes: u32_at(len + 16),
            });
            at = end;
        }
        Registry { entries }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        for entry in &self.entries {
            bytes.extend_from_slice(&(entry.prefix.len() as u16).to_le_bytes());
            bytes.extend_from_slice(entry.prefix.as_bytes());
            bytes.extend_from_slice(&entry.sets.to_le_bytes());
            bytes.extend_from_slice(&entry.stamped_us.to_le_bytes());
            bytes.extend_from_slice(&entry.claimed.to_le_bytes());
            bytes.extend_from_slice(&entry.set_bytes.to_le_bytes());
        }
        bytes
    }

    /// Stamps the tables in use at `now_us`; a table stamped less than [`HEARTBEAT_EVERY_US`]
    /// ago is left as it is. A table being emptied is live again. Whether anything changed.
    pub fn stamp(&mut self, tables: &[InUse], now_us: u64) -> bool {
        let mut changed = false;
        for table in tables {
            if table.prefix.len() > MAX_PREFIX {
                continue;
            }
            let at = self.entries.iter().position(|e| e.prefix == table.prefix);
            let len = self.entries.len();
            match at.and_then(|at| self.entries.get_mut(at)) {
                Some(entry) => {
                    let due = now_us.saturating_sub(entry.stamped_us) >= HEARTBEAT_EVERY_US;
                    let grown = entry.sets < table.sets || entry.set_bytes < table.set_bytes;
                    if due || entry.claimed > 0 || grown {
                        entry.stamped_us = entry.stamped_us.max(now_us);
                        entry.claimed = 0;
                        entry.sets = entry.sets.max(table.sets);
                        entry.set_bytes = entry.set_bytes.max(table.set_bytes);
                        changed = true;
                    }
                }
                None if len < MAX_TABLES => {
                    self.entries.push(Entry {
                        prefix: table.prefix.to_owned(),
                        sets: table.sets,
                        set_bytes: table.set_bytes,
                        stamped_us: now_us,
                        claimed: 0,
                    });
                    changed = true;
                }
                None => {}
            }
        }
        changed
    }

    /// The prefixes of `tables` the registry does not track (it was full, or the prefix is
    /// longer than it keeps).
    pub fn untracked<'a>(&self, tables: &[InUse<'a>]) -> Vec<&'a str> {
        tables
            .iter()
            .filter(|t| !self.entries.iter().any(|e| e.prefix == t.prefix))
            .map(|t| t.prefix)
            .collect()
    }

    /// Claims the next sets to empty: of the first table not stamped for [`GRACE_US`], from
    /// where the last claim ended, as many as `budget` bytes of full sets hold (at least one, at
    /// most [`SWEEP_BATCH`]). A table whose last sets are claimed leaves the registry. `None`
    /// when no table is due (or `budget` is 0).
    pub fn claim(&mut self, now_us: u64, budget: u64) -> Option<Sweep> {
        if budget == 0 {
            return None;
        }
        let at = self
            .entries
            .iter()
            .position(|e| now_us.saturating_sub(e.stamped_us) >= GRACE_US)?;
        let entry = &mut self.entries[at];
        let from = entry.claimed.min(entry.sets);
        let sets = (budget / u64::from(entry.set_bytes.max(1))).clamp(1, u64::from(SWEEP_BATCH));
        let to = from.saturating_add(sets as u32).min(entry.sets);
        let bytes = u64::from(to - from) * u64::from(entry.set_bytes);
        entry.claimed = to;
        let last = to >= entry.sets;
        let prefix = if last {
            self.entries.remove(at).prefix
        } else {
            entry.prefix.clone()
        };
        Some(Sweep {
            prefix,
            from,
            to,
            bytes,
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of `sets` sets of one byte: a budget in bytes is one in sets.
    fn in_use(prefix: &str, sets: u32) -> InUse<'_> {
        InUse {
            prefix,
            sets,
            set_bytes: 1,
        }
    }

    #[test]
    fn round_trips() {
        let mut registry = Registry::default();
        registry.stamp(
            &[in_use("sluice/a/0000000a/", 8192), in_use("sluice/b/1/", 1)],
            7,
        );
        registry.entries[1].claimed = 3;
        assert_eq!(Registry::decode(&registry.encode()), registry);
    }

    #[test]
    fn corrupt_bytes_read_as_what_can_be_read() {
        let mut registry = Registry::default();
        registry.stamp(&[in_use("sluice/a/1/", 8), in_use("sluice/b/2/", 8)], 7);
        let bytes = registry.encode();
        for cut in 0..bytes.len() {
            let read = Registry::decode(&bytes[..cut]);
            assert!(read.entries.len() <= 2, "cut at {cut}");
            assert!(registry.entries.starts_with(&read.entries), "cut at {cut}");
        }
        assert_eq!(Registry::decode(&[0xff; 64]), Registry::default());
    }

    #[test]
    fn a_live_table_is_never_claimed() {
        let mut registry = Registry::default();
        let mut now = 1_000_000;
        for _ in 0..100 {
            registry.stamp(&[in_use("sluice/a/1/", 8192)], now);
            assert_eq!(registry.claim(now, SWEEP_BATCH.into()), None, "at {now} µs");
            now += 1_000_000;
        }
    }

    #[test]
    fn stamps_are_written_once_a_heartbeat() {
        let mut registry = Registry::default();
        assert!(registry.stamp(&[in_use("sluice/a/1/", 8)], 0));
        assert!(!registry.stamp(&[in_use("sluice/a/1/", 8)], HEARTBEAT_EVERY_US - 1));
        assert!(registry.stamp(&[in_use("sluice/a/1/", 8)], HEARTBEAT_EVERY_US));
    }

    #[test]
    fn a_stale_table_is_emptied_in_batches_then_forgotten() {
        let mut registry = Registry::default();
        let sets = SWEEP_BATCH * 2 + 5;
        registry.stamp(
            &[in_use("sluice/old/1/", sets), in_use("sluice/new/2/", 8)],
            0,
        );
        let now = GRACE_US - 1;
        registry.stamp(&[in_use("sluice/new/2/", 8)], now);
        assert_eq!(
            registry.claim(now, SWEEP_BATCH.into()),
            None,
            "within the grace at {now} µs"
        );
        let now = GRACE_US;
        let mut claimed = Vec::new();
        while let Some(sweep) = registry.claim(now, SWEEP_BATCH.into()) {
            assert_eq!(sweep.prefix, "sluice/old/1/");
            claimed.push((sweep.from, sweep.to, sweep.last));
        }
        assert_eq!(
            claimed,
            vec![
                (0, SWEEP_BATCH, false),
                (SWEEP_BATCH, 2 * SWEEP_BATCH, false),
                (2 * SWEEP_BATCH, sets, true)
            ]
        );
        assert_eq!(registry.entries.len(), 1, "{registry:?}");
        assert_eq!(registry.entries[0].prefix, "sluice/new/2/");
    }

    #[test]
    fn a_table_stamped_again_while_emptied_is_live_again() {
        let mut registry = Registry::default();
        registry.stamp(&[in_use("sluice/a/1/", SWEEP_BATCH * 3)], 0);
        assert!(registry.claim(GRACE_US, SWEEP_BATCH.into()).is_some());
        assert!(registry.stamp(&[in_use("sluice/a/1/", SWEEP_BATCH * 3)], GRACE_US + 1));
        assert_eq!(registry.entries[0].claimed, 0);
        assert_eq!(registry.claim(GRACE_US + 2, SWEEP_BATCH.into()), None);
        // Stale again later: emptied from its first set.
        let sweep = registry.claim(2 * GRACE_US + 1, SWEEP_BATCH.into());
        assert_eq!(sweep.map(|s| s.from), Some(0));
    }

    #[test]
    fn the_registry_is_bounded_and_never_drops_a_live_table() {
        let mut registry = Registry::default();
        let names: Vec<String> = (0..MAX_TABLES + 10)
            .map(|i| format!("sluice/r{i}/1/"))
            .collect();
        let tables: Vec<InUse> = names.iter().map(|n| in_use(n, 1)).collect();
        registry.stamp(&tables, 0);
        assert_eq!(registry.entries.len(), MAX_TABLES);
        assert!(Registry::decode(&registry.encode()).entries.len() == MAX_TABLES);
        // Said, not silent: the ones left out are named.
        let left_out: Vec<&str> = names[MAX_TABLES..].iter().map(String::as_str).collect();
        assert_eq!(registry.untracked(&tables), left_out);
        // The untracked ones are tracked once the stale ones are emptied.
        let late = &tables[MAX_TABLES..];
        while registry.claim(GRACE_US, SWEEP_BATCH.into()).is_some() {}
        assert!(registry.entries.is_empty());
        registry.stamp(late, GRACE_US);
        assert_eq!(registry.entries.len(), 10);
        assert!(registry.untracked(late).is_empty());
        let long = "x".repeat(MAX_PREFIX + 1);
        assert!(!registry.stamp(&[in_use(&long, 1)], GRACE_US));
        assert_eq!(registry.untracked(&[in_use(&long, 1)]), [long.as_str()]);
    }

    #[test]
    fn a_claim_takes_no_more_than_its_budget() {
        let mut registry = Registry::default();
        registry.stamp(&[in_use("sluice/a/1/", 10), in_use("sluice/b/1/", 10)], 0);
        let sweep = registry
            .claim(GRACE_US, 4)
            .map(|s| (s.prefix, s.from, s.to));
        assert_eq!(sweep, Some(("sluice/a/1/".to_owned(), 0, 4)));
        assert_eq!(registry.claim(GRACE_US, 0), None);
        let sweep = registry
            .claim(GRACE_US, 100)
            .map(|s| (s.from, s.to, s.last));
        assert_eq!(sweep, Some((4, 10, true)));
        let sweep = registry
            .claim(GRACE_US, 100)
            .map(|s| (s.prefix, s.from, s.to));
        assert_eq!(sweep, Some(("sluice/b/1/".to_owned(), 0, 10)));
        assert!(registry.entries.is_empty());
    }

    #[test]
    fn a_late_request_to_an_emptied_set_finds_a_fresh_record() {
        use crate::limit::table::{KeyHasher, Record, Table};
        use crate::limit::{Limit, Period};
        let limits = vec![Limit::new(10, Period::Minute, None).unwrap()];
        let table = Table::new("r", &limits, 64, KeyHasher::new([1, 2]));
        let mut set = Vec::new();
        let mut spent = Record::fresh(42, &limits, 0);
        spent.buckets[0].tokens = 0.0;
        table.store(&mut set, &spent, &limits, 0);
        assert_eq!(table.find(&set, 42), Some(spent));
        // What the sweep writes over the set.
        let mut emptied = Vec::new();
        assert_eq!(table.find(&emptied, 42), None);
        let fresh = table.find_or_fresh(&emptied, 42, &limits, 5);
        assert_eq!(fresh, Record::fresh(42, &limits, 5));
        table.store(&mut emptied, &fresh, &limits, 5);
        assert_eq!(table.find(&emptied, 42), Some(fresh));
    }

    #[test]
    fn large_sets_are_claimed_fewer_at_a_time() {
        let mut registry = Registry::default();
        let big = InUse {
            prefix: "sluice/logs/1/",
            sets: 100,
            set_bytes: 300_000,
        };
        registry.stamp(&[big], 0);
        let sweep = registry.claim(GRACE_US, 1 << 20);
        assert_eq!(
            sweep.map(|s| (s.from, s.to, s.bytes)),
            Some((0, 3, 900_000))
        );
        let sweep = registry.claim(GRACE_US, SWEEP_BYTES);
        assert_eq!(sweep.map(|s| (s.from, s.to)), Some((3, 30)));
        // A set larger than the budget still goes, one at a time.
        let sweep = registry.claim(GRACE_US, 1);
        assert_eq!(sweep.map(|s| (s.from, s.to)), Some((30, 31)));
    }

    #[test]
    fn a_clock_going_back_never_claims() {
        let mut registry = Registry::default();
        registry.stamp(&[in_use("sluice/a/1/", 8)], GRACE_US * 5);
        assert_eq!(registry.claim(0, SWEEP_BATCH.into()), None);
        assert!(!registry.stamp(&[in_use("sluice/a/1/", 8)], 0));
        assert_eq!(registry.entries[0].stamped_us, GRACE_US * 5);
    }
}
