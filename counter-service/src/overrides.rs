//! Live overrides: what operators change through the admin API ([`crate::admin`]) without a
//! redeploy (an emergency bypass, limits replacing a rule's or a tier's, keys blocked or
//! allowed), kept in Redis by `lua/overrides.lua` and answered to every proxy's sync.
//!
//! **Storage.** Every key is under the hash tag `{overrides}` (one slot of a Redis Cluster, so
//! one script call changes the whole set atomically): the version ([`VERSION_KEY`]), the bypass
//! ([`BYPASS_KEY`]), the limits and the keys as proxies need them ([`LIMITS_KEY`],
//! [`KEYS_KEY`]), who set each entry, when and why ([`META_KEY`]), when the entries set with a
//! ttl expire ([`EXPIRY_KEY`]), and the audit log ([`AUDIT_KEY`], the latest [`AUDIT_CAP`]
//! changes). The limit keys are `sluice:{<16 hex digits>}:…`, so none can name these.
//!
//! **Versioning.** Every change increments the version in the same script call as the change
//! (a reader never sees a new set with an old version). The first version is the Redis clock in
//! milliseconds, plus one: a Redis that lost its data never hands out again a version a proxy
//! already holds.
//!
//! **Expiry.** Every call of the script, reads included, first removes the entries whose ttl
//! ran out, incrementing the version and recording each in the audit log (by `(ttl)`): an
//! expired entry is never answered, and the next sync of every proxy sees the set without it.
//! The clock is Redis `TIME`, so every replica agrees on it.
//!
//! **The sync path.** Each sync runs the script once, beside (concurrently with) its grants:
//! it answers the current version and bypass, and the whole set only when the version is
//! neither the proxy's nor the one this replica holds in memory ([`crate::override_cache::Cache`]). So a proxy's
//! sync answer always reflects every change made before it, on any replica, at the cost of
//! one small script call; the set travels from Redis once per replica and version. When the
//! call fails, the sync is answered its grants, no set (the proxy keeps its own) and the last
//! bypass this replica read.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use redis::ScriptInvocation;
use serde_json::{json, Map, Value};
use sluice_protocol::{KeyAction, LiveOverrides, Overrides, OverridesDelta, KEY_PART_SEPARATOR};

use crate::backend::BackendError;
use crate::error::AppError;
use crate::override_cache::Built;
use crate::state::AppState;

/// The version of the set (a string; absent: 0).
pub const VERSION_KEY: &str = "sluice:{overrides}:version";
/// The bypass: `"1"` on, `"0"` off (absent: not set).
pub const BYPASS_KEY: &str = "sluice:{overrides}:bypass";
/// A hash: target (`rule` or `rule/tier`) -> the limits' JSON array, as the operator gave it.
pub const LIMITS_KEY: &str = "sluice:{overrides}:limits";
/// A hash: rule, U+001F, the key's parts joined by U+001F -> `block` or `allow`.
pub const KEYS_KEY: &str = "sluice:{overrides}:keys";
/// A hash: entry -> `set_at_ms expires_at_ms {"who":…,"reason":…}`.
pub const META_KEY: &str = "sluice:{overrides}:meta";
/// A sorted set: entry -> expires_at_ms, of the entries set with a ttl.
pub const EXPIRY_KEY: &str = "sluice:{overrides}:expiry";
/// A list of JSON entries, newest first: the audit log.
pub const AUDIT_KEY: &str = "sluice:{overrides}:audit";
/// A list, newest first: the change log, `"<version> <entry>"` for every entry of the set a
/// change touched, from which syncs are answered deltas.
pub const LOG_KEY: &str = "sluice:{overrides}:log";
/// A hash: `set_bytes` (the set's size as proxies receive it), `log_bytes`, `log_from` (the log
/// holds every change after this version).
pub const SIZES_KEY: &str = "sluice:{overrides}:sizes";
/// Every key of the live overrides, in the order `lua/overrides.lua` takes them.
pub const KEYS: [&str; 9] = [
    VERSION_KEY,
    BYPASS_KEY,
    LIMITS_KEY,
    KEYS_KEY,
    META_KEY,
    EXPIRY_KEY,
    AUDIT_KEY,
    LOG_KEY,
    SIZES_KEY,
];

/// Most keys overridden at once (over every rule).
pub const MAX_KEY_OVERRIDES: u64 = 10_000;
/// Most limit overrides at once.
pub const MAX_LIMIT_OVERRIDES: u64 = 1_000;
/// Most entries the audit log keeps.
pub const AUDIT_CAP: u64 = 1_000;
/// Most bytes one entry may add to the set as proxies receive it (its name and value,
/// JSON-escaped): the longest key `--max-key-bytes` allows by default (512 bytes, each escaped
/// to at most 6) fits, and so do 8 limits.
pub const MAX_ENTRY_BYTES: u64 = 4 << 10;
/// Most entries the change log keeps: a proxy more changes behind gets the whole set.
pub const LOG_CAP: u64 = 1_000;
/// Most bytes the change log keeps (its entries' versions and names).
pub const LOG_MAX_BYTES: u64 = 256 << 10;
/// Who the audit log says removed an entry whose ttl ran out (no credential name has
/// parentheses).
pub const EXPIRED_BY: &str = "(ttl)";

/// Why an entry was set, and for how long.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Note {
    /// The entry is removed this many seconds after it is set; `None`: kept until deleted.
    pub ttl_s: Option<u64>,
    pub reason: Option<String>,
}

/// One change of the set (already validated: see [`crate::admin`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// Every proxy admits everything while `enabled`.
    SetBypass {
        enabled: bool,
        note: Note,
    },
    ClearBypass,
    /// `limits` (in the filter configuration's format) replace the limits of `target`.
    SetLimits {
        target: String,
        limits: Vec<Value>,
        note: Note,
    },
    DeleteLimits {
        target: String,
    },
    /// `value` (a bulkhead override's JSON object) replaces what it names of bulkhead `name`.
    /// Kept beside the limits, as `bulkhead:NAME` ([`sluice_core::overrides::BULKHEAD_PREFIX`]).
    SetBulkhead {
        name: String,
        value: Value,
        note: Note,
    },
    DeleteBulkhead {
        name: String,
    },
    /// The key of `rule` made of `key` (its parts, in order) is blocked or allowed.
    SetKey {
        rule: String,
        key: Vec<String>,
        action: KeyAction,
        note: Note,
    },
    DeleteKey {
        rule: String,
        key: Vec<String>,
    },
    /// The key of `rule` made of `key` counts with `limits` (the configuration's format) in
    /// place of its rule's. Kept beside the limits, as `key:RULE` U+001F the parts
    /// ([`sluice_core::overrides::KEY_LIMITS_PREFIX`]), bounded by `--key-limits-max`.
    SetKeyLimits {
        rule: String,
        key: Vec<String>,
        limits: Vec<Value>,
        note: Note,
    },
    DeleteKeyLimits {
        rule: String,
        key: Vec<String>,
    },
}

impl Change {
    /// The action, as the audit log says it and as the metrics label it.
    pub fn action(&self) -> (&'static str, &'static str) {
        match self {
            Change::SetBypass { .. } => ("set bypass", "set_bypass"),
            Change::ClearBypass => ("clear bypass", "clear_bypass"),
            Change::SetLimits { .. } => ("set limits", "set_limits"),
            Change::DeleteLimits { .. } => ("delete limits", "delete_limits"),
            Change::SetBulkhead { .. } => ("set bulkhead", "set_bulkhead"),
            Change::DeleteBulkhead { .. } => ("delete bulkhead", "delete_bulkhead"),
            Change::SetKey { .. } => ("set key", "set_key"),
            Change::DeleteKey { .. } => ("delete key", "delete_key"),
            Change::SetKeyLimits { .. } => ("set key limits", "set_key_limits"),
            Change::DeleteKeyLimits { .. } => ("delete key limits", "delete_key_limits"),
        }
    }

    /// What the audit log says it changed: `bypass`, the limits' target, or the key's rule.
    pub fn target(&self) -> &str {
        match self {
            Change::SetBypass { .. } | Change::ClearBypass => "bypass",
            Change::SetLimits { target, .. } | Change::DeleteLimits { target } => target,
            Change::SetBulkhead { name, .. } | Change::DeleteBulkhead { name } => name,
            Change::SetKey { rule, .. }
            | Change::DeleteKey { rule, .. }
            | Change::SetKeyLimits { rule, .. }
            | Change::DeleteKeyLimits { rule, .. } => rule,
        }
    }

    /// The kind of entry, as `lua/overrides.lua` names it, and its field in the kind's hash.
    fn entry(&self) -> (&'static str, String) {
        match self {
            Change::SetBypass { .. } | Change::ClearBypass => ("bypass", String::new()),
            Change::SetLimits { target, .. } | Change::DeleteLimits { target } => {
                ("limits", target.clone())
            }
            Change::SetBulkhead { name, .. } | Change::DeleteBulkhead { name } => {
                ("limits", bulkhead_target(name))
            }
            Change::SetKey { rule, key, .. } | Change::DeleteKey { rule, key } => {
                ("keys", key_field(rule, key))
            }
            Change::SetKeyLimits { rule, key, .. } | Change::DeleteKeyLimits { rule, key } => (
                "limits",
                sluice_core::overrides::key_limits_target(rule, key),
            ),
        }
    }

    fn note(&self) -> Option<&Note> {
        match self {
            Change::SetBypass { note, .. }
            | Change::SetLimits { note, .. }
            | Change::SetBulkhead { note, .. }
            | Change::SetKey { note, .. }
            | Change::SetKeyLimits { note, .. } => Some(note),
            _ => None,
        }
    }

    /// The value the audit log records.
    fn audit_value(&self) -> Value {
        let mut value = match self {
            Change::SetBypass { enabled, .. } => json!({"enabled": enabled}),
            Change::SetLimits { limits, .. } => json!({"limits": limits}),
            Change::SetBulkhead { value, .. } => json!({"bulkhead": value}),
            Change::SetKey { key, action, .. } => json!({"key": key, "action": action}),
            Change::DeleteKey { key, .. } | Change::DeleteKeyLimits { key, .. } => {
                json!({"key": key})
            }
            Change::SetKeyLimits { key, limits, .. } => json!({"key": key, "limits": limits}),
            Change::ClearBypass | Change::DeleteLimits { .. } | Change::DeleteBulkhead { .. } => {
                Value::Null
            }
        };
        if let (Some(note), Value::Object(map)) = (self.note(), &mut value) {
            map.insert("ttl_s".into(), json!(note.ttl_s));
            map.insert("reason".into(), json!(note.reason));
        }
        value
    }
}

/// The field of a bulkhead override in [`LIMITS_KEY`]: `bulkhead:NAME`, which no rule or tier
/// can be named (':' is not allowed in names).
pub fn bulkhead_target(name: &str) -> String {
    format!("{}{name}", sluice_core::overrides::BULKHEAD_PREFIX)
}

/// The field of a key override in [`KEYS_KEY`]: the rule, then each part, joined by U+001F.
pub fn key_field(rule: &str, key: &[String]) -> String {
    let mut field = rule.to_owned();
    for part in key {
        field.push(KEY_PART_SEPARATOR);
        field.push_str(part);
    }
    field
}

/// What a change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The version after the call (unchanged when nothing was done).
    pub version: u64,
    /// Whether it was done: a set is refused when its kind holds its most entries
    /// ([`MAX_KEY_OVERRIDES`], [`MAX_LIMIT_OVERRIDES`]) or past a bound in bytes (`refused`);
    /// a delete finds no such entry.
    pub done: bool,
    /// Why a set was refused.
    pub refused: Option<Refused>,
    /// When a set was done, on the Redis clock, in ms since the epoch.
    pub set_at_ms: u64,
    pub expires_at_ms: Option<u64>,
}

/// Why a set was refused (nothing was written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its kind holds its most entries.
    Full,
    /// The entry takes this many bytes, more than [`MAX_ENTRY_BYTES`].
    EntryBytes(u64),
    /// The set would take this many bytes, more than `--overrides-max-bytes`.
    SetBytes(u64),
}

/// The admin API's answer to a refused set: 400 naming the field and the bound.
pub fn refusal(
    change: &Change,
    refused: Refused,
    max_set_bytes: u64,
    max_key_limits: u64,
) -> AppError {
    let field = match change {
        Change::SetLimits { .. } => "target",
        Change::SetBulkhead { .. } => "bulkhead",
        _ => "key",
    };
    match refused {
        Refused::Full => match change {
            Change::SetKeyLimits { .. } => AppError::invalid(
                field,
                format!(
                    "at most {max_key_limits} keys are given limits of their own \
                     (--key-limits-max): delete one first"
                ),
            ),
            Change::SetLimits { .. } | Change::SetBulkhead { .. } => AppError::invalid(
                field,
                format!(
                    "at most {MAX_LIMIT_OVERRIDES} limit and bulkhead overrides are kept: delete one first"
                ),
            ),
            _ => AppError::invalid(
                field,
                format!("at most {MAX_KEY_OVERRIDES} key overrides are kept: delete one first"),
            ),
        },
        Refused::EntryBytes(bytes) => AppError::invalid(
            match change {
                Change::SetLimits { .. } | Change::SetKeyLimits { .. } => "limits",
                Change::SetBulkhead { .. } => "bulkhead",
                _ => "key",
            },
            format!(
                "the entry takes {bytes} bytes as proxies receive it (JSON-escaped), more than \
                 {MAX_ENTRY_BYTES}"
            ),
        ),
        Refused::SetBytes(bytes) => AppError::invalid(
            field,
            format!(
                "the live overrides would take {bytes} bytes as proxies receive them, more than \
                 --overrides-max-bytes {max_set_bytes}: delete some first"
            ),
        ),
    }
}

/// Applies one change for `who` (the admin credential's name): one `lua/overrides.lua` call,
/// which also removes the expired entries. Logged and counted when done. `now_override_us` is 0
/// in service (Redis `TIME` is the clock); tests pass a fake time.
pub async fn write(
    state: &AppState,
    who: &str,
    change: &Change,
    now_override_us: u64,
) -> Result<Written, BackendError> {
    let (action, label) = change.action();
    let (kind, field) = change.entry();
    let audit = json!({
        "who": who,
        "action": action,
        "target": change.target(),
        "value": change.audit_value(),
    })
    .to_string();
    // the script puts at_ms and the version in front
    let audit = audit.strip_prefix('{').unwrap_or(&audit);
    let mut invocation = invocation(state, now_override_us);
    let written = match change {
        Change::ClearBypass
        | Change::DeleteLimits { .. }
        | Change::DeleteBulkhead { .. }
        | Change::DeleteKey { .. }
        | Change::DeleteKeyLimits { .. } => {
            invocation.arg("delete").arg(kind).arg(&field).arg(audit);
            let (version, expired, done): (String, Vec<String>, i64) =
                state.backend.invoke("overrides", &invocation).await?;
            noted_expired(state, &expired);
            Written {
                version: parse_version(&version)?,
                done: done == 1,
                refused: None,
                set_at_ms: 0,
                expires_at_ms: None,
            }
        }
        Change::SetBypass { .. }
        | Change::SetLimits { .. }
        | Change::SetBulkhead { .. }
        | Change::SetKey { .. }
        | Change::SetKeyLimits { .. } => {
            let (value, max_entries) = match change {
                Change::SetBypass { enabled, .. } => (if *enabled { "1" } else { "0" }.into(), 0),
                Change::SetLimits { limits, .. } => {
                    (Value::from(limits.clone()).to_string(), MAX_LIMIT_OVERRIDES)
                }
                Change::SetBulkhead { value, .. } => (
                    Value::from(vec![value.clone()]).to_string(),
                    MAX_LIMIT_OVERRIDES,
                ),
                Change::SetKey { action, .. } => (action_name(*action).into(), MAX_KEY_OVERRIDES),
                Change::SetKeyLimits { limits, .. } => (
                    Value::from(limits.clone()).to_string(),
                    state.settings.key_limits_max,
                ),
                _ => (String::new(), 0),
            };
            let note = change.note().cloned().unwrap_or_default();
            let meta = json!({"who": who, "reason": note.reason}).to_string();
            let ttl_ms = note.ttl_s.map_or(0, |s| s.saturating_mul(1_000));
            invocation
                .arg("set")
                .arg(kind)
                .arg(&field)
                .arg(value)
                .arg(ttl_ms)
                .arg(meta)
                .arg(max_entries)
                .arg(audit);
            let (version, expired, done, set_at_ms, expires_at_ms, bytes): (
                String,
                Vec<String>,
                i64,
                i64,
                i64,
                i64,
            ) = state.backend.invoke("overrides", &invocation).await?;
            noted_expired(state, &expired);
            let bytes = u64::try_from(bytes).unwrap_or(0);
            Written {
                version: parse_version(&version)?,
                done: done == 1,
                refused: match done {
                    1 => None,
                    -1 => Some(Refused::EntryBytes(bytes)),
                    -2 => Some(Refused::SetBytes(bytes)),
                    _ => Some(Refused::Full),
                },
                set_at_ms: u64::try_from(set_at_ms).unwrap_or(0),
                expires_at_ms: u64::try_from(expires_at_ms).ok().filter(|&at| at > 0),
            }
        }
    };
    state.metrics.overrides_version.set(gauge(written.version));
    // the next sync on this replica reads the set it just changed
    state.overrides.forget_head();
    if written.done {
        state.metrics.admin_changed(label);
        tracing::info!(
            who,
            action,
            target = change.target(),
            version = written.version,
            "override changed"
        );
    }
    Ok(written)
}

fn action_name(action: KeyAction) -> &'static str {
    match action {
        KeyAction::Block => "block",
        KeyAction::Allow => "allow",
    }
}

fn parse_action(name: &str) -> Option<KeyAction> {
    match name {
        "block" => Some(KeyAction::Block),
        "allow" => Some(KeyAction::Allow),
        _ => None,
    }
}

/// A call of `lua/overrides.lua` with its keys and first arguments.
fn invocation(state: &AppState, now_override_us: u64) -> ScriptInvocation<'_> {
    let mut invocation = state.scripts.overrides.prepare_invoke();
    for key in KEYS {
        invocation.key(key);
    }
    invocation
        .arg(now_override_us)
        .arg(AUDIT_CAP)
        .arg(state.settings.overrides_max_bytes)
        .arg(MAX_ENTRY_BYTES)
        .arg(LOG_CAP)
        .arg(LOG_MAX_BYTES);
    state.metrics.script_called("overrides", 1);
    invocation
}

fn parse_version(text: &str) -> Result<u64, BackendError> {
    text.parse()
        .map_err(|_| BackendError::Reply(format!("overrides.lua answered the version {text:?}")))
}

fn gauge(version: u64) -> i64 {
    i64::try_from(version).unwrap_or(i64::MAX)
}

/// Logs and counts the entries a call found expired and removed.
fn noted_expired(state: &AppState, expired: &[String]) {
    if expired.is_empty() {
        return;
    }
    state.metrics.overrides_expired.inc_by(expired.len() as u64);
    for entry in expired {
        let (kind, target) = entry.split_once('\u{1f}').unwrap_or((entry, ""));
        let target = target.split('\u{1f}').next().unwrap_or_default();
        let action = match kind {
            "keys" => "expire key",
            "limits" => "expire limits",
            _ => "expire bypass",
        };
        tracing::info!(who = EXPIRED_BY, action, target, "override expired");
    }
}

/// The set as one read found it.
struct Read {
    version: u64,
    /// The bypass value: `"1"`, `"0"`, or `""` when not set.
    bypass: String,
    /// What the script answered of the set.
    answer: Answer,
    /// The change log holds every change after this version (a proxy there or later can be
    /// answered a delta).
    log_from: Option<u64>,
}

impl Read {
    fn bypass(&self) -> bool {
        self.bypass == "1"
    }
}

/// What a read answered of the set.
enum Answer {
    /// Nothing: the version is the proxy's, or the one this replica holds.
    Nothing,
    Whole(Stored),
    /// The entries changed since the proxy's version: as they are now, and the names of those
    /// removed.
    Delta(Stored, Vec<String>),
}

/// The stored set, or its entries a delta sets: flat hashes, field then value.
struct Stored {
    limits: Vec<String>,
    keys: Vec<String>,
    meta: Vec<String>,
    /// Flat (keys field, expires_at_ms) of the key entries that expire.
    expires: Vec<String>,
}

/// Reads the version and the bypass, and the whole set unless the version is `cached` or
/// `proxy` (`None`: any version); with `delta`, the changes since `proxy` when the log holds
/// them. `with_meta` also reads who set each entry.
async fn read(
    state: &AppState,
    cached: Option<u64>,
    proxy: Option<u64>,
    delta: bool,
    with_meta: bool,
    now_override_us: u64,
) -> Result<Read, BackendError> {
    let mut invocation = invocation(state, now_override_us);
    let version = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
    invocation
        .arg("read")
        .arg(version(cached))
        .arg(version(proxy))
        .arg(if with_meta { "1" } else { "0" })
        .arg(if delta { "1" } else { "0" });
    type Reply = (
        String,
        Vec<String>,
        String,
        i64,
        Vec<String>,
        Vec<String>,
        Vec<String>,
        i64,
        String,
        Vec<String>,
    );
    let (version, expired, bypass, answer, limits, keys, more, set_bytes, log_from, expires): Reply =
        state.backend.invoke("overrides", &invocation).await?;
    noted_expired(state, &expired);
    let answer = match answer {
        1 => Answer::Whole(Stored {
            limits,
            keys,
            meta: more,
            expires,
        }),
        2 => Answer::Delta(
            Stored {
                limits,
                keys,
                meta: Vec::new(),
                expires,
            },
            more,
        ),
        _ => Answer::Nothing,
    };
    let read = Read {
        version: parse_version(&version)?,
        bypass,
        answer,
        log_from: log_from.parse().ok(),
    };
    state.metrics.overrides_version.set(gauge(read.version));
    state.metrics.overrides_bytes.set(set_bytes);
    state.metrics.bypass.set(i64::from(read.bypass()));
    state.overrides.set_bypass(read.bypass());
    state
        .overrides
        .set_head(read.version, read.bypass(), read.log_from, Instant::now());
    Ok(read)
}

/// The pairs of a flat HGETALL reply.
fn pairs(flat: &[String]) -> impl Iterator<Item = (&str, &str)> {
    flat.chunks_exact(2).map(|pair| (&*pair[0], &*pair[1]))
}

/// The set as proxies take it. A stored value that does not parse is left out (and logged).
fn live(version: u64, stored: &Stored) -> LiveOverrides {
    let mut live = LiveOverrides {
        version,
        ..LiveOverrides::default()
    };
    (live.limits, live.keys) = entries(stored);
    live.expires = expiries(stored);
    live
}

/// When the key entries of a stored set (or delta) that expire do, per rule and key, as proxies
/// take them. One that does not parse is left out (and logged): its key then has no expiry.
fn expiries(stored: &Stored) -> Expires {
    let mut expires = Expires::new();
    for (field, at) in pairs(&stored.expires) {
        match (field.split_once(KEY_PART_SEPARATOR), at.parse::<u64>()) {
            (Some((rule, key)), Ok(at)) => {
                expires
                    .entry(rule.to_owned())
                    .or_default()
                    .insert(key.to_owned(), at);
            }
            _ => tracing::warn!(field, at, "stored key expiry left out"),
        }
    }
    expires
}

type Expires = BTreeMap<String, BTreeMap<String, u64>>;

/// The limits and the keys of a stored set (or delta), as proxies take them.
fn entries(stored: &Stored) -> (Limits, KeysByRule) {
    let mut limits = Limits::new();
    let mut keys = KeysByRule::new();
    for (target, json) in pairs(&stored.limits) {
        match serde_json::from_str::<Vec<Value>>(json) {
            Ok(parsed) => {
                limits.insert(target.to_owned(), parsed);
            }
            Err(error) => tracing::warn!(target, "stored limits override left out: {error}"),
        }
    }
    for (field, action) in pairs(&stored.keys) {
        match (field.split_once(KEY_PART_SEPARATOR), parse_action(action)) {
            (Some((rule, key)), Some(action)) => {
                keys.entry(rule.to_owned())
                    .or_default()
                    .insert(key.to_owned(), action);
            }
            _ => tracing::warn!(field, action, "stored key override left out"),
        }
    }
    (limits, keys)
}

type Limits = BTreeMap<String, Vec<Value>>;
type KeysByRule = BTreeMap<String, BTreeMap<String, KeyAction>>;

/// The delta from `from` to `version`: the entries set, and those removed (by name).
fn delta(from: u64, version: u64, stored: &Stored, removed: &[String]) -> OverridesDelta {
    let (limits, keys) = entries(stored);
    let mut delta = OverridesDelta {
        from,
        version,
        limits,
        keys,
        expires: expiries(stored),
        ..OverridesDelta::default()
    };
    for name in removed {
        match name.split_once('\u{1f}') {
            Some(("limits", target)) => delta.removed_limits.push(target.to_owned()),
            Some(("keys", field)) => match field.split_once(KEY_PART_SEPARATOR) {
                Some((rule, key)) => delta
                    .removed_keys
                    .entry(rule.to_owned())
                    .or_default()
                    .push(key.to_owned()),
                None => tracing::warn!(name, "logged key override left out"),
            },
            _ => tracing::warn!(name, "logged override left out"),
        }
    }
    delta
}

/// What a sync is answered: the current bypass, and, when `proxy_version` is not the current
/// version, the changes since it (`delta`: the proxy takes deltas, and the change log holds
/// them) or else the whole set. When Redis fails, the last bypass this replica read and no set
/// (logged: the proxy keeps the set it has). `now_override_us` is 0 in service; tests pass a
/// fake time.
pub async fn for_sync(
    state: &AppState,
    proxy_version: u64,
    delta_ok: bool,
    now_override_us: u64,
) -> Overrides {
    let cache = &state.overrides;
    let cached = cache.current();
    let delta_ok = delta_ok && proxy_version != 0;
    // Syncs close together share one read: within --overrides-refresh-ms of the last, the
    // version it found (and the set or the delta, when this replica holds it) answers without
    // Redis.
    let refresh = state.settings.overrides_refresh();
    if !refresh.is_zero() && now_override_us == 0 {
        if let Some(head) = cache.fresh_head(refresh, Instant::now()) {
            if head.version == proxy_version {
                state.metrics.overrides_reads_shared.inc();
                return answer(state, head.bypass, None, None);
            }
            if delta_ok {
                if let Some(delta) = cache.delta(proxy_version, head.version) {
                    state.metrics.overrides_reads_shared.inc();
                    return answer(state, head.bypass, None, Some(delta));
                }
            }
            // a delta the log cannot serve: the whole set
            let whole = !delta_ok
                || proxy_version > head.version
                || head.log_from.is_none_or(|from| proxy_version < from);
            if let Some(set) = cached
                .as_ref()
                .filter(|set| whole && set.version == head.version)
            {
                state.metrics.overrides_reads_shared.inc();
                return answer(state, head.bypass, Some(set.clone()), None);
            }
        }
    }
    let read = read(
        state,
        cached.as_ref().map(|set| set.version),
        Some(proxy_version),
        delta_ok,
        false,
        now_override_us,
    )
    .await;
    let read = match read {
        Ok(read) => read,
        Err(error) => {
            tracing::warn!("live overrides not answered: {error}");
            return answer(state, cache.last_bypass(), None, None);
        }
    };
    if read.version == proxy_version {
        return answer(state, read.bypass(), None, None);
    }
    match (&read.answer, cached) {
        (Answer::Delta(stored, removed), _) => {
            let built = Arc::new(Built::new(delta(
                proxy_version,
                read.version,
                stored,
                removed,
            )));
            cache.store_delta(built.clone());
            answer(state, read.bypass(), None, Some(built))
        }
        (Answer::Whole(stored), _) => {
            let set = Arc::new(Built::new(live(read.version, stored)));
            cache.store(set.clone());
            answer(state, read.bypass(), Some(set), None)
        }
        (Answer::Nothing, Some(cached)) if cached.version == read.version => {
            answer(state, read.bypass(), Some(cached), None)
        }
        // (the script answers the set unless the version is the cached one)
        (Answer::Nothing, _) => answer(state, read.bypass(), None, None),
    }
}

/// The overrides of a sync answer, counted.
fn answer(
    state: &AppState,
    bypass: bool,
    set: Option<Arc<Built<LiveOverrides>>>,
    delta: Option<Arc<Built<OverridesDelta>>>,
) -> Overrides {
    let metrics = &state.metrics;
    if let Some(set) = &set {
        metrics.overrides_sent.inc();
        metrics.overrides_answered_bytes("whole", set.bytes);
    }
    if let Some(delta) = &delta {
        metrics.overrides_deltas_sent.inc();
        metrics.overrides_answered_bytes("delta", delta.bytes);
    }
    Overrides {
        bypass,
        load_level: None,
        fleet_proxies: None,
        live: set.map(|set| set.value.clone()),
        delta: delta.map(|delta| delta.value.clone()),
    }
}

/// Whether the emergency bypass is in force now: the head this replica read within
/// `--overrides-refresh-ms`, else one read (the set itself only when it changed since the one
/// this replica holds). An error when Redis does not answer.
pub async fn bypass_now(state: &AppState) -> Result<bool, BackendError> {
    let cache = &state.overrides;
    let refresh = state.settings.overrides_refresh();
    if !refresh.is_zero() {
        if let Some(head) = cache.fresh_head(refresh, Instant::now()) {
            return Ok(head.bypass);
        }
    }
    let cached = cache.current().map(|set| set.version);
    Ok(read(state, cached, None, false, false, 0).await?.bypass())
}

/// The whole set as the admin API shows it (`GET /admin/v1/overrides`): the version, the
/// bypass, the limits by target and the keys by rule, each with who set it, when, why and
/// when it expires.
pub async fn view(state: &AppState, now_override_us: u64) -> Result<Value, BackendError> {
    let read = read(state, None, None, false, true, now_override_us).await?;
    let empty = Stored {
        limits: Vec::new(),
        keys: Vec::new(),
        meta: Vec::new(),
        expires: Vec::new(),
    };
    let stored = match &read.answer {
        Answer::Whole(stored) => stored,
        _ => &empty,
    };
    state
        .overrides
        .store(Arc::new(Built::new(live(read.version, stored))));
    let meta: HashMap<&str, &str> = pairs(&stored.meta).collect();
    let record = |entry: &str, fields: Value| record(fields, meta.get(entry).copied());

    let bypass = match read.bypass.as_str() {
        "" => Value::Null,
        value => record("bypass", json!({"enabled": value == "1"})),
    };
    let mut limits = Map::new();
    let mut bulkheads = Map::new();
    let mut key_limits: BTreeMap<&str, Map<String, Value>> = BTreeMap::new();
    for (target, json) in pairs(&stored.limits) {
        let parsed: Value = serde_json::from_str(json).unwrap_or(Value::Null);
        let entry = format!("limits\u{1f}{target}");
        if let Some(named) = target.strip_prefix(sluice_core::overrides::KEY_LIMITS_PREFIX) {
            let Some((rule, key)) = named.split_once(KEY_PART_SEPARATOR) else {
                continue;
            };
            let parts: Vec<&str> = key.split(KEY_PART_SEPARATOR).collect();
            key_limits.entry(rule).or_default().insert(
                key.to_owned(),
                record(&entry, json!({"key": parts, "limits": parsed})),
            );
            continue;
        }
        match target.strip_prefix(sluice_core::overrides::BULKHEAD_PREFIX) {
            Some(name) => {
                let value = match parsed {
                    Value::Array(mut one) if one.len() == 1 => one.remove(0),
                    other => other,
                };
                bulkheads.insert(name.to_owned(), record(&entry, json!({"bulkhead": value})));
            }
            None => {
                limits.insert(target.to_owned(), record(&entry, json!({"limits": parsed})));
            }
        }
    }
    let mut keys: BTreeMap<&str, Map<String, Value>> = BTreeMap::new();
    for (field, action) in pairs(&stored.keys) {
        let Some((rule, key)) = field.split_once(KEY_PART_SEPARATOR) else {
            continue;
        };
        let parts: Vec<&str> = key.split(KEY_PART_SEPARATOR).collect();
        let entry = format!("keys\u{1f}{field}");
        keys.entry(rule).or_default().insert(
            key.to_owned(),
            record(&entry, json!({"key": parts, "action": action})),
        );
    }
    Ok(json!({
        "version": read.version,
        "bypass": bypass,
        "limits": limits,
        "bulkheads": bulkheads,
        "keys": keys,
        "key_limits": key_limits,
    }))
}

/// One entry as the admin API shows it: its own fields, then who set it, why, when, and when it
/// expires (from its meta value, `set_at_ms expires_at_ms json`).
pub fn record(fields: Value, meta: Option<&str>) -> Value {
    let mut record = match fields {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    let mut parts = meta.unwrap_or_default().splitn(3, ' ');
    let set_at_ms: Option<u64> = parts.next().and_then(|ms| ms.parse().ok());
    let expires_at_ms: Option<u64> = parts
        .next()
        .and_then(|ms| ms.parse().ok())
        .filter(|&ms| ms > 0);
    let note: Value = parts
        .next()
        .and_then(|json| serde_json::from_str(json).ok())
        .unwrap_or_default();
    record.insert("who".into(), note.get("who").cloned().unwrap_or_default());
    record.insert(
        "reason".into(),
        note.get("reason").cloned().unwrap_or_default(),
    );
    record.insert("set_at_ms".into(), json!(set_at_ms));
    record.insert("expires_at_ms".into(), json!(expires_at_ms));
    Value::Object(record)
}

/// The latest `limit` entries of the audit log, newest first.
pub async fn audit(state: &AppState, limit: u64) -> Result<Vec<Value>, BackendError> {
    let stop = i64::try_from(limit).unwrap_or(i64::MAX).saturating_sub(1);
    let mut command = redis::cmd("LRANGE");
    command.arg(AUDIT_KEY).arg(0).arg(stop);
    let entries: Vec<String> = state.backend.query("audit", &command).await?;
    Ok(entries
        .iter()
        .map(|entry| serde_json::from_str(entry).unwrap_or_else(|_| Value::String(entry.clone())))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_field_joins_the_rule_and_the_parts() {
        let key = vec!["alice".to_owned(), "GET".to_owned()];
        assert_eq!(key_field("api", &key), "api\u{1f}alice\u{1f}GET");
        assert_eq!(key_field("api/gold", &key[..1]), "api/gold\u{1f}alice");
    }

    #[test]
    fn every_key_shares_the_hash_tag() {
        for key in KEYS {
            assert!(key.starts_with("sluice:{overrides}:"), "{key}");
        }
    }

    #[test]
    fn a_record_carries_who_when_and_why() {
        let meta = r#"1700000000000 1700000600000 {"who":"alice","reason":"incident 42"}"#;
        assert_eq!(
            record(json!({"enabled": true}), Some(meta)),
            json!({"enabled": true, "who": "alice", "reason": "incident 42",
                   "set_at_ms": 1_700_000_000_000u64, "expires_at_ms": 1_700_000_600_000u64})
        );
        let meta = r#"1700000000000 0 {"who":"bob","reason":null}"#;
        assert_eq!(
            record(json!({"action": "block"}), Some(meta)),
            json!({"action": "block", "who": "bob", "reason": null,
                   "set_at_ms": 1_700_000_000_000u64, "expires_at_ms": null})
        );
    }

    #[test]
    fn the_audit_value_says_what_was_set() {
        let change = Change::SetKey {
            rule: "api".into(),
            key: vec!["alice".into()],
            action: KeyAction::Block,
            note: Note {
                ttl_s: Some(60),
                reason: None,
            },
        };
        assert_eq!(change.action(), ("set key", "set_key"));
        assert_eq!(change.target(), "api");
        assert_eq!(
            change.audit_value(),
            json!({"key": ["alice"], "action": "block", "ttl_s": 60, "reason": null})
        );
        assert_eq!(
            Change::DeleteLimits {
                target: "api/gold".into()
            }
            .audit_value(),
            Value::Null
        );
    }
}
