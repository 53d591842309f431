//! Live overrides from the counter service: limits that replace a rule's (or one tier's) and
//! keys blocked or allowed, applied to a proxy's policy without a redeploy. The proxy keeps the
//! last set it heard in shared data ([`OVERRIDES_KEY`]), so it keeps them while the service is
//! out of reach, and every worker builds the same limiter from them.

pub mod live;

use std::net::IpAddr;

use crate::config::{self, err, ConfigError, RuleAt};
use crate::limit::table::Table;
use crate::limit::Limit;
use crate::limiter::bucket_limits;
use crate::policy::{BareKeys, KeyPart, Policy, Rule};
use crate::protocol::{LiveOverrides, KEY_PART_SEPARATOR, MAX_KEY_BYTES};

/// The shared-data key holding the last set of live overrides (JSON).
pub const OVERRIDES_KEY: &str = "sluice/overrides";
/// Most lines a proxy logs about one set's entries it did not apply (it counts them all).
pub const MAX_LOGGED_PROBLEMS: usize = 20;
/// A limit override whose target starts with this overrides a bulkhead of `shedding`
/// (`bulkhead:api`), its value the override's one JSON object ([`check_bulkhead`]). No rule can
/// be named so (':' is not allowed in names), so the set carries them beside the rules' limits,
/// under the same bounds, deltas, ttls and audit.
pub const BULKHEAD_PREFIX: &str = "bulkhead:";
/// A limit override whose target starts with this gives one key of a rule limits of its own
/// (`key:api` U+001F `42`: the rule, then the key's parts as the filter writes them, joined by
/// U+001F), checked by [`check_key_limits`]. It travels beside the rules' limits (no rule can be
/// named so), under the same bounds, deltas, ttls and audit; a proxy older than it leaves it
/// out as a rule it does not know.
pub const KEY_LIMITS_PREFIX: &str = "key:";
/// Most keys with limits of their own a proxy applies; it leaves out the others (and says so).
pub const MAX_KEY_LIMITS: usize = 10_000;

/// The target of the limit override of `rule`'s key of `parts` ([`KEY_LIMITS_PREFIX`]).
pub fn key_limits_target(rule: &str, parts: &[String]) -> String {
    let mut target = format!("{KEY_LIMITS_PREFIX}{rule}");
    for part in parts {
        target.push(KEY_PART_SEPARATOR);
        target.push_str(part);
    }
    target
}

/// `policy` with `live` applied, and what could not be applied, one line each: a limit override
/// the configuration's checks refuse (the rule's consistency, its cost, the memory its sliding
/// logs would take...), a target no rule has, a key that cannot match anything. Those are left
/// as configured.
///
/// A limit override targets `rule` (every tier of a rule with tiers) or `rule/tier` (that
/// tier; it wins over `rule`). A rule whose fallback was its own limits (the default) falls
/// back to the new ones; a fleet share divides the new ones. Each is checked by [`check_limits`], each key by [`check_key`], as the
/// counter service checks them when it is given the proxies' configuration.
pub fn apply(policy: &Policy, live: &LiveOverrides) -> (Policy, Vec<String>) {
    let mut applied = policy.clone();
    let mut problems = Vec::new();
    // A whole rule's first: a tier's own override replaces it on that tier.
    let mut targets: Vec<_> = live.limits.iter().collect();
    // A key's own limits last: they are checked against their rule as overridden.
    targets
        .sort_by_key(|(target, _)| (target.starts_with(KEY_LIMITS_PREFIX), target.contains('/')));
    for (target, json) in targets {
        let at = format!("limits.{target}");
        if let Some(name) = target.strip_prefix(BULKHEAD_PREFIX) {
            let at = format!("bulkheads.{name}");
            let checked = match json.as_slice() {
                [one] => check_bulkhead(policy, name, one, &at, &at),
                _ => Err(err(&at, "expected one override object")),
            };
            match checked {
                Ok((index, bulkhead)) => {
                    let slot = applied
                        .shedding
                        .as_mut()
                        .and_then(|s| s.bulkheads.get_mut(index));
                    if let Some(slot) = slot {
                        *slot = bulkhead;
                    }
                }
                Err(e) => problems.push(e.to_string()),
            }
            continue;
        }
        if let Some(named) = target.strip_prefix(KEY_LIMITS_PREFIX) {
            let mut parts = named.split(KEY_PART_SEPARATOR).map(str::to_string);
            let rule = parts.next().unwrap_or_default();
            let parts: Vec<String> = parts.collect();
            let at = format!(
                "keys.{rule} {:?}: limits",
                parts.join(&KEY_PART_SEPARATOR.to_string())
            );
            let held: usize = applied.key_limits.values().map(|keys| keys.len()).sum();
            if held >= MAX_KEY_LIMITS {
                problems.push(format!(
                    "{at}: a proxy applies at most {MAX_KEY_LIMITS} keys' own limits"
                ));
                continue;
            }
            // Checked against the rule as overridden: the key's record is in its table.
            match check_key_limits(&applied, &rule, &parts, json, &at) {
                Ok(limits) => {
                    let joined = parts.join(&KEY_PART_SEPARATOR.to_string());
                    applied
                        .key_limits
                        .entry(rule)
                        .or_default()
                        .insert(joined, limits);
                }
                Err(e) => problems.push(e.to_string()),
            }
            continue;
        }
        match check_limits(policy, target, json, &at, &at) {
            Ok(rules) => {
                for (index, rule) in rules {
                    if let Some(slot) = applied.rules.get_mut(index) {
                        *slot = rule;
                    }
                }
            }
            Err(e) => problems.push(e.to_string()),
        }
    }
    applied.key_overrides.clear();
    applied.key_expires.clear();
    applied.bare_key_overrides = BareKeys::default();
    for (rule, keys) in &live.keys {
        for (joined, action) in keys {
            let parts: Vec<String> = joined
                .split(KEY_PART_SEPARATOR)
                .map(str::to_string)
                .collect();
            let matched = match check_key(policy, rule, &parts) {
                Ok(matched) => matched,
                Err(e) => {
                    problems.push(format!("keys.{rule} {joined:?}: {e}"));
                    continue;
                }
            };
            applied
                .key_overrides
                .entry(rule.clone())
                .or_default()
                .insert(joined.clone(), *action);
            let expires_ms = live
                .expires
                .get(rule)
                .and_then(|keys| keys.get(joined))
                .copied()
                .unwrap_or(0);
            if expires_ms != 0 {
                applied
                    .key_expires
                    .entry(rule.clone())
                    .or_default()
                    .insert(joined.clone(), expires_ms);
            }
            if matched
                .iter()
                .any(|m| m.first_present && m.alternative.is_none())
            {
                if let Some(configured) = configured_rules(policy, rule).next() {
                    let parts: Vec<(Option<usize>, String)> = matched
                        .into_iter()
                        .map(|m| (m.alternative, m.value))
                        .collect();
                    applied.bare_key_overrides.insert(
                        rule,
                        &configured.key,
                        &parts,
                        *action,
                        expires_ms,
                    );
                }
            }
        }
    }
    (applied, problems)
}

/// The rules of `policy` a limit override of `target` replaces (by index), with the override's
/// limits: `target` is a rule (every tier of it) or `rule/tier`. Each is checked as the
/// configuration checks its rules ([`config::check_rule`], with the policy's `max_keys`); the
/// error names the limits' fields under `limits_at` (`limits[0].requests`) and an unknown
/// target as `target_at`.
pub fn check_limits(
    policy: &Policy,
    target: &str,
    json: &[serde_json::Value],
    target_at: &str,
    limits_at: &str,
) -> Result<Vec<(usize, Rule)>, ConfigError> {
    let limits = config::parse_limits(limits_at, json)?;
    let named: Vec<(usize, &Rule)> = policy
        .rules
        .iter()
        .enumerate()
        .filter(|(_, r)| r.name == target || r.tier.as_ref().is_some_and(|t| t.rule == target))
        .collect();
    if named.is_empty() {
        return Err(err(target_at, format!("no rule or tier named {target:?}")));
    }
    let mut out = Vec::with_capacity(named.len());
    for (index, rule) in named {
        let rule = rule.with_limits(&limits);
        config::check_rule(
            &rule,
            policy.max_keys,
            policy.host,
            &RuleAt::Override { limits: limits_at },
        )?;
        out.push((index, rule));
    }
    Ok(out)
}

/// The limits `json` of one key of configured rule `rule` (its `parts`, as [`check_key`] takes
/// them), checked as the configuration checks the rule with them ([`config::check_rule`], every
/// tier), and keeping its table's layout (the same algorithm and number of limits, a sliding
/// log the same length): the key's record stays in its rule's table, read by its own limits. A
/// first-present part names its alternative (`jwt:sub=alice`): a key's limits are one key's.
/// Errors name the limits' fields under `limits_at`, the key's as [`check_key`] does.
pub fn check_key_limits(
    policy: &Policy,
    rule: &str,
    parts: &[String],
    json: &[serde_json::Value],
    limits_at: &str,
) -> Result<Vec<Limit>, ConfigError> {
    let matched = check_key(policy, rule, parts)?;
    if let Some(j) = matched
        .iter()
        .position(|m| m.first_present && m.alternative.is_none())
    {
        return Err(err(
            format!("key[{j}]"),
            "a key's own limits are one key's: name the alternative its value comes from, as the filter writes it (jwt:sub=alice, client_ip=203.0.113.7)",
        ));
    }
    let limits = config::parse_limits(limits_at, json)?;
    for configured in configured_rules(policy, rule) {
        let keyed = configured.with_key_limits(&limits);
        config::check_rule(
            &keyed,
            policy.max_keys,
            policy.host,
            &RuleAt::Override { limits: limits_at },
        )?;
        let layout = |r: &Rule| Table::layout(bucket_limits(r), policy.max_keys);
        if layout(&keyed) != layout(configured) {
            let own: Vec<String> = bucket_limits(configured)
                .iter()
                .map(|l| match l.log_len() {
                    0 => l.algorithm().name().to_string(),
                    n => format!("{} of {n}", l.algorithm().name()),
                })
                .collect();
            return Err(err(
                limits_at,
                format!(
                    "a key's own limits count in its rule's table, so they keep the form of {:?}'s: {} limit(s), [{}] (a sliding log of the same length); give another form a rule of its own",
                    configured.name,
                    own.len(),
                    own.join(", ")
                ),
            ));
        }
    }
    Ok(limits)
}

/// The bulkhead `name` of `policy` (by index) with the live override `json` applied, checked as
/// the configuration checks a bulkhead ([`config::override_bulkhead`]): the error names an unknown
/// bulkhead as `name_at` and the override's fields under `at` (`mode`, `limit.static`...).
pub fn check_bulkhead(
    policy: &Policy,
    name: &str,
    json: &serde_json::Value,
    name_at: &str,
    at: &str,
) -> Result<(usize, crate::shed::policy::Bulkhead), ConfigError> {
    let Some(shedding) = policy.shedding.as_ref() else {
        return Err(err(
            name_at,
            format!("no bulkhead named {name:?}: the configuration has no shedding"),
        ));
    };
    let Some(index) = shedding.bulkheads.iter().position(|b| b.name == name) else {
        let names: Vec<&str> = shedding.bulkheads.iter().map(|b| b.name.as_str()).collect();
        return Err(err(
            name_at,
            format!(
                "no bulkhead named {name:?}; the bulkheads are {}",
                names.join(", ")
            ),
        ));
    };
    let bulkhead = shedding
        .bulkheads
        .get(index)
        .ok_or_else(|| err(name_at, "no such bulkhead"))?;
    let overridden = config::override_bulkhead(shedding, bulkhead, json, at)?;
    Ok((index, overridden))
}

/// What one part of a key override matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMatch {
    /// Whether the rule's part is first-present (`header:x-user|client_ip`).
    pub first_present: bool,
    /// For a first-present part, the alternative the override names (`client_ip=127.0.0.1`);
    /// `None`: the value a client sent, from whichever alternative supplied it.
    pub alternative: Option<usize>,
    /// The value, without the alternative's name.
    pub value: String,
}

/// The rules configured as `rule` (one, or one per tier).
fn configured_rules<'a>(policy: &'a Policy, rule: &'a str) -> impl Iterator<Item = &'a Rule> {
    policy
        .rules
        .iter()
        .filter(move |r| r.tier.as_ref().map_or(r.name.as_str(), |t| t.rule.as_str()) == rule)
}

/// Checks a key override of configured rule `rule` against its key: one part per part of the
/// key, each a value the part can take as the filter writes it (an address for `client_ip`,
/// the network for `client_ip/24`, a normalized path...), and the key short enough to be matched
/// (the filter replaces a key longer than [`MAX_KEY_BYTES`] by its digest). On a first-present
/// part (`header:x-user|client_ip`) a part is the value a client sent (`127.0.0.1`: it matches
/// that value from whichever alternative supplied it) or names its alternative as the filter
/// writes it (`client_ip=127.0.0.1`). The error names `rule`, or the part (`key[0]`), with the
/// form it needs.
pub fn check_key(
    policy: &Policy,
    rule: &str,
    parts: &[String],
) -> Result<Vec<KeyMatch>, ConfigError> {
    let Some(name_len) = configured_rules(policy, rule).map(|r| r.name.len()).min() else {
        return Err(err("rule", format!("no rule named {rule:?}")));
    };
    let Some(configured) = configured_rules(policy, rule).next() else {
        return Err(err("rule", format!("no rule named {rule:?}")));
    };
    let key = &configured.key;
    if parts.len() != key.len() {
        let names: Vec<String> = key.iter().map(KeyPart::name).collect();
        return Err(err(
            "key",
            format!(
                "rule {rule:?} is keyed by {} part(s), [{}]: give one value for each, in order; got {}",
                key.len(),
                names.join(", "),
                parts.len()
            ),
        ));
    }
    let mut length = name_len;
    let mut matched = Vec::with_capacity(parts.len());
    for (j, (part, value)) in key.iter().zip(parts).enumerate() {
        let at = format!("key[{j}]");
        let KeyPart::First(alternatives) = part else {
            if let Some(problem) = impossible(part, value) {
                return Err(err(at, problem));
            }
            length += 1 + value.len();
            matched.push(KeyMatch {
                first_present: false,
                alternative: None,
                value: value.clone(),
            });
            continue;
        };
        // `alternative=value`: that alternative only.
        let named = alternatives.iter().enumerate().find_map(|(a, alt)| {
            let name = alt.name();
            let rest = value.strip_prefix(name.as_str())?.strip_prefix('=')?;
            Some((a, alt, name, rest))
        });
        if let Some((a, alt, name, rest)) = named {
            if let Some(problem) = impossible(alt, rest) {
                return Err(err(at, format!("{name}: {problem}")));
            }
            length += 1 + value.len();
            matched.push(KeyMatch {
                first_present: true,
                alternative: Some(a),
                value: rest.to_string(),
            });
            continue;
        }
        // The value a client sent: whichever alternative can hold it.
        let forms = || {
            alternatives
                .iter()
                .map(|alt| format!("{}=...", alt.name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let network = alternatives.iter().find_map(|alt| match alt {
            KeyPart::ClientIpPrefix { .. } if value.parse::<IpAddr>().is_ok() => {
                impossible(alt, value)
            }
            _ => None,
        });
        if let Some(problem) = network {
            return Err(err(
                at,
                format!(
                    "{problem}; to mean another alternative's value, name it ({})",
                    forms()
                ),
            ));
        }
        let shortest = alternatives
            .iter()
            .filter(|alt| impossible(alt, value).is_none())
            .map(|alt| alt.name().len())
            .min();
        let Some(shortest) = shortest else {
            let problems: Vec<String> = alternatives
                .iter()
                .filter_map(|alt| impossible(alt, value).map(|p| format!("{}: {p}", alt.name())))
                .collect();
            return Err(err(
                at,
                format!(
                    "no alternative of {} can be {value:?} ({})",
                    part.name(),
                    problems.join("; ")
                ),
            ));
        };
        length += 1 + shortest + 1 + value.len();
        matched.push(KeyMatch {
            first_present: true,
            alternative: None,
            value: value.clone(),
        });
    }
    if length > MAX_KEY_BYTES {
        return Err(err(
            "key",
            format!(
                "the rule's key would be {length} bytes (its name, then each part as the filter writes it, joined by U+001F): the filter replaces a key over {MAX_KEY_BYTES} bytes by its digest, so no override can name it"
            ),
        ));
    }
    Ok(matched)
}

/// Why `value` is never what `part` (not first-present) reads from a request, in the form it
/// needs; `None` when it can be.
fn impossible(part: &KeyPart, value: &str) -> Option<String> {
    if value.is_empty() {
        return Some("must not be empty".into());
    }
    if value.contains(KEY_PART_SEPARATOR) {
        return Some("must not hold U+001F (it separates the parts)".into());
    }
    match part {
        KeyPart::ClientIp => value.parse::<IpAddr>().is_err().then(|| {
            format!("the part is client_ip: expected a client address such as 203.0.113.7 or 2001:db8::7, got {value:?}")
        }),
        KeyPart::ClientIpPrefix { v4, v6 } => {
            let address = value.split_once('/').map_or(value, |(address, _)| address);
            match address.parse::<IpAddr>() {
                Ok(ip) => {
                    let network = crate::policy::prefix_of(ip, *v4, *v6);
                    (network != value).then(|| {
                        format!(
                            "the part is client_ip/{v4}/{v6}, the client's network: expected {network:?}, got {value:?}"
                        )
                    })
                }
                Err(_) => Some(format!(
                    "the part is client_ip/{v4}/{v6}, the client's network: expected a network such as {:?} or {:?}, got {value:?}",
                    crate::policy::prefix_of(IpAddr::from([203, 0, 113, 7]), *v4, *v6),
                    crate::policy::prefix_of(IpAddr::from([0x2001, 0xdb8, 1, 2, 3, 4, 5, 6]), *v4, *v6),
                )),
            }
        }
        KeyPart::Path => {
            let normal = crate::request::path::normalize(value);
            (normal != value).then(|| {
                format!("the part is the path as the filter keys it (normalized, without a query): expected {normal:?}, got {value:?}")
            })
        }
        KeyPart::Method => {
            let token = value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            (!token).then(|| format!("the part is the method: expected one such as GET, got {value:?}"))
        }
        KeyPart::Const(constant) => (value != constant)
            .then(|| format!("the part is const:{constant}: its only value is {constant:?}, got {value:?}")),
        KeyPart::Header(_) | KeyPart::Query { .. } | KeyPart::Claim(_) | KeyPart::Cookie(_) => None,
        KeyPart::First(_) => Some("alternatives do not nest".into()),
    }
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
    use crate::policy::Fallback;
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
            expires: Default::default(),
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

    fn limits(target: &str, limits: serde_json::Value) -> LiveOverrides {
        let serde_json::Value::Array(limits) = limits else {
            panic!("limits is a list")
        };
        LiveOverrides {
            version: 1,
            limits: [(target.to_string(), limits)].into(),
            ..Default::default()
        }
    }

    /// A rule's configuration: its error, or none.
    fn config_error(json: String) -> Option<String> {
        crate::parse(json.as_bytes()).err().map(|e| e.to_string())
    }

    #[test]
    fn an_override_passes_the_configurations_memory_bound_with_the_same_message() {
        let rule = |max_keys: u32, requests: u64| {
            format!(
                r#"{{"max_keys": {max_keys}, "rules": [{{"name": "api", "key": ["client_ip"],
                    "limits": [{{"requests": {requests}, "per": "minute", "algorithm": "sliding_log"}}]}}]}}"#
            )
        };
        let policy = crate::parse(rule(65_536, 5).as_bytes()).unwrap();
        let big = json!([{"requests": 1000, "per": "minute", "algorithm": "sliding_log"}]);
        let (p, problems) = apply(&policy, &limits("api", big.clone()));
        // Left as configured: 5 a minute, not 1,000 timestamps for each of 65,536 keys (500 MiB).
        assert_eq!(p.rules, policy.rules);
        let configured = config_error(rule(65_536, 1000)).unwrap();
        assert_eq!(
            configured,
            "rules[0].limits[0].requests: its sliding logs keep 1000 timestamps per key: 500 MiB \
             for max_keys 65536, more than the 64 MiB a rule may take; lower requests or max_keys"
        );
        let expected = configured.replacen("rules[0].limits", "limits.api", 1);
        assert_eq!(problems, [expected]);
        // The counter service, given the proxies' configuration, says the same of the same.
        let service = check_limits(&policy, "api", big.as_array().unwrap(), "target", "limits")
            .unwrap_err()
            .to_string();
        assert_eq!(service, configured.replacen("rules[0].", "", 1));
        // With fewer keys the same logs fit (8,192 keys × 1,000 × 8 bytes: 62.5 MiB).
        let small = crate::parse(rule(8_192, 5).as_bytes()).unwrap();
        assert_eq!(config_error(rule(8_192, 1000)), None);
        let (p, problems) = apply(&small, &limits("api", big));
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(p.rules[0].limits[0].requests(), 1000);
    }

    #[test]
    fn an_override_passes_every_check_of_the_configuration() {
        let base = r#"{"service": {"cluster": "c"}, "rules": [
            {"name": "cached", "key": ["client_ip"], "cost": 3, "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "strict", "key": ["client_ip"], "consistency": "strict", "limits": [{"requests": 10, "per": "minute"}]},
            {"name": "plans", "key": ["client_ip"], "consistency": "local", "tiers": {"from": "header:x-plan",
                "default": "free", "limits": {"free": [{"requests": 5, "per": "minute"}],
                "pro": [{"requests": 50, "per": "minute"}]}}}]}"#;
        let policy = crate::parse(base.as_bytes()).unwrap();
        let cases = [
            // A cost the new limits never admit: refused as the configuration refuses it.
            (
                "cached",
                json!([{"requests": 2, "per": "second"}]),
                "limits.cached[0]: 3 is more than limits.cached ever admits at once (2): no request could pass",
            ),
            (
                "cached",
                json!([{"requests": 5, "per": "minute", "algorithm": "sliding_log"}]),
                "limits.cached[0].algorithm: sliding_log is exact, so it is decided per request",
            ),
            (
                "strict",
                json!([{"requests": 5, "per": "second", "algorithm": "leaky_bucket"}]),
                "limits.strict[0].algorithm: leaky_bucket shapes the traffic of one proxy",
            ),
            // A strict rule's own limits are its fallback's: their logs are kept per key.
            (
                "strict",
                json!([{"requests": 1000, "per": "minute", "algorithm": "sliding_log"}]),
                "limits.strict[0].requests: its sliding logs keep 1000 timestamps per key",
            ),
            // A whole tiered rule: every tier must pass.
            (
                "plans",
                json!([{"requests": 999, "per": "minute", "algorithm": "sliding_log"}]),
                "limits.plans[0].requests: its sliding logs keep 999 timestamps per key",
            ),
            ("nope", json!([{"requests": 1, "per": "second"}]), "limits.nope: no rule or tier named \"nope\""),
            (
                "api",
                json!([{"requests": 1, "per": "second"}, {"requests": 1, "per": "minute", "algorithm": "gcra"}]),
                "limits.api[1].algorithm: the limits of a rule share one algorithm",
            ),
        ];
        for (target, new, expected) in cases {
            let (p, problems) = apply(&policy, &limits(target, new));
            assert_eq!(p.rules, policy.rules, "{target}");
            assert_eq!(problems.len(), 1, "{target}: {problems:?}");
            assert!(problems[0].starts_with(expected), "{target}: {problems:?}");
        }
        // The configuration says the same of the same rules.
        let configured = config_error(base.replace(
            r#""cost": 3, "limits": [{"requests": 10, "per": "minute"}]"#,
            r#""cost": 3, "limits": [{"requests": 2, "per": "second"}]"#,
        ));
        assert_eq!(
            configured.as_deref(),
            Some("rules[0].cost: 3 is more than rules[0].limits ever admits at once (2): no request could pass")
        );
        // A tier's own override wins over its rule's, each checked.
        let both = LiveOverrides {
            version: 2,
            limits: [
                (
                    "plans".to_string(),
                    vec![json!({"requests": 7, "per": "minute"})],
                ),
                (
                    "plans/pro".to_string(),
                    vec![json!({"requests": 70, "per": "minute"})],
                ),
            ]
            .into(),
            ..Default::default()
        };
        let (p, problems) = apply(&policy, &both);
        assert!(problems.is_empty(), "{problems:?}");
        let requests: Vec<u64> = p.rules[2..]
            .iter()
            .map(|r| r.limits[0].requests())
            .collect();
        assert_eq!(requests, [7, 70]);
    }

    fn keyed(key: &str) -> Policy {
        crate::parse(
            format!(r#"{{"rules": [{{"name": "api", "key": {key}, "limits": [{{"requests": 10, "per": "minute"}}]}}]}}"#)
                .as_bytes(),
        )
        .unwrap()
    }

    fn check(policy: &Policy, parts: &[&str]) -> Result<Vec<KeyMatch>, String> {
        let parts: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
        check_key(policy, "api", &parts).map_err(|e| e.to_string())
    }

    #[test]
    fn a_key_that_can_match_nothing_is_refused_with_the_form_it_needs() {
        let first = keyed(r#"["header:x-user|client_ip", "method"]"#);
        assert!(check(&first, &["127.0.0.1", "GET"]).is_ok());
        assert!(check(&first, &["client_ip=127.0.0.1", "GET"]).is_ok());
        assert!(check(&first, &["header:x-user=bob", "GET"]).is_ok());
        assert_eq!(
            check(&first, &["127.0.0.1"]).unwrap_err(),
            "key: rule \"api\" is keyed by 2 part(s), [header:x-user|client_ip, method]: give one \
             value for each, in order; got 1"
        );
        assert_eq!(
            check(&first, &["client_ip=nowhere", "GET"]).unwrap_err(),
            "key[0]: client_ip: the part is client_ip: expected a client address such as \
             203.0.113.7 or 2001:db8::7, got \"nowhere\""
        );
        assert!(check(&first, &["bob", "GET /"])
            .unwrap_err()
            .starts_with("key[1]: the part is the method"));
        assert_eq!(
            check_key(&first, "other", &["x".to_string()])
                .unwrap_err()
                .to_string(),
            "rule: no rule named \"other\""
        );
        let network = keyed(r#"["jwt:sub|client_ip/24"]"#);
        assert!(check(&network, &["198.51.100.0/24"]).is_ok());
        assert!(check(&network, &["alice"]).is_ok());
        assert_eq!(
            check(&network, &["198.51.100.7"]).unwrap_err(),
            "key[0]: the part is client_ip/24/64, the client's network: expected \
             \"198.51.100.0/24\", got \"198.51.100.7\"; to mean another alternative's value, \
             name it (jwt:sub=..., client_ip/24/64=...)"
        );
        let plain = keyed(r#"["client_ip/24", "path", "const:eu"]"#);
        assert!(check(&plain, &["198.51.100.0/24", "/a/b", "eu"]).is_ok());
        assert!(check(&plain, &["198.51.100.1/24", "/a/b", "eu"])
            .unwrap_err()
            .contains("expected \"198.51.100.0/24\""));
        assert!(check(&plain, &["2001:db8::/64", "/a/../b", "eu"])
            .unwrap_err()
            .starts_with("key[1]: the part is the path as the filter keys it (normalized, without a query): expected \"/b\""));
        assert!(check(&plain, &["2001:db8::/64", "/b", "us"])
            .unwrap_err()
            .starts_with("key[2]: the part is const:eu: its only value is \"eu\""));
        // Too long to be matched: the filter keys it by its digest.
        let long = "u".repeat(MAX_KEY_BYTES);
        assert!(check(&keyed(r#"["header:x-user"]"#), &[&long])
            .unwrap_err()
            .starts_with("key: the rule's key would be"));

        // The proxy leaves out what cannot match, and says why.
        let live = LiveOverrides {
            version: 1,
            keys: [(
                "api".to_string(),
                [
                    ("127.0.0.1".to_string(), KeyAction::Block),
                    (
                        format!("127.0.0.1{KEY_PART_SEPARATOR}GET"),
                        KeyAction::Block,
                    ),
                ]
                .into(),
            )]
            .into(),
            ..Default::default()
        };
        let (p, problems) = apply(&first, &live);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("keys.api \"127.0.0.1\": key: rule \"api\" is keyed by 2"),
            "{problems:?}"
        );
        assert_eq!(p.key_overrides["api"].len(), 1);
    }
}
