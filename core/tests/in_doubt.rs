//! Exactly once through lost answers: a batch that may have been applied is kept in doubt and
//! resent first, labels and all, until one is answered; a batch that surely was not is undone.
//! Against a model of the service's rule (an entry counts only if its round is newer than the
//! last one applied for the key: `lua/prelude.lua`'s round_is_new), any sequence of answered,
//! lost-after-applying, lost-before-applying and refused batches debits exactly what the proxy
//! admitted, key by key.

use std::collections::HashMap;

use proptest::prelude::*;
use sluice_core::protocol::{Hints, Lease, SyncEntry, SyncResponse};
use sluice_core::sync::outbox::{Pending, MAX_BATCH_KEYS};
use sluice_core::sync::proxy::{claim_round, read_state};
use sluice_core::sync::round::{self, Batch, Failure};
use sluice_core::{Decision, Limiter, MemoryStore, PlainRequest};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

const CACHED: &str = r#"{"service": {"cluster": "svc", "breaker_failures": 1, "breaker_cooldown_ms": 1000},
    "rules": [{"name": "shared", "key": ["header:x-key"], "consistency": "cached",
    "limits": [{"requests": 1000000, "per": "second"}]}]}"#;

/// The service, as far as counting goes: what it debited per key, and the last round applied.
#[derive(Default)]
struct Service {
    last: HashMap<String, (u32, u32)>,
    debited: HashMap<String, u64>,
}

impl Service {
    fn apply(&mut self, batch: &Batch) {
        for entry in &batch.request.entries {
            self.apply_entry(entry);
        }
    }

    fn apply_entry(&mut self, entry: &SyncEntry) {
        let new = entry.round == 0
            || match self.last.get(&entry.key) {
                None => true,
                Some(&(epoch, counter)) => epoch != entry.epoch() || entry.counter() > counter,
            };
        if new {
            *self.debited.entry(entry.key.clone()).or_default() += entry.spent;
            if entry.round != 0 {
                self.last
                    .insert(entry.key.clone(), (entry.epoch(), entry.counter()));
            }
        }
    }
}

/// What became of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Answered,
    /// Applied, the answer lost (a timeout, a replica killed after its script ran).
    AppliedThenLost,
    /// Lost before the service applied it (a reset, a 503 from the proxy's side).
    LostBeforeApplying,
    /// Refused as a whole (a 4xx) or not sent: surely not applied.
    Refused,
}

struct Proxy {
    limiter: Limiter,
    store: MemoryStore,
    waiting: Pending,
    now: u64,
    admitted: HashMap<String, u64>,
}

impl Proxy {
    fn new() -> Proxy {
        Proxy {
            limiter: Limiter::new(sluice_core::parse(CACHED.as_bytes()).unwrap()),
            store: MemoryStore::default(),
            waiting: Pending::default(),
            now: T0,
            admitted: HashMap::new(),
        }
    }

    /// A request for `key`; whether it was admitted.
    fn request(&mut self, key: &str) -> bool {
        let mut request = PlainRequest::get("/").with_header("x-key", key);
        let conditions = sluice_core::limiter::Conditions {
            now_us: self.now,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        let evaluation = self
            .limiter
            .decide(&mut request, conditions, &mut self.store);
        if matches!(evaluation.decision, Decision::Allow { .. }) {
            *self
                .admitted
                .entry(format!("shared\u{1f}{key}"))
                .or_default() += 1;
        }
        let admitted = matches!(evaluation.decision, Decision::Allow { .. });
        for (rule, key) in evaluation.newly_unsynced {
            let _ = self.waiting.push(rule, key);
        }
        admitted
    }

    /// Claims a round (two seconds on: past any breaker cooldown) and composes its batch.
    fn compose(&mut self) -> Batch {
        self.now += 2 * SECOND;
        claim_round(&mut self.store, self.now, 100, 250_000, 1).expect("a round is due");
        round::compose(
            &self.limiter,
            &mut self.waiting,
            "p-1",
            100,
            &mut self.store,
        )
        .expect("a round goes out every interval")
    }

    fn settle(&mut self, batch: &Batch, outcome: Outcome) {
        let service = self.limiter.policy().service.clone().unwrap();
        match outcome {
            Outcome::Answered => {
                let grant = Lease {
                    tokens: 1_000,
                    ttl_ms: 300,
                    remaining: 1_000,
                    reset_ms: 0,
                    token_ms: None,
                    refused: None,
                    penalty_ms: 0,
                };
                let response = SyncResponse {
                    grants: vec![grant; batch.request.entries.len()],
                    hints: Hints::default(),
                };
                round::settle(&self.limiter, batch, &response, self.now, &mut self.store).unwrap();
            }
            // What the filter sees of each: core decides whether to put the batch back or keep
            // it in doubt.
            lost => {
                let (failure, status) = match lost {
                    Outcome::AppliedThenLost => (Failure::Timeout, None),
                    Outcome::LostBeforeApplying => (Failure::Status, Some("503")),
                    _ => (Failure::Status, Some("400")),
                };
                for (rule, key) in round::recover(
                    &self.limiter,
                    batch,
                    &service,
                    failure,
                    status,
                    self.now,
                    1.0,
                    &mut self.store,
                ) {
                    let _ = self.waiting.push(rule, key);
                }
            }
        }
    }
}

fn run(steps: &[(Vec<u8>, Outcome)]) -> (Proxy, Service) {
    let mut proxy = Proxy::new();
    let mut service = Service::default();
    for (requests, outcome) in steps {
        for key in requests {
            proxy.request(&format!("k{key}"));
        }
        let batch = proxy.compose();
        if matches!(outcome, Outcome::Answered | Outcome::AppliedThenLost) {
            service.apply(&batch);
        }
        proxy.settle(&batch, *outcome);
    }
    // The service answers again: at most two rounds settle everything (the one in doubt, then
    // the counts its keys held back meanwhile).
    for _ in 0..3 {
        let batch = proxy.compose();
        service.apply(&batch);
        proxy.settle(&batch, Outcome::Answered);
    }
    (proxy, service)
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        Just(Outcome::Answered),
        Just(Outcome::AppliedThenLost),
        Just(Outcome::LostBeforeApplying),
        Just(Outcome::Refused),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("SLUICE_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(64)
    ))]

    #[test]
    fn the_service_debits_exactly_what_the_proxy_admitted(
        steps in prop::collection::vec(
            (prop::collection::vec(0u8..4, 0..6), outcome()),
            1..12,
        )
    ) {
        let (mut proxy, service) = run(&steps);
        prop_assert!(round::in_doubt(&mut proxy.store).is_empty(), "nothing left in doubt");
        prop_assert_eq!(&service.debited.into_iter().filter(|(_, n)| *n > 0).collect::<HashMap<_, _>>(), &proxy.admitted);
    }
}

#[test]
fn a_lost_answer_is_resent_with_its_labels_and_the_key_waits() {
    let mut proxy = Proxy::new();
    let mut service = Service::default();
    proxy.request("a");
    proxy.request("a");
    let first = proxy.compose();
    let label = read_state(&mut proxy.store).round_label();
    assert_ne!(label, 0);
    assert_eq!(first.request.entries[0].round, label);
    service.apply(&first);
    proxy.settle(&first, Outcome::AppliedThenLost);
    assert_eq!(round::in_doubt(&mut proxy.store).len(), 1);

    // A third request while the first two are in doubt: its count waits in the record.
    proxy.request("a");
    let second = proxy.compose();
    assert_eq!(second.replayed, 1);
    assert_eq!(
        second.request.entries, first.request.entries,
        "resent as sent"
    );
    assert!(read_state(&mut proxy.store).round_label() > label);
    // Refused as a whole: the entry stays in doubt, nothing is put back in the record.
    proxy.settle(&second, Outcome::Refused);
    assert_eq!(round::in_doubt(&mut proxy.store).len(), 1);

    let third = proxy.compose();
    assert_eq!(third.request.entries, first.request.entries);
    service.apply(&third);
    proxy.settle(&third, Outcome::Answered);
    assert!(round::in_doubt(&mut proxy.store).is_empty(), "settled");
    assert_eq!(
        service.debited["shared\u{1f}a"], 2,
        "the replay counted nothing"
    );

    let fourth = proxy.compose();
    assert_eq!(fourth.replayed, 0);
    assert_eq!(
        fourth.request.entries.len(),
        1,
        "the held-back count goes now"
    );
    assert_eq!(fourth.request.entries[0].spent, 1);
    assert!(fourth.request.entries[0].round > label);
    service.apply(&fourth);
    assert_eq!(service.debited["shared\u{1f}a"], 3);
}

#[test]
fn without_labels_the_model_counts_a_replay_twice() {
    // The control: the same sequence with the labels stripped double counts.
    let mut proxy = Proxy::new();
    let mut service = Service::default();
    proxy.request("a");
    let mut first = proxy.compose();
    first.request.entries[0].round = 0;
    service.apply(&first);
    proxy.settle(&first, Outcome::AppliedThenLost);
    let mut again = proxy.compose();
    again.request.entries[0].round = 0;
    service.apply(&again);
    assert_eq!(service.debited["shared\u{1f}a"], 2);
}

#[test]
fn the_epoch_is_drawn_once_and_again_when_the_counter_wraps() {
    let mut store = MemoryStore::default();
    let first = claim_round(&mut store, T0, 100, 0, 1).unwrap();
    let second = claim_round(&mut store, T0 + SECOND, 100, 0, 1).unwrap();
    assert_ne!(first.epoch, 0);
    assert_eq!(first.epoch, second.epoch);
    assert_eq!(second.round_label(), first.round_label() + 1);
    sluice_core::sync::proxy::update_state(&mut store, |s| s.rounds = u64::from(u32::MAX)).unwrap();
    let wrapped = claim_round(&mut store, T0 + 2 * SECOND, 100, 0, 1).unwrap();
    assert_eq!(wrapped.rounds as u32, 0);
    assert_ne!(
        wrapped.epoch, first.epoch,
        "a new epoch: the service takes it as new"
    );
}

#[test]
fn rounds_that_overlap_lose_nothing_in_doubt() {
    // A round's answer came after the next round was composed (a late callback): the later
    // batch's answer settles only the entries it carried.
    let mut proxy = Proxy::new();
    let mut service = Service::default();
    proxy.request("a");
    let first = proxy.compose();
    service.apply(&first);
    proxy.settle(&first, Outcome::AppliedThenLost);
    proxy.request("b");
    let second = proxy.compose();
    assert_eq!(second.replayed, 1);
    proxy.request("c");
    let third = proxy.compose();
    assert_eq!(
        third.replayed, 1,
        "the second is still in flight: the first is still in doubt"
    );
    proxy.settle(&second, Outcome::LostBeforeApplying);
    service.apply(&third);
    proxy.settle(&third, Outcome::Answered);
    let left: Vec<String> = round::in_doubt(&mut proxy.store)
        .into_iter()
        .map(|(_, e)| e.key)
        .collect();
    assert_eq!(left, ["shared\u{1f}b"], "b's batch is still in doubt");
    for _ in 0..2 {
        let batch = proxy.compose();
        service.apply(&batch);
        proxy.settle(&batch, Outcome::Answered);
    }
    let debited: HashMap<_, _> = service.debited.into_iter().collect();
    assert_eq!(debited, proxy.admitted);
}

/// A configuration reloaded while a batch was out changed the rule's limits: the answer's lease,
/// granted for the old limits, does not go to the key under the new ones.
#[test]
fn a_lease_answered_after_a_reload_goes_only_to_the_limits_it_was_granted_for() {
    let mut proxy = Proxy::new();
    proxy.request("a");
    let batch = proxy.compose();
    assert_eq!(batch.request.entries.len(), 1);

    // The reload: the same rule, now 1 an hour with a fallback of 1 an hour.
    const RELOADED: &str = r#"{"service": {"cluster": "svc", "breaker_failures": 1, "breaker_cooldown_ms": 1000},
        "rules": [{"name": "shared", "key": ["header:x-key"], "consistency": "cached",
                   "limits": [{"requests": 1, "per": "hour"}],
                   "fallback": {"policy": "fail_open", "limits": [{"requests": 1, "per": "hour"}]}}]}"#;
    proxy.limiter = Limiter::new(sluice_core::parse(RELOADED.as_bytes()).unwrap());
    // The key under the new limits is seen (the fallback admits one), then the answer comes.
    assert!(proxy.request("a"), "the fallback's one");
    proxy.settle(&batch, Outcome::Answered);
    // Had the 1,000-token lease of the old limits gone to it, it would admit again.
    assert!(!proxy.request("a"), "no lease granted for other limits");
}

/// Rounds that overlap, every one lost: the list stops at its cap, and what does not fit goes
/// back into the records instead of being dropped, so the service still debits every admission
/// (twice for the entries undone from a batch it had applied after all, never fewer).
#[test]
fn the_list_in_doubt_is_capped_and_loses_nothing() {
    for applied in [false, true] {
        let mut proxy = Proxy::new();
        let mut service = Service::default();
        let mut out = Vec::new();
        for round in 0..5 {
            for key in 0..MAX_BATCH_KEYS {
                proxy.request(&format!("r{round}k{key}"));
            }
            out.push(proxy.compose());
        }
        let outcome = if applied {
            Outcome::AppliedThenLost
        } else {
            Outcome::LostBeforeApplying
        };
        for batch in &out {
            assert_eq!(batch.request.entries.len(), MAX_BATCH_KEYS);
            if applied {
                service.apply(batch);
            }
            proxy.settle(batch, outcome);
        }
        assert_eq!(
            round::in_doubt(&mut proxy.store).len(),
            round::MAX_IN_DOUBT_KEYS,
            "capped"
        );
        assert_eq!(
            proxy.waiting.len(),
            MAX_BATCH_KEYS,
            "the last batch's keys wait again"
        );
        for _ in 0..10 {
            if round::in_doubt(&mut proxy.store).is_empty() && proxy.waiting.is_empty() {
                break;
            }
            let batch = proxy.compose();
            service.apply(&batch);
            proxy.settle(&batch, Outcome::Answered);
        }
        assert!(round::in_doubt(&mut proxy.store).is_empty());
        let debited: HashMap<_, _> = service.debited.into_iter().collect();
        assert_eq!(debited.len(), proxy.admitted.len());
        for (key, admitted) in &proxy.admitted {
            let expected = if applied && key.contains("r4k") { 2 } else { 1 };
            assert_eq!(debited[key], admitted * expected, "{key}");
        }
    }
}

#[test]
fn only_a_batch_not_sent_or_refused_with_a_4xx_is_put_back() {
    use round::surely_not_applied;
    assert!(surely_not_applied(Failure::NotSent, None));
    for status in ["400", "401", "403", "413", "429"] {
        let failure = Failure::of(Some(status));
        assert!(surely_not_applied(failure, Some(status)), "{status}");
    }
    // It may have been applied: a timeout, a reset, a 5xx, a 200 that does not parse.
    assert!(!surely_not_applied(Failure::of(None), None));
    for status in ["500", "502", "503", "504"] {
        assert!(
            !surely_not_applied(Failure::of(Some(status)), Some(status)),
            "{status}"
        );
    }
    assert!(!surely_not_applied(Failure::Malformed, Some("200")));
    assert_eq!(Failure::of(Some("504")), Failure::Timeout);
    assert_eq!(Failure::of(Some("403")), Failure::Unauthorized);
}
