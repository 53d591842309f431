//! Reading a configuration with the filter's own parser.

use std::io::Read;
use std::path::Path;

use serde_json::Value;
use sluice_core::Policy;

use crate::Failure;

/// A valid configuration: the filter's policy, and the JSON it came from (for what the policy
/// keeps only in compiled form: path templates and address blocks, shown as written).
pub struct Loaded {
    pub policy: Policy,
    pub json: Value,
}

/// Reads `file` (`-`: standard input) and parses it as the filter does.
pub fn load(file: &Path) -> Result<Loaded, Failure> {
    let bytes = if file.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::stdin()
            .read_to_end(&mut bytes)
            .map_err(|e| Failure::Unreadable(format!("cannot read standard input: {e}")))?;
        bytes
    } else {
        std::fs::read(file)
            .map_err(|e| Failure::Unreadable(format!("cannot read {}: {e}", file.display())))?
    };
    parse(&bytes)
}

/// The filter's parse: its error's text is the message the filter logs.
pub fn parse(bytes: &[u8]) -> Result<Loaded, Failure> {
    let policy = sluice_core::parse(bytes).map_err(|e| Failure::Invalid(e.to_string()))?;
    // What the filter accepted is JSON.
    let json = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    Ok(Loaded { policy, json })
}

impl Loaded {
    /// The `match` of the configured rule `name`, as written.
    pub fn rule_match(&self, name: &str) -> Option<&Value> {
        self.json
            .get("rules")?
            .as_array()?
            .iter()
            .find(|rule| rule.get("name").and_then(Value::as_str) == Some(name))?
            .get("match")
    }

    /// The strings of a list field of a configured rule's `match`, as written.
    pub fn match_list(&self, rule: &str, field: &str) -> Vec<String> {
        self.rule_match(rule)
            .and_then(|m| m.get(field))
            .and_then(Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `bypass.cidrs` as written.
    pub fn bypass_cidrs(&self) -> Vec<String> {
        self.json
            .pointer("/bypass/cidrs")
            .and_then(Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The configured name of a rule (a tier's rule is `rule/tier`).
pub fn configured_name(rule: &sluice_core::policy::Rule) -> &str {
    rule.tier
        .as_ref()
        .map_or(rule.name.as_str(), |t| t.rule.as_str())
}

/// One line: the rules, their tiers, the counter service, shedding.
pub fn summary(policy: &Policy) -> String {
    use sluice_core::shed::policy::ShedMode;
    // Configured rules in order, each with its tiers.
    let mut configured: Vec<(&str, Vec<&str>)> = Vec::new();
    for rule in &policy.rules {
        let name = configured_name(rule);
        if configured.last().is_none_or(|(last, _)| *last != name) {
            configured.push((name, Vec::new()));
        }
        if let (Some(tier), Some((_, tiers))) = (&rule.tier, configured.last_mut()) {
            tiers.push(tier.name.as_str());
        }
    }
    let mut parts = Vec::new();
    let tiered: Vec<String> = configured
        .iter()
        .filter(|(_, tiers)| !tiers.is_empty())
        .map(|(name, tiers)| format!("{name}: {}", tiers.join(", ")))
        .collect();
    let mut rules = plural(configured.len(), "rule", "rules");
    if !tiered.is_empty() {
        rules.push_str(&format!(
            " (tiers of {}; {} as enforced)",
            tiered.join("; "),
            plural(policy.rules.len(), "rule", "rules")
        ));
    }
    parts.push(rules);
    parts.push(match &policy.service {
        Some(service) => format!(
            "counter service: {}",
            match &service.upstream {
                sluice_core::policy::Upstream::Cluster(name) => format!("cluster {name}"),
                sluice_core::policy::Upstream::Address(address) => format!("address {address}"),
            }
        ),
        None => "no counter service".to_string(),
    });
    if let Some(shedding) = &policy.shedding {
        let rolling: Vec<String> = shedding
            .bulkheads
            .iter()
            .filter_map(|b| match (b.mode, b.ramp_percent) {
                (ShedMode::Enforce, 100) => None,
                (ShedMode::Enforce, p) => Some(format!("{} enforces {p}%", b.name)),
                (mode, _) => Some(format!("{} in {}", b.name, mode.name())),
            })
            .collect();
        let mut line = format!(
            "shedding: {}",
            plural(shedding.bulkheads.len(), "bulkhead", "bulkheads")
        );
        if !rolling.is_empty() {
            line.push_str(&format!(" ({})", rolling.join(", ")));
        }
        let curves: Vec<&str> = shedding
            .bulkheads
            .iter()
            .filter(|b| b.curve.is_some())
            .map(|b| b.name.as_str())
            .collect();
        if !curves.is_empty() {
            line.push_str(&format!(
                ", shed at random by a curve: {}",
                curves.join(", ")
            ));
        }
        let reported: Vec<String> = shedding
            .bulkheads
            .iter()
            .filter_map(|b| {
                let header = b.saturation_header.as_deref()?;
                Some(format!("{} ({header})", b.name))
            })
            .collect();
        if !reported.is_empty() {
            line.push_str(&format!(
                ", the upstream reports its saturation: {}",
                reported.join(", ")
            ));
        }
        parts.push(line);
    }
    let mut following = Vec::new();
    for rule in &policy.rules {
        let Some(dynamic) = &rule.dynamic else {
            continue;
        };
        let mut what = Vec::new();
        if let Some(scale) = &dynamic.scale {
            what.push(format!("scaled by the {} level", scale.level.name()));
        }
        if !dynamic.schedule.is_empty() {
            let windows: Vec<String> = dynamic.schedule.iter().map(|w| w.utc()).collect();
            what.push(format!("scheduled {} UTC", windows.join(", ")));
        }
        following.push(format!("{} {}", rule.name, what.join(" and ")));
    }
    if !following.is_empty() {
        parts.push(format!(
            "limits that follow load or time: {}",
            following.join(", ")
        ));
    }
    let paths: Vec<String> = policy
        .rules
        .iter()
        .filter_map(|r| Some(format!("{} ({})", r.quota_path.as_deref()?, r.name)))
        .collect();
    if !paths.is_empty() {
        parts.push(format!("quota paths: {}", paths.join(", ")));
    }
    format!("valid: {}", parts.join("; "))
}

pub fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
