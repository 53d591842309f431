//! The limiter: a validated [`Policy`] and the code that enforces it over a [`Store`].

pub mod decision;
pub mod key;

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::limit::table::{self, KeyHasher, Record, Table};
use crate::limit::token_bucket::Verdict;
use crate::limit::{Algorithm, Limit};
use crate::limiter::decision::{Decision, Evaluation, Outcome, Quota, Spend, Spent};
use crate::policy::RuleId;
use crate::policy::{Consistency, Fallback, LimitsFrom, Mode, Policy, Rule};
use crate::protocol::KeyAction;
use crate::request::RequestView;
use crate::store::{self, Store};
use crate::top::{RuleTop, Taken};

/// How stale a key's recency may get before a denial writes it anyway.
const RECENCY_US: u64 = 1_000_000;

/// What the limiter needs to know about the world besides the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conditions {
    /// Microseconds since the Unix epoch.
    pub now_us: u64,
    /// Whether the counter service is usable (circuit breaker not open).
    pub service_up: bool,
    /// When the breaker lets a probe through again (0: not open).
    pub service_back_us: u64,
    /// The load levels a rule's `scale` reads ([`crate::limit::dynamic`]).
    pub load: crate::limit::dynamic::Load,
}

/// A policy, ready to enforce.
#[derive(Debug, Clone)]
pub struct Limiter {
    policy: Policy,
    tables: Vec<Table>,
    /// Per rule: whether a denial may be remembered ([`Notes`]).
    notable: Vec<bool>,
    /// Whether any rule reads the client address ([`Policy::needs_client_ip`], asked on every
    /// request), and whether any rule is strict: worked out once.
    needs_client_ip: bool,
    strict: bool,
    /// Whether any rule takes concurrency slots ([`slot_lapse`]), and whether any counts by
    /// its answer's status (`count_when`): worked out once, so that requests of a policy
    /// without them skip their work at a stream's end.
    slots: bool,
    counts_by_status: bool,
    /// Whether some rule's limits follow the load ([`crate::limit::dynamic`]), and whether
    /// some rule answers a quota path: worked out once.
    scales: bool,
    quota_paths: bool,
    follows: bool,
    /// This worker's memory of recent denials.
    notes: std::cell::RefCell<Notes>,
    /// Buffers for a request's key and its set's store key, kept between requests so that
    /// building them allocates nothing.
    scratch: std::cell::RefCell<Scratch>,
    /// Per rule: this worker's sketches of the keys it admits and denies most (`None`: the rule
    /// has no `top_keys`). See [`crate::top`].
    top: std::cell::RefCell<Vec<Option<RuleTop>>>,
    /// Per rule (empty when no key has limits of its own: [`Policy::key_limits`]), the rule as
    /// each key with its own limits counts it, by the key's fingerprint in the rule's table.
    keyed: Vec<HashMap<u64, Arc<Rule>>>,
    /// The rules of `limits_from` as the values read made them, by rule and requests; at most
    /// [`MAX_VALUED`], forgotten all at once when full.
    valued: std::cell::RefCell<HashMap<(usize, u64), Arc<Rule>>>,
    /// Per rule with a `penalty`, the rule without it: how it counts its missing bucket
    /// ([`Limiter::penalizing`]).
    unpenalized: Vec<Option<Arc<Rule>>>,
}

/// Most rules made from values `limits_from` read that a limiter keeps.
const MAX_VALUED: usize = 256;

/// See [`Limiter`]'s `scratch`.
#[derive(Debug, Clone, Default)]
struct Scratch {
    key: String,
    set_key: String,
}

/// A worker's memory of recent local denials: until when a key of a rule stays denied. Nothing
/// but the refill can give such a key tokens back (the rule is local, and no refund, lease or
/// shaper can reach it: see [`notable`]), so a repeated request before then is denied with the
/// same answer without reading the shared key table, one host call and a set's copy fewer. A
/// note lasts at most [`RECENCY_US`], so a hot denied key still refreshes its record's recency.
#[derive(Debug, Clone, Default)]
pub struct Notes {
    denied: std::collections::HashMap<(usize, u64), Note, BuildFingerprintHasher>,
}

/// The notes' hasher: their keys are a rule's index and a fingerprint, already a keyed hash of
/// the key (see [`crate::limit::table::KeyHasher`]), so mixing the two words is enough.
type BuildFingerprintHasher = std::hash::BuildHasherDefault<FingerprintHasher>;

#[derive(Default)]
struct FingerprintHasher(u64);

impl std::hash::Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(29) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }
}

#[derive(Debug, Clone, Copy)]
struct Note {
    /// Until when the note may answer: the retry time, or sooner (see [`RECENCY_US`]).
    until_us: u64,
    retry_at_us: u64,
    reset_at_us: u64,
    limit: Limit,
}

/// Most notes a worker keeps; past it they are all forgotten at once.
const MAX_NOTES: usize = 4_096;

/// Whether a denial by `policy.rules[index]` may be remembered: a local, enforced rule whose
/// tokens only the refill brings back: no shaping limit (a cancelled delay gives back), no
/// later rule and no strict rule (their denials refund what it spent), no queue (a request
/// shed while it waits is refunded), no cost charged after the fact; no penalty (a key in its
/// penalty is told the penalty's time left, as the service tells it, not the denial's wait).
fn notable(policy: &Policy, index: usize) -> bool {
    let Some(rule) = policy.rules.get(index) else {
        return false;
    };
    let last = index + 1 == policy.rules.len();
    let strict = policy
        .rules
        .iter()
        .any(|r| r.consistency == Consistency::Strict);
    rule.consistency == Consistency::Local
        && rule.mode == Mode::Enforce
        && rule.ramp_percent >= 100
        && rule.cost_header.is_none()
        && rule.count_when.is_none()
        && rule.penalty_us == 0
        // A limit that follows load or time may rise before the noted wait is over.
        && rule.dynamic.is_none()
        && last
        && !strict
        && policy.shedding.is_none()
        && !rule.limits.iter().any(|l| {
            // A release frees a concurrency slot at any time.
            matches!(
                l.algorithm(),
                Algorithm::LeakyBucket | Algorithm::Concurrency
            )
        })
}

#[cfg_attr(test, derive(Debug, PartialEq))]
struct RuleVerdict {
    allowed: bool,
    quota: Quota,
    retry_after_us: u64,
    spend: Spend,
    /// A shaping limit holds the request this long before it leaves.
    delay_us: u64,
    /// Fail-closed without the service: the limiter could not decide.
    unavailable: bool,
    /// A fail-closed cached rule without a lease while the service is up: the service decides
    /// this request, as it does a strict rule's ([`ask`]).
    asks: bool,
}

/// A rule's verdict on one record, and what it means for the sync.
struct Counted {
    verdict: RuleVerdict,
    /// The key got its first count the service has not seen.
    dirty: bool,
    /// Denied on a spent lease while the global bucket is known to be empty: a round brought
    /// forward would bring nothing.
    hopeless: bool,
}

/// What [`Limiter::decide_into`] gathers over a request's rules and keys: written into the
/// caller's [`Evaluation`] as it goes (never built aside and moved: on the Wasm hot path a move
/// of a struct this size costs more than the fields it copies), and the denial or the tightest
/// answer, which [`Tally::finish`] makes the decision.
struct Tally<'e> {
    e: &'e mut Evaluation,
    /// The most restrictive answer among the rules that counted the request.
    tightest: Option<(RuleId, Quota)>,
    denial: Option<Decision>,
    /// Whether the denial's key is digested for the access log (`access_log`).
    digests: bool,
}

impl Tally<'_> {
    fn denied(&self) -> bool {
        matches!(self.denial, Some(Decision::Deny { .. }))
    }

    fn failed_closed(&self) -> bool {
        matches!(self.denial, Some(Decision::Unavailable { .. }))
    }

    fn admit(
        &mut self,
        (id, rule): (RuleId, &Rule),
        key: &str,
        fingerprint: u64,
        v: &RuleVerdict,
        now_us: u64,
    ) {
        self.e.delay_us = self.e.delay_us.max(v.delay_us);
        self.e.spent.push(Spent {
            rule: id,
            fingerprint,
            how: v.spend,
            cost: rule.cost.min(u32::MAX as u64) as u32,
            lapse_us: slot_lapse(rule, now_us),
            valued: rule.given,
        });
        if rule.cost_header.is_some() || rule.count_when.is_some() {
            self.e.chargeable.push((id, key.to_string()));
        }
        self.e.outcomes.push((id, Outcome::Allowed));
        // Of the rules that show their headers on admitted responses.
        if rule.answer.headers_admitted
            && self
                .tightest
                .is_none_or(|(_, q)| v.quota.remaining < q.remaining)
        {
            self.tightest = Some((id, v.quota));
        }
    }

    /// A key the service must decide ([`ask`]): checked once the other rules admit the request;
    /// the round brought forward (the key has no lease); charged the cost its response reports,
    /// if the check admits it.
    fn ask(&mut self, id: RuleId, rule: &Rule, key: &str) {
        self.e.asked.push((id, key.to_string()));
        if rule.cost_header.is_some() {
            self.e.chargeable.push((id, key.to_string()));
        }
    }

    /// A would-be denial that monitor, warn or the ramp lets through.
    fn let_through(&mut self, id: RuleId, rule: &Rule, key: &str, quota: Quota) {
        let outcome = if rule.mode == Mode::Warn {
            self.e.warned.push((id, key.to_string()));
            Outcome::Warned
        } else {
            Outcome::ShadowDenied
        };
        self.e.outcomes.push((id, outcome));
        self.tightest = Some((id, quota));
    }

    fn deny(&mut self, id: RuleId, key: &str, quota: Quota, retry_after_us: u64) {
        self.e.outcomes.push((id, Outcome::Denied));
        self.digest(key);
        self.denial = Some(Decision::Deny {
            rule: id,
            quota,
            retry_after_us,
        });
    }

    /// The denial is of `key`: its digest for the access log, if asked for (a SHA-256, so only
    /// then).
    fn digest(&mut self, key: &str) {
        if self.digests {
            self.e.denied_key = Some(key::KeyDigest::of(key));
        }
    }

    /// The evaluation: a denial gives back what the rules before it spent.
    fn finish(self, limiter: &Limiter, store: &mut dyn Store) {
        self.e.decision = match self.denial {
            Some(denial) => {
                limiter.refund(&self.e.spent, store);
                self.e.spent.clear();
                self.e.chargeable.clear();
                self.e.delay_us = 0;
                denial
            }
            None => Decision::Allow {
                quota: self.tightest,
            },
        };
    }
}

/// How long a key blocked without a ttl is told to wait: such a block lasts until an operator
/// lifts it.
pub const BLOCKED_RETRY_US: u64 = 60_000_000;
/// Longest wait a blocked key is told: the longest ttl the service takes (366 days), whatever
/// expiry a sync answer carries.
pub const MAX_BLOCKED_RETRY_US: u64 = 366 * 86_400 * 1_000_000;

/// How long a key whose block expires at `expires_ms` (Unix milliseconds; 0: no expiry) is told
/// to wait at `now_us`: the time the block has left (a block past its end, not yet lifted by a
/// sync, answers 0: the header says 1 s), at most [`MAX_BLOCKED_RETRY_US`]; without expiry,
/// [`BLOCKED_RETRY_US`].
pub fn blocked_retry_us(expires_ms: u64, now_us: u64) -> u64 {
    if expires_ms == 0 {
        return BLOCKED_RETRY_US;
    }
    expires_ms
        .saturating_mul(1_000)
        .saturating_sub(now_us)
        .min(MAX_BLOCKED_RETRY_US)
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
    /// Fail-closed without the service: not a rate limit (503).
    pub unavailable: bool,
}

/// The tick, in milliseconds, of a worker that serves shedding's wait queue or holds requests
/// for a leaky bucket.
pub const FINE_TICK_MS: u64 = 2;

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
        Limiter::with_tables(policy, tables)
    }

    /// A limiter for `policy`, which is `configured` with live overrides applied
    /// ([`crate::overrides::apply`]: the same rules in the same order). A rule whose limits keep
    /// the configured layout keeps its configured table, counts and all ([`Table::new`]); one
    /// whose layout an override changed counts in its rule's one table for overridden layouts
    /// ([`Table::live`]). So no sequence of overrides gives a rule more than two tables.
    pub fn with_overrides(policy: Policy, configured: &Policy, secret: [u64; 2]) -> Limiter {
        let hasher = KeyHasher::new(secret);
        let max_keys = policy.max_keys;
        let tables = policy
            .rules
            .iter()
            .enumerate()
            .map(|(i, rule)| {
                let limits = bucket_limits(rule);
                let kept = configured.rules.get(i).is_some_and(|c| {
                    c.name == rule.name
                        && Table::layout(bucket_limits(c), configured.max_keys)
                            == Table::layout(limits, max_keys)
                });
                if kept {
                    Table::new(&rule.name, limits, max_keys, hasher)
                } else {
                    Table::live(&rule.name, limits, max_keys, hasher)
                }
            })
            .collect();
        Limiter::with_tables(policy, tables)
    }

    fn with_tables(policy: Policy, tables: Vec<Table>) -> Limiter {
        let notable = (0..policy.rules.len())
            .map(|i| notable(&policy, i))
            .collect();
        let top = policy
            .rules
            .iter()
            .map(|r| (r.top_keys > 0).then(|| RuleTop::new(r.top_keys as usize)))
            .collect();
        let keyed = keyed_rules(&policy, &tables);
        let unpenalized = policy
            .rules
            .iter()
            .map(|rule| (rule.penalty_us > 0).then(|| Arc::new(rule.without_penalty())))
            .collect();
        Limiter {
            top: std::cell::RefCell::new(top),
            keyed,
            unpenalized,
            valued: Default::default(),
            needs_client_ip: policy.needs_client_ip(),
            strict: policy
                .rules
                .iter()
                .any(|r| r.consistency == Consistency::Strict),
            slots: policy.rules.iter().any(takes_slots),
            counts_by_status: policy.rules.iter().any(|r| r.count_when.is_some()),
            scales: policy
                .rules
                .iter()
                .any(|r| r.dynamic.as_ref().is_some_and(|d| d.scale.is_some())),
            quota_paths: policy.rules.iter().any(|r| r.quota_path.is_some()),
            follows: policy.rules.iter().any(|r| {
                r.quota_path.is_some() || r.dynamic.as_ref().is_some_and(|d| d.scale.is_some())
            }),
            policy,
            tables,
            notable,
            notes: Default::default(),
            scratch: Default::default(),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether a request may hold concurrency slots to give back at its stream's end: some
    /// rule has a concurrent limit.
    pub fn holds_slots(&self) -> bool {
        self.slots
    }

    /// Whether some rule counts its top keys (`top_keys`).
    pub fn counts_top(&self) -> bool {
        self.top.borrow().iter().any(Option::is_some)
    }

    /// Whether some rule counts by its answer's status (`count_when`).
    pub fn counts_by_status(&self) -> bool {
        self.counts_by_status
    }

    /// Whether some rule's limits follow the load level (its `scale`): the host then works out
    /// the levels for [`Conditions::load`].
    pub fn scales(&self) -> bool {
        self.scales
    }

    /// Whether some rule answers a quota path.
    pub fn has_quota_paths(&self) -> bool {
        self.quota_paths
    }

    /// Whether some rule's limits follow the load or some rule answers a quota path: the one
    /// test a request of a policy without them pays.
    pub fn follows(&self) -> bool {
        self.follows
    }

    /// The caller's own quota of each rule whose `quota_path` is `path`, its key computed as
    /// for a limited request (the tightest of its keys; none if a key part it skips is
    /// missing), under the limits that decide its requests (the rule as [`Limiter::counted_as`]
    /// makes it for the request, then as [`Limiter::keyed`] for each key): what the rule would
    /// tell it now, spending nothing and writing nothing. `None` when no rule answers `path`.
    pub fn quotas(
        &self,
        path: &str,
        request: &mut dyn RequestView,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Option<Vec<(RuleId, Option<Quota>)>> {
        let mut found: Option<Vec<(RuleId, Option<Quota>)>> = None;
        for Enforced { id, rule, table } in self.rules() {
            if rule.quota_path.as_deref() != Some(path) {
                continue;
            }
            let valued = self.counted_as(id, rule, request);
            let rule = valued.as_deref().unwrap_or(rule);
            let mut tightest: Option<Quota> = None;
            for key in key::keys(rule, request) {
                // An operator's override of the key decides it as it decides its requests: an
                // allowed key is not limited by the rule, a blocked one has nothing left until
                // its block ends.
                let quota = match self.policy.key_override_until(rule, &key) {
                    Some((KeyAction::Allow, _)) => continue,
                    Some((KeyAction::Block, expires_ms)) => Quota {
                        limit: first_limit(rule),
                        remaining: 0,
                        reset_us: blocked_retry_us(expires_ms, conditions.now_us),
                    },
                    None => {
                        let fingerprint = table.fingerprint(&key);
                        let rule = self.keyed(id, rule, fingerprint);
                        self.quota_of(rule, table, fingerprint, conditions, store)
                    }
                };
                if tightest.is_none_or(|t| quota.remaining < t.remaining) {
                    tightest = Some(quota);
                }
            }
            found.get_or_insert_with(Vec::new).push((id, tightest));
        }
        found
    }

    /// What `rule` would tell the key of `fingerprint` now: for each limit in force, its state
    /// read without a cost, the fewest remaining answering. Reads the key's record and writes
    /// nothing.
    fn quota_of(
        &self,
        rule: &Rule,
        table: &Table,
        fingerprint: u64,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Quota {
        let now = conditions.now_us;
        let in_force = in_force(rule, conditions);
        let limits = in_force.as_slice();
        let read = store::update(store, &table.set_key(fingerprint), |set| {
            let mut record = table.find_or_fresh(set, fingerprint, bucket_limits(rule), now);
            let mut quota: Option<Quota> = None;
            for (limit, mut state) in record.states(limits) {
                let v = state.check(limit, now, 0);
                if quota.is_none_or(|q| v.remaining < q.remaining) {
                    quota = Some(Quota {
                        limit: *limit,
                        remaining: v.remaining,
                        reset_us: v.reset_us,
                    });
                }
            }
            if record.penalty_until_us > now && rule.penalty_us > 0 {
                let wait = (record.penalty_until_us - now).min(rule.penalty_us);
                quota = quota.map(|q| Quota {
                    remaining: 0,
                    reset_us: q.reset_us.max(wait),
                    ..q
                });
            }
            (quota, false)
        });
        read.ok().flatten().unwrap_or(Quota {
            limit: first_limit(rule),
            remaining: first_limit(rule).burst(),
            reset_us: 0,
        })
    }

    /// [`Policy::needs_client_ip`], worked out when the limiter was made.
    pub fn needs_client_ip(&self) -> bool {
        self.needs_client_ip
    }

    /// The one tick period, in milliseconds, a worker asks of its host: the finest any part
    /// needs. Shedding's wait queue and a leaky bucket's held requests are served every
    /// [`FINE_TICK_MS`]; the sync ticks at a tenth of its interval (5 ms to 1 s); otherwise the
    /// key tables' heartbeat. Set once: nginx (ngx_wasm_module) traps a second
    /// `proxy_set_tick_period_milliseconds`, Envoy would keep the last.
    pub fn tick_ms(&self) -> u64 {
        let policy = &self.policy;
        let shapes = self.rules().any(|r| {
            r.rule
                .limits
                .iter()
                .any(|l| l.algorithm() == crate::Algorithm::LeakyBucket)
        });
        if policy.shedding.is_some() || shapes {
            return FINE_TICK_MS;
        }
        match policy.service.as_ref().filter(|_| policy.needs_service()) {
            Some(service) => (service.sync_interval_ms / 10).clamp(5, 1_000),
            None => crate::limit::registry::HEARTBEAT_EVERY_US / 1_000,
        }
    }

    /// The rule `id` names, with its table.
    pub fn rule(&self, id: RuleId) -> Option<Enforced<'_>> {
        let rule = self.policy.rule(id)?;
        let table = self.tables.get(id.index())?;
        Some(Enforced { id, rule, table })
    }

    /// The rule `id` names as it counts `key`: with the key's own limits when an operator gave
    /// it some ([`Policy::key_limits`]), else as configured; without its penalty for its missing
    /// bucket ([`Limiter::penalizing`]); with its table.
    pub fn rule_for(&self, id: RuleId, key: &str) -> Option<Enforced<'_>> {
        let mut enforced = self.rule(id)?;
        if !self.keyed.is_empty() {
            enforced.rule = self.keyed(id, enforced.rule, enforced.table.fingerprint(key));
        }
        if let Cow::Borrowed(rule) = self.penalizing(id, enforced.rule, key) {
            enforced.rule = rule;
        }
        Some(enforced)
    }

    /// `rule` (rule `id`, as configured, as a key's own limits or a request's value made it) as
    /// it counts `key`: without its penalty when `key` is the rule's missing bucket
    /// ([`key::in_missing_bucket`]): that bucket is every client's without the part, and one
    /// client's failures must not lock them all out for the penalty's length. So the proxy
    /// starts none, asks the service for none (a sync entry or a check carries no penalty) and
    /// takes none the service answers. One test for a rule without a penalty.
    #[inline]
    fn penalizing<'a>(&'a self, id: RuleId, rule: &'a Rule, key: &str) -> Cow<'a, Rule> {
        if rule.penalty_us == 0 || !key::in_missing_bucket(key) {
            return Cow::Borrowed(rule);
        }
        self.unpenalized(id, rule)
    }

    /// [`Limiter::penalizing`]'s rule without its penalty: made once for a rule as configured;
    /// a copy for one a request's `limits_from` value made (a key's own limits are made without
    /// it for a missing bucket: [`keyed_rules`]).
    #[cold]
    fn unpenalized<'a>(&'a self, id: RuleId, rule: &'a Rule) -> Cow<'a, Rule> {
        let configured = self.policy.rule(id).is_some_and(|c| std::ptr::eq(c, rule));
        match self.unpenalized.get(id.index()).and_then(Option::as_deref) {
            Some(twin) if configured => Cow::Borrowed(twin),
            _ => Cow::Owned(rule.without_penalty()),
        }
    }

    /// `rule` (rule `id`) as it counts the key of `fingerprint`: with the key's own limits, if
    /// it has some. One test for a policy without them.
    #[inline]
    fn keyed<'a>(&'a self, id: RuleId, rule: &'a Rule, fingerprint: u64) -> &'a Rule {
        if self.keyed.is_empty() {
            return rule;
        }
        self.keyed
            .get(id.index())
            .and_then(|keys| keys.get(&fingerprint))
            .map_or(rule, |keyed| keyed)
    }

    /// Rule `id` (`rule`) as `request` sets its limits, before any key's own: with the limit its
    /// `limits_from` value gives; `None` when it counts as configured. One test for a rule without
    /// `limits_from`.
    #[inline]
    fn counted_as(
        &self,
        id: RuleId,
        rule: &Rule,
        request: &mut dyn RequestView,
    ) -> Option<Arc<Rule>> {
        match &rule.limits_from {
            None => None,
            Some(from) => self.valued(id, rule, from, request),
        }
    }

    /// Rule `id` (`rule`, whose `limits_from` is `from`) as `request` sets its limit: `None` when
    /// the request has no usable value, or the value gives the rule's own limit.
    #[inline(never)]
    fn valued(
        &self,
        id: RuleId,
        rule: &Rule,
        from: &LimitsFrom,
        request: &mut dyn RequestView,
    ) -> Option<Arc<Rule>> {
        let own = rule.limits.first()?;
        let values = from.from.values(request);
        let limit = from.limit(own, values.first().map(String::as_str), rule.cost)?;
        self.made(id, rule, limit)
    }

    /// Rule `id` (`rule`) with `limit` in place of its one limit: `None` when it is its own.
    fn made(&self, id: RuleId, rule: &Rule, limit: Limit) -> Option<Arc<Rule>> {
        if rule.limits.first() == Some(&limit) {
            return None;
        }
        let mut valued = self.valued.borrow_mut();
        if let Some(made) = valued.get(&(id.index(), limit.requests())) {
            return Some(made.clone());
        }
        if valued.len() >= MAX_VALUED {
            valued.clear();
        }
        let mut made = rule.clone();
        made.limits = vec![limit];
        // Limits of `limits_from` are at most MAX_TOKENS (2^31).
        made.given = limit.requests().min(u32::MAX as u64) as u32;
        let made = Arc::new(made);
        valued.insert((id.index(), limit.requests()), made.clone());
        Some(made)
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
    /// do (a rule that spent is refunded when a later rule denies). Once a rule denies, the
    /// rules after it are asked how long they would make the client wait, uncharged, and the
    /// longest wait answers. Strict rules are the exchange's: they need the service.
    pub fn decide(
        &self,
        request: &mut dyn RequestView,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Evaluation {
        let mut evaluation = Evaluation::default();
        self.decide_into(request, conditions, store, &mut evaluation);
        evaluation
    }

    /// [`decide`](Self::decide), written into `evaluation`, which must be empty (as
    /// [`Evaluation::default`] makes it): the exchange keeps it where it lives.
    pub fn decide_into(
        &self,
        request: &mut dyn RequestView,
        conditions: Conditions,
        store: &mut dyn Store,
        evaluation: &mut Evaluation,
    ) {
        self.decide_except(None, request, conditions, store, evaluation);
    }

    /// [`decide_into`](Self::decide_into), but for a request of the quota path `probe`
    /// ([`Limiter::quotas`]): every rule that matches it decides it as any request, except
    /// those answering `probe`, which read the key they report and spend nothing of it. A
    /// request that is not a quota path's (`None`) pays one test a matching rule for it.
    pub fn decide_except(
        &self,
        probe: Option<&str>,
        request: &mut dyn RequestView,
        conditions: Conditions,
        store: &mut dyn Store,
        evaluation: &mut Evaluation,
    ) {
        let mut tally = Tally {
            e: evaluation,
            tightest: None,
            denial: None,
            digests: self.policy.access_log,
        };
        for Enforced { id, rule, table } in self.rules() {
            if rule.consistency == Consistency::Strict || !rule.applies(request) {
                continue;
            }
            if probe.is_some() && rule.quota_path.as_deref() == probe {
                continue;
            }
            let valued = self.counted_as(id, rule, request);
            let rule = valued.as_deref().unwrap_or(rule);
            // The key is built in this worker's buffer (given back below), and so is its set's
            // store key: a request of a single-keyed rule allocates neither.
            let buffer = std::mem::take(&mut self.scratch.borrow_mut().key);
            let keys = key::keys_in(rule, request, buffer);
            for key in keys.iter() {
                if tally.denied() {
                    self.ask_wait(&mut tally, (id, rule), key, conditions, store);
                } else {
                    let before = tally.e.outcomes.len();
                    let fingerprint = self.decide_key(
                        &mut tally,
                        Enforced { id, rule, table },
                        key,
                        conditions,
                        store,
                    );
                    // A rule without `top_keys` pays this test alone.
                    if rule.top_keys > 0 {
                        let enforced = Enforced { id, rule, table };
                        self.count_top(enforced, key, fingerprint, &tally, before);
                    }
                }
                if tally.failed_closed() {
                    break;
                }
            }
            if let key::Keys::One(buffer) = keys {
                self.scratch.borrow_mut().key = buffer;
            }
            if tally.failed_closed() {
                break;
            }
        }
        tally.finish(self, store);
    }

    /// Counts `key` in its rule's sketches by the outcome [`Limiter::decide_key`] left for it
    /// (past `before`): admitted, or denied (a would-be denial of monitor, warn or the ramp
    /// included). A key the service decides (a fail-closed rule's check) is counted by neither.
    #[cold]
    fn count_top(
        &self,
        enforced: Enforced<'_>,
        key: &str,
        fingerprint: u64,
        tally: &Tally,
        before: usize,
    ) {
        let Some(&(id, outcome)) = tally.e.outcomes.get(before) else {
            return;
        };
        if id != enforced.id {
            return;
        }
        let mut top = self.top.borrow_mut();
        let Some(Some(sketches)) = top.get_mut(id.index()) else {
            return;
        };
        let fingerprint = match fingerprint {
            0 => enforced.table.fingerprint(key),
            known => known,
        };
        match outcome {
            Outcome::Allowed => sketches.admitted.offer(fingerprint, key),
            Outcome::Denied | Outcome::ShadowDenied | Outcome::Warned => {
                sketches.denied.offer(fingerprint, key)
            }
            Outcome::Uncounted | Outcome::FailedClosed => {}
        }
    }

    /// This worker's summaries of each rule with `top_keys` that counted something since the
    /// last take, its sketches emptied: what it adds to its proxy's ([`crate::top::publish`]) or
    /// logs.
    pub fn take_top(&self) -> Vec<(RuleId, Taken)> {
        self.top
            .borrow_mut()
            .iter_mut()
            .enumerate()
            .filter_map(|(i, t)| Some((RuleId::new(i), t.as_mut()?.take()?)))
            .collect()
    }

    /// A request already denied: how long `rule` would make it wait for `key`, uncharged; the
    /// longest wait answers.
    fn ask_wait(
        &self,
        tally: &mut Tally,
        (rule, spec): (RuleId, &Rule),
        key: &str,
        conditions: Conditions,
        store: &mut dyn Store,
    ) {
        if let Some(Decision::Deny {
            rule: by,
            quota: told,
            retry_after_us: wait,
        }) = &mut tally.denial
        {
            if let Some((quota, longer)) = self.wait_of(rule, spec, key, conditions, store) {
                if longer > *wait {
                    (*by, *told, *wait) = (rule, quota, longer);
                    tally.digest(key);
                }
            }
        }
    }

    /// One key of one rule: an operator's override, else a remembered denial, else the key's
    /// record counted in the store; the rule's answer goes into the tally. Answers the key's
    /// fingerprint (0 when an override decided it without one), for its rule's top keys.
    fn decide_key(
        &self,
        tally: &mut Tally,
        Enforced { id, rule, table }: Enforced<'_>,
        key: &str,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> u64 {
        let now = conditions.now_us;
        match self.policy.key_override_until(rule, key) {
            Some((KeyAction::Allow, _)) => {
                tally.e.outcomes.push((id, Outcome::Allowed));
                return 0;
            }
            Some((KeyAction::Block, expires_ms)) => {
                tally.e.outcomes.push((id, Outcome::Denied));
                tally.denial = Some(blocked(rule, id, expires_ms, now));
                tally.digest(key);
                return 0;
            }
            None => {}
        }
        let fingerprint = table.fingerprint(key);
        let rule = self.keyed(id, rule, fingerprint);
        let counted = self.penalizing(id, rule, key);
        let rule: &Rule = &counted;
        let notable = self.notable.get(id.index()).copied().unwrap_or(false);
        if notable {
            if let Some((quota, retry_after_us)) = self.noted(id, fingerprint, now) {
                tally.deny(id, key, quota, retry_after_us);
                return fingerprint;
            }
        }
        let Ok(Counted {
            verdict,
            dirty,
            hopeless,
        }) = self.count(rule, table, fingerprint, conditions, store)
        else {
            tally.e.outcomes.push((id, Outcome::Uncounted));
            return fingerprint;
        };
        if dirty {
            tally.e.newly_unsynced.push((id, key.to_string()));
        }
        if verdict.asks {
            tally.ask(id, rule, key);
            return fingerprint;
        }
        tally.e.lease_exhausted |= verdict.spend == Spend::Lease && !verdict.allowed && !hopeless;
        if verdict.allowed {
            tally.admit((id, rule), key, fingerprint, &verdict, now);
        } else if verdict.unavailable && rule.mode == Mode::Enforce {
            tally.e.outcomes.push((id, Outcome::FailedClosed));
            tally.denial = Some(Decision::Unavailable {
                rule: id,
                retry_after_us: verdict.retry_after_us,
            });
            tally.digest(key);
        } else if !enforced(rule, key, now) {
            tally.let_through(id, rule, key, verdict.quota);
        } else {
            if notable {
                self.note(id, fingerprint, now, &verdict);
            }
            tally.deny(id, key, verdict.quota, verdict.retry_after_us);
        }
        fingerprint
    }

    /// Counts a request against the record of `fingerprint` in `rule`'s table: one
    /// compare-and-swap step on its set.
    fn count(
        &self,
        rule: &Rule,
        table: &Table,
        fingerprint: u64,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Result<Counted, store::StoreError> {
        let now = conditions.now_us;
        let limits = bucket_limits(rule);
        let mut set_key = std::mem::take(&mut self.scratch.borrow_mut().set_key);
        table.set_key_into(fingerprint, &mut set_key);
        let step = store::update(store, &set_key, |set| {
            let found = table.find(set, fingerprint);
            let seen_us = found.as_ref().map(|r| r.seen_us);
            let mut record = match found {
                Some(record) => record,
                None => table.find_or_fresh(set, fingerprint, limits, now),
            };
            let was_unsynced = record.unsynced();
            let penalty_was = record.penalty_until_us;
            // A `count_when` rule's request holds its cost while it is in flight, as any
            // request's: its answer's status keeps it or gives it back (`Exchange::finish`).
            let verdict = judge(rule, &mut record, conditions);
            // A local denial changes nothing a later request could tell apart (the refill is a
            // function of the stored stamp), so it skips the write, keeping the deny path to one
            // read; it still refreshes the key's recency once a second. A key seen later than
            // now (the clock was stepped back) is written, so its buckets keep the new time.
            let unchanged = !verdict.allowed
                && rule.consistency == Consistency::Local
                && record.penalty_until_us == penalty_was
                && seen_us.is_some_and(|seen| {
                    now.saturating_sub(seen) < RECENCY_US
                        && seen <= now.saturating_add(crate::limit::token_bucket::CLOCK_STEP_US)
                });
            if unchanged {
                let counted = Counted {
                    verdict,
                    dirty: false,
                    hopeless: false,
                };
                return (counted, false);
            }
            // A lease that ran out while the global bucket is known to be empty: a round
            // brought forward could only bring an empty lease (the key's report waits too, by
            // the same test: `Record::globally_empty`).
            let hopeless = !verdict.allowed
                && verdict.spend == Spend::Lease
                && match rule.limits.as_slice() {
                    [limit] if !limit.algorithm().windowed() => record.globally_empty(limit, now),
                    _ => false,
                };
            record.seen_us = now;
            table.store(set, &record, limits, now);
            let dirty =
                rule.consistency != Consistency::Local && !was_unsynced && record.unsynced();
            let counted = Counted {
                verdict,
                dirty,
                hopeless,
            };
            (counted, true)
        });
        self.scratch.borrow_mut().set_key = set_key;
        step
    }

    /// How long rule `index` (`rule`, as this request's value made it) would make a request of
    /// `key` wait, were it asked at `conditions`:
    /// `None` if it would admit it (or not enforce its denial, or cannot tell). Reads the key's
    /// record, charges and writes nothing: the wait of a rule after the one that denied.
    fn wait_of(
        &self,
        index: RuleId,
        rule: &Rule,
        key: &str,
        conditions: Conditions,
        store: &mut dyn Store,
    ) -> Option<(Quota, u64)> {
        let table = self.table(index)?;
        let now = conditions.now_us;
        match self.policy.key_override_until(rule, key) {
            Some((KeyAction::Allow, _)) => return None,
            Some((KeyAction::Block, expires_ms)) => {
                return match blocked(rule, index, expires_ms, now) {
                    Decision::Deny {
                        quota,
                        retry_after_us,
                        ..
                    } => Some((quota, retry_after_us)),
                    _ => None,
                };
            }
            None => {}
        }
        if !enforced(rule, key, now) {
            return None;
        }
        let fingerprint = table.fingerprint(key);
        let rule = self.keyed(index, rule, fingerprint);
        let counted = self.penalizing(index, rule, key);
        let rule: &Rule = &counted;
        if self.notable.get(index.index()).copied().unwrap_or(false) {
            if let Some(noted) = self.noted(index, fingerprint, now) {
                return Some(noted);
            }
        }
        let limits = bucket_limits(rule);
        let mut set_key = std::mem::take(&mut self.scratch.borrow_mut().set_key);
        table.set_key_into(fingerprint, &mut set_key);
        let verdict = store::update(store, &set_key, |set| {
            let mut record = table.find_or_fresh(set, fingerprint, limits, now);
            (judge(rule, &mut record, conditions), false)
        });
        self.scratch.borrow_mut().set_key = set_key;
        let verdict = verdict.ok()?;
        (!verdict.allowed && !verdict.unavailable && !verdict.asks)
            .then_some((verdict.quota, verdict.retry_after_us))
    }

    /// A remembered denial of `fingerprint` by `rule`, still in force at `now`: its answer then.
    fn noted(&self, rule: RuleId, fingerprint: u64, now: u64) -> Option<(Quota, u64)> {
        let mut notes = self.notes.borrow_mut();
        let key = (rule.index(), fingerprint);
        let note = *notes.denied.get(&key)?;
        if now >= note.until_us || now < note.until_us.saturating_sub(RECENCY_US) {
            notes.denied.remove(&key);
            return None;
        }
        let quota = Quota {
            limit: note.limit,
            remaining: 0,
            reset_us: note.reset_at_us.saturating_sub(now),
        };
        Some((quota, note.retry_at_us.saturating_sub(now)))
    }

    /// Remembers a denial until a request could be admitted (at most [`RECENCY_US`]).
    fn note(&self, rule: RuleId, fingerprint: u64, now: u64, verdict: &RuleVerdict) {
        if verdict.retry_after_us == 0 || verdict.unavailable {
            return;
        }
        let mut notes = self.notes.borrow_mut();
        if notes.denied.len() >= MAX_NOTES {
            notes.denied.clear();
        }
        notes.denied.insert(
            (rule.index(), fingerprint),
            Note {
                // Saturating: a corrupt record can report any wait.
                until_us: now.saturating_add(verdict.retry_after_us.min(RECENCY_US)),
                retry_at_us: now.saturating_add(verdict.retry_after_us),
                reset_at_us: now.saturating_add(verdict.quota.reset_us),
                limit: verdict.quota.limit,
            },
        );
    }

    /// The strict rules that match this request, with their keys: each needs one check.
    pub fn strict_keys(&self, request: &mut dyn RequestView) -> Vec<(RuleId, String)> {
        let mut keys = Vec::new();
        if !self.strict {
            return keys;
        }
        for Enforced {
            id: index, rule, ..
        } in self.rules()
        {
            if rule.consistency == Consistency::Strict && rule.applies(request) {
                keys.extend(key::keys(rule, request).into_iter().map(|key| (index, key)));
            }
        }
        keys
    }

    /// A strict rule's answer when the counter service cannot give one: its fallback. Also a
    /// fail-closed cached rule's whose check failed ([`ask`]): its 503, its record's counts kept
    /// for the sync.
    pub fn fallback(
        &self,
        rule: RuleId,
        key: &str,
        now_us: u64,
        service_back_us: u64,
        store: &mut dyn Store,
    ) -> Option<RuleAnswer> {
        let Enforced {
            rule: spec, table, ..
        } = self.rule(rule)?;
        let fingerprint = table.fingerprint(key);
        let spec = self.keyed(rule, spec, fingerprint);
        let counted = self.penalizing(rule, spec, key);
        let spec: &Rule = &counted;
        let limits = bucket_limits(spec);
        let conditions = Conditions {
            now_us,
            service_up: false,
            service_back_us,
            load: Default::default(),
        };
        let verdict = store::update(store, &table.set_key(fingerprint), |set| {
            let mut record = table.find_or_fresh(set, fingerprint, limits, now_us);
            let counts = (record.spent, record.denied);
            let verdict = judge(spec, &mut record, conditions);
            record.seen_us = now_us;
            // Strict rules report nothing to the sync: their counts are already global. A
            // cached rule's are the sync's, announced already: none is added unannounced.
            (record.spent, record.denied) = match spec.consistency {
                Consistency::Strict => (0, 0),
                _ => counts,
            };
            table.store(set, &record, limits, now_us);
            (verdict, true)
        })
        .ok()?;
        Some(RuleAnswer {
            allowed: verdict.allowed,
            quota: verdict.quota,
            retry_after_us: verdict.retry_after_us,
            unavailable: verdict.unavailable,
        })
    }

    /// A cached key the service denied with a check ([`ask`]): if the key has a lease now (its
    /// sync answered while the check was out, and the check set that lease aside as another
    /// proxy's), the request is spent from it when it holds the cost: the answer and what to
    /// give back if a strict rule denies after all, and whether the key got its first unsynced
    /// count (to announce it). `None` otherwise: the check's answer stands.
    pub fn leased(
        &self,
        rule: RuleId,
        key: &str,
        now_us: u64,
        store: &mut dyn Store,
    ) -> Option<(RuleAnswer, Spent, bool)> {
        let Enforced {
            rule: spec, table, ..
        } = self.rule(rule)?;
        if spec.consistency != Consistency::Cached {
            return None;
        }
        let fingerprint = table.fingerprint(key);
        let spec = self.keyed(rule, spec, fingerprint);
        let counted = self.penalizing(rule, spec, key);
        let spec: &Rule = &counted;
        let limits = bucket_limits(spec);
        let verdict = store::update(store, &table.set_key(fingerprint), |set| {
            let Some(mut record) = table.find(set, fingerprint) else {
                return (None, false);
            };
            if now_us >= record.lease_until_us
                || record.lease < spec.cost.min(u32::MAX as u64) as u32
            {
                return (None, false);
            }
            let conditions = Conditions {
                now_us,
                service_up: true,
                service_back_us: 0,
                load: Default::default(),
            };
            let was_unsynced = record.unsynced();
            let verdict = judge(spec, &mut record, conditions);
            record.seen_us = now_us;
            table.store(set, &record, limits, now_us);
            let dirty = !was_unsynced && record.unsynced();
            (Some((verdict, dirty)), true)
        })
        .ok()??;
        let (verdict, dirty) = verdict;
        let spent = Spent {
            rule,
            fingerprint,
            how: verdict.spend,
            cost: spec.cost.min(u32::MAX as u64) as u32,
            lapse_us: 0,
            valued: 0,
        };
        let answer = RuleAnswer {
            allowed: verdict.allowed,
            quota: verdict.quota,
            retry_after_us: verdict.retry_after_us,
            unavailable: verdict.unavailable,
        };
        verdict.allowed.then_some((answer, spent, dirty))
    }

    /// The demand of an asked key ([`ask`]) once its check is answered: counted as `denied`
    /// (demand no lease covered), so the key's next sync brings a lease sized for it. Not
    /// before: a sync that carried the key while its check was out could lease the key's tokens
    /// to this proxy before the check reached Redis, and the check, setting that lease aside as
    /// any proxy's, would deny the request the lease was for. Returns whether the key got its
    /// first unsynced count (to announce it).
    pub fn demand(&self, rule: RuleId, key: &str, now_us: u64, store: &mut dyn Store) -> bool {
        let Some(Enforced {
            rule: spec, table, ..
        }) = self.rule(rule)
        else {
            return false;
        };
        if spec.consistency != Consistency::Cached {
            return false;
        }
        let fingerprint = table.fingerprint(key);
        let spec = self.keyed(rule, spec, fingerprint);
        let limits = bucket_limits(spec);
        let cost = spec.cost.min(u32::MAX as u64) as u32;
        store::update(store, &table.set_key(fingerprint), |set| {
            let mut record = match table.find(set, fingerprint) {
                Some(record) => record,
                None => table.find_or_fresh(set, fingerprint, limits, now_us),
            };
            let was_unsynced = record.unsynced();
            record.denied = record.denied.saturating_add(cost);
            record.seen_us = now_us;
            table.store(set, &record, limits, now_us);
            (!was_unsynced && record.unsynced(), true)
        })
        .unwrap_or(false)
    }

    /// Charges `cost` more to a key a request of `rule` was admitted on (the cost its response
    /// reported): spent whatever is left, so a key can go into debt; the next requests wait for
    /// it. Cached rules report it to the service with their next sync. Returns whether the key
    /// got its first unsynced count (to announce it).
    pub fn charge(
        &self,
        rule: RuleId,
        key: &str,
        cost: u64,
        now_us: u64,
        store: &mut dyn Store,
    ) -> bool {
        let Some(Enforced {
            rule: spec, table, ..
        }) = self.rule(rule)
        else {
            return false;
        };
        let fingerprint = table.fingerprint(key);
        let spec = self.keyed(rule, spec, fingerprint);
        let limits = bucket_limits(spec);
        store::update(store, &table.set_key(fingerprint), |set| {
            let mut record = table.find_or_fresh(set, fingerprint, limits, now_us);
            let was_unsynced = record.unsynced();
            for (limit, mut state) in record.states(limits) {
                state.charge(limit, now_us, cost);
            }
            if spec.consistency != Consistency::Local {
                record.lease = record
                    .lease
                    .saturating_sub(cost.min(u32::MAX as u64) as u32);
                record.global_remaining = record
                    .global_remaining
                    .saturating_sub(cost.min(u32::MAX as u64) as u32);
                record.spent = record
                    .spent
                    .saturating_add(cost.min(u32::MAX as u64) as u32);
            }
            record.seen_us = now_us;
            table.store(set, &record, limits, now_us);
            let newly = spec.consistency != Consistency::Local && !was_unsynced;
            (newly, true)
        })
        .unwrap_or(false)
    }

    /// Gives back the tokens a request spent (it was denied after they were spent), and the
    /// slots it took.
    pub fn refund(&self, spent: &[Spent], store: &mut dyn Store) {
        for s in spent {
            self.refund_one(s, store);
        }
    }

    /// The stream of a request admitted with `spent` ended, however it ended: the concurrency
    /// slots it took go back (its rate-limit tokens stay spent).
    pub fn release(&self, spent: &[Spent], store: &mut dyn Store) {
        for s in spent.iter().filter(|s| s.lapse_us != 0) {
            self.refund_one(s, store);
        }
    }

    fn refund_one(&self, spent: &Spent, store: &mut dyn Store) {
        let Spent {
            rule: index,
            fingerprint,
            how,
            cost,
            lapse_us,
            valued: spent_under,
        } = *spent;
        let (cost32, cost) = (cost, cost as u64);
        let Some(Enforced { rule, table, .. }) = self.rule(index) else {
            return;
        };
        let rule = self.keyed(index, rule, fingerprint);
        // Given back under the limit the request's value gave, as it was spent.
        let valued = match (&rule.limits_from, spent_under) {
            (Some(_), requests) if requests > 0 => rule
                .limits
                .first()
                .and_then(|own| own.with_requests(requests as u64))
                .and_then(|limit| self.made(index, rule, limit)),
            _ => None,
        };
        let rule = valued.as_deref().unwrap_or(rule);
        // Best effort: a refund that loses every race leaves the client one token short.
        let _ = store::update(store, &table.set_key(fingerprint), |set| {
            let Some(mut record) = table.find(set, fingerprint) else {
                return ((), false);
            };
            match how {
                Spend::Lease => {
                    record.lease = record.lease.saturating_add(cost32);
                    record.global_remaining = record.global_remaining.saturating_add(cost32);
                }
                Spend::Buckets => {
                    for (limit, mut state) in record.states(bucket_limits(rule)) {
                        state.release(limit, cost, lapse_us);
                    }
                }
            }
            if rule.consistency != Consistency::Local {
                record.spent = record.spent.saturating_sub(cost32);
            }
            table.store(set, &record, bucket_limits(rule), record.seen_us);
            ((), true)
        });
    }
}

/// When the slot a request of `rule` admitted at `now_us` takes lapses, for a concurrency rule
/// (its one limit is one; local only): what names the slot for its release. 0 otherwise.
fn slot_lapse(rule: &Rule, now_us: u64) -> u64 {
    match rule.limits.as_slice() {
        [limit] if limit.algorithm() == Algorithm::Concurrency => {
            crate::limit::concurrency::lapse_us(limit, now_us)
        }
        _ => 0,
    }
}

/// Per rule of `policy`, the rule as each key an operator gave its own limits counts it
/// ([`Rule::with_key_limits`]), by the key's fingerprint in the rule's table (a
/// rule with tiers: every tier, each keying as `rule/tier`). Empty when no key has limits.
fn keyed_rules(policy: &Policy, tables: &[Table]) -> Vec<HashMap<u64, Arc<Rule>>> {
    if policy.key_limits.is_empty() {
        return Vec::new();
    }
    policy
        .rules
        .iter()
        .zip(tables)
        .map(|(rule, table)| {
            let configured = rule
                .tier
                .as_ref()
                .map_or(rule.name.as_str(), |t| t.rule.as_str());
            let Some(keys) = policy.key_limits.get(configured) else {
                return HashMap::new();
            };
            // Keys of the same limits (customers of one contract) share one rule; a missing
            // bucket's is without the penalty ([`Limiter::penalizing`]).
            let mut made: HashMap<(&[Limit], bool), Arc<Rule>> = HashMap::new();
            keys.iter()
                .map(|(parts, limits)| {
                    let key = format!("{}{}{parts}", rule.name, key::SEPARATOR);
                    let missing = key::in_missing_bucket(&key);
                    let keyed = made
                        .entry((limits.as_slice(), missing))
                        .or_insert_with(|| {
                            let keyed = rule.with_key_limits(limits);
                            Arc::new(if missing {
                                keyed.without_penalty()
                            } else {
                                keyed
                            })
                        })
                        .clone();
                    (table.fingerprint(&key), keyed)
                })
                .collect()
        })
        .collect()
}

/// Whether requests `rule` admits take a slot ([`slot_lapse`] is not 0 for them).
fn takes_slots(rule: &Rule) -> bool {
    matches!(rule.limits.as_slice(), [limit] if limit.algorithm() == Algorithm::Concurrency)
}

/// The limits a rule's local buckets follow: its own when local, its fallback otherwise.
pub fn bucket_limits(rule: &Rule) -> &[Limit] {
    match (&rule.consistency, &rule.fallback) {
        (Consistency::Local, _) => &rule.limits,
        (_, Fallback::Open(limits)) => limits,
        (_, Fallback::Closed) => &[],
    }
}

/// The denial of a key in its penalty until `until_us`: nothing spent, every limit told to wait
/// for the penalty's end (at most the rule's penalty from `now`, whatever a record says).
fn penalized(rule: &Rule, until_us: u64, now: u64) -> RuleVerdict {
    let wait = until_us.saturating_sub(now).min(rule.penalty_us);
    RuleVerdict {
        allowed: false,
        quota: Quota {
            limit: first_limit(rule),
            remaining: 0,
            reset_us: wait,
        },
        retry_after_us: wait,
        spend: Spend::Buckets,
        delay_us: 0,
        unavailable: false,
        asks: false,
    }
}

/// One rule's answer for one record, spending on allow and counting for the sync. A rule with a
/// `penalty` denies a key in its penalty outright (its own, or the service's, taken from a
/// lease answer), and starts one when it denies a key that went over.
#[inline]
fn judge(rule: &Rule, record: &mut Record, conditions: Conditions) -> RuleVerdict {
    if rule.penalty_us == 0 {
        return judge_limits(rule, record, conditions);
    }
    judge_penalty(rule, record, conditions)
}

/// [`judge`] for a rule with a `penalty`, out of line: a rule without one pays a field's test.
#[inline(never)]
fn judge_penalty(rule: &Rule, record: &mut Record, conditions: Conditions) -> RuleVerdict {
    let now = conditions.now_us;
    if record.penalty_until_us > now {
        if rule.consistency != Consistency::Local {
            let cost32 = rule.cost.min(u32::MAX as u64) as u32;
            record.denied = record.denied.saturating_add(cost32);
        }
        return penalized(rule, record.penalty_until_us, now);
    }
    let mut verdict = judge_limits(rule, record, conditions);
    // A lease that ran out speaks for this proxy's share only: the key went over if the global
    // state holds no more either, as the service last said; else the service starts the
    // penalty if it sees the key over at the next sync, and answers it to every proxy.
    let over = match verdict.spend {
        Spend::Buckets => true,
        Spend::Lease => (record.global_remaining as u64) < rule.cost,
    };
    if over && !verdict.allowed && !verdict.unavailable && !verdict.asks {
        record.penalty_until_us = now.saturating_add(rule.penalty_us);
        verdict.retry_after_us = verdict.retry_after_us.max(rule.penalty_us);
        verdict.quota.reset_us = verdict.quota.reset_us.max(rule.penalty_us);
    }
    verdict
}

/// [`judge`] by the rule's limits alone.
#[inline(always)]
fn judge_limits(rule: &Rule, record: &mut Record, conditions: Conditions) -> RuleVerdict {
    let now = conditions.now_us;
    let synced = rule.consistency != Consistency::Local;
    let cost = rule.cost;
    let verdict = if synced && conditions.service_up && now < record.lease_until_us {
        let verdict = spend_lease(rule, record, now, cost);
        if verdict.allowed {
            // The fallback buckets follow what this proxy spends, so a lapse of the lease
            // falls back to what is left locally, not to a fresh burst.
            for (limit, mut state) in record.states(bucket_limits(rule)) {
                state.spend(limit, now, cost);
            }
        }
        verdict
    } else {
        match (&rule.consistency, &rule.fallback) {
            (Consistency::Local, _) => match rule.dynamic {
                None => spend_buckets(&rule.limits, record, now, cost),
                Some(_) => spend_in_force(rule, record, conditions),
            },
            (_, Fallback::Open(limits)) => {
                // The headers still advertise the rule's limit, not the fallback's.
                let mut verdict = spend_buckets(limits, record, now, cost);
                verdict.quota.limit = first_limit(rule);
                verdict
            }
            // No lease (a new key, or one idle until its lease lapsed) while the service is
            // up: it is asked, not refused.
            (Consistency::Cached, Fallback::Closed) if conditions.service_up => {
                ask(first_limit(rule))
            }
            (_, Fallback::Closed) => closed(
                first_limit(rule),
                conditions.service_back_us.saturating_sub(now),
            ),
        }
    };
    // An asked key's demand is counted once its check is answered ([`Limiter::demand`]).
    if synced && !verdict.asks {
        let cost32 = cost.min(u32::MAX as u64) as u32;
        if verdict.allowed {
            record.spent = record.spent.saturating_add(cost32);
        } else {
            record.denied = record.denied.saturating_add(cost32);
        }
    }
    verdict
}

/// [`spend_buckets`] by the limits in force ([`in_force`]), out of line: a rule whose limits are
/// always its own pays an option's test.
#[inline(never)]
fn spend_in_force(rule: &Rule, record: &mut Record, conditions: Conditions) -> RuleVerdict {
    let limits = in_force(rule, conditions);
    spend_buckets(limits.as_slice(), record, conditions.now_us, rule.cost)
}

/// The limits of a local `rule` in force at `conditions`: its own, or those its `scale` and
/// `schedule` make them ([`crate::limit::dynamic`]).
#[inline(never)]
fn in_force(rule: &Rule, conditions: Conditions) -> crate::limit::dynamic::InForce {
    let none = crate::limit::dynamic::Dynamic {
        scale: None,
        schedule: Vec::new(),
    };
    let dynamic = rule.dynamic.as_deref().unwrap_or(&none);
    dynamic.in_force(&rule.limits, rule.cost, conditions.now_us, conditions.load)
}

/// The denial of a key blocked by a live override that expires at `expires_ms` (0: never).
fn blocked(rule: &Rule, index: RuleId, expires_ms: u64, now_us: u64) -> Decision {
    Decision::Deny {
        rule: index,
        quota: Quota {
            limit: first_limit(rule),
            remaining: 0,
            reset_us: 0,
        },
        retry_after_us: blocked_retry_us(expires_ms, now_us),
    }
}

fn first_limit(rule: &Rule) -> Limit {
    rule.limits.first().copied().unwrap_or(Limit::UNIT)
}

/// A denial that spends nothing: the fail-closed answer, when the limiter cannot decide (503,
/// not a rate limit): retry when the breaker's cool-down ends (at least a second).
fn closed(limit: Limit, until_back_us: u64) -> RuleVerdict {
    RuleVerdict {
        allowed: false,
        quota: Quota {
            limit,
            remaining: 0,
            reset_us: 0,
        },
        retry_after_us: until_back_us.max(1_000_000),
        spend: Spend::Buckets,
        delay_us: 0,
        unavailable: true,
        asks: false,
    }
}

/// The answer of a fail-closed cached rule that has no lease for a key while the counter service
/// is up: the service decides the request, as a strict rule's, with one check on the same global
/// state its syncs lease from (the check sets their leases aside, so the two never admit more
/// than the limit together), and a failed check falls back to [`closed`] (the 503). Nothing is
/// spent here (the check counts the request); once the check is answered it counts as `denied`
/// for the sync, demand the lease did not cover ([`Limiter::demand`]), so the key is announced
/// and its next sync brings a lease sized for it.
/// Refusing instead would answer 503 "the rate limit service cannot be reached" while it can, to
/// every new key and to every key idle for three sync intervals.
fn ask(limit: Limit) -> RuleVerdict {
    RuleVerdict {
        allowed: false,
        quota: Quota {
            limit,
            remaining: 0,
            reset_us: 0,
        },
        retry_after_us: 0,
        spend: Spend::Buckets,
        delay_us: 0,
        unavailable: false,
        asks: true,
    }
}

/// A would-be denial of `rule` for `key` at `now_us`: denied (enforce, or within the ramp's
/// share), or admitted (monitor, warn, outside the ramp). The ramp's draw is a hash of the
/// key and the moment: spread evenly over requests, and the same on every worker.
pub(crate) fn enforced(rule: &Rule, key: &str, now_us: u64) -> bool {
    match rule.mode {
        Mode::Enforce if rule.ramp_percent >= 100 => true,
        Mode::Enforce => {
            let mut bytes = Vec::with_capacity(key.len() + 8);
            bytes.extend_from_slice(key.as_bytes());
            bytes.extend_from_slice(&now_us.to_le_bytes());
            crate::protocol::fnv1a(&bytes) % 100 < rule.ramp_percent as u64
        }
        Mode::Shadow | Mode::Warn => false,
    }
}

/// Spends from the lease. The headers speak of the global bucket, as the service last
/// described it, less what this proxy spent since.
fn spend_lease(rule: &Rule, record: &mut Record, now: u64, cost: u64) -> RuleVerdict {
    let limit = first_limit(rule);
    let cost32 = cost.min(u32::MAX as u64) as u32;
    let allowed = record.lease >= cost32;
    if allowed {
        record.lease -= cost32;
        record.global_remaining = record.global_remaining.saturating_sub(cost32);
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
    // Denied with the global state holding the cost as far as the service said (others' leases
    // hold it): the lease is short, and others' unspent leases come back at their next sync.
    // A window's room frees at its rate at the soonest (one request every `period / requests`),
    // never later than its reset.
    let lease_short_us = if windowed && until_reset > 0 {
        micros_per_token.min(until_reset)
    } else {
        micros_per_token
    };
    let retry_after_us = if allowed {
        0
    } else if record.global_token_at_us != 0 {
        token_wait(rule, record, now, cost, lease_short_us)
    } else if !windowed && record.global_remaining == 0 && until_reset > 0 {
        // The global bucket is empty as far as the service last said (in debt, perhaps):
        // it holds `cost` tokens again when it is `burst - cost` short of full.
        let short_of_full = limit.burst().saturating_sub(cost) * micros_per_token;
        until_reset
            .saturating_sub(short_of_full)
            .max(micros_per_token)
    } else if !windowed || until_reset == 0 {
        // Denied with the lease spent while the global bucket has tokens: others' unspent
        // leases come back at their next sync, and a token at the global rate.
        micros_per_token
    } else if limit.algorithm() == Algorithm::FixedWindow && record.global_remaining == 0 {
        // The fixed window is used up, as far as this proxy knows: nothing before its end.
        until_reset
    } else {
        // A service that does not say when a window has room (an older one): room may come
        // sooner, as others' unspent leases return at their next sync and a sliding window's
        // previous window slides out (one request every `period / requests` when it was full).
        lease_short_us
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
        unavailable: false,
        asks: false,
    }
}

/// The wait of a cached request denied on its lease, when the service said when every limit of
/// the global state has room for one request more than the `remaining` it answered
/// (`global_token_at_us`, whichever limit is short: a rule of several limits is not sized by its
/// first one): a bucket's token back, a window's end (fixed) or the time its previous window has
/// slid out enough (sliding). While the global state is short of `cost` as far as this proxy
/// knows (its `remaining` spent, less what is left of it): that time, plus, for each request
/// more the request needs, the slowest limit's time of a token (none for a fixed window: the next
/// one holds the cost whole): exact for a cost of 1 while the service's count stands. Once that
/// time has passed, or while the global state has room others' leases hold, the lease is what is
/// short: `lease_short_us` (the next sync may bring a lease).
fn token_wait(rule: &Rule, record: &Record, now: u64, cost: u64, lease_short_us: u64) -> u64 {
    let left = record.global_remaining as u64;
    if left >= cost {
        return lease_short_us;
    }
    let slowest_us = rule
        .limits
        .iter()
        .map(|l| match l.algorithm() {
            Algorithm::FixedWindow => 0,
            _ => l.period().micros() / l.requests().max(1),
        })
        .max()
        .unwrap_or(0);
    let more = (cost - left - 1).saturating_mul(slowest_us);
    let at = record.global_token_at_us.saturating_add(more);
    if at <= now {
        return lease_short_us;
    }
    // A window's count weighs two of its periods at most (a sliding window's, through the next
    // one): whatever the service said, no window makes a request wait longer.
    let windows = rule.limits.iter().filter(|l| l.algorithm().windowed());
    match windows.map(|l| l.period().micros().saturating_mul(2)).max() {
        Some(longest) => (at - now).min(longest),
        None => at - now,
    }
}

/// All limits must have the token; then each spends it.
fn spend_buckets(limits: &[Limit], record: &mut Record, now: u64, cost: u64) -> RuleVerdict {
    if let [_] = limits {
        // The common case, one limit: the same answer as below without the table of verdicts
        // (a checked verdict when denied, the admitted one when allowed).
        if let Some((limit, mut state)) = record.states(limits).next() {
            let checked = state.check(limit, now, cost);
            let allowed = checked.allowed;
            let verdict = match allowed {
                true => state.admit(limit, now, cost),
                false => checked,
            };
            return RuleVerdict {
                allowed,
                quota: Quota {
                    limit: *limit,
                    remaining: verdict.remaining,
                    reset_us: verdict.reset_us,
                },
                retry_after_us: verdict.retry_after_us,
                spend: Spend::Buckets,
                delay_us: if allowed { verdict.delay_us } else { 0 },
                unavailable: false,
                asks: false,
            };
        }
    }
    spend_each(limits, record, now, cost)
}

/// [`spend_buckets`] for any number of limits.
fn spend_each(limits: &[Limit], record: &mut Record, now: u64, cost: u64) -> RuleVerdict {
    let mut verdicts: [Option<Verdict>; table::MAX_LIMITS] = [None; table::MAX_LIMITS];
    let mut allowed = true;
    for (i, (limit, mut state)) in record.states(limits).enumerate() {
        let verdict = state.check(limit, now, cost);
        allowed &= verdict.allowed;
        verdicts[i] = Some(verdict);
    }
    if allowed {
        for (i, (limit, mut state)) in record.states(limits).enumerate() {
            verdicts[i] = Some(state.admit(limit, now, cost));
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
        return closed(Limit::UNIT, 0);
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
        unavailable: false,
        asks: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Period, Shaping};

    /// The copies of a rule the limiter makes (one per distinct set of keys' own limits, one
    /// per `limits_from` value) share the configured rule's matcher: a rule listing a thousand
    /// paths, with ten thousand contracts and a client cycling its values, holds its paths once
    /// per worker, not once per copy (the memory the configuration's bounds do not see).
    #[test]
    fn copies_of_a_rule_share_its_matcher() {
        let paths: Vec<String> = (0..1_000)
            .map(|i| format!("\"/api/v1/resource-{i}\""))
            .collect();
        let config = format!(
            r#"{{"rules": [{{"name": "api", "match": {{"paths": [{}]}}, "key": ["header:x-customer"],
                "limits": [{{"requests": 10, "per": "minute"}}]}},
              {{"name": "claims", "match": {{"paths": [{}]}}, "key": ["jwt:sub"],
                "limits": [{{"requests": 2, "per": "minute"}}],
                "limits_from": {{"from": "jwt:rate", "max": 10000}}}}]}}"#,
            paths.join(","),
            paths.join(",")
        );
        let configured = crate::parse(config.as_bytes()).unwrap();
        let contracts = (0..200u64)
            .map(|i| {
                let target = crate::overrides::key_limits_target("api", &[format!("c{i}")]);
                (
                    target,
                    vec![serde_json::json!({"requests": 100 + i, "per": "minute"})],
                )
            })
            .collect();
        let live = crate::protocol::LiveOverrides {
            version: 1,
            limits: contracts,
            ..Default::default()
        };
        let (applied, problems) = crate::overrides::apply(&configured, &live);
        assert!(problems.is_empty(), "{problems:?}");
        let limiter = Limiter::with_overrides(applied, &configured, [7, 9]);
        let api = &limiter.policy().rules[0];
        let keyed = limiter.keyed.first().map_or(0, HashMap::len);
        assert_eq!(keyed, 200, "one copy per contract");
        for rule in limiter.keyed.iter().flat_map(HashMap::values) {
            assert!(Arc::ptr_eq(&rule.matcher, &api.matcher));
        }
        let claims = &limiter.policy().rules[1];
        let id = RuleId::new(1);
        for rate in 3..300u64 {
            let mut request = crate::PlainRequest::get("/api/v1/resource-7")
                .with_claim("sub", "alice")
                .with_claim("rate", &rate.to_string());
            let made = limiter.counted_as(id, claims, &mut request);
            let made = made.expect("a copy with the value's limit");
            assert_eq!(made.limits[0].requests(), rate);
            assert!(Arc::ptr_eq(&made.matcher, &claims.matcher), "{rate}");
        }
    }

    /// A request's stream end skips the release of concurrency slots, and its response skips
    /// the `count_when` status, unless some rule has them: what the limiter works out once
    /// follows the rules.
    #[test]
    fn slots_and_status_counts_are_worked_out_from_the_rules() {
        let limiter = |rules: &str| {
            let config = format!(r#"{{"rules": [{rules}]}}"#);
            Limiter::new(crate::parse(config.as_bytes()).unwrap())
        };
        let plain =
            r#"{"name": "a", "key": ["client_ip"], "limits": [{"requests": 1, "per": "second"}]}"#;
        let inflight = r#"{"name": "b", "key": ["client_ip"], "limits": [{"concurrent": 2}]}"#;
        let login = r#"{"name": "c", "key": ["client_ip"], "count_when": {"statuses": [401]}, "limits": [{"requests": 1, "per": "second"}]}"#;
        let cases = [
            (plain.to_string(), false, false),
            (format!("{plain}, {inflight}"), true, false),
            (format!("{login}, {plain}"), false, true),
            (format!("{inflight}, {login}"), true, true),
        ];
        for (rules, slots, by_status) in cases {
            let limiter = limiter(&rules);
            assert_eq!(limiter.holds_slots(), slots, "{rules}");
            assert_eq!(limiter.counts_by_status(), by_status, "{rules}");
        }
    }

    #[test]
    fn what_the_limiter_works_out_once_is_what_the_policy_says() {
        for key in [r#"["client_ip"]"#, r#"["header:x-user"]"#, r#"["path"]"#] {
            let config = format!(
                r#"{{"rules": [{{"name": "r", "key": {key}, "limits": [{{"requests": 1, "per": "second"}}]}}]}}"#
            );
            let policy = crate::parse(config.as_bytes()).unwrap();
            let limiter = Limiter::new(policy.clone());
            assert_eq!(limiter.needs_client_ip(), policy.needs_client_ip(), "{key}");
            assert_eq!(
                limiter.needs_client_ip(),
                key.contains("client_ip"),
                "{key}"
            );
            let mut request = crate::request::PlainRequest::get("/").from_ip("10.0.0.1");
            assert!(
                limiter.strict_keys(&mut request).is_empty(),
                "no strict rule"
            );
        }
    }

    /// The one-limit path of `spend_buckets` answers and leaves the record exactly as the
    /// general one, for every algorithm, over arrivals that are admitted and denied.
    #[test]
    fn one_limit_spends_as_the_general_path_would() {
        let limits = [
            Limit::new(5, Period::Second, Some(3)).unwrap(),
            Limit::new(5, Period::Second, Some(3)).unwrap().gcra(),
            Limit::windowed(4, Period::Second, Algorithm::FixedWindow).unwrap(),
            Limit::windowed(4, Period::Second, Algorithm::SlidingWindow).unwrap(),
            Limit::logged(4, Period::Second).unwrap(),
            Limit::leaky(
                5,
                Period::Second,
                Shaping {
                    delay: 1,
                    queue: 2,
                    max_delay_ms: 1_000,
                },
            )
            .unwrap(),
        ];
        for limit in limits {
            let limits = [limit];
            let mut now = 1_700_000_000_000_000u64;
            let mut fast = Record::fresh(7, &limits, now);
            let mut general = fast.clone();
            let (mut allowed, mut denied) = (0, 0);
            for i in 0..400u64 {
                // Bursts, gaps, and now and then a step back of the clock.
                now = match i % 37 {
                    0 => now - 2_000_000,
                    n if n % 5 == 0 => now + 700_000,
                    _ => now + 37_000 + (i * 7_919) % 90_000,
                };
                let cost = 1 + i % 3;
                let a = spend_buckets(&limits, &mut fast, now, cost);
                let b = spend_each(&limits, &mut general, now, cost);
                assert_eq!(a, b, "{limit:?}, request {i} at {now}");
                assert_eq!(fast, general, "{limit:?}, request {i} at {now}");
                if a.allowed {
                    allowed += 1;
                } else {
                    denied += 1;
                }
            }
            assert!(
                allowed > 20 && denied > 20,
                "{limit:?}: {allowed} / {denied}"
            );
        }
    }
}
