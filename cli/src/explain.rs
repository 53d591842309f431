//! `sluice explain`: what the configuration does with one request, rule by rule, with the
//! filter's own matching and key building.

use std::fmt::Write;
use std::net::IpAddr;

use serde::Serialize;
use sluice_core::limiter::key;
use sluice_core::policy::{Mode, Rule};
use sluice_core::request::matcher::{HeaderTest, Matcher};
use sluice_core::request::net::{resolve_client, strip_port, ClientFrom};
use sluice_core::shed::policy::LimitKind;
use sluice_core::{Limiter, PlainRequest, RequestView};

use crate::config::{configured_name, plural, Loaded};
use crate::text;

/// The request to explain, as the filter would see it.
#[derive(clap::Args)]
pub struct RequestArgs {
    /// The request's method.
    #[arg(long, default_value = "GET", value_parser = parse_method)]
    pub method: String,
    /// The request's path, with its query if any: `/users/42/export?format=csv`.
    #[arg(long, value_parser = parse_path)]
    pub path: String,
    /// A request header, `NAME: VALUE` (repeatable): `-H 'x-api-key: k1'`.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// The host the request is for (its `:authority`), such as api.example.com.
    #[arg(long)]
    pub host: Option<String>,
    /// The downstream peer's address (Envoy's source.address). With `client_ip.trusted_hops`
    /// set, the client address is read from X-Forwarded-For (`-H`) as the filter reads it.
    #[arg(long, value_name = "ADDRESS", value_parser = parse_address)]
    pub client_ip: Option<String>,
    /// A claim of the token Envoy's jwt_authn verified, `NAME=VALUE` (repeatable), for
    /// `jwt:CLAIM` key parts and tiers: `--claim sub=alice --claim plan=pro`.
    #[arg(long = "claim", value_name = "NAME=VALUE", value_parser = parse_claim)]
    pub claims: Vec<(String, String)>,
}

fn parse_method(text: &str) -> Result<String, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(format!("must be an HTTP method such as GET, got {text:?}"));
    }
    Ok(text.to_ascii_uppercase())
}

fn parse_path(text: &str) -> Result<String, String> {
    if !text.starts_with('/') {
        return Err(format!("must start with '/', got {text:?}"));
    }
    Ok(text.to_string())
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    // `:authority: api.example.com` names a pseudo-header: its name starts with a colon.
    let split = text
        .char_indices()
        .skip(1)
        .find(|(_, c)| *c == ':')
        .map(|(at, _)| at);
    let Some(at) = split else {
        return Err(format!("expected NAME: VALUE, got {text:?}"));
    };
    let name = text[..at].trim();
    let pseudo = name.strip_prefix(':').unwrap_or(name);
    if pseudo.is_empty()
        || !pseudo
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
    {
        return Err(format!("{name:?} is not a header name"));
    }
    Ok((name.to_ascii_lowercase(), text[at + 1..].trim().to_string()))
}

fn parse_claim(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_string(), value.to_string())),
        _ => Err(format!("expected NAME=VALUE, got {text:?}")),
    }
}

fn parse_address(text: &str) -> Result<String, String> {
    match strip_port(text).parse::<IpAddr>() {
        Ok(_) => Ok(text.to_string()),
        Err(_) => Err(format!(
            "expected an IP address (optionally with a port), got {text:?}"
        )),
    }
}

/// What the configuration does with one request.
#[derive(Debug, Serialize)]
pub struct Explanation {
    pub request: RequestSummary,
    pub bypassed: bool,
    /// Why the request skips every rule.
    pub bypass_reason: Option<String>,
    /// Every rule, in order (a rule with tiers is one rule per tier).
    pub rules: Vec<RuleReport>,
    /// The bulkhead that governs the request, when the configuration sheds load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shedding: Option<ShedReport>,
}

/// How load shedding would treat the request.
#[derive(Debug, Serialize)]
pub struct ShedReport {
    /// The bulkhead it belongs to; `None`: not governed (a never-shed path, or no bulkhead matches).
    pub bulkhead: Option<String>,
    pub class: Option<String>,
    /// enforce, monitor or warn: the bulkhead's own, else the shedding's.
    pub mode: Option<&'static str>,
    /// The share of would-be sheds an enforce bulkhead sheds, in percent.
    pub ramp_percent: Option<u8>,
    /// The share of the limit in flight at which its class is shed; `None`: never.
    pub threshold: Option<f64>,
    /// The class's guaranteed share of the limit (`shedding.guaranteed`), if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guaranteed: Option<f64>,
    pub limit: Option<String>,
    /// The bulkhead's shedding curve, as (utilization, share shed) points, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub curve: Option<Vec<(f64, f64)>>,
    /// The response header in which the upstream reports its saturation, if it counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saturation_header: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct RequestSummary {
    pub method: String,
    /// The path as sent, without its query.
    pub path: String,
    /// The query string, if any.
    pub query: Option<String>,
    /// The path rules match and key on, when it differs from the path as sent.
    pub normalized_path: Option<String>,
    pub host: Option<String>,
    /// The client address as the filter finds it.
    pub client_ip: Option<String>,
    /// Where the client address came from.
    pub client_ip_from: String,
}

#[derive(Debug, Serialize)]
pub struct RuleReport {
    /// The rule's name as the limiter knows it (`rule/tier` for a tier).
    pub name: String,
    /// The configured rule.
    pub rule: String,
    pub tier: Option<TierReport>,
    /// The rule's `match`, as configured.
    pub matcher: String,
    pub applies: bool,
    /// Why it does not apply.
    pub reason: Option<String>,
    /// The keys it counts the request against (separator shown as `:`); empty when it does not
    /// apply or the request lacks a key part.
    pub keys: Vec<String>,
    /// Why a rule that applies counts nothing.
    pub not_counted: Option<String>,
    /// The key part the request does not have, when the rule counts it in its missing bucket.
    pub missing: Option<String>,
    pub limits: Vec<LimitReport>,
    pub cost: u64,
    pub cost_header: Option<String>,
    /// The response statuses a `count_when` rule counts (none: every request counts up front).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count_when: Option<Vec<u32>>,
    /// How long a key stays denied once it went over (`penalty`), as configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub penalty: Option<String>,
    /// The limits' factors by load level (`scale`): `×0.5 at high, ×0.25 at critical (proxy level)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale: Option<String>,
    /// The windows of the UTC day with other limits (`schedule`): `22:00-06:00 UTC: 100 per minute`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub schedule: Vec<String>,
    /// The path answered with the caller's own quota of this rule (`quota_path`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota_path: Option<String>,
    /// The quota path answers for any key a caller names (`quota_path_any_key`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub quota_path_any_key: bool,
    /// The counters of its top-keys sketches (`top_keys`), per worker and kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_keys: Option<u32>,
    /// Where the rule's limit is read from the request (`limits_from`), and what this request's
    /// value gives; `limits` are then the ones this request counts with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits_from: Option<LimitsFromReport>,
    pub consistency: &'static str,
    pub fallback: Option<String>,
    pub mode: &'static str,
    pub ramp_percent: u8,
}

#[derive(Debug, Serialize)]
pub struct LimitsFromReport {
    /// The claim or header read (`jwt:rate_per_minute`).
    pub from: String,
    pub max: u64,
    /// The request's value of `from`.
    pub value: Option<String>,
    /// Whether the value set the limit (a whole number of 1 or more); else the rule's own.
    pub used: bool,
}

#[derive(Debug, Serialize)]
pub struct TierReport {
    pub name: String,
    /// The key part the tier is read from.
    pub from: String,
    pub default: bool,
    /// The request's value of `from`.
    pub value: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct LimitReport {
    pub requests: u64,
    /// The period; `in flight` for a concurrent limit (whose `requests` are at once).
    pub per: String,
    /// A concurrent limit's `max_hold`: the longest a slot is held when its release is lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_hold: Option<String>,
    pub burst: u64,
    pub algorithm: &'static str,
    pub text: String,
}

pub fn explain(loaded: &Loaded, args: &RequestArgs) -> Explanation {
    let policy = &loaded.policy;
    let mut request = PlainRequest {
        method: args.method.clone(),
        path: args.path.clone(),
        ..PlainRequest::default()
    };
    if let Some(host) = &args.host {
        request = request.with_header(":authority", host);
    }
    for (name, value) in &args.headers {
        request = request.with_header(name, value);
    }
    for (name, value) in &args.claims {
        request = request.with_claim(name, value);
    }

    // The client address as the filter finds it, by the same function.
    let hops = policy.client_ip.trusted_hops;
    let peer = args.client_ip.clone().unwrap_or_default();
    let xff = request.header("x-forwarded-for");
    let (client, from) = resolve_client(peer, || xff.iter().map(|v| v.as_bytes()), hops);
    let client = client.unwrap_or_default();
    let client_ip_from = match from {
        ClientFrom::ForwardedNotAnAddress => format!(
            "none: X-Forwarded-For's entry {hops} from the right (client_ip.trusted_hops) is not an address"
        ),
        ClientFrom::Forwarded => {
            format!("X-Forwarded-For, entry {hops} from the right (client_ip.trusted_hops)")
        }
        ClientFrom::Nothing => "none given (--client-ip)".to_string(),
        ClientFrom::Peer if hops > 0 => {
            format!("the peer (X-Forwarded-For has fewer than {hops} entries)")
        }
        ClientFrom::Peer => "the peer".to_string(),
    };
    request.client_ip = (!client.is_empty()).then(|| client.clone());

    let limiter = Limiter::new(policy.clone());
    let client_addr: Option<IpAddr> = client.parse().ok();
    let path = request.path().to_string();
    let bypassed = limiter.bypassed(&path, client_addr);
    let bypass_reason = bypassed.then(|| {
        let bypass = &policy.bypass;
        let cidrs = loaded.bypass_cidrs();
        if bypass.all {
            "bypass.all is set".to_string()
        } else if bypass.paths.contains(&path) {
            format!("path {path} is in bypass.paths")
        } else {
            let block = client_addr
                .and_then(|ip| bypass.cidrs.iter().position(|c| c.contains(ip)))
                .and_then(|i| cidrs.get(i).cloned())
                .unwrap_or_default();
            format!("client address {client} is in bypass.cidrs ({block})")
        }
    });

    let normal = request.normal_path().to_string();
    let summary = RequestSummary {
        method: request.method.clone(),
        normalized_path: (normal != path).then_some(normal),
        path,
        query: args.path.split_once('?').map(|(_, q)| q.to_string()),
        host: request.host().map(str::to_string),
        client_ip: request.client_ip.clone(),
        client_ip_from,
    };

    let rules = limiter
        .rules()
        .map(|enforced| report(loaded, enforced.rule, &mut request))
        .collect();
    let shedding = policy.shedding.as_ref().map(|shedding| {
        let seat = sluice_core::shed::admission::classify(shedding, &mut request);
        let spec = seat.and_then(|s| shedding.bulkheads.get(s.bulkhead));
        ShedReport {
            bulkhead: spec.map(|b| b.name.clone()),
            class: seat
                .and_then(|s| shedding.classes.get(s.class))
                .map(|c| c.name.clone()),
            mode: spec.map(|b| b.mode.name()),
            ramp_percent: spec.map(|b| b.ramp_percent),
            threshold: seat.zip(spec).and_then(|(s, b)| b.threshold(s.class)),
            guaranteed: seat
                .and_then(|s| shedding.guaranteed.get(s.class).copied())
                .filter(|&g| g > 0.0),
            limit: spec.map(|b| match b.limit {
                LimitKind::Static(n) => format!("{n} in flight"),
                LimitKind::Adaptive(a) => {
                    let latency = if a.percentile > 0.0 {
                        format!("p{} latency", a.percentile)
                    } else {
                        "mean latency".to_string()
                    };
                    format!(
                        "adaptive, {} to {} in flight, by its {latency}",
                        a.min, a.max
                    )
                }
            }),
            curve: spec
                .and_then(|b| b.curve.as_ref())
                .map(|c| c.points.clone()),
            saturation_header: spec.and_then(|b| b.saturation_header.clone()),
        }
    });
    Explanation {
        request: summary,
        bypassed,
        bypass_reason,
        rules,
        shedding,
    }
}

/// The shedding lines of an explanation.
fn render_shedding(out: &mut String, report: &ShedReport) {
    let Some(bulkhead) = &report.bulkhead else {
        out.push_str("shedding: not governed (a never-shed path, or no bulkhead matches)\n");
        return;
    };
    let _ = write!(out, "shedding: bulkhead {bulkhead}");
    if let Some(limit) = &report.limit {
        let _ = write!(out, " ({limit})");
    }
    let class = report.class.as_deref().unwrap_or_default();
    match report.threshold {
        Some(t) => {
            let _ = write!(
                out,
                ", class {class} shed from {}% of the limit",
                (t * 100.0).round()
            );
        }
        None => {
            let _ = write!(out, ", class {class} never shed (counted in flight)");
        }
    }
    if let Some(g) = report.guaranteed {
        let _ = write!(
            out,
            ", guaranteed {}% of the limit (admitted under it even when the bulkhead is full)",
            (g * 100.0).round()
        );
    }
    out.push('\n');
    if let (Some(points), Some(_)) = (&report.curve, report.threshold) {
        let points: Vec<String> = points
            .iter()
            .map(|(at, shed)| format!("{}% at {}%", (shed * 100.0).round(), (at * 100.0).round()))
            .collect();
        let _ = writeln!(
            out,
            "          below that, shed at random by the curve: {}",
            points.join(", ")
        );
    }
    if let Some(header) = &report.saturation_header {
        let _ = writeln!(
            out,
            "          the upstream's saturation reported in response header {header} counts as the utilization"
        );
    }
    let mode = match (report.mode, report.ramp_percent) {
        (Some("enforce"), Some(p)) if p < 100 => {
            format!("enforce, ramping: {p}% of would-be sheds are shed, the others admitted and counted")
        }
        (Some("enforce"), _) => "enforce: over its share it is answered 503".to_string(),
        (Some("monitor"), _) => "monitor: never shed, what would be shed is counted".to_string(),
        (Some("warn"), _) => {
            "warn: never shed, what would be shed is counted, said in x-sluice-would-shed and logged".to_string()
        }
        _ => String::new(),
    };
    let _ = writeln!(out, "          mode {mode}");
}

fn report(loaded: &Loaded, rule: &Rule, request: &mut PlainRequest) -> RuleReport {
    let configured = configured_name(rule).to_string();
    let applies = rule.applies(request);
    let reason = (!applies).then(|| {
        if rule.matcher.matches(request) {
            tier_mismatch(loaded, rule, request)
        } else {
            mismatch(loaded, &configured, &rule.matcher, request)
        }
    });
    let tier = rule.tier.as_ref().map(|t| TierReport {
        name: t.name.clone(),
        from: t.from.name(),
        default: t.default_for.is_some(),
        value: t.from.values(request).into_iter().next(),
    });
    let keys = if applies {
        key::build(rule, request)
    } else {
        Vec::new()
    };
    // The limits this request counts with: with `limits_from`, its value's.
    let mut limits = rule.limits.clone();
    let limits_from = rule.limits_from.as_ref().map(|from| {
        let value = from.from.values(request).into_iter().next();
        let valued = rule
            .limits
            .first()
            .and_then(|own| from.limit(own, value.as_deref(), rule.cost));
        if let Some(limit) = valued {
            limits = vec![limit];
        }
        LimitsFromReport {
            from: from.from.name(),
            max: from.max,
            value,
            used: valued.is_some(),
        }
    });
    let missing = applies
        .then(|| {
            rule.key
                .iter()
                .find(|part| part.values(request).is_empty())
                .map(|part| part.name())
        })
        .flatten();
    let not_counted = (applies && keys.is_empty()).then(|| {
        let missing = missing.clone().unwrap_or_default();
        format!(
            "the request has no {missing}: the rule does not count it (\"when_missing\": \"skip\")"
        )
    });
    let missing = missing.filter(|_| !keys.is_empty()).map(|part| {
        format!("the request has no {part}: counted with every such request, in the rule's missing bucket")
    });
    RuleReport {
        name: rule.name.clone(),
        matcher: matcher_text(loaded, &configured, &rule.matcher),
        rule: configured,
        tier,
        applies,
        reason,
        keys: keys.iter().map(|k| text::key(k)).collect(),
        not_counted,
        missing,
        limits: limits
            .iter()
            .map(|l| LimitReport {
                requests: l.requests(),
                per: match l.algorithm() {
                    sluice_core::Algorithm::Concurrency => "in flight".to_string(),
                    _ => l.period().to_string(),
                },
                max_hold: (l.algorithm() == sluice_core::Algorithm::Concurrency)
                    .then(|| l.period().to_string()),
                burst: l.burst(),
                algorithm: l.algorithm().name(),
                text: text::limit(l),
            })
            .collect(),
        cost: rule.cost,
        cost_header: rule.cost_header.clone(),
        count_when: rule.count_when.as_ref().map(|c| c.statuses.clone()),
        penalty: (rule.penalty_us > 0).then(|| text::penalty(rule.penalty_us)),
        scale: rule
            .dynamic
            .as_ref()
            .and_then(|d| d.scale.as_ref())
            .map(text::scale),
        schedule: rule
            .dynamic
            .iter()
            .flat_map(|d| d.schedule.iter())
            .map(text::window)
            .collect(),
        quota_path: rule.quota_path.clone(),
        quota_path_any_key: rule.quota_path_any_key,
        top_keys: (rule.top_keys > 0).then_some(rule.top_keys),
        limits_from,
        consistency: text::consistency(rule.consistency),
        fallback: text::fallback(rule),
        mode: text::mode(rule.mode),
        ramp_percent: rule.ramp_percent,
    }
}

/// A matcher as configured: `path_prefix /api/; methods GET, POST`.
pub fn matcher_text(loaded: &Loaded, rule: &str, m: &Matcher) -> String {
    let mut parts = Vec::new();
    if let Some(prefix) = &m.path_prefix {
        parts.push(format!("path_prefix {prefix}"));
    }
    if !m.paths.is_empty() {
        parts.push(format!("paths {}", m.paths.join(", ")));
    }
    if !m.templates.is_empty() {
        parts.push(format!(
            "path_templates {}",
            loaded.match_list(rule, "path_templates").join(", ")
        ));
    }
    if !m.methods.is_empty() {
        parts.push(format!("methods {}", m.methods.join(", ")));
    }
    if !m.hosts.is_empty() {
        parts.push(format!("hosts {}", m.hosts.join(", ")));
    }
    if !m.headers.is_empty() {
        let tests: Vec<String> = m
            .headers
            .iter()
            .map(|(name, test)| text::header_test(name, test))
            .collect();
        parts.push(format!("headers {}", tests.join(", ")));
    }
    if !m.client_cidrs.is_empty() {
        parts.push(format!(
            "client_cidrs {}",
            loaded.match_list(rule, "client_cidrs").join(", ")
        ));
    }
    if parts.is_empty() {
        "every request".to_string()
    } else {
        parts.join("; ")
    }
}

/// Why a request does not match `m`: the first part it fails, each tested by the filter's
/// own matcher.
fn mismatch(loaded: &Loaded, rule: &str, m: &Matcher, request: &mut PlainRequest) -> String {
    let path = request.path().to_string();
    if let Some(prefix) = &m.path_prefix {
        if fails(
            request,
            Matcher {
                path_prefix: Some(prefix.clone()),
                ..Matcher::default()
            },
        ) {
            return format!("path {path} is not under {prefix}");
        }
    }
    if !m.paths.is_empty()
        && fails(
            request,
            Matcher {
                paths: m.paths.clone(),
                ..Matcher::default()
            },
        )
    {
        return format!("path {path} is not one of {}", m.paths.join(", "));
    }
    if !m.templates.is_empty()
        && fails(
            request,
            Matcher {
                templates: m.templates.clone(),
                ..Matcher::default()
            },
        )
    {
        return format!(
            "path {path} matches none of {}",
            loaded.match_list(rule, "path_templates").join(", ")
        );
    }
    if !m.methods.is_empty()
        && fails(
            request,
            Matcher {
                methods: m.methods.clone(),
                ..Matcher::default()
            },
        )
    {
        return format!(
            "method {} is not one of {}",
            request.method,
            m.methods.join(", ")
        );
    }
    if !m.hosts.is_empty()
        && fails(
            request,
            Matcher {
                hosts: m.hosts.clone(),
                ..Matcher::default()
            },
        )
    {
        return match request.host() {
            Some(host) => format!("host {host} is not one of {}", m.hosts.join(", ")),
            None => format!(
                "the request has no host (--host); the rule's hosts are {}",
                m.hosts.join(", ")
            ),
        };
    }
    for (name, test) in &m.headers {
        if fails(
            request,
            Matcher {
                headers: vec![(name.clone(), test.clone())],
                ..Matcher::default()
            },
        ) {
            return match test {
                HeaderTest::Present => format!("header {name} is absent"),
                HeaderTest::Absent => format!("header {name} is present"),
                HeaderTest::Equals(want) => format!("no header {name} is {want:?}"),
            };
        }
    }
    if !m.client_cidrs.is_empty()
        && fails(
            request,
            Matcher {
                client_cidrs: m.client_cidrs.clone(),
                ..Matcher::default()
            },
        )
    {
        let cidrs = loaded.match_list(rule, "client_cidrs").join(", ");
        return match request.client_ip() {
            Some(ip) => format!("client address {ip} is in none of {cidrs}"),
            None => format!("the request has no client address (--client-ip); the rule's client_cidrs are {cidrs}"),
        };
    }
    "its match does not match".to_string()
}

/// Whether the request fails a matcher of one part.
fn fails(request: &mut PlainRequest, only: Matcher) -> bool {
    !only.matches(request)
}

/// Why a request that matches a tier's rule is not of that tier.
fn tier_mismatch(loaded: &Loaded, rule: &Rule, request: &mut PlainRequest) -> String {
    let Some(tier) = &rule.tier else {
        return "its match does not match".to_string();
    };
    let from = tier.from.name();
    let value = tier.from.values(request).into_iter().next();
    match (&tier.default_for, value) {
        (Some(_), Some(v)) => format!(
            "tier {} is the default, but {from} is {v:?}, a tier of its own",
            tier.name
        ),
        (None, Some(v)) => format!("tier {}, but {from} is {v:?}", tier.name),
        (_, None) => {
            let default = loaded
                .policy
                .rules
                .iter()
                .filter_map(|r| r.tier.as_ref())
                .find(|t| t.rule == tier.rule && t.default_for.is_some())
                .map(|t| t.name.clone())
                .unwrap_or_default();
            format!(
                "tier {}, but the request has no {from} (the default tier, {default}, counts it)",
                tier.name
            )
        }
    }
}

/// The explanation as text.
pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let r = &e.request;
    let _ = write!(out, "request:  {} {}", r.method, r.path);
    if let Some(query) = &r.query {
        let _ = write!(out, "?{query}");
    }
    if let Some(normal) = &r.normalized_path {
        let _ = write!(out, " (normalized: {normal})");
    }
    out.push('\n');
    if let Some(host) = &r.host {
        let _ = writeln!(out, "host:     {host}");
    }
    match &r.client_ip {
        Some(ip) => {
            let _ = writeln!(out, "client:   {ip} (from {})", r.client_ip_from);
        }
        None => {
            let _ = writeln!(out, "client:   {}", r.client_ip_from);
        }
    }
    match &e.bypass_reason {
        Some(reason) => {
            let _ = writeln!(
                out,
                "bypassed: yes, {reason}: no rule counts it. Were it not bypassed:"
            );
        }
        None => out.push_str("bypassed: no\n"),
    }
    if let Some(shedding) = &e.shedding {
        render_shedding(&mut out, shedding);
    }
    if e.rules.is_empty() {
        out.push_str("\nno rate-limit rules (the configuration only sheds load)\n");
        return out;
    }
    out.push_str(
        "\nrules, in order (the request is admitted when every rule that applies admits it):\n",
    );
    for (i, rule) in e.rules.iter().enumerate() {
        out.push('\n');
        match &rule.reason {
            None => {
                let _ = writeln!(out, "{}. {}: applies", i + 1, rule.name);
            }
            Some(reason) => {
                let _ = writeln!(out, "{}. {}: does not apply: {reason}", i + 1, rule.name);
            }
        }
        let _ = writeln!(out, "   match:       {}", rule.matcher);
        if let Some(tier) = &rule.tier {
            let default = if tier.default { ", the default" } else { "" };
            let value = match &tier.value {
                Some(v) => format!("{} is {v:?}", tier.from),
                None => format!("no {}", tier.from),
            };
            let _ = writeln!(
                out,
                "   tier:        {}{default} of {} (request: {value})",
                tier.name, rule.rule
            );
        }
        if !rule.applies {
            continue;
        }
        match &rule.not_counted {
            Some(why) => {
                let _ = writeln!(out, "   key:         none: {why}");
            }
            None => {
                let label = if rule.keys.len() == 1 {
                    "key: "
                } else {
                    "keys:"
                };
                let _ = writeln!(out, "   {label}        {}", rule.keys.join(", "));
                if let Some(missing) = &rule.missing {
                    let _ = writeln!(out, "   missing:     {missing}");
                }
            }
        }
        let limits: Vec<&str> = rule.limits.iter().map(|l| l.text.as_str()).collect();
        let _ = writeln!(out, "   limits:      {}", limits.join("; "));
        if let Some(from) = &rule.limits_from {
            let read = match (&from.value, from.used) {
                (Some(value), true) => format!("this request's {value:?} set the limit above"),
                (Some(value), false) => format!(
                    "this request's {value:?} is no whole number of 1 or more: the rule's own limit"
                ),
                (None, _) => "this request has none: the rule's own limit".to_string(),
            };
            let _ = writeln!(
                out,
                "   limit from:  {}, at most {} ({read})",
                from.from, from.max
            );
        }
        match &rule.cost_header {
            Some(header) => {
                let _ = writeln!(
                    out,
                    "   cost:        {}, then the value of the response's {header} header",
                    rule.cost
                );
            }
            None => {
                let _ = writeln!(out, "   cost:        {}", rule.cost);
            }
        }
        if let Some(statuses) = &rule.count_when {
            let statuses: Vec<String> = statuses.iter().map(u32::to_string).collect();
            let _ = writeln!(
                out,
                "   counted:     only when the response's status is {} (checked up front, spent after the answer)",
                statuses.join(", ")
            );
        }
        if let Some(penalty) = &rule.penalty {
            let _ = writeln!(
                out,
                "   penalty:     a key that goes over stays denied for {penalty}"
            );
        }
        if let Some(scale) = &rule.scale {
            let _ = writeln!(out, "   scale:       {scale}");
        }
        for window in &rule.schedule {
            let _ = writeln!(out, "   schedule:    {window}");
        }
        if let Some(path) = &rule.quota_path {
            let whose = match rule.quota_path_any_key {
                false => "the caller's own quota",
                true => "the quota of any key the caller names (quota_path_any_key)",
            };
            let _ = writeln!(
                out,
                "   quota path:  {path} answers {whose} of this rule (spends nothing of it; the other rules decide the request as any)"
            );
        }
        if let Some(counters) = rule.top_keys {
            let _ = writeln!(
                out,
                "   top keys:    the keys it admits and denies most, {counters} counters of each per worker (sluice top; logged each minute without a service)"
            );
        }
        let _ = writeln!(out, "   consistency: {}", rule.consistency);
        if let Some(fallback) = &rule.fallback {
            let _ = writeln!(out, "   fallback:    {fallback}");
        }
        if rule.mode == text::mode(Mode::Enforce) && rule.ramp_percent < 100 {
            let _ = writeln!(
                out,
                "   mode:        enforce, ramp_percent {} (that share of would-be denials denied)",
                rule.ramp_percent
            );
        } else {
            let _ = writeln!(out, "   mode:        {}", rule.mode);
        }
    }
    let applying: Vec<&str> = e
        .rules
        .iter()
        .filter(|r| r.applies)
        .map(|r| r.name.as_str())
        .collect();
    out.push('\n');
    if applying.is_empty() {
        let _ = writeln!(
            out,
            "no rule applies (of {})",
            plural(e.rules.len(), "rule", "rules")
        );
    } else {
        let _ = writeln!(
            out,
            "applies: {} ({} of {})",
            applying.join(", "),
            applying.len(),
            plural(e.rules.len(), "rule", "rules")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_split_at_the_first_colon_after_the_name() {
        assert_eq!(
            parse_header("X-User: alice").unwrap(),
            ("x-user".to_string(), "alice".to_string())
        );
        assert_eq!(
            parse_header(":authority: api.example.com:8443").unwrap(),
            (":authority".to_string(), "api.example.com:8443".to_string())
        );
        assert_eq!(
            parse_header("x-empty:").unwrap(),
            ("x-empty".to_string(), String::new())
        );
        assert!(parse_header("no colon").is_err());
        assert!(parse_header("bad name: x").is_err());
        assert!(parse_header(": x").is_err());
    }

    #[test]
    fn addresses_claims_and_methods_are_checked() {
        assert!(parse_address("203.0.113.7").is_ok());
        assert!(parse_address("203.0.113.7:5555").is_ok());
        assert!(parse_address("[2001:db8::1]:443").is_ok());
        assert!(parse_address("alice").is_err());
        assert_eq!(
            parse_claim("plan=pro").unwrap(),
            ("plan".to_string(), "pro".to_string())
        );
        assert!(parse_claim("=pro").is_err());
        assert_eq!(parse_method("post").unwrap(), "POST");
        assert!(parse_method("GET /").is_err());
    }
}
