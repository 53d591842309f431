//! Every outcome has a name: what the limiter decided, and what each rule said.

use smallvec::SmallVec;

use crate::limit::Limit;
use crate::policy::RuleId;

/// What a client is told about one limit: the figures behind the rate-limit headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: Limit,
    /// Requests the client may still make now.
    pub remaining: u64,
    /// Microseconds until the quota is whole again.
    pub reset_us: u64,
}

/// The decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Admitted. `quota` is the most restrictive answer among the rules that counted it.
    Allow { quota: Option<(RuleId, Quota)> },
    /// Refused by rule `rule`; nothing was spent.
    Deny {
        rule: RuleId,
        quota: Quota,
        retry_after_us: u64,
    },
    /// Refused because rule `rule` cannot decide: it fails closed and the counter service is
    /// out of reach. Not a rate limit: 503.
    Unavailable { rule: RuleId, retry_after_us: u64 },
}

/// What one rule said about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    Denied,
    /// A monitor rule (or one ramping up) would have denied; the request went on.
    ShadowDenied,
    /// A warn rule would have denied; the request went on, and the client and operator are
    /// told.
    Warned,
    /// The rule's state could not be updated (contention, host failure): the request went on
    /// uncounted by this rule.
    Uncounted,
    /// The rule fails closed and the counter service is out of reach: the request was refused
    /// (503, [`Decision::Unavailable`]).
    FailedClosed,
}

// The lists a decision makes per request (each rule's outcome, what each spent) hold one entry
// for most requests: held inline, on the stack or in their owner, until they outgrow their
// room, as a vector would be an allocation and a free each time.

/// Each matching rule's outcome, in rule order (one rule, most often).
pub type Outcomes = SmallVec<[(RuleId, Outcome); 4]>;
/// What an admitted request spent, rule by rule.
pub type Spending = SmallVec<[Spent; 2]>;

/// The decision, with each matching rule's outcome (for metrics) and the keys whose counts the
/// counter service has not seen yet (for the sync).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub decision: Decision,
    pub outcomes: Outcomes,
    /// (rule, key) pairs that just got their first unsynced count since the last sync.
    pub newly_unsynced: Vec<(RuleId, String)>,
    /// What an admitted request spent, to give back if a strict check denies it after all.
    pub spent: Spending,
    /// A lease ran out: the proxy should sync early rather than deny until its next interval.
    pub lease_exhausted: bool,
    /// Admitted by a shaping limit (leaky bucket) to leave this much later.
    pub delay_us: u64,
    /// Warn rules that would have denied, with the key.
    pub warned: Vec<(RuleId, String)>,
    /// Rules with a `cost_header` that admitted the request, with the key: what the response
    /// reports is charged to them.
    pub chargeable: Vec<(RuleId, String)>,
    /// Keys of fail-closed cached rules without a lease while the service is up: the service
    /// decides them, one check each, as it does a strict rule's, once the other rules admit.
    pub asked: Vec<(RuleId, String)>,
    /// The digest of the key a denial (or a fail-closed refusal) is of, for the access log.
    pub denied_key: Option<crate::limiter::key::KeyDigest>,
}

/// Nothing decided yet: what [`Limiter::decide_into`](super::Limiter::decide_into) starts from.
impl Default for Evaluation {
    fn default() -> Evaluation {
        Evaluation {
            decision: Decision::Allow { quota: None },
            outcomes: Outcomes::new(),
            newly_unsynced: Vec::new(),
            spent: Spending::new(),
            lease_exhausted: false,
            delay_us: 0,
            warned: Vec::new(),
            chargeable: Vec::new(),
            asked: Vec::new(),
            denied_key: None,
        }
    }
}

/// How a rule spent a request's tokens, so they can be given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spend {
    Buckets,
    Lease,
}

/// A token a rule spent for a request; given back with `Limiter::refund` if the request is
/// denied later (by a strict rule's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spent {
    pub(crate) rule: RuleId,
    pub(crate) fingerprint: u64,
    pub(crate) how: Spend,
    /// At most [`crate::limit::MAX_TOKENS`] (a rule's `cost`), kept in 32 bits so that the
    /// record stays 32 bytes with `valued`.
    pub(crate) cost: u32,
    /// A concurrency rule's slot: when it lapses, which names it for its release
    /// ([`crate::limit::concurrency::lapse_us`]); 0 for other rules.
    pub(crate) lapse_us: u64,
    /// The requests of the limit a rule's `limits_from` gave the request (its own limit's when
    /// it gave none), so a refund gives back under the limit that spent; 0 for other rules.
    pub(crate) valued: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decisions_lists_hold_the_common_case_inline() {
        let mut outcomes = Outcomes::new();
        for n in 0..4 {
            outcomes.push((RuleId::new(n), Outcome::Allowed));
        }
        assert!(!outcomes.spilled(), "four rules' outcomes inline");
        outcomes.push((RuleId::new(4), Outcome::Denied));
        assert_eq!(outcomes.len(), 5, "and more beyond, in order");
        assert_eq!(outcomes[4], (RuleId::new(4), Outcome::Denied));
    }
}
