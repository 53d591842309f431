//! The admin API (`/admin/v1`): the live overrides ([`crate::overrides`]) and their audit log,
//! for the holders of an admin token (`--admin-tokens-file`; without it every route answers 404
//! `admin_disabled`). JSON in and out; every refusal is the JSON error of `/v1`, naming the
//! field.
//!
//! - `GET /admin/v1/overrides`: the whole set.
//! - `PUT|DELETE /admin/v1/overrides/bypass`: `{"enabled": true, "ttl_s": 600, "reason": "…"}`.
//! - `PUT|DELETE /admin/v1/overrides/limits/{rule or rule/tier}`:
//!   `{"limits": [{"requests": 100, "per": "minute"}], "ttl_s": …, "reason": …}`.
//! - `PUT|DELETE /admin/v1/overrides/bulkheads/{name}`: `{"mode": "enforce", "ramp_percent": 25,
//!   "limit": {"static": 64}, "classes": {"free": 0.5}, "ttl_s": …, "reason": …}` (at least one
//!   of the four), checked as the configuration checks a bulkhead.
//! - `PUT|DELETE /admin/v1/overrides/keys/{rule}` (a whole rule, every tier):
//!   `{"key": ["alice"], "action": "block", "ttl_s": …, "reason": …}`, or the key's own limits
//!   `{"key": ["42"], "limits": [{"requests": 5000, "per": "minute"}]}`; a request names the key
//!   in its body (`{"key": […]}`) or, for a one-part key, as `?key=`. A DELETE removes both.
//! - `GET /admin/v1/audit?limit=N`: the latest changes, newest first.
//! - `GET|DELETE /admin/v1/keys/{rule}?key=…`: one key's state, its reset
//!   ([`crate::key_admin`]).
//!
//! A PUT answers the entry as set, with the new version; a DELETE the new version, or 404 when
//! there was no such entry.

use axum::extract::{Path, Query, State};
use axum::http::Uri;
use axum::{Extension, Json};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sluice_protocol::KeyAction;

use crate::auth::Admin;
use crate::body::{JsonBody, OptionalJsonBody};
use crate::error::AppError;
use crate::overrides::{self, Change, Note, Written, AUDIT_CAP};
use crate::settings::Settings;
use crate::state::AppState;

/// Largest admin request body (or `--max-body-bytes` if smaller).
pub use crate::settings::ADMIN_MAX_BODY_BYTES as MAX_BODY_BYTES;
/// Most admin requests served at once; more are shed with 503.
pub const MAX_CONCURRENCY: usize = 16;
pub use crate::validate::{target_name, MAX_NAME_BYTES};
/// Longest `reason`.
pub const MAX_REASON_BYTES: usize = 512;
/// Longest `ttl_s`: 366 days.
pub const MAX_TTL_S: u64 = 366 * 86_400;
/// How many audit entries `GET /admin/v1/audit` answers without `?limit=`.
pub const DEFAULT_AUDIT_LIMIT: u64 = 100;

/// The admin API's body limit.
pub fn body_limit(settings: &Settings) -> usize {
    settings.admin_body_limit()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BypassBody {
    pub enabled: bool,
    #[serde(default)]
    pub ttl_s: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    pub limits: Vec<Value>,
    #[serde(default)]
    pub ttl_s: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyBody {
    /// The key's parts in order, or one string for a one-part key (checked by [`key_parts`]);
    /// a one-part key may be given as `?key=` instead.
    #[serde(default)]
    pub key: Option<Value>,
    /// Block or allow the key; or, instead, `limits`.
    #[serde(default)]
    pub action: Option<KeyAction>,
    /// The key's own limits, in the configuration's format, in place of its rule's.
    #[serde(default)]
    pub limits: Option<Vec<Value>>,
    #[serde(default)]
    pub ttl_s: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyOnlyBody {
    pub key: Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyQuery {
    key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    limit: Option<String>,
}

/// `GET /admin/v1/overrides`
pub async fn get_overrides(State(state): State<AppState>) -> Result<Json<Value>, AppError> {
    Ok(Json(overrides::view(&state, 0).await?))
}

/// `PUT /admin/v1/overrides/bypass`
pub async fn put_bypass(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    JsonBody(body): JsonBody<BypassBody>,
) -> Result<Json<Value>, AppError> {
    let note = note(body.ttl_s, body.reason)?;
    let fields = json!({"enabled": body.enabled});
    let change = Change::SetBypass {
        enabled: body.enabled,
        note,
    };
    set(&state, &admin, change, fields).await
}

/// `DELETE /admin/v1/overrides/bypass`
pub async fn delete_bypass(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
) -> Result<Json<Value>, AppError> {
    delete(
        &state,
        &admin,
        Change::ClearBypass,
        "bypass override".into(),
    )
    .await
}

/// `PUT /admin/v1/overrides/limits/{target}`
pub async fn put_limits(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(target): Path<String>,
    JsonBody(body): JsonBody<LimitsBody>,
) -> Result<Json<Value>, AppError> {
    target_name("target", &target)?;
    sluice_core::config::parse_limits("limits", &body.limits)
        .map_err(|error| AppError::invalid(error.field, error.problem))?;
    if let Some(policy) = &state.policy {
        sluice_core::overrides::check_limits(policy, &target, &body.limits, "target", "limits")
            .map_err(|error| AppError::invalid(error.field, error.problem))?;
    }
    let note = note(body.ttl_s, body.reason)?;
    let fields = json!({"target": target, "limits": body.limits});
    let change = Change::SetLimits {
        target,
        limits: body.limits,
        note,
    };
    set(&state, &admin, change, fields).await
}

/// `DELETE /admin/v1/overrides/limits/{target}`
pub async fn delete_limits(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(target): Path<String>,
) -> Result<Json<Value>, AppError> {
    target_name("target", &target)?;
    let missing = format!("limits override for {target:?}");
    delete(&state, &admin, Change::DeleteLimits { target }, missing).await
}

/// `PUT /admin/v1/overrides/bulkheads/{name}`: the body is the override (`mode`, `ramp_percent`,
/// `limit`, `classes`), with `ttl_s` and `reason`. Without the proxies' configuration, every check
/// that needs none is made (the mode, the ramp, the limit's bounds, the thresholds' range); with
/// it (`--policy`), all of them (the bulkhead, its classes, a ramp of its mode), as the proxies
/// make them.
pub async fn put_bulkhead(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<Map<String, Value>>,
) -> Result<Json<Value>, AppError> {
    bulkhead_name("bulkhead", &name)?;
    let mut body = body;
    let ttl_s = match body.remove("ttl_s") {
        None | Some(Value::Null) => None,
        Some(ttl) => Some(ttl.as_u64().ok_or_else(|| {
            AppError::invalid(
                "ttl_s",
                format!("must be a whole number of seconds, got {ttl}"),
            )
        })?),
    };
    let reason = match body.remove("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(reason)) => Some(reason),
        Some(other) => {
            return Err(AppError::invalid(
                "reason",
                format!("must be a string, got {other}"),
            ))
        }
    };
    let value = Value::Object(body);
    let checked = match &state.policy {
        Some(policy) => {
            sluice_core::overrides::check_bulkhead(policy, &name, &value, "bulkhead", "")
                .map(|_| ())
        }
        None => sluice_core::config::check_bulkhead_override(&value),
    };
    checked.map_err(|error| AppError::invalid(error.field, error.problem))?;
    let note = note(ttl_s, reason)?;
    let fields = json!({"bulkhead": name, "override": value});
    let change = Change::SetBulkhead { name, value, note };
    set(&state, &admin, change, fields).await
}

/// `DELETE /admin/v1/overrides/bulkheads/{name}`
pub async fn delete_bulkhead(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> Result<Json<Value>, AppError> {
    bulkhead_name("bulkhead", &name)?;
    let missing = format!("bulkhead override for {name:?}");
    delete(&state, &admin, Change::DeleteBulkhead { name }, missing).await
}

/// A bulkhead's name: 1 to [`MAX_NAME_BYTES`] characters of a-z, A-Z, 0-9, `-`, `_`, `.`.
pub fn bulkhead_name(field: &str, value: &str) -> Result<(), AppError> {
    if value.contains('/') {
        return Err(AppError::invalid(
            field,
            format!("must be a bulkhead's name, got {value:?}"),
        ));
    }
    target_name(field, value).map_err(|_| {
        AppError::invalid(
            field,
            format!(
                "must be a bulkhead's name: 1 to {MAX_NAME_BYTES} characters of a-z, A-Z, 0-9, \
                 '-', '_', '.', got {value:?}"
            ),
        )
    })
}

/// `PUT /admin/v1/overrides/keys/{rule}[?key=…]`: `action` blocks or allows the key; `limits`
/// gives it limits of its own, checked as the configuration checks its rule with them (with
/// `--policy`; their form in any case) and bounded by `--key-limits-max`.
pub async fn put_key(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(rule): Path<String>,
    uri: Uri,
    JsonBody(body): JsonBody<KeyBody>,
) -> Result<Json<Value>, AppError> {
    rule_name("rule", &rule)?;
    let query: KeyQuery = query(&uri)?;
    let given = one_key(body.key, query.key)?;
    let key = key_parts(&given, &rule, &state.settings)?;
    matchable(&key, &given, &rule, state.policy.as_deref())?;
    let note = note(body.ttl_s, body.reason)?;
    let change = match (body.action, body.limits) {
        (Some(action), None) => Change::SetKey {
            rule,
            key,
            action,
            note,
        },
        (None, Some(limits)) => {
            sluice_core::config::parse_limits("limits", &limits)
                .map_err(|error| AppError::invalid(error.field, error.problem))?;
            if let Some(policy) = &state.policy {
                sluice_core::overrides::check_key_limits(policy, &rule, &key, &limits, "limits")
                    .map_err(|error| {
                        let field = match &given {
                            Value::String(_) if error.field == "key[0]" => "key".to_string(),
                            _ => error.field,
                        };
                        AppError::invalid(field, error.problem)
                    })?;
            }
            Change::SetKeyLimits {
                rule,
                key,
                limits,
                note,
            }
        }
        _ => {
            return Err(AppError::invalid(
                "action",
                "give the key an action (block or allow) or limits of its own, one of the two",
            ))
        }
    };
    let fields = match &change {
        Change::SetKey {
            rule, key, action, ..
        } => json!({"rule": rule, "key": key, "action": action}),
        Change::SetKeyLimits {
            rule, key, limits, ..
        } => json!({"rule": rule, "key": key, "limits": limits}),
        _ => Value::Null,
    };
    set(&state, &admin, change, fields).await
}

/// The key of a request: in the body or (one part) as `?key=`, not both.
pub fn one_key(body: Option<Value>, query: Option<String>) -> Result<Value, AppError> {
    match (body, query) {
        (Some(key), None) => Ok(key),
        (None, Some(one)) => Ok(Value::String(one)),
        (Some(_), Some(_)) => Err(AppError::invalid(
            "key",
            "give the key in the body or as ?key=, not both",
        )),
        (None, None) => Err(AppError::invalid(
            "key",
            "missing: give it in the body ({\"key\": [...]}) or, for a one-part key, as ?key=",
        )),
    }
}

/// `DELETE /admin/v1/overrides/keys/{rule}`, the key in the body or (one part) `?key=`: its
/// block or allow and its own limits, whichever it has; 404 when it has neither.
pub async fn delete_key(
    State(state): State<AppState>,
    Extension(admin): Extension<Admin>,
    Path(rule): Path<String>,
    uri: Uri,
    OptionalJsonBody(body): OptionalJsonBody<KeyOnlyBody>,
) -> Result<Json<Value>, AppError> {
    rule_name("rule", &rule)?;
    let query: KeyQuery = query(&uri)?;
    let key = one_key(body.map(|body| body.key), query.key)?;
    let key = key_parts(&key, &rule, &state.settings)?;
    let missing = format!("key override for {key:?} in rule {rule:?}");
    let action = Change::DeleteKey {
        rule: rule.clone(),
        key: key.clone(),
    };
    let action = overrides::write(&state, &admin.name, &action, 0).await?;
    let limits = overrides::write(
        &state,
        &admin.name,
        &Change::DeleteKeyLimits { rule, key },
        0,
    )
    .await?;
    if !action.done && !limits.done {
        return Err(AppError::NoOverride(missing));
    }
    Ok(Json(json!({"version": limits.version.max(action.version)})))
}

/// `GET /admin/v1/audit?limit=N`
pub async fn audit(State(state): State<AppState>, uri: Uri) -> Result<Json<Value>, AppError> {
    let query: AuditQuery = query(&uri)?;
    let limit = match query.limit {
        None => DEFAULT_AUDIT_LIMIT,
        Some(text) => text
            .parse::<u64>()
            .ok()
            .filter(|limit| (1..=AUDIT_CAP).contains(limit))
            .ok_or_else(|| {
                AppError::invalid(
                    "limit",
                    format!("must be an integer between 1 and {AUDIT_CAP}, got {text:?}"),
                )
            })?,
    };
    let entries = overrides::audit(&state, limit).await?;
    Ok(Json(json!({"entries": entries})))
}

/// Sets an entry: answers it as set (`fields`, then who, why, when, until when) with the new
/// version; 400 when its kind is full, or past a bound in bytes.
async fn set(
    state: &AppState,
    admin: &Admin,
    change: Change,
    fields: Value,
) -> Result<Json<Value>, AppError> {
    let written = overrides::write(state, &admin.name, &change, 0).await?;
    if let Some(refused) = written.refused {
        let settings = &state.settings;
        return Err(overrides::refusal(
            &change,
            refused,
            settings.overrides_max_bytes,
            settings.key_limits_max,
        ));
    }
    let reason = match &change {
        Change::SetBypass { note, .. }
        | Change::SetLimits { note, .. }
        | Change::SetBulkhead { note, .. }
        | Change::SetKey { note, .. }
        | Change::SetKeyLimits { note, .. } => note.reason.clone(),
        _ => None,
    };
    Ok(Json(answer(fields, admin, reason, &written)))
}

/// Deletes an entry: answers the new version; 404 naming `missing` when there was none.
async fn delete(
    state: &AppState,
    admin: &Admin,
    change: Change,
    missing: String,
) -> Result<Json<Value>, AppError> {
    let written = overrides::write(state, &admin.name, &change, 0).await?;
    if !written.done {
        return Err(AppError::NoOverride(missing));
    }
    Ok(Json(json!({"version": written.version})))
}

fn answer(fields: Value, admin: &Admin, reason: Option<String>, written: &Written) -> Value {
    let mut answer = json!({"version": written.version});
    if let (Value::Object(answer), Value::Object(fields)) = (&mut answer, fields) {
        answer.extend(fields);
        answer.insert("who".into(), json!(&*admin.name));
        answer.insert("reason".into(), json!(reason));
        answer.insert("set_at_ms".into(), json!(written.set_at_ms));
        answer.insert("expires_at_ms".into(), json!(written.expires_at_ms));
    }
    answer
}

/// The query string as `T`; 400 naming `query` when it does not parse (an unknown parameter).
fn query<T: DeserializeOwned>(uri: &Uri) -> Result<T, AppError> {
    Query::<T>::try_from_uri(uri)
        .map(|Query(query)| query)
        .map_err(|rejection| {
            let text = rejection.body_text();
            let reason = text
                .strip_prefix("Failed to deserialize query string: ")
                .unwrap_or(&text);
            AppError::invalid("query", reason)
        })
}

/// `ttl_s` in [1, [`MAX_TTL_S`]], `reason` at most [`MAX_REASON_BYTES`].
fn note(ttl_s: Option<u64>, reason: Option<String>) -> Result<Note, AppError> {
    if let Some(ttl) = ttl_s {
        if !(1..=MAX_TTL_S).contains(&ttl) {
            return Err(AppError::invalid(
                "ttl_s",
                format!("must be between 1 and {MAX_TTL_S} (366 days), got {ttl}"),
            ));
        }
    }
    if let Some(reason) = &reason {
        if reason.len() > MAX_REASON_BYTES {
            return Err(AppError::invalid(
                "reason",
                format!("longer than {MAX_REASON_BYTES} bytes"),
            ));
        }
    }
    Ok(Note { ttl_s, reason })
}

/// A rule's name: 1 to [`MAX_NAME_BYTES`] characters of a-z, A-Z, 0-9, `-`, `_`, `.`, as the
/// filter's configuration names them. Key overrides apply to a whole rule, every tier (the
/// filter looks them up by the rule's configured name).
pub fn rule_name(field: &str, value: &str) -> Result<(), AppError> {
    if value.contains('/') {
        return Err(AppError::invalid(
            field,
            format!(
                "must be a rule's name, without a tier: a key override applies to every tier \
                 of its rule, got {value:?}"
            ),
        ));
    }
    target_name(field, value)
}

/// The parts of a key: one string (a one-part key) or an array of strings, each non-empty and
/// without U+001F (the separator); the rule's whole key (its name and the parts, joined by
/// U+001F) at most `--max-key-bytes`, as any key the service counts.
pub fn key_parts(key: &Value, rule: &str, settings: &Settings) -> Result<Vec<String>, AppError> {
    let (parts, one): (Vec<String>, bool) = match key {
        Value::String(part) => (vec![part.clone()], true),
        Value::Array(items) => {
            let parts = items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(part) => Ok(part.clone()),
                    _ => Err(AppError::invalid(format!("key[{i}]"), "must be a string")),
                })
                .collect::<Result<_, _>>()?;
            (parts, false)
        }
        _ => {
            return Err(AppError::invalid(
                "key",
                "must be the key's parts in order (an array of strings), or one string",
            ))
        }
    };
    if parts.is_empty() {
        return Err(AppError::invalid("key", "must hold at least one part"));
    }
    for (i, part) in parts.iter().enumerate() {
        let field = if one {
            "key".into()
        } else {
            format!("key[{i}]")
        };
        if part.is_empty() {
            return Err(AppError::invalid(field, "must not be empty"));
        }
        if part.contains(sluice_protocol::KEY_PART_SEPARATOR) {
            return Err(AppError::invalid(
                field,
                "must not hold U+001F (it separates the parts)",
            ));
        }
    }
    let length = overrides::key_field(rule, &parts).len();
    if length > settings.max_key_bytes {
        return Err(AppError::invalid(
            "key",
            format!(
                "longer than {} bytes (the rule's key: its name and the parts, joined by U+001F)",
                settings.max_key_bytes
            ),
        ));
    }
    Ok(parts)
}

/// Whether a key override can match a request: with the proxies' configuration, checked against
/// the rule's key as the proxies check it ([`sluice_core::overrides::check_key`]); without it,
/// only its length (the filter replaces a key over [`sluice_protocol::MAX_KEY_BYTES`] by its
/// digest, so no override names it). `given` is the key as sent (one string: named `key`).
pub fn matchable(
    key: &[String],
    given: &Value,
    rule: &str,
    policy: Option<&sluice_core::policy::Policy>,
) -> Result<(), AppError> {
    let length = overrides::key_field(rule, key).len();
    if length > sluice_protocol::MAX_KEY_BYTES {
        return Err(AppError::invalid(
            "key",
            format!(
                "the rule's key would be {length} bytes (its name and the parts, joined by \
                 U+001F): the filter replaces a key over {} bytes by its digest, so no override \
                 can name it",
                sluice_protocol::MAX_KEY_BYTES
            ),
        ));
    }
    let Some(policy) = policy else {
        return Ok(());
    };
    sluice_core::overrides::check_key(policy, rule, key).map_err(|error| {
        let field = match given {
            Value::String(_) if error.field == "key[0]" => "key".to_string(),
            _ => error.field,
        };
        AppError::invalid(field, error.problem)
    })?;
    Ok(())
}

/// `GET /admin/v1/top?rule=…&window=…[&limit=…]`: the keys `rule` admitted and denied most over
/// the window (`1m` to `15m`; default `5m`), `limit` of each (1 to 64; default 20).
pub async fn top(State(state): State<AppState>, uri: Uri) -> Result<Json<Value>, AppError> {
    let query = crate::top::Query::parse(&uri)?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(Json(state.top.query(
        &query.rule,
        query.minutes,
        query.limit,
        now_ms,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn settings() -> Settings {
        Settings::parse_from(["sluice-counter-service", "--token", "t"])
    }

    fn message(result: Result<impl std::fmt::Debug, AppError>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn rule_names_are_the_configurations() {
        assert!(target_name("target", "api").is_ok());
        assert!(target_name("target", "api-v2.internal_x/gold").is_ok());
        for bad in ["", "/gold", "api/", "api/gold/x", "a b", &"r".repeat(65)] {
            assert!(
                message(target_name("target", bad)).starts_with("target: must be a rule's name"),
                "{bad:?}"
            );
        }
        assert!(target_name("target", &"r".repeat(64)).is_ok());
        assert!(rule_name("rule", "api").is_ok());
        assert_eq!(
            message(rule_name("rule", "api/gold")),
            "rule: must be a rule's name, without a tier: a key override applies to every tier \
             of its rule, got \"api/gold\""
        );
        assert!(message(rule_name("rule", "a b")).starts_with("rule: must be a rule's name"));
    }

    #[test]
    fn key_parts_are_bounded_like_keys() {
        let settings = settings();
        let parts = |key: Value| key_parts(&key, "api", &settings);
        assert_eq!(parts(json!("alice")).unwrap(), ["alice"]);
        assert_eq!(parts(json!(["alice", "GET"])).unwrap(), ["alice", "GET"]);
        assert_eq!(
            message(parts(json!([]))),
            "key: must hold at least one part"
        );
        assert_eq!(message(parts(json!(""))), "key: must not be empty");
        assert_eq!(
            message(parts(json!(["a", ""]))),
            "key[1]: must not be empty"
        );
        assert_eq!(message(parts(json!(["a", 1]))), "key[1]: must be a string");
        assert!(message(parts(json!(7))).starts_with("key: must be the key's parts"));
        assert!(message(parts(json!("a\u{1f}b"))).starts_with("key: must not hold U+001F"));
        // "api" + U+001F + 508 bytes = 512: the longest key
        assert!(parts(json!("k".repeat(508))).is_ok());
        assert!(message(parts(json!("k".repeat(509)))).starts_with("key: longer than 512 bytes"));
    }

    #[test]
    fn notes_are_bounded() {
        assert_eq!(note(None, None).unwrap(), Note::default());
        assert!(note(Some(1), Some("x".repeat(512))).is_ok());
        assert_eq!(
            message(note(Some(0), None)),
            "ttl_s: must be between 1 and 31622400 (366 days), got 0"
        );
        assert!(message(note(Some(MAX_TTL_S + 1), None)).starts_with("ttl_s: "));
        assert_eq!(
            message(note(None, Some("x".repeat(513)))),
            "reason: longer than 512 bytes"
        );
    }
}
