//! The live overrides a proxy keeps ([`crate::overrides::OVERRIDES_KEY`] in shared data): how the
//! whole set or a delta a sync answer carries becomes the set kept, within the proxy's bound.
//!
//! A delta ([`OverridesDelta`]) applies only to the set at its `from` version: one that does not
//! follow the set kept (a set lost or unreadable, a service that lost its history) is ignored,
//! and the next round asks for the whole set (it sends version 0). A set (whole, or after a
//! delta) whose JSON is longer than [`MAX_KEPT_BYTES`] is refused: the proxy keeps its last set
//! and its version, and says so ([`Taken::TooLarge`]).

use std::collections::btree_map::Entry;

use crate::overrides::{decode, encode, OVERRIDES_KEY};
use crate::protocol::{
    LiveOverrides, Overrides, OverridesDelta, MAX_OVERRIDES_BYTES, OVERRIDES_FRAME_BYTES,
};
use crate::store::Store;

/// Longest set a proxy keeps, as JSON: the most a service may keep, and its frame.
pub const MAX_KEPT_BYTES: usize = MAX_OVERRIDES_BYTES + OVERRIDES_FRAME_BYTES;

/// What became of the live overrides of one sync answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// The answer carried none: the proxy is up to date (or the service could not read them).
    Nothing,
    /// The set kept is now the one at `version`, from a whole set or (not `whole`) a delta.
    Kept { version: u64, whole: bool },
    /// A delta from `from` while the set kept is at `kept`: ignored; the next round asks for the
    /// whole set.
    Gap { kept: u64, from: u64 },
    /// The set at `version` would take `bytes` of JSON, more than [`MAX_KEPT_BYTES`]: refused,
    /// the last set is kept.
    TooLarge { version: u64, bytes: usize },
}

/// A delta that does not follow the set: its `from` is not the set's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap;

/// Applies `delta` to `set` (at `delta.from`): the entries it removes go, those it sets are set,
/// and the set is at `delta.version`. [`Gap`], and `set` untouched, if the set is not at `from`.
pub fn apply_delta(set: &mut LiveOverrides, delta: &OverridesDelta) -> Result<(), Gap> {
    if set.version != delta.from {
        return Err(Gap);
    }
    for target in &delta.removed_limits {
        set.limits.remove(target);
    }
    for (rule, keys) in &delta.removed_keys {
        if let Entry::Occupied(mut held) = set.keys.entry(rule.clone()) {
            for key in keys {
                held.get_mut().remove(key);
            }
            if held.get().is_empty() {
                held.remove();
            }
        }
        forget_expiries(&mut set.expires, rule, keys.iter());
    }
    for (target, limits) in &delta.limits {
        set.limits.insert(target.clone(), limits.clone());
    }
    for (rule, keys) in &delta.keys {
        let held = set.keys.entry(rule.clone()).or_default();
        for (key, action) in keys {
            held.insert(key.clone(), *action);
        }
        // A key set again keeps only the expiry the delta gives it.
        forget_expiries(&mut set.expires, rule, keys.keys());
        if let Some(expires) = delta.expires.get(rule) {
            let held = set.expires.entry(rule.clone()).or_default();
            for (key, at) in expires.iter().filter(|(key, _)| keys.contains_key(*key)) {
                held.insert(key.clone(), *at);
            }
        }
    }
    set.version = delta.version;
    Ok(())
}

/// Drops the expiries of `rule`'s `keys` (and the rule's map once empty).
fn forget_expiries<'a>(
    expires: &mut std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
    rule: &str,
    keys: impl Iterator<Item = &'a String>,
) {
    if let Some(held) = expires.get_mut(rule) {
        for key in keys {
            held.remove(key);
        }
        if held.is_empty() {
            expires.remove(rule);
        }
    }
}

/// Takes the set or the delta of `overrides` into the set kept in `store`, atomically: see
/// [`Taken`]. A delta applies to the set kept (none kept: the empty set at version 0).
pub fn take(overrides: &Overrides, store: &mut dyn Store) -> Taken {
    if overrides.live.is_none() && overrides.delta.is_none() {
        return Taken::Nothing;
    }
    let taken = crate::store::update(store, OVERRIDES_KEY, |bytes| {
        let next = match (&overrides.live, &overrides.delta) {
            (Some(live), _) => encode(live),
            (None, Some(delta)) => {
                let mut set = if bytes.is_empty() {
                    LiveOverrides::default()
                } else {
                    match decode(bytes) {
                        Some(set) => set,
                        None => {
                            let kept = 0;
                            let from = delta.from;
                            return (Taken::Gap { kept, from }, false);
                        }
                    }
                };
                let kept = set.version;
                if apply_delta(&mut set, delta).is_err() {
                    let from = delta.from;
                    return (Taken::Gap { kept, from }, false);
                }
                encode(&set)
            }
            (None, None) => return (Taken::Nothing, false),
        };
        let version = overrides
            .live
            .as_ref()
            .map(|live| live.version)
            .or(overrides.delta.as_ref().map(|delta| delta.version))
            .unwrap_or_default();
        if next.len() > MAX_KEPT_BYTES {
            let bytes = next.len();
            return (Taken::TooLarge { version, bytes }, false);
        }
        *bytes = next;
        let whole = overrides.live.is_some();
        (Taken::Kept { version, whole }, true)
    });
    // A store that would not take it: the version stays, so the next round asks again.
    taken.unwrap_or(Taken::Nothing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::KeyAction;
    use crate::store::MemoryStore;
    use serde_json::json;

    fn set(version: u64) -> LiveOverrides {
        LiveOverrides {
            expires: Default::default(),
            version,
            limits: [(
                "api".to_string(),
                vec![json!({"requests": 2, "per": "second"})],
            )]
            .into(),
            keys: [(
                "api".to_string(),
                [
                    ("alice".to_string(), KeyAction::Block),
                    ("bob".to_string(), KeyAction::Allow),
                ]
                .into(),
            )]
            .into(),
        }
    }

    fn delta(version: u64) -> Taken {
        Taken::Kept {
            version,
            whole: false,
        }
    }

    fn whole_set(version: u64) -> Taken {
        Taken::Kept {
            version,
            whole: true,
        }
    }

    fn kept(store: &mut MemoryStore) -> Option<LiveOverrides> {
        let (bytes, _) = store.get(OVERRIDES_KEY).unwrap()?;
        decode(&bytes)
    }

    #[test]
    fn a_delta_sets_replaces_and_removes_entries() {
        let mut live = set(7);
        let delta = OverridesDelta {
            expires: Default::default(),
            from: 7,
            version: 9,
            limits: [(
                "web/gold".to_string(),
                vec![json!({"requests": 1, "per": "minute"})],
            )]
            .into(),
            keys: [
                (
                    "api".to_string(),
                    [("bob".to_string(), KeyAction::Block)].into(),
                ),
                (
                    "login".to_string(),
                    [("10.0.0.1".to_string(), KeyAction::Allow)].into(),
                ),
            ]
            .into(),
            removed_limits: vec!["api".into(), "never-set".into()],
            removed_keys: [
                ("api".to_string(), vec!["alice".to_string()]),
                ("other".to_string(), vec!["x".to_string()]),
            ]
            .into(),
        };
        apply_delta(&mut live, &delta).unwrap();
        assert_eq!(
            serde_json::to_value(&live).unwrap(),
            json!({"version": 9,
                   "limits": {"web/gold": [{"requests": 1, "per": "minute"}]},
                   "keys": {"api": {"bob": "block"}, "login": {"10.0.0.1": "allow"}}})
        );
        // a rule whose last key goes is gone too
        let mut live = set(7);
        let delta = OverridesDelta {
            from: 7,
            version: 8,
            removed_keys: [("api".to_string(), vec!["alice".into(), "bob".into()])].into(),
            ..Default::default()
        };
        apply_delta(&mut live, &delta).unwrap();
        assert!(live.keys.is_empty());
        assert_eq!(live.version, 8);
    }

    /// A block's expiry travels with its key: a delta that sets a key gives it the delta's
    /// expiry or none, one that removes it drops its expiry, and the others keep theirs.
    #[test]
    fn a_delta_carries_the_expiry_of_the_keys_it_sets() {
        let mut live = set(7);
        live.expires = [(
            "api".to_string(),
            [("alice".to_string(), 5_000), ("bob".to_string(), 6_000)].into(),
        )]
        .into();
        let delta = OverridesDelta {
            from: 7,
            version: 8,
            keys: [(
                "api".to_string(),
                [
                    ("bob".to_string(), KeyAction::Block),
                    ("carol".to_string(), KeyAction::Block),
                ]
                .into(),
            )]
            .into(),
            // an expiry for a key the delta does not set is no expiry of anything
            expires: [(
                "api".to_string(),
                [("carol".to_string(), 9_000), ("dave".to_string(), 1)].into(),
            )]
            .into(),
            ..Default::default()
        };
        apply_delta(&mut live, &delta).unwrap();
        assert_eq!(
            live.expires,
            [(
                "api".to_string(),
                [("alice".to_string(), 5_000), ("carol".to_string(), 9_000)].into()
            )]
            .into(),
            "bob set again without a ttl has none"
        );
        let delta = OverridesDelta {
            from: 8,
            version: 9,
            removed_keys: [("api".to_string(), vec!["alice".into(), "carol".into()])].into(),
            ..Default::default()
        };
        apply_delta(&mut live, &delta).unwrap();
        assert!(live.expires.is_empty(), "{:?}", live.expires);
    }

    #[test]
    fn a_delta_that_does_not_follow_is_refused_and_changes_nothing() {
        let mut live = set(7);
        for from in [0, 6, 8, u64::MAX] {
            let delta = OverridesDelta {
                from,
                version: 9,
                removed_limits: vec!["api".into()],
                ..Default::default()
            };
            assert_eq!(apply_delta(&mut live, &delta), Err(Gap));
            assert_eq!(live, set(7));
        }
    }

    #[test]
    fn taking_a_set_then_deltas_keeps_the_set_at_each_version() {
        let mut store = MemoryStore::default();
        let nothing = Overrides::default();
        assert_eq!(take(&nothing, &mut store), Taken::Nothing);
        assert_eq!(kept(&mut store), None);
        // a first delta applies to the empty set at version 0
        let first = Overrides {
            delta: Some(OverridesDelta {
                from: 0,
                version: 3,
                keys: [(
                    "api".to_string(),
                    [("eve".to_string(), KeyAction::Block)].into(),
                )]
                .into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(take(&first, &mut store), delta(3));
        assert_eq!(
            kept(&mut store).unwrap().keys["api"]["eve"],
            KeyAction::Block
        );
        // the whole set replaces whatever is kept
        let whole = Overrides {
            live: Some(set(7)),
            ..Default::default()
        };
        assert_eq!(take(&whole, &mut store), whole_set(7));
        assert_eq!(kept(&mut store), Some(set(7)));
        let next = |from, version| Overrides {
            delta: Some(OverridesDelta {
                from,
                version,
                removed_keys: [("api".to_string(), vec!["bob".to_string()])].into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(take(&next(7, 8), &mut store), delta(8));
        let mut expected = set(8);
        expected.keys.get_mut("api").unwrap().remove("bob");
        assert_eq!(kept(&mut store), Some(expected.clone()));
        // the same delta again (an answer to an older round) does not follow: ignored
        assert_eq!(
            take(&next(7, 8), &mut store),
            Taken::Gap { kept: 8, from: 7 }
        );
        // a gap: the set is left as it was
        assert_eq!(
            take(&next(9, 10), &mut store),
            Taken::Gap { kept: 8, from: 9 }
        );
        assert_eq!(kept(&mut store), Some(expected));
        // a kept set that does not read: a delta cannot apply
        let (_, version) = store.get(OVERRIDES_KEY).unwrap().unwrap();
        assert!(store.set(OVERRIDES_KEY, b"junk", version).unwrap());
        assert_eq!(
            take(&next(8, 9), &mut store),
            Taken::Gap { kept: 0, from: 8 }
        );
    }

    /// A service (or whoever answers in its place) that sends a set past the proxy's bound, whole
    /// or built up by deltas: refused, the last set kept.
    #[test]
    fn a_set_past_the_bound_is_refused_and_the_last_one_kept() {
        let mut store = MemoryStore::default();
        let whole = Overrides {
            live: Some(set(7)),
            ..Default::default()
        };
        assert_eq!(take(&whole, &mut store), whole_set(7));
        let many = |count: usize, prefix: &str| -> LiveOverrides {
            let keys = (0..count)
                .map(|i| (format!("{prefix}-{i:0>200}"), KeyAction::Block))
                .collect();
            LiveOverrides {
                version: 8,
                keys: [("api".to_string(), keys)].into(),
                ..Default::default()
            }
        };
        // about 220 bytes a key: 20,000 keys are past 4 MiB
        let big = Overrides {
            live: Some(many(20_000, "k")),
            ..Default::default()
        };
        let Taken::TooLarge { version, bytes } = take(&big, &mut store) else {
            panic!("taken")
        };
        assert_eq!(version, 8);
        assert!(bytes > MAX_KEPT_BYTES, "{bytes}");
        assert_eq!(kept(&mut store), Some(set(7)));
        // the same size reached through a delta
        let half = Overrides {
            live: Some(many(12_000, "k")),
            ..Default::default()
        };
        assert_eq!(take(&half, &mut store), whole_set(8));
        let more = Overrides {
            delta: Some(OverridesDelta {
                from: 8,
                version: 9,
                keys: many(12_000, "m").keys,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(matches!(
            take(&more, &mut store),
            Taken::TooLarge { version: 9, .. }
        ));
        assert_eq!(kept(&mut store).unwrap().version, 8);
    }
}
