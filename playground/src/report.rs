//! What the playground answers, as plain serializable values.

use serde::Serialize;
use sluice_core::policy::{Consistency, Mode, Policy};
use sluice_core::{Limit, Outcome};

use crate::state::LimitView;

/// A configuration that does not parse: the parser's own field and message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Invalid {
    pub ok: bool,
    /// The field, as the filter's log line names it (`rules[0].limits[0].per`); empty for the
    /// whole document.
    pub field: String,
    pub problem: String,
    /// `field: problem`, exactly as the filter logs it after `invalid configuration: `.
    pub message: String,
}

impl Invalid {
    pub fn new(field: &str, problem: &str) -> Invalid {
        let message = if field.is_empty() {
            problem.to_string()
        } else {
            format!("{field}: {problem}")
        };
        Invalid {
            ok: false,
            field: field.to_string(),
            problem: problem.to_string(),
            message,
        }
    }
}

/// A configuration that parses: its rules.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Valid {
    pub ok: bool,
    pub rules: Vec<RuleInfo>,
    /// What the simulation does differently from a proxy (cached rules counted exactly, ...).
    pub notes: Vec<String>,
}

/// Either answer of [`validation`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Validation {
    Valid(Valid),
    Invalid(Invalid),
}

/// Parses `config` with the filter's parser.
pub fn validation(config: &str) -> Validation {
    match sluice_core::parse(config.as_bytes()) {
        Ok(policy) => Validation::Valid(Valid {
            ok: true,
            rules: rules(&policy),
            notes: notes(&policy, true),
        }),
        Err(e) => Validation::Invalid(Invalid::new(&e.field, &e.problem)),
    }
}

/// One rule as the page lists it (a rule with tiers is one per tier, `rule/tier`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleInfo {
    pub name: String,
    pub limits: Vec<LimitInfo>,
    pub mode: &'static str,
    pub consistency: &'static str,
    pub key: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LimitInfo {
    pub requests: u64,
    pub per: String,
    pub seconds: u64,
    pub burst: u64,
    pub algorithm: &'static str,
}

impl From<&Limit> for LimitInfo {
    fn from(limit: &Limit) -> LimitInfo {
        LimitInfo {
            requests: limit.requests(),
            per: limit.period().to_string(),
            seconds: limit.period().seconds(),
            burst: limit.burst(),
            algorithm: limit.algorithm().name(),
        }
    }
}

pub fn rules(policy: &Policy) -> Vec<RuleInfo> {
    policy
        .rules
        .iter()
        .map(|rule| RuleInfo {
            name: rule.name.clone(),
            limits: rule.limits.iter().map(LimitInfo::from).collect(),
            mode: match rule.mode {
                Mode::Enforce => "enforce",
                Mode::Shadow => "monitor",
                Mode::Warn => "warn",
            },
            consistency: consistency(rule.consistency),
            key: rule.key.iter().map(|k| k.name()).collect(),
        })
        .collect()
}

fn consistency(c: Consistency) -> &'static str {
    match c {
        Consistency::Local => "local",
        Consistency::Cached => "cached",
        Consistency::Strict => "strict",
    }
}

/// How the simulation differs from a proxy for this policy, over a trace whose requests say
/// their response's status (`statuses`) or not.
pub fn notes(policy: &Policy, statuses: bool) -> Vec<String> {
    let mut notes = Vec::new();
    for rule in policy.rules.iter().filter(|r| r.count_when.is_some()) {
        notes.push(if statuses {
            format!(
                "rule {} counts only the answers whose status it names (count_when): a request of the trace without status=NNN is taken as answered 200",
                rule.name
            )
        } else {
            format!(
                "rule {} counts only the answers whose status it names (count_when), and the trace gives no status (extras status=401): it counts nothing here",
                rule.name
            )
        });
    }
    for rule in &policy.rules {
        if rule.consistency != Consistency::Local {
            notes.push(format!(
                "rule {} is {}: simulated as one exact count, what a fleet sharing it through the counter service approaches",
                rule.name,
                consistency(rule.consistency)
            ));
        }
    }
    for rule in &policy.rules {
        if let Some(share) = rule
            .share
            .filter(|_| rule.consistency != Consistency::Local)
        {
            notes.push(format!(
                "rule {} falls back to its limits divided among the proxies the counter service counts (share: fleet): the simulation has the service, so no fallback decides; a count is believed up to {} (max_proxies); a proxy that never heard a count assumes {} (assume_proxies)",
                rule.name, share.max_proxies, share.assume_proxies
            ));
        }
    }
    for rule in &policy.rules {
        if rule.penalty_us > 0 && rule.consistency != Consistency::Local {
            notes.push(format!(
                "rule {}'s penalty is shared fleet-wide through the counter service ({}): a key that goes over on one proxy is denied on every proxy until it ends; the simulation plays one proxy",
                rule.name,
                consistency(rule.consistency)
            ));
        }
        let Some(dynamic) = &rule.dynamic else {
            continue;
        };
        if let Some(scale) = &dynamic.scale {
            use sluice_core::limit::dynamic::LevelSource;
            let whose = match scale.level {
                LevelSource::Proxy => "the proxy's shedding level",
                LevelSource::Fleet => "the fleet level the counter service sends",
            };
            notes.push(format!(
                "rule {} scales its limits by {whose} (scale): load is not simulated, so its limits here are those of the normal level",
                rule.name
            ));
        }
        if !dynamic.schedule.is_empty() {
            let windows: Vec<String> = dynamic.schedule.iter().map(|w| w.utc()).collect();
            notes.push(format!(
                "rule {} has other limits during {} UTC (schedule), simulated: the trace's second 0 is 00:00 UTC (second 79200 is 22:00)",
                rule.name,
                windows.join(", ")
            ));
        }
    }
    for rule in policy.rules.iter().filter(|r| r.quota_path.is_some()) {
        notes.push(format!(
            "rule {} answers {} with the caller's own quota (quota_path): such requests of the trace are decided by the other rules as any request and, admitted, answered 200 (decision answered), spending nothing of the rule's",
            rule.name,
            rule.quota_path.as_deref().unwrap_or("")
        ));
    }
    if let Some(shedding) = &policy.shedding {
        notes.push(
            "shedding is not simulated (it needs upstream latencies): only the rate limits decide"
                .into(),
        );
        for b in &shedding.bulkheads {
            use sluice_core::shed::policy::ShedMode;
            let rollout = match (b.mode, b.ramp_percent) {
                (ShedMode::Enforce, 100) => continue,
                (ShedMode::Enforce, p) => format!("enforces {p}% of what it would shed"),
                (mode, _) => format!("is in {} mode: it would shed nothing", mode.name()),
            };
            notes.push(format!("bulkhead {} {rollout}", b.name));
        }
        for b in &shedding.bulkheads {
            if b.curve.is_some() {
                notes.push(format!(
                    "bulkhead {} sheds at random by its curve, by the requests in flight: not simulated (no request is in flight without an upstream); sluice explain shows the curve",
                    b.name
                ));
            }
            if let Some(header) = &b.saturation_header {
                notes.push(format!(
                    "bulkhead {} reads the upstream's saturation in response header {header}: not simulated (no upstream answers)",
                    b.name
                ));
            }
            if let sluice_core::shed::policy::LimitKind::Adaptive(a) = b.limit {
                notes.push(format!(
                    "bulkhead {} has an adaptive limit by its {} latency (with re-probes at min): not simulated (it needs upstream latencies)",
                    b.name,
                    if a.percentile > 0.0 { format!("p{}", a.percentile) } else { "mean".into() }
                ));
            }
        }
    }
    let in_flight = policy.rules.iter().any(|r| {
        r.limits
            .iter()
            .any(|l| l.algorithm() == sluice_core::limit::Algorithm::Concurrency)
    });
    if in_flight {
        notes.push(
            "requests in flight (concurrent limits) are held for the trace's duration column, in seconds; a request without one ends at once and holds no slot"
                .into(),
        );
    }
    if policy.rules.iter().any(|r| r.cost_header.is_some()) {
        notes.push("costs reported by responses (cost_header) are not simulated".into());
    }
    if policy.rules.iter().any(|r| r.top_keys > 0) {
        notes.push(
            "top keys (top_keys) are counted as a proxy counts them and change no decision; the fleet's table is the counter service's (sluice top), not shown here"
                .into(),
        );
    }
    for rule in &policy.rules {
        if let Some(from) = &rule.limits_from {
            notes.push(format!(
                "rule {} reads its limit from each request's {} (in the trace's extras, {}=5000), at most {}; a request without a whole number there counts with the rule's own limit",
                rule.name,
                from.from.name(),
                from.from.name(),
                from.max
            ));
        }
    }
    if policy.service.is_some() {
        notes.push(
            "live overrides (a key's own limits, blocks, new limits) are set through the counter service's admin API and are not played here: the configuration's limits decide"
                .into(),
        );
    }
    notes
}

/// Every request's answer and the counts over time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub ok: bool,
    /// Where the trace's second 0 is (microseconds since the Unix epoch; a UTC midnight, so
    /// calendar windows start with the trace).
    pub epoch_us: u64,
    pub rules: Vec<RuleInfo>,
    pub notes: Vec<String>,
    pub totals: Totals,
    pub requests: Vec<Answer>,
    pub series: Series,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    pub offered: u64,
    /// Forwarded upstream, at once or delayed by a shaping limit.
    pub admitted: u64,
    /// Of the admitted, those a leaky bucket held.
    pub delayed: u64,
    /// 429.
    pub denied: u64,
    /// 503: a rule that fails closed could not decide.
    pub unavailable: u64,
    pub rules: Vec<RuleTotals>,
}

/// What one rule said, over the whole trace.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RuleTotals {
    /// Requests the rule counted (matched, with a key).
    pub matched: u64,
    pub allowed: u64,
    pub denied: u64,
    /// Would have denied: monitor mode, a ramp, or warn mode.
    pub shadow_denied: u64,
    pub unavailable: u64,
}

impl RuleTotals {
    pub fn count(&mut self, outcome: Outcome) {
        self.matched += 1;
        match outcome {
            Outcome::Allowed => self.allowed += 1,
            Outcome::Denied => self.denied += 1,
            Outcome::ShadowDenied | Outcome::Warned => self.shadow_denied += 1,
            // Went on, uncounted by this rule.
            Outcome::Uncounted => self.allowed += 1,
            Outcome::FailedClosed => self.unavailable += 1,
        }
    }
}

/// One request: what the client got.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Answer {
    /// Seconds after the start of the trace.
    pub t: f64,
    pub line: usize,
    pub client: String,
    pub method: String,
    pub path: String,
    /// `admitted`, `delayed`, `denied` or `unavailable`.
    pub decision: &'static str,
    /// 200 stands for the upstream's answer, to which the headers are added.
    pub status: u32,
    /// The rule that denied it, or whose quota the headers show.
    pub rule: Option<String>,
    pub retry_after: Option<u64>,
    /// How long a shaping limit held it.
    pub delay_ms: Option<f64>,
    /// Exactly the headers sluice sets on the response (a local answer's, or those added to
    /// the upstream's).
    pub headers: Vec<(String, String)>,
    /// A local answer's body.
    pub body: Option<String>,
    pub outcomes: Vec<RuleAnswer>,
}

/// What one rule said of one request, and its key's limits just after.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleAnswer {
    /// Index in `rules`.
    pub rule: usize,
    pub outcome: &'static str,
    /// The key's parts, joined by ` | `.
    pub key: Option<String>,
    pub state: Vec<LimitView>,
}

pub fn outcome_name(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Allowed => "allowed",
        Outcome::Denied => "denied",
        Outcome::ShadowDenied => "shadow_denied",
        Outcome::Warned => "warned",
        Outcome::Uncounted => "uncounted",
        Outcome::FailedClosed => "unavailable",
    }
}

/// Counts per time bucket.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Series {
    /// Seconds per bucket; bucket `i` starts at `i × bucket_s`.
    pub bucket_s: f64,
    pub offered: Vec<u32>,
    pub admitted: Vec<u32>,
    pub denied: Vec<u32>,
    pub rules: Vec<RuleSeries>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RuleSeries {
    pub matched: Vec<u32>,
    pub allowed: Vec<u32>,
    pub denied: Vec<u32>,
    pub shadow_denied: Vec<u32>,
}
