//! A request's whole life as a pure state machine: the host feeds it what it saw and the time,
//! and carries out the [`Effect`]s and the [`Step`] it returns.
//!
//! ```text
//! request seen ──start──▶ shedding ──shed──▶ Respond(503)
//!                            │ admitted (holds a slot) or queued
//!                            ▼
//!                         rate limits ──(strict rules)──▶ checks out ──answered/failed──▶ final
//!                            │                                                            │
//!                            └──── Continue / Queue / Respond(429, slot given back) ◀─────┘
//! queued ──seated (a slot came) / unseated (shed while waiting, spends refunded)
//! response seen ──responded + response_headers──▶ the headers to add, the latency noted
//! stream ended (any way) ──finish──▶ the slot given back, a latency sample
//! ```
//!
//! Shedding comes first: a shed request spends no quota. Local and cached rules are decided at
//! once from the store; each strict rule sends one check and the request waits for the
//! answers. A check that fails (no answer, an error, a timeout) counts against the circuit
//! breaker and the rule decides by its fallback. A strict denial gives back what the other
//! rules spent. Nothing here reads a clock or does I/O.

use crate::limit::dynamic::Load;
use crate::limit::Limit;
use crate::limiter::decision::{Decision, Evaluation, Outcome, Quota, Spending};
use crate::limiter::key::KeyDigest;
use crate::limiter::{Conditions, Enforced, Limiter, RuleAnswer};
use crate::policy::Mode;
use crate::policy::RuleId;
use crate::protocol::{CheckRequest, CheckResponse, LimitSpec};
use crate::reply::headers::{each_header, Reset};
pub use crate::reply::{Protocol, Reply, SHED_HEADER};
use crate::request::RequestView;
use crate::shed::policy::BulkheadId;
use crate::shed::{self, Admission, Level, Pressure, Seat, ShedMode, ShedReason, Shedding};
use crate::store::Store;
use crate::sync::proxy;

/// What the host knows besides the request, at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moment {
    /// Microseconds since the Unix epoch.
    pub now_us: u64,
    /// The circuit breaker is closed: leases and strict checks may be used.
    pub service_up: bool,
    /// The counter service's emergency bypass is on.
    pub bypass: bool,
    /// A number in [0.5, 1.5] drawn by the host, to jitter the breaker's cool-down.
    pub jitter: f64,
    /// A uniform draw in [0, 1), for the success-rate rejection and `Retry-After` spread.
    pub draw: f64,
    /// The fleet level from the counter service's last fresh answer.
    pub fleet: Option<f64>,
}

impl Moment {
    /// `now_us` with the service up, no bypass, no fleet level and middling draws: for tests
    /// and tools.
    pub fn at(now_us: u64) -> Moment {
        Moment {
            now_us,
            service_up: true,
            bypass: false,
            jitter: 1.0,
            draw: 0.5,
            fleet: None,
        }
    }
}

/// What the host does with the request next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Forward it upstream.
    Continue,
    /// Hold it: strict checks are out; [`Exchange::answered`] says when to go on.
    Wait,
    /// Answer it locally (and do not forward it).
    Respond(Reply),
    /// Hold it until `until_us`, then forward it: a leaky bucket shapes it to its slot. If
    /// its stream ends before, tell the exchange ([`Exchange::cancel_delay`]).
    Delay { until_us: u64 },
    /// Hold it in the worker's wait queue for a slot of its bulkhead ([`crate::shed::WaitQueue`]);
    /// tell the exchange how it ends with [`Exchange::seated`] or [`Exchange::unseated`].
    Queue {
        seat: Seat,
        level: Level,
        wait_budget_us: Option<u64>,
    },
}

/// Something the host carries out besides the request's own step.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Count a rule's outcome (metrics).
    Outcome { rule: RuleId, outcome: Outcome },
    /// The request skipped every rule (metrics).
    Bypassed,
    /// A key got its first unsynced count: announce it to the syncer.
    Announce { rule: RuleId, key: String },
    /// A lease ran out: bring the next sync round forward ([`proxy::hurry`]).
    Hurry,
    /// Send this strict check; feed its answer (or its failure, even to be sent) to
    /// [`Exchange::answered`] with `check`. `asks`: the check of a cached key without a lease
    /// (a fail-closed rule's): the host names its proxy id in it ([`CheckRequest::proxy`], as
    /// its syncs do), so that a denial the proxy's own lease covers answers that lease.
    Check {
        check: usize,
        request: CheckRequest,
        asks: bool,
    },
    /// A strict check failed; the breaker in the store counted it (metrics, and the host
    /// re-reads the breaker).
    CheckFailed,
    /// Shedding admitted the request (it holds a slot) or queued it.
    Admitted { seat: Seat, queued: bool },
    /// Shedding answered 503; `would`: monitor or warn mode let it through instead.
    Shed {
        seat: Seat,
        reason: ShedReason,
        would: bool,
    },
    /// Set this header on the request to the upstream (replacing any the client sent).
    RequestHeader { name: String, value: String },
    /// Remove this header from the request to the upstream: one only sluice may set
    /// ([`WOULD_SHED_HEADER`], the degradation header), when sluice does not set it.
    ClearRequestHeader { name: String },
    /// A warn rule would have denied this key: tell the operator (a rate-limited log line).
    Warn { rule: RuleId, key: String },
    /// A warn bulkhead would have shed this request (of `seat`'s class, for `reason`): tell the
    /// operator (a rate-limited log line).
    WarnShed { seat: Seat, reason: ShedReason },
    /// A response's reported cost was charged to a rule (metrics).
    Charged { rule: RuleId, cost: u64 },
    /// The stream ended after the upstream answered: a latency and status sample.
    Finished {
        bulkhead: BulkheadId,
        latency_us: u64,
        status: u32,
        /// A gRPC response's `grpc-status` (from its headers or its trailers).
        grpc_status: Option<u32>,
    },
}

/// One request's state between its callbacks.
#[derive(Debug, Default)]
pub struct Exchange {
    /// The rule and quota whose headers go on the response (the most restrictive).
    quota: Option<(RuleId, Quota)>,
    /// Strict checks out: (rule, key), by check number; `None` once answered.
    checks: Vec<Option<(RuleId, String)>>,
    /// What local and cached rules spent, given back if a strict rule denies.
    spent: Spending,
    /// The first strict denial.
    denied: Option<(RuleId, RuleAnswer)>,
    /// The digest of the key of the denial that answers (for the access log).
    denied_key: Option<KeyDigest>,
    /// The seat a request answered locally had or waited for, once given up (for the access log).
    gave_up: Option<Seat>,
    /// The request was answered locally (no response headers to add).
    answered: bool,
    /// The bulkhead slot it holds, and since when.
    seat: Option<(Seat, u64)>,
    /// Admitted by shedding into its queue, once rate limits let it through.
    queued: Option<(Seat, Level, Option<u64>)>,
    /// What warn mode would have shed, for the response header.
    warned: Option<ShedReason>,
    /// The upstream's status and when it came (request to response headers).
    answer: Option<(u32, u64)>,
    /// A gRPC response's `grpc-status`, the last seen (a trailer's over a header's).
    grpc_status: Option<u32>,
    /// A shaping limit holds it until then.
    delay_until: Option<u64>,
    /// A warn rule would have denied it: named on the response.
    warn_rule: Option<RuleId>,
    /// Rules that charge the cost the response reports, with their keys.
    chargeable: Vec<(RuleId, String)>,
    /// What kind of client asked, read from the request only when it may be answered locally
    /// (shed, queued, denied, or waiting for strict checks).
    protocol: Protocol,
    /// When the rules last decided (start, or a strict answer): the quotas' reset counts from it.
    decided_us: u64,
    /// The level shedding worked out for the request's bulkhead (normal outside any).
    level: Level,
    /// A request of a quota path: its answer, given instead of forwarding it once the other
    /// rules admit it.
    probe: Option<Box<Probe>>,
}

/// A request of a quota path ([`follow`]).
#[derive(Debug)]
struct Probe {
    /// The path, which the rules answering it do not decide
    /// ([`Limiter::decide_except`]).
    path: String,
    /// The caller's own quota of those rules ([`crate::reply::quota`]).
    reply: Reply,
}

/// The load levels a rule's `scale` reads: shedding's `proxy` level of the request's bulkhead,
/// and the counter service's fleet level (its last fresh answer) through the shedding
/// thresholds. Whatever the service answers (above 1, NaN), the level is one of the four, and a
/// level only lowers a limit ([`crate::limit::dynamic`]). The fleet level is the mean of what
/// the proxies report, so whoever holds one proxy credential can push it up: as shedding does
/// ([`shed::admission::believed_fleet`]), it is believed only up to this proxy's own utilization
/// of the request's bulkhead (none outside one) plus `shedding.fleet_margin`.
#[inline(never)]
fn load(limiter: &Limiter, exchange: &Exchange, fleet: Option<f64>, store: &mut dyn Store) -> Load {
    let Some(shedding) = limiter.policy().shedding.as_ref() else {
        return Load {
            proxy: exchange.level,
            fleet: Level::Normal,
        };
    };
    let fleet = match fleet.filter(|f| !f.is_nan()) {
        None => Level::Normal,
        Some(f) => {
            let own = exchange
                .seat
                .and_then(|(seat, _)| shedding.bulkheads.get(seat.bulkhead))
                .and_then(|b| store.get(&b.gauge_key).ok().flatten())
                .map_or(0.0, |(bytes, _)| shed::Gauge::decode(&bytes).utilization());
            shedding
                .levels
                .level(f.clamp(0.0, 1.0).min(own + shedding.fleet_margin))
        }
    };
    Load {
        proxy: exchange.level,
        fleet,
    }
}

/// What a policy with limits that follow load, or with quota paths, works out for a request
/// shedding admitted: the load levels its `scale`s read ([`load`]), and, for a request of a
/// quota path, its answer: the caller's own quota of each rule answering it
/// ([`crate::reply::quota`]), read without spending. The other rules then decide the request
/// as any ([`Limiter::decide_except`]); once they admit it, it is answered instead of
/// forwarded (its slot given back: [`Exchange::admitted_step`]).
#[inline(never)]
fn follow(
    limiter: &Limiter,
    exchange: &mut Exchange,
    request: &mut dyn RequestView,
    moment: Moment,
    store: &mut dyn Store,
) -> Load {
    let levels = match limiter.scales() {
        false => Load::default(),
        true => load(limiter, exchange, moment.fleet, store),
    };
    if !limiter.has_quota_paths() {
        return levels;
    }
    let path = request.path().to_string();
    let conditions = Conditions {
        now_us: moment.now_us,
        service_up: moment.service_up,
        service_back_us: 0,
        load: levels,
    };
    let Some(quotas) = limiter.quotas(&path, request, conditions, store) else {
        return levels;
    };
    let named: Vec<(&str, Option<Quota>)> = quotas
        .iter()
        .filter_map(|(id, q)| limiter.rule(*id).map(|r| (r.rule.name.as_str(), *q)))
        .collect();
    let reply = crate::reply::quota(&named, moment.now_us);
    exchange.probe = Some(Box::new(Probe { path, reply }));
    levels
}

/// Names the warn rule that would have denied a request (on its response).
pub const WARN_HEADER: &str = "x-sluice-warn";

impl Exchange {
    /// The request's headers were seen: decide every local and cached rule, and send the
    /// strict checks.
    pub fn start(
        limiter: &Limiter,
        request: &mut dyn RequestView,
        client: Option<std::net::IpAddr>,
        moment: Moment,
        store: &mut dyn Store,
    ) -> (Exchange, Step, Vec<Effect>) {
        let mut effects = Vec::new();
        let (exchange, step) =
            Exchange::start_into(limiter, request, client, moment, store, &mut effects);
        (exchange, step, effects)
    }

    /// [`start`](Self::start), its effects appended to `effects`: a host that keeps one vector
    /// for them between requests makes no allocation for them.
    pub fn start_into(
        limiter: &Limiter,
        request: &mut dyn RequestView,
        client: Option<std::net::IpAddr>,
        moment: Moment,
        store: &mut dyn Store,
        effects: &mut Vec<Effect>,
    ) -> (Exchange, Step) {
        let mut exchange = Exchange::default();
        let step = exchange.begin(limiter, request, client, moment, store, effects);
        (exchange, step)
    }

    /// [`start_into`](Self::start_into) in place: this exchange becomes the request's (what it
    /// held is dropped), so that the host keeps it where it lives instead of moving it.
    pub fn begin(
        &mut self,
        limiter: &Limiter,
        request: &mut dyn RequestView,
        client: Option<std::net::IpAddr>,
        moment: Moment,
        store: &mut dyn Store,
        effects: &mut Vec<Effect>,
    ) -> Step {
        *self = Exchange {
            decided_us: moment.now_us,
            ..Exchange::default()
        };
        let exchange = self;
        // The emergency switch and bypassed paths skip shedding too; bypassed addresses do not
        // (a trusted client can still overload the upstream).
        let bypass = &limiter.policy().bypass;
        let exempt =
            moment.bypass || bypass.all || bypass.paths.iter().any(|p| p == request.path());
        if let Some(shedding) = limiter.policy().shedding.as_ref().filter(|_| !exempt) {
            if let Some(reply) = exchange.shed(shedding, request, moment, store, effects) {
                return Step::Respond(reply);
            }
        } else if let Some(shedding) = limiter.policy().shedding.as_ref() {
            // Not decided by shedding: what the upstream is told about load still never comes
            // from the client.
            let names = shedding.degradation_header.iter().cloned();
            effects.extend(
                names
                    .chain([WOULD_SHED_HEADER.to_string()])
                    .map(|name| Effect::ClearRequestHeader { name }),
            );
        }
        // Limits that follow load and time, and quota paths: one test for a policy without them.
        let mut load = Load::default();
        if limiter.follows() {
            load = follow(limiter, exchange, request, moment, store);
        }
        if moment.bypass || limiter.bypassed(request.path(), client) {
            effects.push(Effect::Bypassed);
            let step = exchange.admitted_step(limiter, store);
            return step;
        }
        let service_back_us = if moment.service_up {
            0
        } else {
            proxy::read_state(store).breaker.open_until_us
        };
        let conditions = Conditions {
            now_us: moment.now_us,
            service_up: moment.service_up,
            service_back_us,
            load,
        };
        let mut evaluation = Evaluation::default();
        let probe = exchange.probe.as_deref().map(|p| p.path.as_str());
        limiter.decide_except(probe, request, conditions, store, &mut evaluation);
        effects.extend(
            evaluation
                .outcomes
                .iter()
                .map(|&(rule, outcome)| Effect::Outcome { rule, outcome }),
        );
        if evaluation.lease_exhausted {
            effects.push(Effect::Hurry);
        }
        effects.extend(
            evaluation
                .newly_unsynced
                .into_iter()
                .map(|(rule, key)| Effect::Announce { rule, key }),
        );
        for (rule, key) in evaluation.warned {
            exchange.warn_rule.get_or_insert(rule);
            effects.push(Effect::Warn { rule, key });
        }
        exchange.chargeable = evaluation.chargeable;
        exchange.denied_key = evaluation.denied_key;
        match evaluation.decision {
            Decision::Unavailable {
                rule,
                retry_after_us,
            } => {
                exchange.answered = true;
                exchange.give_up_seat(limiter, store);
                exchange.protocol = Protocol::of_request(request);
                let reply = exchange.unavailable(limiter, rule, retry_after_us);
                Step::Respond(reply)
            }
            Decision::Deny {
                rule,
                quota,
                retry_after_us,
            } => {
                exchange.answered = true;
                exchange.give_up_seat(limiter, store);
                exchange.protocol = Protocol::of_request(request);
                let reply = exchange.denial(limiter, rule, &quota, retry_after_us);
                Step::Respond(reply)
            }
            Decision::Allow { quota } => {
                if let Some((rule, quota)) = quota {
                    exchange.offer(limiter, rule, quota);
                }
                exchange.spent = evaluation.spent;
                if evaluation.delay_us > 0 {
                    exchange.delay_until = Some(moment.now_us.saturating_add(evaluation.delay_us));
                }
                // Strict rules, and fail-closed cached rules' keys without a lease (the limiter
                // asks only while the service is up): one check each.
                let checked = limiter.strict_keys(request).into_iter().map(|c| (c, false));
                let asked = evaluation.asked.into_iter().map(|c| (c, true));
                for ((rule, key), asks) in checked.chain(asked) {
                    if moment.service_up {
                        let Some(Enforced { rule: spec, .. }) = limiter.rule_for(rule, &key) else {
                            continue;
                        };
                        let check = exchange.checks.len();
                        effects.push(Effect::Check {
                            check,
                            request: CheckRequest {
                                key: key.clone(),
                                limits: spec.limits.iter().map(LimitSpec::from).collect(),
                                cost: spec.cost,
                                penalty_ms: spec.penalty_ms(),
                                proxy: None,
                            },
                            asks,
                        });
                        exchange.checks.push(Some((rule, key)));
                    } else {
                        exchange.fall_back(limiter, rule, &key, moment.now_us, store, effects);
                    }
                }
                if !exchange.checks.is_empty() || exchange.denied.is_some() {
                    exchange.protocol = Protocol::of_request(request);
                }
                exchange.step(limiter, store)
            }
        }
    }

    /// A strict check answered (`Some`), or failed: not sent, reset, timed out, an error
    /// status or a body that is not an answer (`None`). Returns the step once every check is
    /// in, `None` while some are still out.
    pub fn answered(
        &mut self,
        limiter: &Limiter,
        check: usize,
        answer: Option<CheckResponse>,
        moment: Moment,
        store: &mut dyn Store,
    ) -> (Option<Step>, Vec<Effect>) {
        let mut effects = Vec::new();
        let Some((rule, key)) = self.checks.get_mut(check).and_then(Option::take) else {
            return (None, effects);
        };
        self.decided_us = moment.now_us;
        match answer {
            Some(checked) => {
                let limit = limiter
                    .rule_for(rule, &key)
                    .and_then(|r| r.rule.limits.first().copied())
                    .unwrap_or(Limit::UNIT);
                let answer = RuleAnswer {
                    allowed: checked.allowed,
                    quota: Quota {
                        limit,
                        remaining: checked.remaining,
                        reset_us: checked.reset_ms.saturating_mul(1_000),
                    },
                    retry_after_us: checked.retry_after_ms.saturating_mul(1_000),
                    unavailable: false,
                };
                // A cached key's sync may have brought it a lease while its check was out (the
                // check set that lease aside): the lease admits what it holds. The service
                // says that lease when the sync's answer has not come yet (it may come after
                // this one): the same grant either way, so it is spent once.
                let _ =
                    proxy::apply_told_lease(limiter, rule, &key, &checked, moment.now_us, store);
                let leased = match answer.allowed {
                    false => limiter.leased(rule, &key, moment.now_us, store),
                    true => None,
                };
                let answer = match leased {
                    Some((admitted, spent, announce)) => {
                        self.spent.push(spent);
                        if announce {
                            let key = key.clone();
                            effects.push(Effect::Announce { rule, key });
                        }
                        admitted
                    }
                    None => {
                        // An asked cached key: its demand goes to the next sync, brought
                        // forward, for a lease (a strict rule's is nothing to sync).
                        if limiter.demand(rule, &key, moment.now_us, store) {
                            let key = key.clone();
                            effects.push(Effect::Announce { rule, key });
                            effects.push(Effect::Hurry);
                        }
                        answer
                    }
                };
                self.record(limiter, rule, &key, answer, moment.now_us, &mut effects);
            }
            None => {
                if let Some(service) = limiter.policy().service.as_ref() {
                    // A failed check counts against the breaker; it leaves the sync round alone.
                    let _ = proxy::update_state(store, |s| {
                        s.breaker.failed(
                            service.breaker_failures,
                            moment.now_us,
                            service.breaker_cooldown_ms.saturating_mul(1_000),
                            moment.jitter,
                        )
                    });
                }
                effects.push(Effect::CheckFailed);
                self.fall_back(limiter, rule, &key, moment.now_us, store, &mut effects);
            }
        }
        if self.checks.iter().any(Option::is_some) {
            return (None, effects);
        }
        (Some(self.step(limiter, store)), effects)
    }

    /// The response's headers were seen: the rate-limit headers to add to it.
    pub fn response_headers(&mut self, limiter: &Limiter) -> Vec<(&'static str, String)> {
        let mut headers = Vec::new();
        self.each_response_header(limiter, &mut |name, value| {
            headers.push((name, value.to_string()))
        });
        headers
    }

    /// [`response_headers`](Self::response_headers), one at a time, without collecting them.
    pub fn each_response_header(
        &mut self,
        limiter: &Limiter,
        header: &mut dyn FnMut(&'static str, &str),
    ) {
        if self.answered {
            return;
        }
        if let Some(reason) = self.warned.take() {
            header(WOULD_SHED_HEADER, reason.name());
        }
        if let Some(rule) = self.warn_rule.take() {
            let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
            header(WARN_HEADER, name);
        }
        if let Some((rule, quota)) = self.quota.take() {
            let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
            let reset = Reset::of(limiter.policy().reset, self.decided_us);
            each_header(limiter.policy().headers, name, &quota, reset, header);
        }
    }

    /// The response reported its cost in `header`'s `value`: charge it to the keys of the
    /// rules that count it (rules with that `cost_header` that admitted the request). A value
    /// that is not a whole number of tokens is ignored. Returns the effects (announcements of
    /// keys whose counts the sync has not seen).
    pub fn response_cost(
        &mut self,
        limiter: &Limiter,
        header: &str,
        value: &str,
        now_us: u64,
        store: &mut dyn Store,
    ) -> Vec<Effect> {
        let Ok(cost) = value.trim().parse::<u64>() else {
            return Vec::new();
        };
        let cost = cost.min(crate::limit::MAX_TOKENS);
        let mut effects = Vec::new();
        let (charged, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.chargeable)
            .into_iter()
            .partition(|(rule, _)| {
                limiter
                    .rule(*rule)
                    .and_then(|r| r.rule.cost_header.as_deref())
                    == Some(header)
            });
        self.chargeable = kept;
        if cost == 0 {
            return effects;
        }
        for (rule, key) in charged {
            if limiter.charge(rule, &key, cost, now_us, store) {
                effects.push(Effect::Announce { rule, key });
            }
            effects.push(Effect::Charged { rule, cost });
        }
        effects
    }

    /// Whether a rule that admitted this request counts it by its response's status
    /// (`count_when`): the host then reads the status and calls [`Exchange::response_status`].
    pub fn counts_by_status(&self, limiter: &Limiter) -> bool {
        limiter.counts_by_status()
            && self
                .chargeable
                .iter()
                .any(|(rule, _)| counts_by_status(limiter, *rule))
    }

    /// The response's status was seen: the rules that count by it (`count_when`) keep the cost
    /// their keys reserved when they admitted the request if it is a status they count, and
    /// give it back otherwise. Runs once: later calls do nothing. Returns what was counted.
    pub fn response_status(
        &mut self,
        limiter: &Limiter,
        status: u32,
        _now_us: u64,
        store: &mut dyn Store,
    ) -> Vec<Effect> {
        let mut effects = Vec::new();
        let (answered, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.chargeable)
            .into_iter()
            .partition(|(rule, _)| counts_by_status(limiter, *rule));
        self.chargeable = kept;
        let mut not_counted: Vec<RuleId> = Vec::new();
        for (rule, _) in answered {
            let Some(spec) = limiter.rule(rule).map(|r| r.rule) else {
                continue;
            };
            if spec.count_when.as_ref().is_some_and(|c| c.counts(status)) {
                effects.push(Effect::Charged {
                    rule,
                    cost: spec.cost,
                });
            } else if !not_counted.contains(&rule) {
                not_counted.push(rule);
            }
        }
        self.give_back(limiter, &not_counted, store);
        effects
    }

    /// Gives back what `rules` spent on this request (the cost a `count_when` rule reserved
    /// when its answer does not count).
    fn give_back(&mut self, limiter: &Limiter, rules: &[RuleId], store: &mut dyn Store) {
        if rules.is_empty() {
            return;
        }
        let (back, keep): (Spending, Spending) = self
            .spent
            .iter()
            .copied()
            .partition(|s| rules.contains(&s.rule));
        limiter.refund(&back, store);
        self.spent = keep;
    }

    /// The response headers whose values the rules that admitted this request charge.
    pub fn cost_headers<'a>(&self, limiter: &'a Limiter) -> Vec<&'a str> {
        let mut names: Vec<&str> = self
            .chargeable
            .iter()
            .filter_map(|(rule, _)| limiter.rule(*rule)?.rule.cost_header.as_deref())
            .collect();
        names.dedup();
        names
    }

    /// Strict checks still out.
    pub fn checks_out(&self) -> usize {
        self.checks.iter().filter(|c| c.is_some()).count()
    }

    /// Keeps the most restrictive quota for the response headers, of the rules that show theirs.
    fn offer(&mut self, limiter: &Limiter, rule: RuleId, quota: Quota) {
        if !limiter
            .rule(rule)
            .is_some_and(|r| r.rule.answer.headers_admitted)
        {
            return;
        }
        if self
            .quota
            .is_none_or(|(_, q)| quota.remaining < q.remaining)
        {
            self.quota = Some((rule, quota));
        }
    }

    /// A strict rule decided locally, by its fallback.
    fn fall_back(
        &mut self,
        limiter: &Limiter,
        rule: RuleId,
        key: &str,
        now_us: u64,
        store: &mut dyn Store,
        effects: &mut Vec<Effect>,
    ) {
        let back_us = proxy::read_state(store).breaker.open_until_us;
        match limiter.fallback(rule, key, now_us, back_us, store) {
            Some(answer) => self.record(limiter, rule, key, answer, now_us, effects),
            None => effects.push(Effect::Outcome {
                rule,
                outcome: Outcome::Uncounted,
            }),
        }
    }

    fn record(
        &mut self,
        limiter: &Limiter,
        rule: RuleId,
        key: &str,
        answer: RuleAnswer,
        now_us: u64,
        effects: &mut Vec<Effect>,
    ) {
        let Some(spec) = limiter.rule(rule).map(|r| r.rule) else {
            return;
        };
        let outcome = if answer.allowed {
            Outcome::Allowed
        } else if answer.unavailable && spec.mode == Mode::Enforce {
            Outcome::FailedClosed
        } else if crate::limiter::enforced(spec, key, now_us) {
            Outcome::Denied
        } else if spec.mode == Mode::Warn {
            self.warn_rule.get_or_insert(rule);
            effects.push(Effect::Warn {
                rule,
                key: key.to_string(),
            });
            Outcome::Warned
        } else {
            Outcome::ShadowDenied
        };
        effects.push(Effect::Outcome { rule, outcome });
        if matches!(outcome, Outcome::FailedClosed | Outcome::Denied) {
            // Of several strict denials, the one that makes the client wait longest answers
            // (an unavailable rule's 503 stays: it is not a rate limit).
            let longer = self.denied.as_ref().is_none_or(|(_, held)| {
                !held.unavailable
                    && !answer.unavailable
                    && answer.retry_after_us > held.retry_after_us
            });
            if longer {
                self.denied = Some((rule, answer));
                if limiter.policy().access_log {
                    self.denied_key = Some(KeyDigest::of(key));
                }
            }
        } else {
            self.offer(limiter, rule, answer.quota);
        }
    }

    /// Wait while checks are out; then deny (giving back what was spent) or go on.
    fn step(&mut self, limiter: &Limiter, store: &mut dyn Store) -> Step {
        if self.checks_out() > 0 {
            return Step::Wait;
        }
        match self.denied.take() {
            Some((rule, answer)) => {
                limiter.refund(&self.spent, store);
                self.spent.clear();
                self.chargeable.clear();
                self.answered = true;
                self.give_up_seat(limiter, store);
                if answer.unavailable {
                    Step::Respond(self.unavailable(limiter, rule, answer.retry_after_us))
                } else {
                    Step::Respond(self.denial(limiter, rule, &answer.quota, answer.retry_after_us))
                }
            }
            None => self.admitted_step(limiter, store),
        }
    }
}

/// The local replies of rate limits, shaped for the client that asked ([`crate::reply`]).
impl Exchange {
    /// What kind of client asked (known once the request may be answered locally).
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    fn unavailable(&self, limiter: &Limiter, rule: RuleId, retry_after_us: u64) -> Reply {
        let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
        let mut reply = crate::reply::limiter_unavailable(name, retry_after_us, self.protocol)
            .linking(limiter.policy().docs_url.as_deref());
        self.tell(limiter, &mut reply, rule);
        reply
    }

    /// `reply` tells the access log the rule, the key's digest and the request's seat, when the
    /// policy asks for them (`access_log`). In place: a reply is too big to move for nothing.
    fn tell(&self, limiter: &Limiter, reply: &mut Reply, rule: RuleId) {
        if limiter.policy().access_log {
            reply.facts.rule = Some(rule);
            reply.facts.key = self.denied_key;
            reply.facts.placed(self.gave_up);
        }
    }

    fn denial(&self, limiter: &Limiter, rule: RuleId, quota: &Quota, retry_after_us: u64) -> Reply {
        let policy = limiter.policy();
        let docs = policy.docs_url.as_deref();
        let Some(spec) = limiter.rule(rule).map(|r| r.rule) else {
            return crate::reply::limiter_unavailable("", retry_after_us, self.protocol)
                .linking(docs);
        };
        let reset = Reset::of(policy.reset, self.decided_us);
        let mut reply = crate::reply::rate_limited(
            spec,
            quota,
            retry_after_us,
            policy.headers,
            reset,
            self.protocol,
            docs,
        );
        self.tell(limiter, &mut reply, rule);
        reply
    }
}

/// Shedding: the request's slot in its bulkhead, from admission to the stream's end.
impl Exchange {
    /// The shedding decision; `Some(reply)` when the request is shed at once.
    fn shed(
        &mut self,
        shedding: &Shedding,
        request: &mut dyn RequestView,
        moment: Moment,
        store: &mut dyn Store,
        effects: &mut Vec<Effect>,
    ) -> Option<Reply> {
        let pressure = Pressure {
            now_us: moment.now_us,
            fleet: moment.fleet,
            draw: moment.draw,
        };
        let level = match shed::admit(shedding, request, pressure, store) {
            Admission::Exempt { level } => level,
            Admission::Admitted {
                seat,
                level,
                would_shed,
            } => {
                self.seat = Some((seat, moment.now_us));
                effects.push(Effect::Admitted {
                    seat,
                    queued: false,
                });
                if let Some(reason) = would_shed {
                    effects.push(Effect::Shed {
                        seat,
                        reason,
                        would: true,
                    });
                    let warn = shedding
                        .bulkheads
                        .get(seat.bulkhead)
                        .is_some_and(|b| b.mode == ShedMode::Warn);
                    if warn {
                        effects.push(Effect::WarnShed { seat, reason });
                        self.warned = Some(reason);
                        effects.push(Effect::RequestHeader {
                            name: WOULD_SHED_HEADER.into(),
                            value: reason.name().into(),
                        });
                    }
                }
                level
            }
            Admission::Queue {
                seat,
                level,
                wait_budget_us,
                ..
            } => {
                self.queued = Some((seat, level, wait_budget_us));
                self.protocol = Protocol::of_request(request);
                effects.push(Effect::Admitted { seat, queued: true });
                level
            }
            Admission::Shed {
                seat,
                level,
                reason,
            } => {
                self.answered = true;
                effects.push(Effect::Shed {
                    seat,
                    reason,
                    would: false,
                });
                self.protocol = Protocol::of_request(request);
                return Some(
                    crate::reply::overloaded(
                        shedding,
                        seat,
                        level,
                        reason,
                        moment.draw,
                        self.protocol,
                    )
                    .linking(shedding.docs_url.as_deref()),
                );
            }
        };
        self.level = level;
        if let Some(name) = &shedding.degradation_header {
            effects.push(Effect::RequestHeader {
                name: name.clone(),
                value: level.name().into(),
            });
        }
        if self.warned.is_none() {
            // Only sluice says what it would have shed: a client's own claim never reaches the
            // upstream.
            effects.push(Effect::ClearRequestHeader {
                name: WOULD_SHED_HEADER.into(),
            });
        }
        None
    }

    /// Go on: after its delay if a leaky bucket shapes it (a request both shaped and queued by
    /// shedding goes after its delay, uncounted by the bulkhead: shaping already paces it), to
    /// the queue if shedding asked for it, else upstream; a quota path's request is answered.
    fn admitted_step(&mut self, limiter: &Limiter, store: &mut dyn Store) -> Step {
        if self.probe.is_some() {
            return self.answer_probe(limiter, store);
        }
        if let Some(until_us) = self.delay_until {
            self.queued = None;
            return Step::Delay { until_us };
        }
        match self.queued {
            Some((seat, level, wait_budget_us)) => Step::Queue {
                seat,
                level,
                wait_budget_us,
            },
            None => Step::Continue,
        }
    }

    /// A quota path's request the rules admitted: answered instead of forwarded, at once (what
    /// the rules spent on it stays spent), its slot given back.
    #[cold]
    #[inline(never)]
    fn answer_probe(&mut self, limiter: &Limiter, store: &mut dyn Store) -> Step {
        self.answered = true;
        self.delay_until = None;
        self.chargeable.clear();
        self.give_up_seat(limiter, store);
        match self.probe.take() {
            Some(probe) => Step::Respond(probe.reply),
            None => Step::Continue,
        }
    }

    /// A request answered locally gives its slot back at once (and leaves no queue).
    fn give_up_seat(&mut self, limiter: &Limiter, store: &mut dyn Store) {
        let waited = self.queued.take().map(|(seat, _, _)| seat);
        self.gave_up = self.seat.map(|(seat, _)| seat).or(waited);
        if let (Some((seat, _)), Some(shedding)) =
            (self.seat.take(), limiter.policy().shedding.as_ref())
        {
            let _ = shed::release(shedding, seat, store);
        }
    }

    /// The queued request got a slot at `now_us` (the queue took it for it).
    pub fn seated(&mut self, now_us: u64) {
        if let Some((seat, _, _)) = self.queued.take() {
            self.seat = Some((seat, now_us));
        }
    }

    /// The queued request was shed while it waited: what rate limits spent on it is given back.
    pub fn unseated(&mut self, limiter: &Limiter, store: &mut dyn Store) {
        if self.queued.take().is_some() {
            limiter.refund(&self.spent, store);
            self.spent.clear();
            self.answered = true;
        }
    }

    /// The wait queue refused the request (full, and keeping its waiters): what the rate limits
    /// spent on it is given back and it is shed with `queue_full`, its `Retry-After` spread by
    /// `draw` as every shed answer's. The seat it would have taken, for the shedding metrics, and
    /// the reply; `None` when it was not waiting for a seat.
    pub fn queue_full(
        &mut self,
        limiter: &Limiter,
        level: Level,
        draw: f64,
        store: &mut dyn Store,
    ) -> Option<(Seat, Reply)> {
        let seat = self.waiting()?;
        let shedding = limiter.policy().shedding.as_ref()?;
        self.unseated(limiter, store);
        let reason = ShedReason::QueueFull;
        let reply = crate::reply::overloaded(shedding, seat, level, reason, draw, self.protocol)
            .linking(shedding.docs_url.as_deref());
        Some((seat, reply))
    }

    /// The request was held for its slot and its stream ended before it left: what the rules
    /// spent on it is given back (its slot, to the next request).
    pub fn cancel_delay(&mut self, limiter: &Limiter, store: &mut dyn Store) {
        if self.delay_until.take().is_some() {
            limiter.refund(&self.spent, store);
            self.spent.clear();
        }
    }

    /// The bulkhead seat this request waits for, if it waits.
    pub fn waiting(&self) -> Option<Seat> {
        self.queued.map(|(seat, _, _)| seat)
    }

    /// Whether it holds a bulkhead slot.
    pub fn holds_slot(&self) -> bool {
        self.seat.is_some()
    }

    /// The upstream's (or Envoy's, for it) response status was seen at `now_us`.
    pub fn responded(&mut self, status: u32, now_us: u64) {
        if self.answer.is_none() {
            self.answer = Some((status, now_us));
        }
    }

    /// The response carried `grpc-status` (in its headers, a trailers-only answer, or in its
    /// trailers): a success-rate sample counts a gRPC failure by it. A value that is not a
    /// number is ignored.
    pub fn grpc_responded(&mut self, value: &str) {
        if let Ok(code) = value.trim().parse::<u32>() {
            self.grpc_status = Some(code);
        }
    }

    /// The response header in which the upstream of the request's bulkhead reports its
    /// saturation, if the request holds a slot of a bulkhead that reads one. Only the
    /// upstream's response counts: a request header of the same name is never read.
    pub fn saturation_header<'a>(&self, limiter: &'a Limiter) -> Option<&'a str> {
        let (seat, _) = self.seat?;
        let shedding = limiter.policy().shedding.as_ref()?;
        shedding
            .bulkheads
            .get(seat.bulkhead)?
            .saturation_header
            .as_deref()
    }

    /// The upstream's report in that header, for its bulkhead's samples
    /// ([`crate::worker::ShedWorker::reported`]): `None` unless the request holds a slot of a
    /// bulkhead that reads one and `value` parses strictly
    /// ([`crate::shed::policy::parse_saturation`]).
    pub fn saturation_report(&self, limiter: &Limiter, value: &str) -> Option<(BulkheadId, f64)> {
        self.saturation_header(limiter)?;
        let (seat, _) = self.seat?;
        Some((seat.bulkhead, crate::shed::policy::parse_saturation(value)?))
    }

    /// [`Exchange::finish`]'s refund of the `count_when` reservations no status answered, out
    /// of line.
    #[inline(never)]
    fn end_reservations(&mut self, limiter: &Limiter, store: &mut dyn Store) {
        let mut pending: Vec<RuleId> = Vec::new();
        self.chargeable.retain(|(rule, _)| {
            let reserved = counts_by_status(limiter, *rule);
            if reserved && !pending.contains(rule) {
                pending.push(*rule);
            }
            !reserved
        });
        self.give_back(limiter, &pending, store);
    }

    /// [`Exchange::finish`]'s release of the slots the request took, out of line.
    #[inline(never)]
    fn release_slots(&mut self, limiter: &Limiter, store: &mut dyn Store) {
        limiter.release(&self.spent, store);
        self.spent.clear();
    }

    /// The stream ended, however it ended (response, reset, timeout, local reply): the
    /// concurrency slots it took and its bulkhead slot go back, and the latency becomes a
    /// sample. Runs once; later calls do nothing.
    pub fn finish(&mut self, limiter: &Limiter, store: &mut dyn Store) -> Vec<Effect> {
        let mut effects = Vec::new();
        // A `count_when` rule's reservation whose answer never came (a reset, a timeout before
        // the response's headers) goes back: such a request is not counted.
        if limiter.counts_by_status() && !self.chargeable.is_empty() {
            self.end_reservations(limiter, store);
        }
        // Only a concurrent limit's slots go back (another rule's spent tokens stay spent).
        if limiter.holds_slots() && !self.spent.is_empty() {
            self.release_slots(limiter, store);
        }
        let Some((seat, since_us)) = self.seat.take() else {
            return effects;
        };
        if let Some(shedding) = limiter.policy().shedding.as_ref() {
            let _ = shed::release(shedding, seat, store);
        }
        if let Some((status, at_us)) = self.answer.take() {
            effects.push(Effect::Finished {
                bulkhead: seat.bulkhead,
                latency_us: at_us.saturating_sub(since_us),
                status,
                grpc_status: self.grpc_status,
            });
        }
        effects
    }
}

/// Whether `rule` counts its requests by their answer's status (`count_when`).
fn counts_by_status(limiter: &Limiter, rule: RuleId) -> bool {
    limiter
        .rule(rule)
        .is_some_and(|r| r.rule.count_when.is_some())
}

/// The request header (and response header) by which warn mode says what it would have shed.
pub const WOULD_SHED_HEADER: &str = "x-sluice-would-shed";
