//! A request's whole life as a pure state machine: the host feeds it what it saw and the time,
//! and carries out the [`Effect`]s and the [`Step`] it returns.
//!
//! ```text
//! request seen ──start──▶ decided ──(strict rules)──▶ checks out ──answered/failed──▶ final
//!                            │                                                          │
//!                            └───────────── Continue / Respond(429) ◀──────────────────┘
//! response seen ──response_headers──▶ the rate-limit headers to add
//! ```
//!
//! Local and cached rules are decided at once from the store; each strict rule sends one
//! check and the request waits for the answers. A check that fails (no answer, an error, a
//! timeout) counts against the circuit breaker and the rule decides by its fallback. A strict
//! denial gives back what the other rules spent. Nothing here reads a clock or does I/O.

use crate::decision::{Decision, Outcome, Quota, Spent};
use crate::headers::{denial_body, render, retry_after_seconds};
use crate::limit::Limit;
use crate::limiter::{Conditions, Enforced, Limiter, RuleAnswer};
use crate::policy::Mode;
use crate::policy::RuleId;
use crate::protocol::{CheckRequest, CheckResponse, LimitSpec};
use crate::proxy_sync;
use crate::request::RequestView;
use crate::store::Store;

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
}

/// A local answer to send instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
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
    /// A lease ran out: bring the next sync round forward ([`proxy_sync::hurry`]).
    Hurry,
    /// Send this strict check; feed its answer (or its failure, even to be sent) to
    /// [`Exchange::answered`] with `check`.
    Check { check: usize, request: CheckRequest },
    /// A strict check failed; the breaker in the store counted it (metrics, and the host
    /// re-reads the breaker).
    CheckFailed,
}

/// One request's state between its callbacks.
#[derive(Debug, Default)]
pub struct Exchange {
    /// The rule and quota whose headers go on the response (the most restrictive).
    quota: Option<(RuleId, Quota)>,
    /// Strict checks out: (rule, key), by check number; `None` once answered.
    checks: Vec<Option<(RuleId, String)>>,
    /// What local and cached rules spent, given back if a strict rule denies.
    spent: Vec<Spent>,
    /// The first strict denial.
    denied: Option<(RuleId, RuleAnswer)>,
    /// The request was answered locally (no response headers to add).
    answered: bool,
}

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
        let mut exchange = Exchange::default();
        let mut effects = Vec::new();
        if moment.bypass || limiter.bypassed(request.path(), client) {
            effects.push(Effect::Bypassed);
            return (exchange, Step::Continue, effects);
        }
        let conditions = Conditions {
            now_us: moment.now_us,
            service_up: moment.service_up,
        };
        let evaluation = limiter.decide(request, conditions, store);
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
        match evaluation.decision {
            Decision::Deny {
                rule,
                quota,
                retry_after_us,
            } => {
                exchange.answered = true;
                let reply = denial(limiter, rule, &quota, retry_after_us);
                (exchange, Step::Respond(reply), effects)
            }
            Decision::Allow { quota } => {
                if let Some((rule, quota)) = quota {
                    exchange.offer(rule, quota);
                }
                exchange.spent = evaluation.spent;
                for (rule, key) in limiter.strict_keys(request) {
                    if moment.service_up {
                        let Some(Enforced { rule: spec, .. }) = limiter.rule(rule) else {
                            continue;
                        };
                        let check = exchange.checks.len();
                        effects.push(Effect::Check {
                            check,
                            request: CheckRequest {
                                key: key.clone(),
                                limits: spec.limits.iter().map(LimitSpec::from).collect(),
                                cost: 1,
                            },
                        });
                        exchange.checks.push(Some((rule, key)));
                    } else {
                        exchange.fall_back(limiter, rule, &key, moment.now_us, store, &mut effects);
                    }
                }
                let step = exchange.step(limiter, store);
                (exchange, step, effects)
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
        match answer {
            Some(answer) => {
                let limit = limiter
                    .rule(rule)
                    .and_then(|r| r.rule.limits.first().copied())
                    .unwrap_or(Limit::UNIT);
                let answer = RuleAnswer {
                    allowed: answer.allowed,
                    quota: Quota {
                        limit,
                        remaining: answer.remaining,
                        reset_us: answer.reset_ms.saturating_mul(1_000),
                    },
                    retry_after_us: answer.retry_after_ms.saturating_mul(1_000),
                };
                self.record(limiter, rule, answer, &mut effects);
            }
            None => {
                if let Some(service) = limiter.policy().service.as_ref() {
                    // A failed check counts against the breaker; it leaves the sync round alone.
                    let _ = proxy_sync::update_state(store, |s| {
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
        if self.answered {
            return Vec::new();
        }
        let Some((rule, quota)) = self.quota.take() else {
            return Vec::new();
        };
        let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
        render(limiter.policy().headers, name, &quota)
    }

    /// Strict checks still out.
    pub fn checks_out(&self) -> usize {
        self.checks.iter().filter(|c| c.is_some()).count()
    }

    /// Keeps the most restrictive quota for the response headers.
    fn offer(&mut self, rule: RuleId, quota: Quota) {
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
        match limiter.fallback(rule, key, now_us, store) {
            Some(answer) => self.record(limiter, rule, answer, effects),
            None => effects.push(Effect::Outcome {
                rule,
                outcome: Outcome::Unavailable,
            }),
        }
    }

    fn record(
        &mut self,
        limiter: &Limiter,
        rule: RuleId,
        answer: RuleAnswer,
        effects: &mut Vec<Effect>,
    ) {
        let shadow = limiter
            .rule(rule)
            .is_some_and(|r| r.rule.mode == Mode::Shadow);
        let outcome = match (answer.allowed, shadow) {
            (true, _) => Outcome::Allowed,
            (false, true) => Outcome::ShadowDenied,
            (false, false) => Outcome::Denied,
        };
        effects.push(Effect::Outcome { rule, outcome });
        if outcome == Outcome::Denied {
            if self.denied.is_none() {
                self.denied = Some((rule, answer));
            }
        } else {
            self.offer(rule, answer.quota);
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
                self.answered = true;
                Step::Respond(denial(limiter, rule, &answer.quota, answer.retry_after_us))
            }
            None => Step::Continue,
        }
    }
}

/// The 429 for a denial by `rule`.
fn denial(limiter: &Limiter, rule: RuleId, quota: &Quota, retry_after_us: u64) -> Reply {
    let policy = limiter.policy();
    let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
    let retry_after = retry_after_seconds(retry_after_us);
    let mut headers = vec![
        ("retry-after", retry_after.to_string()),
        ("content-type", "application/json".to_string()),
    ];
    headers.extend(render(policy.headers, name, quota));
    Reply {
        status: 429,
        headers,
        body: denial_body(name, quota, retry_after),
    }
}
