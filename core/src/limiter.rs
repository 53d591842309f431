//! The limiter: a validated [`Policy`] and the code that enforces it over a [`Store`].

use std::net::IpAddr;

use crate::bucket::Verdict;
use crate::decision::{Decision, Evaluation, Outcome, Quota, Spend, Spent};
use crate::key;
use crate::limit::{Algorithm, Limit};
use crate::policy::RuleId;
use crate::policy::{Consistency, Fallback, Mode, Policy, Rule};
use crate::request::RequestView;
use crate::store::{self, Store};
use crate::table::{self, KeyHasher, Record, Table};

/// How stale a key's recency may get before a denial writes it anyway.
const RECENCY_US: u64 = 1_000_000;

/// What the limiter needs to know about the world besides the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conditions {
    /// Microseconds since the Unix epoch.
    pub now_us: u64,
    /// Whether the counter service is usable (circuit breaker not open).
    pub service_up: bool,
}

/// A policy, ready to enforce.
#[derive(Debug, Clone)]
pub struct Limiter {
    policy: Policy,
    tables: Vec<Table>,
}

struct RuleVerdict {
    allowed: bool,
    quota: Quota,
    retry_after_us: u64,
    spend: Spend,
    /// A shaping limit holds the request this long before it leaves.
    delay_us: u64,
}

/// A rule ready to enforce: its identity, its validated value and its key table, always
/// together (the limiter keeps no table apart from its rule).
#[derive(Debug, Clone, Copy)]
pub struct Enforced<'a> {
    pub id: RuleId,
    pub rule: &'a Rule,
    pub table: &'a Table,
}

/// One rule's answer, outside a whole-request decision (strict fallbacks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleAnswer {
    pub allowed: bool,
    pub quota: Quota,
    pub retry_after_us: u64,
}

impl Limiter {
    /// A limiter whose key tables are placed by an unkeyed hash: for tests and tools. A proxy
    /// uses [`Limiter::with_secret`].
    pub fn new(policy: Policy) -> Limiter {
        Limiter::with_secret(policy, [0, 0])
    }

    /// A limiter whose key tables are placed by a hash keyed with `secret`, which clients
    /// cannot know: they cannot pick keys that collide with theirs.
    pub fn with_secret(policy: Policy, secret: [u64; 2]) -> Limiter {
        let hasher = KeyHasher::new(secret);
        let tables = policy
            .rules
            .iter()
            .map(|rule| Table::new(&rule.name, bucket_limits(rule), policy.max_keys, hasher))
            .collect();
        Limiter { policy, tables }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The rule `id` names, with its table.
    pub fn rule(&self, id: RuleId) -> Option<Enforced<'_>> {
        let rule = self.policy.rule(id)?;
        let table = self.tables.get(id.index())?;
        Some(Enforced { id, rule, table })
    }

    /// Every rule, in order, with its table.
    pub fn rules(&self) -> impl Iterator<Item = Enforced<'_>> {
        self.policy
            .rules()
            .zip(&self.tables)
            .map(|((id, rule), table)| Enforced { id, rule, table })
    }

    /// The key table of rule `rule`.
    pub fn table(&self, rule: RuleId) -> Option<&Table> {
        self.rule(rule).map(|r| r.table)
    }

    /// Whether a request skips every rule.
    pub fn bypassed(&self, path: &str, client: Option<IpAddr>) -> bool {
        let bypass = &self.policy.bypass;
        bypass.all
            || bypass.paths.iter().any(|p| p == path)
            || client.is_some_and(|ip| bypass.cidrs.iter().any(|c| c.contains(ip)))
    }

    /// Decides one request: every matching rule must allow, and tokens are spent only when all
    /// do (a rule that spent is refunded when a later rule denies).
    pub fn decide(
        &self,
        request: &mut dyn RequestView,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Evaluation {
        let now = conditions.now_us;
        let mut outcomes = Vec::new();
        let mut newly_unsynced = Vec::new();
        let mut spent: Vec<Spent> = Vec::new();
        let mut tightest: Option<(RuleId, Quota)> = None;
        let mut denial = None;
        let mut lease_exhausted = false;
        let mut delay_us = 0u64;

        for Enforced {
            id: index,
            rule,
            table,
        } in self.rules()
        {
            if rule.consistency == Consistency::Strict || !rule.matcher.matches(request) {
                continue;
            }
            for key in key::build(rule, request) {
                let fingerprint = table.fingerprint(&key);
                let limits = bucket_limits(rule);
                let step = store::update(store, &table.set_key(fingerprint), |set| {
                    let found = table.find(set, fingerprint);
                    let seen_us = found.as_ref().map(|r| r.seen_us);
                    let mut record = match found {
                        Some(record) => record,
                        None => table.find_or_fresh(set, fingerprint, limits, now),
                    };
                    let was_unsynced = record.unsynced();
                    let verdict = judge(rule, &mut record, conditions);
                    // A local denial changes nothing a later request could tell apart (the
                    // refill is a function of the stored stamp), so it skips the write, keeping
                    // the deny path to one read; it still refreshes the key's recency once a
                    // second.
                    let unchanged = !verdict.allowed
                        && rule.consistency == Consistency::Local
                        && seen_us.is_some_and(|seen| now.saturating_sub(seen) < RECENCY_US);
                    if unchanged {
                        return ((verdict, false), false);
                    }
                    record.seen_us = now;
                    table.store(set, &record, limits, now);
                    let dirty = rule.consistency != Consistency::Local
                        && !was_unsynced
                        && record.unsynced();
                    ((verdict, dirty), true)
                });
                let Ok((verdict, dirty)) = step else {
                    outcomes.push((index, Outcome::Unavailable));
                    continue;
                };
                if dirty {
                    newly_unsynced.push((index, key));
                }
                lease_exhausted |= verdict.spend == Spend::Lease && !verdict.allowed;
                if verdict.allowed {
                    delay_us = delay_us.max(verdict.delay_us);
                    spent.push(Spent {
                        rule: index,
                        fingerprint,
                        how: verdict.spend,
                    });
                    outcomes.push((index, Outcome::Allowed));
                    if tightest.is_none_or(|(_, q)| verdict.quota.remaining < q.remaining) {
                        tightest = Some((index, verdict.quota));
                    }
                } else if rule.mode == Mode::Shadow {
                    outcomes.push((index, Outcome::ShadowDenied));
                    tightest = Some((index, verdict.quota));
                } else {
                    outcomes.push((index, Outcome::Denied));
                    denial = Some(Decision::Deny {
                        rule: index,
                        quota: verdict.quota,
                        retry_after_us: verdict.retry_after_us,
                    });
                    break;
                }
            }
            if denial.is_some() {
                break;
            }
        }

        let decision = match denial {
            Some(deny) => {
                self.refund(&spent, store);
                spent.clear();
                deny
            }
            None => Decision::Allow { quota: tightest },
        };
        if !matches!(decision, Decision::Allow { .. }) {
            delay_us = 0;
        }
        Evaluation {
            decision,
            outcomes,
            newly_unsynced,
            spent,
            lease_exhausted,
            delay_us,
        }
    }

    /// The strict rules that match this request, with their keys: each needs one check.
    pub fn strict_keys(&self, request: &mut dyn RequestView) -> Vec<(RuleId, String)> {
        let mut keys = Vec::new();
        for Enforced {
            id: index, rule, ..
        } in self.rules()
        {
            if rule.consistency == Consistency::Strict && rule.matcher.matches(request) {
                keys.extend(
                    key::build(rule, request)
                        .into_iter()
                        .map(|key| (index, key)),
                );
            }
        }
        keys
    }

    /// A strict rule's answer when the counter service cannot give one: its fallback.
    pub fn fallback(
        &self,
        rule: RuleId,
        key: &str,
        now_us: u64,
        store: &mut dyn Store,
    ) -> Option<RuleAnswer> {
        let Enforced {
            rule: spec, table, ..
        } = self.rule(rule)?;
        let fingerprint = table.fingerprint(key);
        let limits = bucket_limits(spec);
        let conditions = Conditions {
            now_us,
            service_up: false,
        };
        let verdict = store::update(store, &table.set_key(fingerprint), |set| {
            let mut record = table.find_or_fresh(set, fingerprint, limits, now_us);
            let verdict = judge(spec, &mut record, conditions);
            record.seen_us = now_us;
            // Strict rules report nothing to the sync: their counts are already global.
            record.spent = 0;
            record.denied = 0;
            table.store(set, &record, limits, now_us);
            (verdict, true)
        })
        .ok()?;
        Some(RuleAnswer {
            allowed: verdict.allowed,
            quota: verdict.quota,
            retry_after_us: verdict.retry_after_us,
        })
    }

    /// Gives back the tokens a request spent (it was denied after they were spent).
    pub fn refund(&self, spent: &[Spent], store: &mut dyn Store) {
        for s in spent {
            self.refund_one(s.rule, s.fingerprint, s.how, store);
        }
    }

    fn refund_one(&self, index: RuleId, fingerprint: u64, how: Spend, store: &mut dyn Store) {
        let Some(Enforced { rule, table, .. }) = self.rule(index) else {
            return;
        };
        // Best effort: a refund that loses every race leaves the client one token short.
        let _ = store::update(store, &table.set_key(fingerprint), |set| {
            let Some(mut record) = table.find(set, fingerprint) else {
                return ((), false);
            };
            match how {
                Spend::Lease => {
                    record.lease = record.lease.saturating_add(1);
                    record.global_remaining = record.global_remaining.saturating_add(1);
                }
                Spend::Buckets => {
                    for (limit, mut state) in record.states(bucket_limits(rule)) {
                        state.give_back(limit, 1);
                    }
                }
            }
            if rule.consistency != Consistency::Local {
                record.spent = record.spent.saturating_sub(1);
            }
            table.store(set, &record, bucket_limits(rule), record.seen_us);
            ((), true)
        });
    }
}

/// The limits a rule's local buckets follow: its own when local, its fallback otherwise.
pub fn bucket_limits(rule: &Rule) -> &[Limit] {
    match (&rule.consistency, &rule.fallback) {
        (Consistency::Local, _) => &rule.limits,
        (_, Fallback::Open(limits)) => limits,
        (_, Fallback::Closed) => &[],
    }
}

/// One rule's answer for one record, spending on allow and counting for the sync.
fn judge(rule: &Rule, record: &mut Record, conditions: Conditions) -> RuleVerdict {
    let now = conditions.now_us;
    let synced = rule.consistency != Consistency::Local;
    let verdict = if synced && conditions.service_up && now < record.lease_until_us {
        let verdict = spend_lease(rule, record, now);
        if verdict.allowed {
            // The fallback buckets follow what this proxy spends, so a lapse of the lease
            // falls back to what is left locally, not to a fresh burst.
            for (limit, mut state) in record.states(bucket_limits(rule)) {
                state.spend(limit, now, 1);
            }
        }
        verdict
    } else {
        match (&rule.consistency, &rule.fallback) {
            (Consistency::Local, _) => spend_buckets(&rule.limits, record, now),
            (_, Fallback::Open(limits)) => {
                // The headers still advertise the rule's limit, not the fallback's.
                let mut verdict = spend_buckets(limits, record, now);
                verdict.quota.limit = first_limit(rule);
                verdict
            }
            (_, Fallback::Closed) => closed(first_limit(rule)),
        }
    };
    if synced {
        if verdict.allowed {
            record.spent = record.spent.saturating_add(1);
        } else {
            record.denied = record.denied.saturating_add(1);
        }
    }
    verdict
}

fn first_limit(rule: &Rule) -> Limit {
    rule.limits.first().copied().unwrap_or(Limit::UNIT)
}

/// A denial that spends nothing: the fail-closed answer.
fn closed(limit: Limit) -> RuleVerdict {
    RuleVerdict {
        allowed: false,
        quota: Quota {
            limit,
            remaining: 0,
            reset_us: 0,
        },
        retry_after_us: 1_000_000,
        spend: Spend::Buckets,
        delay_us: 0,
    }
}

/// Spends from the lease. The headers speak of the global bucket, as the service last
/// described it, less what this proxy spent since.
fn spend_lease(rule: &Rule, record: &mut Record, now: u64) -> RuleVerdict {
    let limit = first_limit(rule);
    let allowed = record.lease >= 1;
    if allowed {
        record.lease -= 1;
        record.global_remaining = record.global_remaining.saturating_sub(1);
    }
    let micros_per_token = limit.period().micros() / limit.requests();
    let until_reset = record.global_reset_at_us.saturating_sub(now);
    // A window's reset is the service's: its end (fixed), or when its count no longer weighs
    // (sliding); a token's time must not push it past the end of a fixed window.
    let windowed = limit.algorithm().windowed();
    let reset_us = if windowed {
        until_reset
    } else {
        until_reset.max(micros_per_token)
    };
    let retry_after_us = if allowed {
        0
    } else if !windowed || until_reset == 0 {
        // Denied with the lease spent: a token comes back at the global rate, and the next
        // lease no sooner than the next sync.
        micros_per_token
    } else if limit.algorithm() == Algorithm::FixedWindow && record.global_remaining == 0 {
        // The fixed window is used up, as far as this proxy knows: nothing before its end.
        until_reset
    } else {
        // Room may come sooner: others' unspent leases return at their next sync, and a
        // sliding window frees room as its previous window slides out (one request every
        // `period / requests` when it was full). Never later than the window's reset.
        micros_per_token.min(until_reset)
    };
    RuleVerdict {
        allowed,
        quota: Quota {
            limit,
            remaining: if allowed {
                record.global_remaining.max(record.lease) as u64
            } else {
                0
            },
            reset_us,
        },
        retry_after_us,
        spend: Spend::Lease,
        delay_us: 0,
    }
}

/// All limits must have the token; then each spends it.
fn spend_buckets(limits: &[Limit], record: &mut Record, now: u64) -> RuleVerdict {
    let mut verdicts: [Option<Verdict>; table::MAX_LIMITS] = [None; table::MAX_LIMITS];
    let mut allowed = true;
    for (i, (limit, mut state)) in record.states(limits).enumerate() {
        let verdict = state.check(limit, now, 1);
        allowed &= verdict.allowed;
        verdicts[i] = Some(verdict);
    }
    if allowed {
        for (i, (limit, mut state)) in record.states(limits).enumerate() {
            verdicts[i] = Some(state.admit(limit, now, 1));
        }
    }
    // The most restrictive limit speaks: when denying, the one that makes the client wait
    // longest; when allowing, the one with the fewest requests left.
    let mut chosen: Option<(Limit, Verdict)> = None;
    for (limit, verdict) in limits.iter().zip(verdicts.iter().flatten()) {
        let tighter = match chosen {
            None => true,
            Some((_, c)) if allowed => verdict.remaining < c.remaining,
            Some((_, c)) => !verdict.allowed && verdict.retry_after_us > c.retry_after_us,
        };
        if tighter && (allowed || !verdict.allowed) {
            chosen = Some((*limit, *verdict));
        }
    }
    let Some((limit, verdict)) = chosen else {
        // No limits: only a fail-closed fallback has none, and it never gets here.
        return closed(Limit::UNIT);
    };
    let delay_us = if allowed {
        verdicts
            .iter()
            .flatten()
            .map(|v| v.delay_us)
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    RuleVerdict {
        allowed,
        quota: Quota {
            limit,
            remaining: verdict.remaining,
            reset_us: verdict.reset_us,
        },
        retry_after_us: verdict.retry_after_us,
        spend: Spend::Buckets,
        delay_us,
    }
}
