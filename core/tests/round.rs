//! A sync round in core alone: the batch composed by count and bytes, an answer settled
//! (leases, refused entries, hints, the breaker), a failed batch undone.

use sluice_core::policy::RuleId;
use sluice_core::protocol::{Hints, Lease, Overrides, SyncResponse};
use sluice_core::sync::outbox::{Pending, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
use sluice_core::sync::proxy::{claim_round, read_state};
use sluice_core::sync::round::{self, Mismatch};
use sluice_core::{Decision, Limiter, MemoryStore, PlainRequest};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

const CACHED: &str = r#"{"service": {"cluster": "svc", "breaker_failures": 1, "breaker_cooldown_ms": 1000},
    "rules": [{"name": "shared", "key": ["header:x-key"], "consistency": "cached",
    "limits": [{"requests": 100, "per": "second"}]}]}"#;

fn limiter() -> Limiter {
    Limiter::new(sluice_core::parse(CACHED.as_bytes()).unwrap())
}

/// Spends one token on each key (from the fallback: no lease yet) and returns the keys waiting.
fn spend(limiter: &Limiter, store: &mut MemoryStore, keys: &[String]) -> Pending {
    let mut waiting = Pending::default();
    for key in keys {
        let mut request = PlainRequest::get("/").with_header("x-key", key);
        let conditions = sluice_core::limiter::Conditions {
            now_us: T0,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        let evaluation = limiter.decide(&mut request, conditions, store);
        assert!(matches!(evaluation.decision, Decision::Allow { .. }));
        for (rule, key) in evaluation.newly_unsynced {
            let _ = waiting.push(rule, key);
        }
    }
    waiting
}

fn grant(tokens: u64, refused: Option<&str>) -> Lease {
    Lease {
        tokens,
        ttl_ms: 300,
        remaining: tokens,
        reset_ms: 0,
        token_ms: None,
        refused: refused.map(str::to_string),
        penalty_ms: 0,
    }
}

#[test]
fn a_batch_takes_what_fits_and_the_rest_waits() {
    let limiter = limiter();
    let mut store = MemoryStore::default();
    let keys: Vec<String> = (0..MAX_BATCH_KEYS + 10).map(|i| format!("k{i}")).collect();
    let mut waiting = spend(&limiter, &mut store, &keys);
    let batch = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert_eq!(batch.request.entries.len(), MAX_BATCH_KEYS);
    assert_eq!(waiting.len(), 10, "the rest wait for the next round");
    assert!(serde_json::to_vec(&batch.request).unwrap().len() <= MAX_BATCH_BYTES);
    assert!(batch.request.entries.iter().all(|e| e.spent == 1));
    let again = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert_eq!(again.request.entries.len(), 10);
    // Nothing left: the round still goes out, empty (its answer carries the bypass and the
    // live overrides).
    let empty = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert!(empty.request.entries.is_empty());
}

#[test]
fn long_keys_are_batched_by_bytes() {
    let limiter = limiter();
    let mut store = MemoryStore::default();
    // Digests are 82 bytes; the bound is on the worst-case escaped size of each entry.
    let keys: Vec<String> = (0..3_000)
        .map(|i| format!("{i}-{}", "x".repeat(300)))
        .collect();
    let mut waiting = spend(&limiter, &mut store, &keys);
    let mut sent = 0;
    while let Some(batch) = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store)
        .filter(|b| !b.request.entries.is_empty())
    {
        let body = serde_json::to_vec(&batch.request).unwrap();
        assert!(body.len() <= MAX_BATCH_BYTES, "{} bytes", body.len());
        sent += batch.request.entries.len();
    }
    assert_eq!(
        sent, 3_000,
        "every key went out, in batches under the bound"
    );
}

#[test]
fn an_answer_installs_leases_drops_refused_entries_and_closes_the_breaker() {
    let limiter = limiter();
    let mut store = MemoryStore::default();
    let keys = vec!["good".to_string(), "bad".to_string()];
    let mut waiting = spend(&limiter, &mut store, &keys);
    claim_round(&mut store, T0, 100, 250_000, 1).unwrap();
    let batch = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    let response = SyncResponse {
        grants: vec![grant(50, None), grant(0, Some("entries[1].key: too long"))],
        hints: Hints {
            next_sync_ms: 200,
            overrides: Overrides {
                bypass: true,
                load_level: None,
                fleet_proxies: None,
                live: None,
                delta: None,
            },
        },
    };
    let settled = round::settle(&limiter, &batch, &response, T0, &mut store).unwrap();
    assert_eq!(settled.refused, 1);
    assert_eq!(settled.reason.as_deref(), Some("entries[1].key: too long"));
    let state = read_state(&mut store);
    assert_eq!(state.busy_until_us, 0, "the round is over");
    assert_eq!(state.interval_ms, 200);
    assert!(state.bypass);
    let table = limiter.table(RuleId::new(0)).unwrap();
    let good = table.fingerprint("shared\u{1f}good");
    let set = store_get(&mut store, &table.set_key(good));
    assert_eq!(table.find(&set, good).unwrap().lease, 50, "leased");
    let bad = table.fingerprint("shared\u{1f}bad");
    let set = store_get(&mut store, &table.set_key(bad));
    let record = table.find(&set, bad).unwrap();
    assert!(
        !record.unsynced(),
        "a refused entry's counts are not put back"
    );
    let short = SyncResponse {
        grants: vec![grant(1, None)],
        hints: Hints::default(),
    };
    assert_eq!(
        round::settle(&limiter, &batch, &short, T0, &mut store),
        Err(Mismatch)
    );
}

#[test]
fn a_failed_batch_is_undone_and_counted_against_the_breaker() {
    let limiter = limiter();
    let mut store = MemoryStore::default();
    let mut waiting = spend(&limiter, &mut store, &["a".to_string()]);
    claim_round(&mut store, T0, 100, 250_000, 1).unwrap();
    let batch = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    let service = limiter.policy().service.clone().unwrap();
    let again = round::undo(&limiter, &batch, &service, T0, 1.0, &mut store);
    assert_eq!(
        again,
        vec![(RuleId::new(0), "shared\u{1f}a".to_string())],
        "announce it again"
    );
    let state = read_state(&mut store);
    assert_eq!(state.busy_until_us, 0, "the round is released");
    assert_eq!(state.breaker.failures, 1);
    assert_eq!(state.breaker.open_until_us, T0 + SECOND);
    let mut waiting = Pending::default();
    let _ = waiting.push(RuleId::new(0), "shared\u{1f}a".to_string());
    let retry = round::compose(&limiter, &mut waiting, "p-1", 100, &mut store).unwrap();
    assert_eq!(retry.request.entries[0].spent, 1, "the count came back");
}

fn store_get(store: &mut MemoryStore, key: &str) -> Vec<u8> {
    use sluice_core::Store;
    store.get(key).unwrap().map(|(v, _)| v).unwrap_or_default()
}
