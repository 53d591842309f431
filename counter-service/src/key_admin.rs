//! One key of one rule, for the holders of an admin token: its state as the service keeps it
//! (`GET /admin/v1/keys/{rule}?key=…`) and its reset (`DELETE`, same query), both one
//! `lua/keys.lua` call on the key's own Redis keys (one hash slot).
//!
//! - `{rule}`: as the filter names the rule: its name, or `rule/tier` for one tier of a rule
//!   with tiers (each tier counts its own keys).
//! - `key=`: the key's parts as the filter writes them, joined by U+001F (`%1F`),
//!   percent-encoded (`+` is a space); UTF-8, at most [`MAX_KEY_BYTES`] with the rule's name.
//! - `limits=` (optional): the limits whose state to read or reset, a JSON array in the
//!   configuration's syntax (`[{"requests":100,"per":"minute"}]`). Without it the service
//!   takes the rule's from `--policy`: the configured ones and the live override in force;
//!   without `--policy` it is required (the service keeps a key's state per limit, and is not
//!   told a rule's limits otherwise).
//!
//! Only the Redis keys named from the rule, the key and the limits are read or deleted (their
//! names are made here, never matched by pattern); the key's live override is read beside them.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::{Extension, Json};
use percent_encoding::percent_decode_str;
use serde_json::{json, Map, Value};
use sluice_core::policy::{Consistency, Policy};
use sluice_protocol::{AlgorithmSpec, LimitSpec, KEY_PART_SEPARATOR, MAX_KEY_BYTES, MAX_LIMITS};

use crate::admin::target_name;
use crate::auth::Admin;
use crate::error::AppError;
use crate::keys;
use crate::overrides::{self, key_field};
use crate::state::AppState;

/// Most leases answered per limit; the answer says how many there were (`leases_total`).
pub const MAX_LEASES: usize = 100;

/// What a request names: the rule as the filter names it, the key's parts, and the limits.
struct Named {
    rule: String,
    /// The configured rule (`rule` without its tier): key overrides are kept under it.
    configured: String,
    parts: Vec<String>,
    /// Each limit and where it came from: `request`, `policy`, `override`.
    limits: Vec<(&'static str, LimitSpec)>,
    /// The key's field of a key override that would match it by the value a client sent (a
    /// first-present part without its alternative's name), when it differs.
    bare: Option<Vec<String>>,
    /// The key's own limits (a live override), as the admin API shows the entry; `Null` when it
    /// has none.
    own: Value,
}

/// `GET /admin/v1/keys/{rule}?key=…[&limits=…]`
pub async fn show(
    State(state): State<AppState>,
    rule: Result<Path<String>, PathRejection>,
    uri: Uri,
) -> Result<Json<Value>, AppError> {
    let named = name(&state, &rule_path(rule)?, &uri).await?;
    Ok(Json(run(&state, &named, "show", 0).await?))
}

/// `DELETE /admin/v1/keys/{rule}?key=…[&limits=…]`: the state as it was, and `deleted`.
pub async fn reset(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    rule: Result<Path<String>, PathRejection>,
    uri: Uri,
) -> Result<Json<Value>, AppError> {
    let named = name(&state, &rule_path(rule)?, &uri).await?;
    let answer = run(&state, &named, "reset", 0).await?;
    audit(&state, &admin, &named, &answer).await;
    tracing::info!(
        who = %admin.name,
        rule = %crate::error::loggable(&named.rule),
        key = %crate::error::loggable(&named.parts.join("\u{1f}")),
        deleted = %answer["deleted"],
        "key reset"
    );
    Ok(Json(answer))
}

/// Records a reset in the audit log (`GET /admin/v1/audit`): who, when, the rule, the key and
/// how many Redis keys went, under the set's current version (a reset changes no override). The
/// reset is done whatever happens here: a failure is logged, not answered.
async fn audit(state: &AppState, admin: &Admin, named: &Named, answer: &Value) {
    let version: Result<Option<String>, _> = state
        .backend
        .query("audit", redis::cmd("GET").arg(overrides::VERSION_KEY))
        .await;
    let version = match version {
        Ok(text) => text.and_then(|t| t.parse::<u64>().ok()).unwrap_or(0),
        Err(error) => {
            tracing::warn!(%error, "a key reset was not recorded in the audit log");
            return;
        }
    };
    let entry = json!({
        "at_ms": answer["now_ms"],
        "version": version,
        "who": &*admin.name,
        "action": "reset key",
        "target": named.rule,
        "value": {"key": named.parts, "deleted": answer["deleted"]},
    })
    .to_string();
    let cap = overrides::AUDIT_CAP as i64;
    let pushed: Result<i64, _> = state
        .backend
        .query(
            "audit",
            redis::cmd("LPUSH").arg(overrides::AUDIT_KEY).arg(entry),
        )
        .await;
    let trimmed: Result<(), _> = match pushed {
        Ok(_) => {
            state
                .backend
                .query(
                    "audit",
                    redis::cmd("LTRIM")
                        .arg(overrides::AUDIT_KEY)
                        .arg(0)
                        .arg(cap - 1),
                )
                .await
        }
        Err(error) => Err(error),
    };
    if let Err(error) = trimmed {
        tracing::warn!(%error, "a key reset was not recorded in the audit log");
    }
}

/// The rule of the path; 400 naming `rule` when it is not UTF-8 once percent-decoded.
fn rule_path(rule: Result<Path<String>, PathRejection>) -> Result<String, AppError> {
    rule.map(|Path(rule)| rule).map_err(|_| {
        AppError::invalid(
            "rule",
            "must be a rule's name, or rule/tier, in UTF-8 once percent-decoded",
        )
    })
}

/// Runs `lua/keys.lua` (`op`: show or reset) on the named key's limits, reads its live override
/// beside it, and answers both. `now_override_us` is 0 in service; tests pass a fake time.
async fn run(
    state: &AppState,
    named: &Named,
    op: &str,
    now_override_us: u64,
) -> Result<Value, AppError> {
    let entry = key_field(&named.rule, &named.parts);
    let mut invocation = state.scripts.keys.prepare_invoke();
    invocation.arg(now_override_us).arg(op).arg(MAX_LEASES);
    for (_, limit) in &named.limits {
        invocation
            .key(keys::limit_key(&entry, limit))
            .arg(kind(limit))
            .arg(limit.requests)
            .arg(limit.period_ms)
            .arg(limit.burst);
    }
    let specs: Vec<LimitSpec> = named.limits.iter().map(|(_, limit)| *limit).collect();
    if let Some(penalty) = keys::penalty_key(&entry, &specs) {
        invocation.key(penalty);
    }
    let field = key_field(&named.configured, &named.parts);
    let bare = named
        .bare
        .as_ref()
        .map(|parts| key_field(&named.configured, parts));
    let (reply, found) = tokio::join!(
        state.backend.invoke::<String>("keys", &invocation),
        key_override(state, &field, bare.as_deref())
    );
    state.metrics.script_called("keys", 1);
    let reply: Value = serde_json::from_str(&reply?)
        .map_err(|error| AppError::Internal(format!("keys.lua answered no JSON: {error}")))?;
    let now_ms = reply["now_ms"].as_u64().unwrap_or(0);
    let stored = match &reply["limits"] {
        Value::Array(limits) => limits.clone(),
        _ => Vec::new(),
    };
    if stored.len() != named.limits.len() {
        return Err(AppError::Internal(format!(
            "keys.lua answered {} limits for {}",
            stored.len(),
            named.limits.len()
        )));
    }
    let limits: Vec<Value> = named
        .limits
        .iter()
        .zip(stored)
        .map(|((source, limit), state)| {
            let mut out = Map::new();
            out.insert("source".into(), json!(source));
            out.insert("limit".into(), json!(limit));
            if let Value::Object(state) = state {
                for (name, value) in state {
                    // cjson writes an empty list as an object
                    let value = match (name.as_str(), value) {
                        ("leases", Value::Object(_)) => json!([]),
                        (_, value) => value,
                    };
                    out.insert(name, value);
                }
            }
            let total = out.get("leases_total").and_then(Value::as_u64);
            let cut = total.unwrap_or(0) > MAX_LEASES as u64;
            if out.contains_key("leases") {
                out.insert("leases_cut".into(), json!(cut));
            }
            Value::Object(out)
        })
        .collect();
    let live = match found? {
        Some((action, meta)) => live_override(&action, meta.as_deref(), now_ms),
        None => Value::Null,
    };
    let mut answer = json!({
        "rule": named.rule,
        "key": named.parts,
        "now_ms": now_ms,
        "limits": limits,
        "override": live,
        "key_limits": named.own,
        "penalty": reply.get("penalty").cloned().unwrap_or(Value::Null),
    });
    if op == "reset" {
        answer["deleted"] = reply["deleted"].clone();
    }
    Ok(answer)
}

/// How `lua/keys.lua` reads a limit's key.
fn kind(limit: &LimitSpec) -> &'static str {
    match limit.algorithm {
        AlgorithmSpec::TokenBucket => "bucket",
        AlgorithmSpec::SlidingLog => "log",
        _ => keys::window_kind(limit),
    }
}

/// The key override of `field` (else of `bare`): its action and its meta (`set_at_ms
/// expires_at_ms json`), `None` when there is none.
async fn key_override(
    state: &AppState,
    field: &str,
    bare: Option<&str>,
) -> Result<Option<(String, Option<String>)>, AppError> {
    for field in std::iter::once(field).chain(bare) {
        let action: Option<String> = state
            .backend
            .query(
                "key_override",
                redis::cmd("HGET").arg(overrides::KEYS_KEY).arg(field),
            )
            .await?;
        if let Some(action) = action {
            let meta: Option<String> = state
                .backend
                .query(
                    "key_override",
                    redis::cmd("HGET")
                        .arg(overrides::META_KEY)
                        .arg(format!("keys{KEY_PART_SEPARATOR}{field}")),
                )
                .await?;
            return Ok(Some((action, meta)));
        }
    }
    Ok(None)
}

/// A key override as answered: its action, who set it and why, when, and until when (`null`
/// when it does not expire); `null` when it expired (removed at the next change of the set).
fn live_override(action: &str, meta: Option<&str>, now_ms: u64) -> Value {
    let mut fields = meta.unwrap_or_default().splitn(3, ' ');
    let set_at_ms: Option<u64> = fields.next().and_then(|t| t.parse().ok());
    let expires_at_ms: Option<u64> = fields
        .next()
        .and_then(|t| t.parse().ok())
        .filter(|&at| at != 0);
    let note: Value = fields
        .next()
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or(Value::Null);
    if expires_at_ms.is_some_and(|at| at <= now_ms) {
        return Value::Null;
    }
    json!({
        "action": action,
        "who": note["who"],
        "reason": note["reason"],
        "set_at_ms": set_at_ms,
        "expires_at_ms": expires_at_ms,
        "ttl_ms": expires_at_ms.map(|at| at - now_ms),
    })
}

/// Reads and checks what a request names: 400 naming `rule`, `key`, `key[i]`, `limits` or
/// `query`.
async fn name(state: &AppState, rule: &str, uri: &Uri) -> Result<Named, AppError> {
    target_name("rule", rule)?;
    if rule.split('/').any(|name| name == "." || name == "..") {
        return Err(AppError::invalid(
            "rule",
            format!(
                "must be a rule's name, or rule/tier, other than . and .. (an HTTP client \
                 resolves them as a path), got {rule:?}"
            ),
        ));
    }
    let configured = rule.split('/').next().unwrap_or(rule).to_owned();
    let query = Query::parse(uri)?;
    let key = query.key.ok_or_else(|| {
        AppError::invalid(
            "key",
            "missing: give it as ?key= (the parts joined by U+001F, %1F)",
        )
    })?;
    let parts = key_parts(rule, &key)?;
    let policy = state.policy.as_deref();
    let bare = match policy {
        Some(policy) => checked(policy, rule, &configured, &parts)?,
        None => None,
    };
    let (own, own_limits) = key_limits(state, &configured, &parts).await?;
    let limits = match (query.limits, policy) {
        (Some(text), _) => given_limits(&text)?
            .into_iter()
            .map(|limit| ("request", limit))
            .collect(),
        (None, Some(policy)) => {
            let mut limits = policy_limits(state, policy, rule, &configured).await?;
            for limit in own_limits {
                if !limits.iter().any(|(_, known)| *known == limit) {
                    limits.push(("key override", limit));
                }
            }
            limits
        }
        (None, None) if !own_limits.is_empty() => own_limits
            .into_iter()
            .map(|limit| ("key override", limit))
            .collect(),
        (None, None) => {
            return Err(AppError::invalid(
                "limits",
                "missing: the service runs without --policy, so it does not know the rule's \
                 limits; name them as the configuration does, e.g. \
                 limits=[{\"requests\":100,\"per\":\"minute\"}]",
            ))
        }
    };
    Ok(Named {
        rule: rule.to_owned(),
        configured,
        parts,
        limits,
        bare,
        own,
    })
}

/// The query: `key` and `limits`, each at most once, percent-decoded to UTF-8.
#[derive(Default)]
struct Query {
    key: Option<String>,
    limits: Option<String>,
}

impl Query {
    fn parse(uri: &Uri) -> Result<Query, AppError> {
        let mut query = Query::default();
        for pair in uri.query().unwrap_or_default().split('&') {
            if pair.is_empty() {
                continue;
            }
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let slot = match name {
                "key" => &mut query.key,
                "limits" => &mut query.limits,
                other => {
                    return Err(AppError::invalid(
                        "query",
                        format!(
                            "unknown parameter \"{}\": expected key and limits",
                            crate::error::loggable(&decoded_lossy(other))
                        ),
                    ))
                }
            };
            if slot.is_some() {
                return Err(AppError::invalid(name, "given twice"));
            }
            *slot = Some(decoded(name, value)?);
        }
        Ok(query)
    }
}

/// A query value percent-decoded (`+` a space); 400 naming `field` when it is not UTF-8.
fn decoded(field: &str, value: &str) -> Result<String, AppError> {
    let spaced = value.replace('+', " ");
    percent_decode_str(&spaced)
        .decode_utf8()
        .map(|text| text.into_owned())
        .map_err(|_| {
            AppError::invalid(
                field,
                "is not UTF-8 once percent-decoded: the filter writes a key in UTF-8 (a header \
                 value that is not as U+001E, hex: and its bytes)",
            )
        })
}

fn decoded_lossy(value: &str) -> String {
    percent_decode_str(value).decode_utf8_lossy().into_owned()
}

/// The key's parts (split at U+001F), each non-empty; the rule's key (its name and the parts,
/// joined by U+001F) at most [`MAX_KEY_BYTES`], as the filter sends keys.
fn key_parts(rule: &str, key: &str) -> Result<Vec<String>, AppError> {
    if key.is_empty() {
        return Err(AppError::invalid("key", "must not be empty"));
    }
    let length = rule.len() + 1 + key.len();
    if length > MAX_KEY_BYTES {
        return Err(AppError::invalid(
            "key",
            format!(
                "the rule's key would be {length} bytes (its name and the parts, joined by \
                 U+001F): the filter sends no key over {MAX_KEY_BYTES} bytes (it sends a longer \
                 one's digest)"
            ),
        ));
    }
    let parts: Vec<String> = key.split(KEY_PART_SEPARATOR).map(str::to_owned).collect();
    if let Some(i) = parts.iter().position(String::is_empty) {
        return Err(AppError::invalid(
            format!("key[{i}]"),
            "must not be empty (the parts are joined by U+001F)",
        ));
    }
    Ok(parts)
}

/// With the proxies' configuration: the rule exists as the filter names it (a tier of a rule
/// with tiers), shares its counts (not `local`), and the key is one it can build
/// ([`sluice_core::overrides::check_key`]), each first-present part naming its alternative as
/// the filter writes it (`client_ip=203.0.113.7`). Answers the key's parts as a key override
/// may name them instead (by the value a client sent), when they differ.
fn checked(
    policy: &Policy,
    rule: &str,
    configured: &str,
    parts: &[String],
) -> Result<Option<Vec<String>>, AppError> {
    let Some(found) = policy.rules.iter().find(|r| r.name == rule) else {
        let tiers: Vec<&str> = policy
            .rules
            .iter()
            .filter_map(|r| r.tier.as_ref().filter(|t| t.rule == rule))
            .map(|t| t.name.as_str())
            .collect();
        if !tiers.is_empty() {
            return Err(AppError::invalid(
                "rule",
                format!(
                    "{rule:?} has tiers, and each counts its own keys: name one, as \
                     {rule}/{} (its tiers: {})",
                    tiers[0],
                    tiers.join(", ")
                ),
            ));
        }
        return Err(AppError::invalid("rule", format!("no rule named {rule:?}")));
    };
    if found.consistency == Consistency::Local {
        return Err(AppError::invalid(
            "rule",
            format!("{rule:?} is local: each proxy keeps its own counts, the service holds none"),
        ));
    }
    let matched = sluice_core::overrides::check_key(policy, configured, parts)
        .map_err(|error| AppError::invalid(error.field, error.problem))?;
    if let Some(i) = matched
        .iter()
        .position(|m| m.first_present && m.alternative.is_none())
    {
        return Err(AppError::invalid(
            format!("key[{i}]"),
            "the part is first-present: name the alternative that supplied it as the filter \
             writes it (e.g. client_ip=203.0.113.7, jwt:sub=alice)",
        ));
    }
    let bare: Vec<String> = matched.into_iter().map(|m| m.value).collect();
    Ok((bare != parts).then_some(bare))
}

/// `limits=`: a JSON array of limits in the configuration's syntax, as the filter converts them.
fn given_limits(text: &str) -> Result<Vec<LimitSpec>, AppError> {
    let json: Vec<Value> = serde_json::from_str(text).map_err(|error| {
        AppError::invalid(
            "limits",
            format!("must be a JSON array of limits as the configuration writes them: {error}"),
        )
    })?;
    if json.is_empty() || json.len() > MAX_LIMITS {
        return Err(AppError::invalid(
            "limits",
            format!("must hold 1 to {MAX_LIMITS} limits, got {}", json.len()),
        ));
    }
    let limits = sluice_core::config::parse_limits("limits", &json)
        .map_err(|error| AppError::invalid(error.field, error.problem))?;
    Ok(dedup(limits.iter().map(LimitSpec::from)))
}

/// The rule's limits from the proxies' configuration, then those of the live limit override
/// in force on it (its tier's, else its rule's), if any and other.
async fn policy_limits(
    state: &AppState,
    policy: &Policy,
    rule: &str,
    configured: &str,
) -> Result<Vec<(&'static str, LimitSpec)>, AppError> {
    let configured_limits: Vec<LimitSpec> = policy
        .rules
        .iter()
        .find(|r| r.name == rule)
        .map(|r| dedup(r.limits.iter().map(LimitSpec::from)))
        .unwrap_or_default();
    let mut limits: Vec<(&'static str, LimitSpec)> = configured_limits
        .iter()
        .map(|&limit| ("policy", limit))
        .collect();
    let mut targets = vec![rule];
    if configured != rule {
        targets.push(configured);
    }
    for target in targets {
        let text: Option<String> = state
            .backend
            .query(
                "limit_override",
                redis::cmd("HGET").arg(overrides::LIMITS_KEY).arg(target),
            )
            .await?;
        let Some(text) = text else { continue };
        let parsed = serde_json::from_str::<Vec<Value>>(&text)
            .ok()
            .and_then(|json| sluice_core::config::parse_limits("limits", &json).ok());
        if let Some(parsed) = parsed {
            for limit in dedup(parsed.iter().map(LimitSpec::from)) {
                if !limits.iter().any(|(_, known)| *known == limit) {
                    limits.push(("override", limit));
                }
            }
        }
        break;
    }
    Ok(limits)
}

/// The key's own limits (a live override of configured rule `configured`'s key of `parts`): the
/// entry as the admin API shows it (`Null` when there is none) and the limits (none when they do
/// not parse).
async fn key_limits(
    state: &AppState,
    configured: &str,
    parts: &[String],
) -> Result<(Value, Vec<LimitSpec>), AppError> {
    let target = sluice_core::overrides::key_limits_target(configured, parts);
    let text: Option<String> = state
        .backend
        .query(
            "key_limits",
            redis::cmd("HGET").arg(overrides::LIMITS_KEY).arg(&target),
        )
        .await?;
    let Some(text) = text else {
        return Ok((Value::Null, Vec::new()));
    };
    let meta: Option<String> = state
        .backend
        .query(
            "key_limits",
            redis::cmd("HGET")
                .arg(overrides::META_KEY)
                .arg(format!("limits{KEY_PART_SEPARATOR}{target}")),
        )
        .await?;
    let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let limits = match &json {
        Value::Array(items) => sluice_core::config::parse_limits("limits", items)
            .map(|parsed| dedup(parsed.iter().map(LimitSpec::from)))
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let shown = overrides::record(json!({"limits": json}), meta.as_deref());
    Ok((shown, limits))
}

/// The limits in order, each once (two equal limits share one Redis key).
fn dedup(limits: impl Iterator<Item = LimitSpec>) -> Vec<LimitSpec> {
    let mut out: Vec<LimitSpec> = Vec::new();
    for limit in limits {
        if !out.contains(&limit) {
            out.push(limit);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(query: &str) -> Uri {
        format!("/admin/v1/keys/api?{query}").parse().unwrap()
    }

    fn message<T>(result: Result<T, AppError>) -> String {
        match result {
            Ok(_) => "ok".into(),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn the_query_is_percent_decoded_utf8_each_parameter_once() {
        let query = Query::parse(&uri("key=a%1Fb%2Fc+d%2B&limits=%5B%5D")).unwrap();
        assert_eq!(query.key.as_deref(), Some("a\u{1f}b/c d+"));
        assert_eq!(query.limits.as_deref(), Some("[]"));
        assert_eq!(
            message(Query::parse(&uri("key=%FF%FE"))),
            "key: is not UTF-8 once percent-decoded: the filter writes a key in UTF-8 (a header \
             value that is not as U+001E, hex: and its bytes)"
        );
        assert_eq!(
            message(Query::parse(&uri("key=a&key=b"))),
            "key: given twice"
        );
        assert!(message(Query::parse(&uri("key=a&ke%0Ay=b")))
            .starts_with("query: unknown parameter \"ke\\ny\""));
    }

    #[test]
    fn key_parts_are_bounded_like_the_filters_keys() {
        assert_eq!(key_parts("api", "alice").unwrap(), ["alice"]);
        assert_eq!(
            key_parts("api", "alice\u{1f}GET").unwrap(),
            ["alice", "GET"]
        );
        assert_eq!(message(key_parts("api", "")), "key: must not be empty");
        assert!(message(key_parts("api", "a\u{1f}")).starts_with("key[1]: must not be empty"));
        // "api" + U+001F + 252 bytes = 256: the longest key the filter sends
        assert!(key_parts("api", &"k".repeat(252)).is_ok());
        assert!(message(key_parts("api", &"k".repeat(253)))
            .starts_with("key: the rule's key would be 257 bytes"));
        // control characters are a key's bytes (U+001E marks the filter's own values)
        assert_eq!(
            key_parts("api", "\u{1e}missing\u{1f}a\nb").unwrap(),
            ["\u{1e}missing", "a\nb"]
        );
    }

    #[test]
    fn limits_are_the_configurations() {
        assert_eq!(
            given_limits(r#"[{"requests": 5, "per": "hour"}, {"requests": 5, "per": "hour"}]"#)
                .unwrap(),
            [LimitSpec::token_bucket(5, 3_600_000, 5)]
        );
        assert!(message(given_limits("[]")).starts_with("limits: must hold 1 to 8"));
        assert!(message(given_limits("{")).starts_with("limits: must be a JSON array"));
        assert!(
            message(given_limits(r#"[{"requests": 5, "per": "fortnight"}]"#))
                .starts_with("limits[0].per")
        );
    }

    #[test]
    fn an_override_is_answered_until_it_expires() {
        let meta = r#"100 5000 {"who":"alice","reason":"abuse"}"#;
        let live = live_override("block", Some(meta), 4_000);
        assert_eq!(live["action"], "block");
        assert_eq!(live["who"], "alice");
        assert_eq!(live["ttl_ms"], 1_000);
        assert_eq!(live_override("block", Some(meta), 5_000), Value::Null);
        let forever = live_override("allow", Some("100 0 {}"), 4_000);
        assert_eq!(forever["expires_at_ms"], Value::Null);
        assert_eq!(forever["action"], "allow");
    }
}
