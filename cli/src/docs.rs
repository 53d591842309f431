//! `sluice docs`: the rate limits per endpoint and tier, in Markdown, for an API's consumers.

use std::fmt::Write;

use sluice_core::exchange::WARN_HEADER;
use sluice_core::policy::{HeaderStyle, KeyPart, Mode, Rule, WhenMissing};
use sluice_core::request::matcher::HeaderTest;

use crate::config::{configured_name, Loaded};
use crate::text;

pub fn markdown(loaded: &Loaded) -> String {
    let policy = &loaded.policy;
    let mut out = String::from("## Rate limits\n\n");
    if policy.rules.is_empty() {
        out.push_str("No rate limits are configured.\n");
        let notes = shedding_notes(policy);
        if !notes.is_empty() {
            out.push('\n');
            for note in notes {
                let _ = writeln!(out, "{note}");
            }
        }
        return out;
    }
    out.push_str(
        "A request is admitted when every limit that applies to it admits it. A request over a \
         limit is answered `429 Too Many Requests`, with `Retry-After`: the seconds until it \
         would be admitted.",
    );
    let headers = match policy.headers {
        HeaderStyle::None => None,
        HeaderStyle::Legacy => {
            Some("`X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`")
        }
        HeaderStyle::Draft => Some("`RateLimit-Policy` and `RateLimit` (IETF draft)"),
        HeaderStyle::Both => Some(
            "`RateLimit-Policy` and `RateLimit` (IETF draft), and `X-RateLimit-Limit`, \
             `X-RateLimit-Remaining` and `X-RateLimit-Reset`",
        ),
    };
    if let Some(headers) = headers {
        let _ = write!(
            out,
            " Responses carry {headers}, naming the most restrictive rule that applies."
        );
    }
    out.push_str("\n\n| endpoint | methods | keyed by | tier | limits | cost | mode | rule |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for rule in &policy.rules {
        let cells = [
            endpoint(loaded, rule),
            if rule.matcher.methods.is_empty() {
                "any".to_string()
            } else {
                rule.matcher.methods.join(", ")
            },
            text::key_for_consumers(&rule.key),
            tier(rule),
            rule.limits
                .iter()
                .map(text::limit_for_consumers)
                .collect::<Vec<_>>()
                .join("; "),
            match (&rule.cost_header, &rule.count_when) {
                (Some(header), _) => format!("{} + the response's `{header}`", rule.cost),
                (None, Some(when)) => format!(
                    "{} when the response's status is {}",
                    rule.cost,
                    when.statuses
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                (None, None) => rule.cost.to_string(),
            },
            mode(rule),
            format!("`{}`", rule.name),
        ];
        let cells: Vec<String> = cells.iter().map(|c| cell(c)).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }

    let mut notes = Vec::new();
    if policy.rules.iter().any(|r| r.matcher.path_prefix.is_some()) {
        notes.push("A path ending in `*` stands for every path that starts so.".to_string());
    }
    let mut tiered: Vec<&str> = Vec::new();
    for rule in &policy.rules {
        let Some(t) = &rule.tier else { continue };
        if tiered.contains(&t.rule.as_str()) {
            continue;
        }
        tiered.push(t.rule.as_str());
        let default = policy
            .rules
            .iter()
            .filter_map(|r| r.tier.as_ref())
            .find(|d| d.rule == t.rule && d.default_for.is_some())
            .map_or("", |d| d.name.as_str());
        notes.push(format!(
            "The tier of `{}` is the request's {}; requests without one, or of a tier not listed, count as `{default}`.",
            t.rule,
            text::key_part_for_consumers(&t.from),
        ));
    }
    let mut read: Vec<&str> = Vec::new();
    for rule in &policy.rules {
        let Some(from) = &rule.limits_from else {
            continue;
        };
        let configured = rule
            .tier
            .as_ref()
            .map_or(rule.name.as_str(), |t| t.rule.as_str());
        if read.contains(&configured) {
            continue;
        }
        read.push(configured);
        let per = rule
            .limits
            .first()
            .map_or("period".to_string(), |l| l.period().to_string());
        notes.push(format!(
            "`{configured}`'s limit is your own when your request carries it as its {} (requests per {per}, a whole number, at most {}); the limit above is for requests without it.",
            text::key_part_for_consumers(&from.from),
            from.max
        ));
    }
    for rule in policy.rules.iter().filter(|r| r.penalty_us > 0) {
        notes.push(format!(
            "A client that goes over `{}` is refused for {} after, whatever its limit: Retry-After says when it ends.",
            rule.name,
            text::penalty(rule.penalty_us)
        ));
    }
    for rule in &policy.rules {
        let Some(dynamic) = &rule.dynamic else {
            continue;
        };
        for window in &dynamic.schedule {
            notes.push(format!(
                "From {} UTC, `{}` allows {} instead.",
                window.utc().replace('-', " to "),
                rule.name,
                window
                    .limits
                    .iter()
                    .map(text::limit_for_consumers)
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
        }
        if let Some(scale) = &dynamic.scale {
            notes.push(format!(
                "Under load, `{}` allows less: {}. The rate-limit headers always say the limit in force.",
                rule.name,
                text::scale(scale)
            ));
        }
    }
    for rule in policy.rules.iter().filter(|r| r.quota_path.is_some()) {
        notes.push(format!(
            "`GET {}` answers your own quota of `{}` as JSON (limit, remaining, reset), without spending it; the request counts against the other limits that apply to it, as any.",
            rule.quota_path.as_deref().unwrap_or(""),
            rule.name
        ));
    }
    let keyed_by_request = |when: WhenMissing| {
        policy.rules.iter().any(|r| {
            r.when_missing == when
                && r.key.iter().any(|p| {
                    matches!(
                        p,
                        KeyPart::Header(_)
                            | KeyPart::Query { .. }
                            | KeyPart::Claim(_)
                            | KeyPart::Cookie(_)
                    )
                })
        })
    };
    if keyed_by_request(WhenMissing::Count) {
        notes.push(
            "Requests without the header, query parameter or token claim a limit is keyed by \
             share one budget of that limit."
                .to_string(),
        );
    }
    if keyed_by_request(WhenMissing::Skip) {
        notes.push(
            "A limit keyed by a header, a query parameter or a token claim that skips requests \
             without it does not apply to them."
                .to_string(),
        );
    }
    let in_flight = policy.rules.iter().any(|r| {
        r.limits
            .iter()
            .any(|l| l.algorithm() == sluice_core::Algorithm::Concurrency)
    });
    if in_flight {
        notes.push(
            "A limit of requests in flight counts a request from when it is admitted until its \
             response ends (or the client goes away): a request over it is answered \
             `429 Too Many Requests` with `Retry-After: 1`, since when another ends is not known."
                .to_string(),
        );
    }
    if policy.rules.iter().any(|r| r.mode == Mode::Warn) {
        notes.push(format!(
            "A limit in warning does not refuse requests yet: a response over it carries `{WARN_HEADER}` with the rule's name."
        ));
    }
    notes.extend(shedding_notes(policy));
    if !policy.bypass.paths.is_empty() {
        let paths: Vec<String> = policy
            .bypass
            .paths
            .iter()
            .map(|p| format!("`{p}`"))
            .collect();
        notes.push(format!("Never limited: {}.", paths.join(", ")));
    }
    if !notes.is_empty() {
        out.push('\n');
        for note in notes {
            let _ = writeln!(out, "{note}");
        }
    }
    out
}

/// What a consumer sees of load shedding being rolled out: a bulkhead that does not answer 503
/// yet (monitor, warn), or only some of the time (a ramp).
fn shedding_notes(policy: &sluice_core::Policy) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(shedding) = &policy.shedding {
        use sluice_core::shed::policy::ShedMode;
        for b in &shedding.bulkheads {
            match (b.mode, b.ramp_percent) {
                (ShedMode::Enforce, 100) => {}
                (ShedMode::Enforce, p) => notes.push(format!(
                    "Load shedding of `{}` is being rolled out: {p}% of the requests it would shed get 503 Service Unavailable, the others go on.",
                    b.name
                )),
                (mode, _) => notes.push(format!(
                    "Load shedding of `{}` is in {} mode: it answers no 503 yet{}.",
                    b.name,
                    mode.name(),
                    if mode == ShedMode::Warn {
                        ", and a response it would have shed carries `x-sluice-would-shed` with the reason"
                    } else {
                        ""
                    }
                )),
            }
            if b.curve.is_some() {
                notes.push(format!(
                    "Load shedding of `{}` sheds some requests at random before the upstream is full (a share rising with its load): a 503 with reason `curve` may come while other requests pass; retry after `Retry-After`.",
                    b.name
                ));
            }
        }
    }
    notes
}

/// A table cell: no pipe or line break may end it early.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// Which requests a rule applies to, in words: paths, hosts, headers, client networks.
fn endpoint(loaded: &Loaded, rule: &Rule) -> String {
    let m = &rule.matcher;
    let configured = configured_name(rule);
    let quoted = |items: &[String], suffix: &str| -> String {
        items
            .iter()
            .map(|i| format!("`{i}{suffix}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut paths = Vec::new();
    if let Some(prefix) = &m.path_prefix {
        paths.push(format!("`{prefix}*`"));
    }
    if !m.paths.is_empty() {
        paths.push(quoted(&m.paths, ""));
    }
    if !m.templates.is_empty() {
        paths.push(quoted(&loaded.match_list(configured, "path_templates"), ""));
    }
    let mut out = if paths.is_empty() {
        "every path".to_string()
    } else {
        paths.join(" and ")
    };
    if !m.hosts.is_empty() {
        let _ = write!(out, " on {}", quoted(&m.hosts, "").replace(", ", " or "));
    }
    for (name, test) in &m.headers {
        let _ = match test {
            HeaderTest::Present => write!(out, ", with header `{name}`"),
            HeaderTest::Absent => write!(out, ", without header `{name}`"),
            HeaderTest::Equals(value) => write!(out, ", with `{name}: {value}`"),
        };
    }
    if !m.client_cidrs.is_empty() {
        let cidrs = loaded.match_list(configured, "client_cidrs");
        let _ = write!(out, ", from {}", quoted(&cidrs, "").replace(", ", " or "));
    }
    out
}

fn tier(rule: &Rule) -> String {
    match &rule.tier {
        None => "—".to_string(),
        Some(t) if t.default_for.is_some() => format!("`{}` (default)", t.name),
        Some(t) => format!("`{}`", t.name),
    }
}

fn mode(rule: &Rule) -> String {
    match rule.mode {
        Mode::Enforce if rule.ramp_percent < 100 => format!(
            "enforced, rolling out ({}% of requests over the limit refused)",
            rule.ramp_percent
        ),
        Mode::Enforce => "enforced".to_string(),
        Mode::Shadow => "not enforced (monitored)".to_string(),
        Mode::Warn => "not enforced yet (warning)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_escape_pipes() {
        assert_eq!(cell("a|b\nc"), "a\\|b c");
    }
}
