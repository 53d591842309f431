//! Playing a trace through a configuration, one proxy, the way the filter drives core: each
//! request goes through [`Exchange`], the same state machine the filter feeds, on an in-memory
//! store and a clock that is the trace's own.

use sluice_core::exchange::{Effect, Exchange, Moment, Step};
use sluice_core::limiter::key::SEPARATOR;
use sluice_core::policy::{Consistency, Policy, RuleId};
use sluice_core::{Limiter, MemoryStore, Outcome};

use crate::report::{
    self, outcome_name, Answer, Invalid, Report, RuleAnswer, RuleSeries, RuleTotals, Series, Totals,
};
use crate::state;
use crate::trace::{parse_trace, Arrival};

/// The trace's second 0: 2026-01-01T00:00:00Z, a UTC midnight, so minute, hour and day windows
/// start with the trace.
pub const EPOCH_US: u64 = 1_767_225_600 * 1_000_000;

/// Buckets of the series: about this many over the trace.
const BUCKETS: f64 = 120.0;

/// Parses both and plays the trace; `Err` names the field or the trace line.
pub fn simulate(config: &str, trace: &str) -> Result<Report, Invalid> {
    let policy =
        sluice_core::parse(config.as_bytes()).map_err(|e| Invalid::new(&e.field, &e.problem))?;
    let arrivals = parse_trace(trace).map_err(|e| Invalid::new("trace", &e))?;
    Ok(simulate_policy(policy, &arrivals))
}

/// Plays `arrivals` (in time order) through `policy` on one proxy. Rules shared through the
/// counter service are counted exactly here (as one local count), shedding is left out: the
/// report's notes say so.
pub fn simulate_policy(mut policy: Policy, arrivals: &[Arrival]) -> Report {
    let rules = report::rules(&policy);
    let notes = report::notes(&policy, arrivals.iter().any(|a| a.status.is_some()));
    for rule in &mut policy.rules {
        rule.consistency = Consistency::Local;
    }
    policy.shedding = None;
    let limiter = Limiter::new(policy);
    let mut store = MemoryStore::default();

    let span_s = arrivals.last().map_or(0.0, |a| a.at_us as f64 / 1e6);
    let bucket_s = bucket_width(span_s);
    let buckets = ((span_s / bucket_s).floor() as usize + 1).min(10 * BUCKETS as usize);
    let zeros = vec![0u32; buckets];
    let mut series = Series {
        bucket_s,
        offered: zeros.clone(),
        admitted: zeros.clone(),
        denied: zeros.clone(),
        rules: vec![
            RuleSeries {
                matched: zeros.clone(),
                allowed: zeros.clone(),
                denied: zeros.clone(),
                shadow_denied: zeros,
            };
            rules.len()
        ],
    };
    let mut totals = Totals {
        rules: vec![RuleTotals::default(); rules.len()],
        ..Totals::default()
    };
    let mut requests = Vec::with_capacity(arrivals.len());

    // Requests in flight, by when their response ends: each gives back what it holds (a
    // concurrent limit's slot) then, as the filter's stream end does.
    let mut in_flight: std::collections::BinaryHeap<InFlight> = Default::default();
    for (order, arrival) in arrivals.iter().enumerate() {
        let now_us = EPOCH_US + arrival.at_us;
        while in_flight.peek().is_some_and(|f| f.ends_us <= now_us) {
            if let Some(mut ended) = in_flight.pop() {
                ended.exchange.finish(&limiter, &mut store);
            }
        }
        let (answer, mut exchange) = play(&limiter, &mut store, arrival, now_us);
        if arrival.duration_us > 0 && matches!(answer.decision, "admitted" | "delayed") {
            in_flight.push(InFlight {
                ends_us: now_us.saturating_add(arrival.duration_us),
                order,
                exchange,
            });
        } else {
            exchange.finish(&limiter, &mut store);
        }
        let b = ((arrival.at_us as f64 / 1e6 / bucket_s) as usize).min(buckets - 1);
        totals.offered += 1;
        series.offered[b] += 1;
        match answer.decision {
            "admitted" | "delayed" | "answered" => {
                totals.admitted += 1;
                totals.delayed += (answer.decision == "delayed") as u64;
                series.admitted[b] += 1;
            }
            "denied" => {
                totals.denied += 1;
                series.denied[b] += 1;
            }
            _ => {
                totals.unavailable += 1;
                series.denied[b] += 1;
            }
        }
        for o in &answer.outcomes {
            let (Some(t), Some(s)) = (totals.rules.get_mut(o.rule), series.rules.get_mut(o.rule))
            else {
                continue;
            };
            s.matched[b] += 1;
            match o.outcome {
                "allowed" | "uncounted" => s.allowed[b] += 1,
                "denied" | "unavailable" => s.denied[b] += 1,
                _ => s.shadow_denied[b] += 1,
            }
            t.count(match o.outcome {
                "allowed" => Outcome::Allowed,
                "denied" => Outcome::Denied,
                "unavailable" => Outcome::FailedClosed,
                "uncounted" => Outcome::Uncounted,
                _ => Outcome::ShadowDenied,
            });
        }
        requests.push(answer);
    }
    Report {
        ok: true,
        epoch_us: EPOCH_US,
        rules,
        notes,
        totals,
        requests,
        series,
    }
}

/// An admitted request whose response has not ended yet: the soonest to end first (then the
/// first to arrive).
struct InFlight {
    ends_us: u64,
    order: usize,
    exchange: Exchange,
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        (self.ends_us, self.order) == (other.ends_us, other.order)
    }
}

impl Eq for InFlight {}

impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InFlight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Reversed: the heap pops the soonest end.
        (other.ends_us, other.order).cmp(&(self.ends_us, self.order))
    }
}

/// One request through the exchange, as the filter would: its answer, its headers, and each
/// rule's key and limits just after; and the exchange, whose stream ends when the caller says.
fn play(
    limiter: &Limiter,
    store: &mut MemoryStore,
    arrival: &Arrival,
    now_us: u64,
) -> (Answer, Exchange) {
    let mut request = arrival.request();
    let moment = Moment::at(now_us);
    let (mut exchange, mut step, effects) = Exchange::start(
        limiter,
        &mut request,
        Some(arrival.client_ip()),
        moment,
        store,
    );
    let mut outcomes: Vec<(RuleId, Outcome)> = Vec::new();
    let mut checks = Vec::new();
    for effect in effects {
        match effect {
            Effect::Outcome { rule, outcome } => outcomes.push((rule, outcome)),
            Effect::Check { check, .. } => checks.push(check),
            _ => {}
        }
    }
    // Every rule is local here, so no check goes out; were one to, it would fail and the rule
    // decide by its fallback, as a proxy without its service.
    for check in checks {
        let (next, more) = exchange.answered(limiter, check, None, moment, store);
        if let Some(next) = next {
            step = next;
        }
        outcomes.extend(more.into_iter().filter_map(|e| match e {
            Effect::Outcome { rule, outcome } => Some((rule, outcome)),
            _ => None,
        }));
    }
    let name = |rule: RuleId| limiter.rule(rule).map(|r| r.rule.name.clone());
    let (decision, status, headers, body, delay_ms) = match step {
        Step::Respond(reply) => {
            // A quota path's answer (200, the caller's own quota) is not a refusal.
            let decision = match reply.status {
                200 => "answered",
                429 => "denied",
                _ => "unavailable",
            };
            (
                decision,
                reply.status,
                reply
                    .headers
                    .iter()
                    .map(|(name, value)| (name.to_string(), value.to_string()))
                    .collect(),
                Some(reply.body),
                None,
            )
        }
        Step::Delay { until_us } => (
            "delayed",
            200,
            owned(exchange.response_headers(limiter)),
            None,
            Some(until_us.saturating_sub(now_us) as f64 / 1e3),
        ),
        Step::Continue | Step::Wait | Step::Queue { .. } => (
            "admitted",
            arrival.status.unwrap_or(200),
            owned(exchange.response_headers(limiter)),
            None,
            None,
        ),
    };
    // The upstream's answer: the rules that count by its status (`count_when`) count it now.
    if decision == "admitted" || decision == "delayed" {
        let status = arrival.status.unwrap_or(200);
        exchange.response_status(limiter, status, now_us, store);
    }
    let retry_after = headers
        .iter()
        .find(|(n, _)| *n == "retry-after")
        .and_then(|(_, v)| v.parse().ok());
    let rule = outcomes
        .iter()
        .find(|(_, o)| matches!(o, Outcome::Denied | Outcome::FailedClosed))
        .filter(|_| decision == "denied" || decision == "unavailable")
        .and_then(|&(r, _)| name(r))
        .or_else(|| quota_rule(limiter, &headers));
    let outcomes = outcomes
        .into_iter()
        .map(|(rule, outcome)| {
            let key = limiter.rule(rule).and_then(|r| {
                sluice_core::limiter::key::build(r.rule, &mut request)
                    .into_iter()
                    .next()
            });
            let state = key
                .as_deref()
                .map(|k| state::view(limiter, rule, k, now_us, store))
                .unwrap_or_default();
            RuleAnswer {
                rule: rule.index(),
                outcome: outcome_name(outcome),
                key: key.map(|k| shown_key(&k)),
                state,
            }
        })
        .collect();
    let answer = Answer {
        t: arrival.at_us as f64 / 1e6,
        line: arrival.line,
        client: arrival.client.clone(),
        method: arrival.method.clone(),
        path: arrival.path.clone(),
        decision,
        status,
        rule,
        retry_after,
        delay_ms,
        headers,
        body,
        outcomes,
    };
    (answer, exchange)
}

/// Headers with owned names, as a local reply's come.
fn owned(headers: Vec<(&'static str, String)>) -> Vec<(String, String)> {
    headers
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect()
}

/// The rule whose quota the headers show (`ratelimit: "name";r=..`), for an admitted request.
fn quota_rule(limiter: &Limiter, headers: &[(String, String)]) -> Option<String> {
    let (_, value) = headers.iter().find(|(n, _)| *n == "ratelimit")?;
    let name = value.strip_prefix('"')?.split('"').next()?;
    limiter
        .rules()
        .find(|r| r.rule.name == name)
        .map(|r| r.rule.name.clone())
}

/// A key as a person reads it: its parts after the rule's name.
fn shown_key(key: &str) -> String {
    let mut parts = key.split(SEPARATOR);
    parts.next();
    let shown: Vec<&str> = parts.collect();
    if shown.is_empty() {
        key.to_string()
    } else {
        shown.join(" | ")
    }
}

/// A round width of about `span / BUCKETS` seconds.
fn bucket_width(span_s: f64) -> f64 {
    const NICE: [f64; 22] = [
        0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0,
        600.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0,
    ];
    let want = span_s / BUCKETS;
    NICE.iter()
        .copied()
        .find(|&w| w >= want)
        .unwrap_or(86_400.0)
}
