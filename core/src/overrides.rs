//! Live overrides from the counter service: limits that replace a rule's (or one tier's) and
//! keys blocked or allowed, applied to a proxy's policy without a redeploy. The proxy keeps the
//! last set it heard in shared data ([`OVERRIDES_KEY`]), so it keeps them while the service is
//! out of reach, and every worker builds the same limiter from them.

use crate::config;
use crate::limit::Limit;
use crate::policy::{Fallback, Policy};
use crate::protocol::LiveOverrides;

/// The shared-data key holding the last set of live overrides (JSON).
pub const OVERRIDES_KEY: &str = "sluice/overrides";

/// `policy` with `live` applied, and what could not be applied (a limit the rule's
/// consistency refuses, a target no rule has): those are left as configured.
///
/// A limit override targets `rule` (every tier of a rule with tiers) or `rule/tier` (that
/// tier; it wins over `rule`). A rule whose fallback was its own limits (the default) falls
/// back to the new ones.
pub fn apply(policy: &Policy, live: &LiveOverrides) -> (Policy, Vec<String>) {
    let mut policy = policy.clone();
    let mut problems = Vec::new();
    let mut parsed: Vec<(String, Vec<Limit>)> = Vec::new();
    for (target, json) in &live.limits {
        match config::parse_limits(&format!("limits.{target}"), json) {
            Ok(limits) => parsed.push((target.clone(), limits)),
            Err(e) => problems.push(e.to_string()),
        }
    }
    for (target, _) in &parsed {
        let known = policy
            .rules
            .iter()
            .any(|r| r.name == *target || r.tier.as_ref().is_some_and(|t| t.rule == *target));
        if !known {
            problems.push(format!("limits.{target}: no rule or tier of that name"));
        }
    }
    for rule in &mut policy.rules {
        let exact = parsed.iter().find(|(t, _)| *t == rule.name);
        let whole = rule
            .tier
            .as_ref()
            .and_then(|tier| parsed.iter().find(|(t, _)| *t == tier.rule));
        let Some((target, limits)) = exact.or(whole) else {
            continue;
        };
        if let Err(e) = config::allowed(&rule.name, rule.consistency, limits, &rule.fallback) {
            problems.push(format!("limits.{target}: {}", e.problem));
            continue;
        }
        if rule.fallback == Fallback::Open(rule.limits.clone()) {
            rule.fallback = Fallback::Open(limits.clone());
        }
        rule.limits = limits.clone();
        // A cost the new limits can never admit would refuse every request: keep it possible.
        let least = rule.limits.iter().map(Limit::burst).min().unwrap_or(1);
        rule.cost = rule.cost.min(least);
    }
    policy.key_overrides = live.keys.clone();
    (policy, problems)
}

/// Encodes a set for shared data.
pub fn encode(live: &LiveOverrides) -> Vec<u8> {
    serde_json::to_vec(live).unwrap_or_default()
}

/// Decodes a set from shared data; `None` if there is none or it does not read.
pub fn decode(bytes: &[u8]) -> Option<LiveOverrides> {
    serde_json::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::KeyAction;
    use serde_json::json;

    fn policy() -> Policy {
        crate::parse(
            br#"{"rules": [
                {"name": "api", "key": ["client_ip"], "limits": [{"requests": 10, "per": "minute"}]},
                {"name": "plans", "key": ["header:x-user"], "tiers": {"from": "header:x-plan", "default": "free",
                    "limits": {"free": [{"requests": 5, "per": "minute"}], "pro": [{"requests": 50, "per": "minute"}]}}}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn limits_replace_a_rule_or_a_tier_and_keys_are_kept() {
        let live = LiveOverrides {
            version: 3,
            limits: [
                (
                    "api".to_string(),
                    vec![json!({"requests": 2, "per": "second"})],
                ),
                (
                    "plans/pro".to_string(),
                    vec![json!({"requests": 500, "per": "minute"})],
                ),
            ]
            .into(),
            keys: [(
                "api".to_string(),
                [("203.0.113.7".to_string(), KeyAction::Block)].into(),
            )]
            .into(),
        };
        let (p, problems) = apply(&policy(), &live);
        assert!(problems.is_empty(), "{problems:?}");
        let requests: Vec<u64> = p.rules.iter().map(|r| r.limits[0].requests()).collect();
        assert_eq!(requests, [2, 5, 500]);
        assert_eq!(
            p.rules[0].fallback,
            Fallback::Open(p.rules[0].limits.clone())
        );
        assert_eq!(p.key_overrides, live.keys);
        // A whole tiered rule: every tier.
        let all = LiveOverrides {
            version: 4,
            limits: [(
                "plans".to_string(),
                vec![json!({"requests": 1, "per": "hour"})],
            )]
            .into(),
            ..Default::default()
        };
        let (p, _) = apply(&policy(), &all);
        assert!(p.rules[1..].iter().all(|r| r.limits[0].requests() == 1));
    }

    #[test]
    fn what_cannot_apply_is_reported_and_left_as_configured() {
        let live = LiveOverrides {
            version: 1,
            limits: [
                (
                    "nope".to_string(),
                    vec![json!({"requests": 2, "per": "second"})],
                ),
                (
                    "api".to_string(),
                    vec![json!({"requests": 2, "per": "fortnight"})],
                ),
            ]
            .into(),
            ..Default::default()
        };
        let (p, problems) = apply(&policy(), &live);
        assert_eq!(p.rules[0].limits[0].requests(), 10);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems.iter().any(|p| p.contains("limits.api[0].per")),
            "{problems:?}"
        );
        assert_eq!(decode(&encode(&live)), Some(live));
        assert_eq!(decode(b"junk"), None);
    }
}
