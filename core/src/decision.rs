//! Every outcome has a name: what the limiter decided, and what each rule said.

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
    Unavailable,
}

/// A short list held inline, on the stack or in its owner, until it outgrows `N`: the lists a
/// decision makes per request (each rule's outcome, what each spent) hold one entry for most
/// requests, and a vector would be an allocation and a free each time.
#[derive(Clone)]
pub struct Few<T: Copy, const N: usize> {
    len: usize,
    /// The first `len` entries while they fit, filled with copies of the first beyond that.
    inline: Option<[T; N]>,
    /// Every entry, once there are more than `N`.
    spilled: Vec<T>,
}

impl<T: Copy, const N: usize> Few<T, N> {
    pub const fn new() -> Few<T, N> {
        Few {
            len: 0,
            inline: None,
            spilled: Vec::new(),
        }
    }

    pub fn push(&mut self, item: T) {
        match &mut self.inline {
            _ if self.len > N => self.spilled.push(item),
            None => self.inline = Some([item; N]),
            Some(items) => match items.get_mut(self.len) {
                Some(slot) => *slot = item,
                None => {
                    self.spilled.reserve(2 * N);
                    self.spilled.extend_from_slice(items);
                    self.spilled.push(item);
                }
            },
        }
        self.len += 1;
    }

    pub fn as_slice(&self) -> &[T] {
        match &self.inline {
            _ if self.len > N => &self.spilled,
            Some(items) => &items[..self.len],
            None => &[],
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
        self.inline = None;
        self.spilled.clear();
    }
}

impl<T: Copy, const N: usize> Default for Few<T, N> {
    fn default() -> Few<T, N> {
        Few::new()
    }
}

impl<T: Copy, const N: usize> std::ops::Deref for Few<T, N> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<'a, T: Copy, const N: usize> IntoIterator for &'a Few<T, N> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl<T: Copy + std::fmt::Debug, const N: usize> std::fmt::Debug for Few<T, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl<T: Copy + PartialEq, const N: usize> PartialEq for Few<T, N> {
    fn eq(&self, other: &Few<T, N>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Copy + Eq, const N: usize> Eq for Few<T, N> {}

impl<T: Copy + PartialEq, const N: usize> PartialEq<Vec<T>> for Few<T, N> {
    fn eq(&self, other: &Vec<T>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// Each matching rule's outcome, in rule order (one rule, most often).
pub type Outcomes = Few<(RuleId, Outcome), 4>;
/// What an admitted request spent, rule by rule.
pub type Spending = Few<Spent, 2>;

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
    pub(crate) cost: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_holds_its_entries_in_order_inline_and_beyond() {
        let mut few: Few<u32, 2> = Few::new();
        assert!(few.is_empty());
        for n in 0..7 {
            few.push(n);
            assert_eq!(few, (0..=n).collect::<Vec<_>>());
            assert_eq!(few.spilled.is_empty(), n < 2, "spilled past 2, at {n}");
        }
        assert_eq!(few.iter().sum::<u32>(), 21);
        assert_eq!(format!("{few:?}"), "[0, 1, 2, 3, 4, 5, 6]");
        few.clear();
        assert_eq!(few, Vec::new());
        few.push(9);
        assert_eq!(few[..], [9]);
        assert_eq!(few.clone(), few);
    }
}
