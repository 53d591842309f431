//! Property-based fuzzing of everything in core that reads untrusted or possibly corrupt input:
//! the configuration parser, the shared-data records and states the filter's workers read (a
//! corrupt or truncated record must never panic a worker), and key, header and path building
//! from client-controlled values.
//!
//! The toolchain is stable Rust, so coverage-guided fuzzing (cargo-fuzz, which needs nightly) is
//! not available; these are `proptest` properties. Every test first replays the committed seed
//! corpus (`tests/fuzz-corpus/`), then runs `SLUICE_FUZZ_CASES` generated cases (default
//! [`DEFAULT_CASES`]; `make fuzz` runs many more). A failing case is shrunk and saved by proptest
//! in `tests/fuzz.proptest-regressions`, which is committed and replayed first on every run.

use std::fs;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Map, Value};

use sluice_core::config::ConfigError;
use sluice_core::limit::table::{KeyHasher, Record, Table};
use sluice_core::limiter::key::MAX_KEY_BYTES;
use sluice_core::policy::HeaderStyle;
use sluice_core::shed::{self, Gauge, Pressure, Samples};
use sluice_core::store::{Store, StoreError};
use sluice_core::sync::proxy::{self, SyncState};
use sluice_core::sync::round;
use sluice_core::{
    Exchange, Limit, Limiter, MemoryStore, Moment, Period, PlainRequest, Quota, RequestView,
};

/// Cases per property when `SLUICE_FUZZ_CASES` is not set: a few seconds in `make test`.
const DEFAULT_CASES: u32 = 256;

fn cases() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

fn config(weight: u32) -> Config {
    Config {
        cases: (cases() / weight).max(16),
        // Shrinking a huge input can take long; the default bound is plenty.
        max_shrink_iters: 2_048,
        ..Config::default()
    }
}

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

fn manifest(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Every file of the corpus directory `dir` (sorted), as bytes.
fn corpus(dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = manifest(&format!("tests/fuzz-corpus/{dir}"));
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
        .into_iter()
        .map(|p| {
            let bytes = fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The configuration parser
// ---------------------------------------------------------------------------------------------

/// The top-level fields of a configuration (what an unknown one is told to pick from).
const TOP_LEVEL: [&str; 10] = [
    "headers",
    "bypass",
    "client_ip",
    "rules",
    "max_keys",
    "service",
    "shedding",
    "jwt_payload_in_metadata",
    "x_ratelimit_reset",
    "host",
];

/// Configurations to mutate: the error fixtures, the examples of the README and docs/, the corpus,
/// and a few valid ones that reach every part of the policy.
fn config_seeds() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> = Vec::new();
    let mut fixtures: Vec<PathBuf> = fs::read_dir(manifest("tests/config"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    fixtures.sort();
    seeds.extend(fixtures.iter().map(|p| fs::read(p).unwrap()));
    // The README's example and every example of the reference in docs/.
    let mut pages = vec![manifest("../README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(manifest("../docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    let text: String = pages
        .iter()
        .map(|p| fs::read_to_string(p).unwrap())
        .collect();
    for block in text.split("```json\n").skip(1) {
        let block = block.split("```").next().unwrap_or_default();
        seeds.push(block.as_bytes().to_vec());
        // A fragment such as `"shedding": {...}` reads as a configuration once wrapped.
        seeds.push(format!("{{{block}}}").into_bytes());
    }
    seeds.extend(corpus("config").into_iter().map(|(_, bytes)| bytes));
    seeds.extend(VALID.iter().map(|c| c.as_bytes().to_vec()));
    seeds
}

/// Valid configurations covering local, cached and strict rules, every algorithm, tiers, key
/// parts of every kind and shedding.
const VALID: [&str; 4] = [
    r#"{"headers": "both", "max_keys": 64, "client_ip": {"trusted_hops": 1},
        "bypass": {"paths": ["/healthz"], "cidrs": ["10.0.0.0/8", "fd00::/8"]},
        "service": {"cluster": "svc", "sync_interval_ms": 100},
        "rules": [
          {"name": "ip", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
           "key": ["client_ip/24/64", "method"], "limits": [{"requests": 5, "per": "second", "burst": 3}]},
          {"name": "user", "key": ["header:x-user", "query:k"], "consistency": "cached",
           "limits": [{"requests": 100, "per": "minute"}, {"requests": 1000, "per": "day"}],
           "fallback": {"policy": "fail_open", "limits": [{"requests": 10, "per": "minute"}]}},
          {"name": "strict", "key": ["path"], "consistency": "strict",
           "limits": [{"requests": 2, "per": "second"}]}]}"#,
    r#"{"max_keys": 64, "rules": [
          {"name": "log", "key": ["header:x-a|header:x-b", "const:c"],
           "limits": [{"requests": 4, "per": "second", "algorithm": "sliding_log"}]},
          {"name": "win", "key": ["client_ip"], "mode": "warn",
           "limits": [{"requests": 3, "per": "second", "algorithm": "sliding_window"}]},
          {"name": "fixed", "key": ["client_ip"],
           "limits": [{"requests": 30, "per": "month", "algorithm": "fixed_window"}]},
          {"name": "leaky", "key": ["client_ip", "path"],
           "limits": [{"requests": 3, "per": "second", "algorithm": "leaky_bucket"}]},
          {"name": "gcra", "key": ["jwt:sub"], "mode": "monitor",
           "limits": [{"requests": 3, "per": "second", "algorithm": "gcra"}]}]}"#,
    r#"{"max_keys": 64, "rules": [{"name": "plans", "key": ["header:x-user"],
        "tiers": {"from": "header:x-plan", "default": "free",
          "limits": {"free": [{"requests": 2, "per": "second"}],
                     "pro": [{"requests": 20, "per": "second"}]}}}]}"#,
    r#"{"shedding": {"class_header": "x-class", "classes": {"high": 0.9, "low": 0.7},
        "bulkheads": [{"name": "api", "match": {"path_prefix": "/api"}, "limit": {"static": 2},
          "timeout_ms": 1000}]},
        "rules": [{"name": "ip", "key": ["client_ip"], "limits": [{"requests": 3, "per": "second"}]}]}"#,
];

/// What every answer of the parser must be: a policy, or an error naming the field (empty only
/// when the whole document is at fault: not JSON, not an object, empty).
fn check_parse(bytes: &[u8]) -> Result<Option<sluice_core::Policy>, TestCaseError> {
    match sluice_core::parse(bytes) {
        Ok(policy) => Ok(Some(policy)),
        Err(error) => {
            check_error(bytes, &error)?;
            Ok(None)
        }
    }
}

fn check_error(bytes: &[u8], error: &ConfigError) -> Result<(), TestCaseError> {
    let message = error.to_string();
    prop_assert!(!error.problem.is_empty(), "no problem stated: {message:?}");
    prop_assert!(!message.contains('\n'), "a multi-line message: {message:?}");
    if error.field.is_empty() {
        return Ok(());
    }
    prop_assert!(
        message.starts_with(&format!("{}: ", error.field)),
        "{message:?} does not start with its field"
    );
    // The path starts with a top-level field the configuration has (or one it lacks and needs).
    let first = error
        .field
        .split(['.', '['])
        .next()
        .unwrap_or_default()
        .to_string();
    let object: Option<Map<String, Value>> = serde_json::from_slice(bytes).ok();
    // (A key may itself hold '.' or '[': the path is not escaped.)
    let known = TOP_LEVEL.contains(&first.as_str())
        || object.as_ref().is_some_and(|o| {
            o.keys()
                .any(|k| !k.is_empty() && error.field.starts_with(&escaped(k)))
        })
        // not an object: an array's `[0]...`, or the key where the parser stopped
        || (object.is_none()
            && (first.is_empty()
                || escaped(&String::from_utf8_lossy(bytes))
                    .replace('\\', "")
                    .contains(&first.replace('\\', ""))));
    prop_assert!(known, "{message:?}: the path does not start with a field");
    Ok(())
}

/// A key as an error message writes it: control characters escaped, one line.
fn escaped(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A well-formed JSON object that the parser refuses must name a field: what was wrong where.
fn check_object_error(bytes: &[u8]) -> Result<(), TestCaseError> {
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(bytes) else {
        return Ok(());
    };
    if object.is_empty() {
        return Ok(());
    }
    if let Err(error) = sluice_core::parse(bytes) {
        // serde_json reads at most 128 levels: deeper is a syntax error, about no one field.
        let recursion = error.problem.contains("recursion limit");
        // A top-level field given twice is named in the problem: "duplicate field `rules`".
        let duplicate = error.problem.starts_with("duplicate field `");
        prop_assert!(
            !error.field.is_empty() || recursion || duplicate,
            "an object refused without naming a field: {error}"
        );
    }
    Ok(())
}

/// An accepted configuration must also run: a few requests through the limiter and the whole
/// exchange (shedding included), on a store of its own.
fn exercise(policy: sluice_core::Policy) {
    let limiter = Limiter::with_secret(policy, [7, 9]);
    let mut store = MemoryStore::default();
    for (i, req) in requests().into_iter().enumerate() {
        let now = T0 + i as u64 * 300_000;
        let mut r = req.clone();
        let _ = limiter.decide(&mut r, conditions(now), &mut store);
        let mut r = req;
        let _ = Exchange::start(&limiter, &mut r, None, Moment::at(now), &mut store);
    }
}

fn conditions(now_us: u64) -> sluice_core::Conditions {
    sluice_core::Conditions {
        now_us,
        service_up: true,
        service_back_us: 0,
        load: Default::default(),
    }
}

/// Requests that match the seed configurations' rules.
fn requests() -> Vec<PlainRequest> {
    vec![
        PlainRequest::get("/api/a").from_ip("10.1.2.3"),
        PlainRequest::get("/api/b?k=1")
            .from_ip("2001:db8::1")
            .with_header("x-user", "alice")
            .with_header("x-plan", "pro")
            .with_header("x-class", "high")
            .with_claim("sub", "u1"),
        PlainRequest::get("/x")
            .from_ip("192.0.2.1")
            .with_header("x-a", "a")
            .with_header("x-user", "bob")
            .with_header("x-class", "low"),
        PlainRequest::get("/api/a").from_ip("10.1.2.3"),
    ]
}

/// Values that have broken parsers before: edges of every number type, odd strings, odd shapes.
fn interesting_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1)),
        Just(json!(u32::MAX)),
        Just(json!(u32::MAX as u64 + 1)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(0.5)),
        Just(json!(f64::MIN_POSITIVE)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        Just(json!("")),
        Just(json!("/")),
        Just(json!("\u{0}")),
        Just(json!("\u{1f}")),
        Just(json!("é/ü/\u{1F600}")),
        Just(json!("a".repeat(70))),
        Just(json!("x".repeat(5_000))),
        Just(json!("client_ip/0/0")),
        Just(json!("client_ip/33")),
        Just(json!("client_ip/32/128")),
        Just(json!("header:")),
        Just(json!("query:\u{1e}")),
        Just(json!("a|b|c|d|e|f|g|h|i")),
        Just(json!("0.0.0.0/0")),
        Just(json!("::/0")),
        Just(json!("/users/{id}")),
        Just(json!("/{a}/{a}")),
        ".{0,24}".prop_map(Value::String),
        Just(json!([])),
        Just(json!({})),
        Just(deep(200)),
        Just(deep(127)),
        Just(json!([{"requests": u64::MAX, "per": "second", "burst": u64::MAX}])),
        Just(json!({"requests": 0, "per": "month"})),
        arbitrary_json(),
    ]
}

/// `[[[…]]]` nested `levels` deep.
fn deep(levels: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..levels {
        v = json!([v]);
    }
    v
}

/// Any JSON value, a few levels deep.
fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One structural change to a JSON document, at the node `at` (an index into its nodes, taken
/// modulo their count).
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the node with another value.
    Replace(usize, Value),
    /// Remove the node from its object or array.
    Drop(usize),
    /// Repeat the node in its array, or copy it under another field of its object.
    Duplicate(usize, String),
    /// The same value with another JSON type (a number as a string, a string as a number...).
    Retype(usize),
    /// Wrap the node in an array or object, `n` levels deep.
    Nest(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), interesting_value()).prop_map(|(at, v)| Mutation::Replace(at, v)),
        2 => any::<usize>().prop_map(Mutation::Drop),
        1 => (any::<usize>(), prop_oneof![Just(String::new()), "[a-z_]{1,10}", prop::sample::select(TOP_LEVEL.to_vec()).prop_map(str::to_string)])
            .prop_map(|(at, k)| Mutation::Duplicate(at, k)),
        2 => any::<usize>().prop_map(Mutation::Retype),
        1 => (any::<usize>(), 1..40usize).prop_map(|(at, n)| Mutation::Nest(at, n)),
    ]
}

/// The JSON pointers of every node of `value` but the root.
fn pointers(value: &Value, at: String, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                pointers(v, p, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(v, p, out);
            }
        }
        _ => {}
    }
}

fn split_pointer(pointer: &str) -> (&str, String) {
    let (parent, last) = pointer.rsplit_once('/').unwrap_or(("", pointer));
    (parent, last.replace("~1", "/").replace("~0", "~"))
}

fn apply(doc: &mut Value, mutation: &Mutation) {
    let mut nodes = Vec::new();
    pointers(doc, String::new(), &mut nodes);
    let pick = |at: usize| nodes.get(at % nodes.len().max(1)).cloned();
    match mutation {
        Mutation::Replace(at, value) => match pick(*at) {
            Some(p) => *doc.pointer_mut(&p).unwrap() = value.clone(),
            None => *doc = value.clone(),
        },
        Mutation::Drop(at) => {
            let Some(p) = pick(*at) else { return };
            let (parent, last) = split_pointer(&p);
            match doc.pointer_mut(parent) {
                Some(Value::Object(map)) => {
                    map.remove(&last);
                }
                Some(Value::Array(items)) => {
                    let i: usize = last.parse().unwrap();
                    items.remove(i);
                }
                _ => {}
            }
        }
        Mutation::Duplicate(at, name) => {
            let Some(p) = pick(*at) else { return };
            let (parent, last) = split_pointer(&p);
            let node = doc.pointer(&p).unwrap().clone();
            match doc.pointer_mut(parent) {
                Some(Value::Object(map)) => {
                    map.insert(format!("{last}{name}"), node);
                }
                Some(Value::Array(items)) => items.push(node),
                _ => {}
            }
        }
        Mutation::Retype(at) => {
            let Some(p) = pick(*at) else { return };
            let node = doc.pointer_mut(&p).unwrap();
            *node = match node.take() {
                Value::Number(n) => Value::String(n.to_string()),
                Value::String(s) => s
                    .parse::<f64>()
                    .ok()
                    .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
                    .unwrap_or(json!(s.len())),
                Value::Bool(b) => json!(b as u8),
                Value::Null => json!(false),
                Value::Array(items) => Value::Object(
                    items
                        .into_iter()
                        .enumerate()
                        .map(|(i, v)| (i.to_string(), v))
                        .collect(),
                ),
                Value::Object(map) => Value::Array(map.into_iter().map(|(_, v)| v).collect()),
            };
        }
        Mutation::Nest(at, levels) => {
            let Some(p) = pick(*at) else { return };
            let node = doc.pointer_mut(&p).unwrap();
            let mut v = node.take();
            for i in 0..*levels {
                v = if i % 2 == 0 {
                    json!([v])
                } else {
                    json!({ "x": v })
                };
            }
            *node = v;
        }
    }
}

/// Byte-level damage to a document: what a truncated or garbled configuration looks like.
#[derive(Debug, Clone)]
enum Damage {
    Truncate(usize),
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    /// A field repeated in the text (`{"rules": …, "rules": …}`): the typed value cannot say.
    DuplicateField(usize),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<usize>().prop_map(Damage::Truncate),
        (any::<usize>(), 1..=255u8).prop_map(|(at, bit)| Damage::Flip(at, bit)),
        (
            any::<usize>(),
            prop_oneof![
                prop::collection::vec(any::<u8>(), 1..8),
                Just(b"\xef\xbb\xbf".to_vec()),
                Just(b"\xff\xfe".to_vec()),
                Just(b"\"\\ud800\"".to_vec()),
                Just(b"1e999999".to_vec()),
                Just(b"-0".to_vec()),
                Just(b"NaN".to_vec()),
                Just(b"{\"".to_vec()),
                Just(b"}]".to_vec()),
            ]
        )
            .prop_map(|(at, b)| Damage::Insert(at, b)),
        any::<usize>().prop_map(Damage::DuplicateField),
    ]
}

fn damage_bytes(bytes: &mut Vec<u8>, damage: &Damage) {
    let len = bytes.len();
    match damage {
        Damage::Truncate(at) => bytes.truncate(at % (len + 1)),
        Damage::Flip(at, bits) if len > 0 => bytes[at % len] ^= bits,
        Damage::Flip(..) => {}
        Damage::Insert(at, more) => {
            let at = at % (len + 1);
            bytes.splice(at..at, more.iter().copied());
        }
        Damage::DuplicateField(at) => {
            // Repeat the first `"name": value` found at or after `at` right after the opening brace.
            let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(bytes) else {
                return;
            };
            if map.is_empty() {
                return;
            }
            let (k, v) = map.iter().nth(at % map.len()).unwrap();
            let field = format!("{}:{},", json!(k), v);
            if let Some(open) = bytes.iter().position(|&b| b == b'{') {
                bytes.splice(open + 1..open + 1, field.into_bytes());
            }
        }
    }
}

#[test]
fn config_corpus_and_seeds_never_panic_and_errors_name_fields() {
    let seeds = config_seeds();
    assert!(seeds.len() > 40, "only {} seeds", seeds.len());
    let mut accepted = 0;
    for seed in &seeds {
        match check_parse(seed) {
            Ok(Some(policy)) => {
                accepted += 1;
                exercise(policy);
            }
            Ok(None) => {}
            Err(e) => panic!(
                "{}: {e} ({:?})",
                String::from_utf8_lossy(seed),
                sluice_core::parse(seed).err()
            ),
        }
        check_object_error(seed).unwrap();
    }
    assert!(accepted >= VALID.len(), "only {accepted} seeds parse");
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn config_from_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_parse(&bytes)?;
    }

    #[test]
    fn config_from_arbitrary_json(value in arbitrary_json()) {
        let bytes = serde_json::to_vec(&value).unwrap();
        check_parse(&bytes)?;
        check_object_error(&bytes)?;
    }

    #[test]
    fn config_from_mutated_valid_configs(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..5),
        damages in prop::collection::vec(damage(), 0..2),
    ) {
        let seeds = config_seeds();
        let seed = seed.get(&seeds);
        let mut bytes = match serde_json::from_slice::<Value>(seed) {
            Ok(mut doc) => {
                for m in &mutations {
                    apply(&mut doc, m);
                }
                serde_json::to_vec(&doc).unwrap()
            }
            Err(_) => seed.clone(),
        };
        if damages.is_empty() {
            check_object_error(&bytes)?;
        }
        for d in &damages {
            damage_bytes(&mut bytes, d);
        }
        if let Some(policy) = check_parse(&bytes)? {
            exercise(policy);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared data: key-table sets, the sync state, overrides, shedding gauges and windows
// ---------------------------------------------------------------------------------------------

fn limits() -> Vec<Vec<Limit>> {
    use sluice_core::limit::Shaping;
    use sluice_core::Algorithm::{FixedWindow, SlidingWindow};
    let shaping = Shaping {
        delay: 1,
        queue: 2,
        max_delay_ms: 500,
    };
    vec![
        vec![Limit::new(10, Period::Second, None).unwrap()],
        vec![
            Limit::new(10, Period::Second, Some(3)).unwrap(),
            Limit::new(100, Period::Hour, Some(5)).unwrap(),
        ],
        vec![Limit::logged(4, Period::Second).unwrap()],
        vec![
            Limit::logged(3, Period::Second).unwrap(),
            Limit::logged(30, Period::Minute).unwrap(),
        ],
        vec![Limit::windowed(3, Period::Minute, SlidingWindow).unwrap()],
        vec![Limit::windowed(3, Period::Month, FixedWindow).unwrap()],
        vec![Limit::new(3, Period::Second, None).unwrap().gcra()],
        vec![Limit::leaky(3, Period::Second, shaping).unwrap()],
    ]
}

/// A set as written by the table: `records` records, the first ones with ghosts after eviction.
fn written_set(table: &Table, limits: &[Limit], records: u64) -> Vec<u8> {
    let mut set = Vec::new();
    for fp in 1..=records {
        let now = T0 + fp * 1_000;
        let mut r = Record::fresh(fp, limits, now);
        r.spent = fp as u32;
        table.store(&mut set, &r, limits, now);
    }
    set
}

/// Damage to a stored value: garbage, truncation, bit flips, a field overwritten with an extreme.
#[derive(Debug, Clone)]
enum Corruption {
    Replace(Vec<u8>),
    Truncate(usize),
    Flip(Vec<(usize, u8)>),
    /// An aligned 8-byte word overwritten (a timestamp, a float, a fingerprint...).
    Word(usize, u64),
    Extend(Vec<u8>),
}

fn corruption() -> impl Strategy<Value = Corruption> {
    let word = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(f64::NAN.to_bits()),
        Just(f64::INFINITY.to_bits()),
        Just(f64::NEG_INFINITY.to_bits()),
        Just((-1.0f64).to_bits()),
        Just(1e300f64.to_bits()),
        Just(T0 + 3_600 * SECOND),
        any::<u64>(),
    ];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2_048).prop_map(Corruption::Replace),
        any::<usize>().prop_map(Corruption::Truncate),
        prop::collection::vec((any::<usize>(), 1..=255u8), 1..8).prop_map(Corruption::Flip),
        (any::<usize>(), word).prop_map(|(at, w)| Corruption::Word(at, w)),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Corruption::Extend),
    ]
}

fn corrupt(bytes: &mut Vec<u8>, c: &Corruption) {
    let len = bytes.len();
    match c {
        Corruption::Replace(garbage) => *bytes = garbage.clone(),
        Corruption::Truncate(at) => bytes.truncate(at % (len + 1)),
        Corruption::Flip(flips) if len > 0 => {
            for (at, bits) in flips {
                bytes[at % len] ^= bits;
            }
        }
        Corruption::Flip(_) => {}
        Corruption::Word(at, word) if len >= 8 => {
            let at = (at % (len / 8)) * 8;
            bytes[at..at + 8].copy_from_slice(&word.to_le_bytes());
        }
        Corruption::Word(..) => {}
        Corruption::Extend(more) => bytes.extend_from_slice(more),
    }
}

/// Every way a worker reads a set, on bytes that may be anything.
fn read_set_every_way(table: &Table, limits: &[Limit], set: &[u8], fingerprint: u64, now: u64) {
    let _ = table.find(set, fingerprint);
    let mut record = table.find_or_fresh(set, fingerprint, limits, now);
    for record in table.records(set) {
        let _ = record.full_at_us(limits, now);
    }
    // The record a worker decides on, then writes back.
    for (limit, mut state) in record.states(limits) {
        let _ = state.check(limit, now, 1);
        let _ = state.admit(limit, now, 1);
        state.give_back(limit, 1);
        state.charge(limit, now, 3);
        let _ = state.ghost_us(limit, now);
    }
    let mut written = set.to_vec();
    let _ = table.store(&mut written, &record, limits, now);
    assert!(
        table.find(&written, fingerprint).is_some(),
        "a stored record must read back"
    );
}

#[test]
fn store_corpus_never_panics() {
    let files = corpus("store");
    for limits in limits() {
        let table = Table::new("r", &limits, 64, KeyHasher::new([1, 2]));
        for (_, bytes) in &files {
            // As stored, and after the table's layout tag: read as a set of this layout.
            let mut tagged = table.tag().to_le_bytes().to_vec();
            tagged.extend_from_slice(bytes);
            for fp in [1, 2, 9, u64::MAX] {
                read_set_every_way(&table, &limits, bytes, fp, T0);
                read_set_every_way(&table, &limits, &tagged, fp, T0);
            }
            let _ = SyncState::decode(bytes);
            let _ = Gauge::decode(bytes);
            let _ = shed::state::Window::decode(bytes);
            let _ = sluice_core::overrides::decode(bytes);
            let _ = proxy::announced(bytes);
        }
    }
}

/// A store whose every value a worker reads was damaged: every key the limiter, the sync and
/// shedding read is first filled from a clean run, then corrupted.
struct Corrupted {
    inner: MemoryStore,
    corruption: Vec<Corruption>,
    next: usize,
}

impl Store for Corrupted {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.inner.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError> {
        self.inner.set(key, value, version)
    }
}

impl Corrupted {
    /// Damages the value of `key` (absent keys get garbage too).
    fn damage(&mut self, key: &str) {
        if self.corruption.is_empty() {
            return;
        }
        let c = &self.corruption[self.next % self.corruption.len()];
        self.next += 1;
        let (mut bytes, version) = self.inner.get(key).unwrap().unwrap_or_default();
        corrupt(&mut bytes, c);
        assert!(self.inner.set(key, &bytes, version).unwrap());
    }
}

/// A store that remembers every key written.
#[derive(Default)]
struct Recording {
    inner: MemoryStore,
    keys: Vec<String>,
}

impl Store for Recording {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        if !self.keys.iter().any(|k| k == key) {
            self.keys.push(key.to_string());
        }
        self.inner.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError> {
        if !self.keys.iter().any(|k| k == key) {
            self.keys.push(key.to_string());
        }
        self.inner.set(key, value, version)
    }
}

/// Drives the limiter, the exchange, the sync and shedding over the store, as the filter would.
fn drive(limiter: &Limiter, store: &mut dyn Store, now: u64) {
    let mut pending = sluice_core::sync::outbox::Pending::default();
    for (i, req) in requests().into_iter().enumerate() {
        let now = now + i as u64 * 250_000;
        let mut r = req.clone();
        let evaluation = limiter.decide(&mut r, conditions(now), store);
        if i % 2 == 0 {
            // Waits for the round at the end.
            for (rule, key) in evaluation.newly_unsynced {
                pending.push(rule, key);
            }
            continue;
        }
        for (rule, key) in &evaluation.newly_unsynced {
            let _ = proxy::snapshot(limiter, *rule, key, store);
            let grant = sluice_core::protocol::Lease {
                tokens: 5,
                ttl_ms: 1_000,
                remaining: 7,
                reset_ms: 2_000,
                token_ms: None,
                refused: None,
                penalty_ms: 0,
            };
            let _ = proxy::apply_lease(limiter, *rule, key, &grant, now, store);
            let _ = proxy::forget(limiter, *rule, key, store);
        }
        let mut r = req;
        let _ = Exchange::start(limiter, &mut r, None, Moment::at(now), store);
        let _ = proxy::read_state(store);
        let _ = proxy::claim_round(store, now, 100, 50_000, 3);
        proxy::hurry(store, now, 100);
        if let Some(shedding) = &limiter.policy().shedding {
            let pressure = Pressure {
                now_us: now,
                fleet: Some(0.5),
                draw: 0.5,
            };
            let mut req = PlainRequest::get("/api/x").with_header("x-class", "high");
            if let shed::Admission::Admitted { seat, .. } =
                shed::admit(shedding, &mut req, pressure, store)
            {
                let _ = shed::release(shedding, seat, store);
            }
            let mut samples = vec![Samples::default(); shedding.bulkheads.len()];
            for s in &mut samples {
                s.answered(20_000, 200, None);
                s.answered(20_000, 503, None);
            }
            let _ = shed::tick(shedding, &mut samples, now, 0.5, store);
            let _ = shed::load_report(shedding, store);
        }
    }
    // A round: the batch composed from the records, answered (one entry refused), settled;
    // and one that fails, undone.
    let later = now + 2 * SECOND;
    if let Some(batch) = round::compose(limiter, &mut pending, "p1", 100, store) {
        let grants = (0..batch.request.entries.len())
            .map(|i| sluice_core::protocol::Lease {
                tokens: 3,
                ttl_ms: 500,
                remaining: 9,
                reset_ms: 1_000,
                token_ms: None,
                refused: (i == 0).then(|| "entries[0].key: too long".to_string()),
                penalty_ms: 0,
            })
            .collect();
        let response = sluice_core::protocol::SyncResponse {
            grants,
            hints: Default::default(),
        };
        let _ = round::settle(limiter, &batch, &response, later, store);
    }
    for req in requests() {
        let mut r = req;
        for (rule, key) in limiter
            .decide(&mut r, conditions(later), store)
            .newly_unsynced
        {
            pending.push(rule, key);
        }
    }
    if let (Some(batch), Some(service)) = (
        round::compose(limiter, &mut pending, "p1", 100, store),
        &limiter.policy().service,
    ) {
        let _ = round::undo(limiter, &batch, service, later, 0.5, store);
    }
}

fn limiters() -> Vec<Limiter> {
    VALID
        .iter()
        .map(|c| Limiter::with_secret(sluice_core::parse(c.as_bytes()).unwrap(), [3, 4]))
        .collect()
}

/// The keys a clean run of `limiter` touches, and the store it leaves.
fn clean_run(limiter: &Limiter) -> Recording {
    let mut store = Recording::default();
    drive(limiter, &mut store, T0);
    store
        .inner
        .set(
            sluice_core::overrides::OVERRIDES_KEY,
            &sluice_core::overrides::encode(&Default::default()),
            0,
        )
        .ok();
    store
        .keys
        .push(sluice_core::overrides::OVERRIDES_KEY.into());
    store
}

#[test]
fn a_limiter_on_the_store_corpus_never_panics() {
    let files = corpus("store");
    for limiter in limiters() {
        let clean = clean_run(&limiter);
        for (_, bytes) in &files {
            let mut store = Corrupted {
                inner: clean.inner.clone(),
                corruption: vec![Corruption::Replace(bytes.clone())],
                next: 0,
            };
            for key in &clean.keys {
                store.damage(key);
            }
            drive(&limiter, &mut store, T0 + SECOND);
        }
    }
}

proptest! {
    #![proptest_config(config(2))]

    #[test]
    fn sets_of_any_bytes_read_without_panic(
        which in any::<prop::sample::Index>(),
        records in 0..12u64,
        damage in prop::collection::vec(corruption(), 1..4),
        fingerprint in prop_oneof![1..=12u64, any::<u64>()],
        later in 0..(7 * 86_400 * SECOND),
    ) {
        let all = limits();
        let limits = which.get(&all);
        let table = Table::new("r", limits, 64, KeyHasher::new([1, 2]));
        let mut set = written_set(&table, limits, records);
        for c in &damage {
            corrupt(&mut set, c);
        }
        read_set_every_way(&table, limits, &set, fingerprint, T0 + later);
        // and a time before everything stored
        read_set_every_way(&table, limits, &set, fingerprint, 0);
    }

    #[test]
    fn states_of_any_bytes_decode_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let state = SyncState::decode(&bytes);
        let _ = state.effective_interval_ms(100);
        let _ = state.fleet.level(T0, SECOND);
        let gauge = Gauge::decode(&bytes);
        prop_assert!(gauge.waiting.len() <= 32);
        let _ = gauge.utilization();
        let _ = shed::state::Window::decode(&bytes);
        let _ = sluice_core::overrides::decode(&bytes);
        let _ = proxy::announced(&bytes);
        // A well-formed state survives a round trip; damage reads as some state, never a panic.
        let round = SyncState::decode(&state.encode());
        prop_assert_eq!(round, state);
    }

    #[test]
    fn a_limiter_on_a_corrupted_store_never_panics(
        which in any::<prop::sample::Index>(),
        damage in prop::collection::vec(corruption(), 1..6),
        later in 0..(3_600 * SECOND),
    ) {
        let all = limiters();
        let limiter = which.get(&all);
        let clean = clean_run(limiter);
        let mut store = Corrupted { inner: clean.inner.clone(), corruption: damage, next: 0 };
        for key in &clean.keys {
            store.damage(key);
        }
        drive(limiter, &mut store, T0 + later);
        // time going backwards against the stored stamps
        drive(limiter, &mut store, T0 - SECOND);
    }
}

// ---------------------------------------------------------------------------------------------
// Keys, headers and paths from client-controlled values
// ---------------------------------------------------------------------------------------------

const KEYED: &str = r#"{"client_ip": {"trusted_hops": 0}, "rules": [
    {"name": "all", "key": ["client_ip/24/64", "method", "path", "header:x-a", "query:q",
       "jwt:sub", "const:c", "header:x-b|header:x-c"],
     "limits": [{"requests": 5, "per": "second"}]},
    {"name": "templ", "match": {"path_templates": ["/users/{id}/x"]}, "key": ["path", "header:x-a"],
     "limits": [{"requests": 5, "per": "second"}]}]}"#;

/// Header values and paths as a hostile client sends them: any bytes, long, repeated.
fn client_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,40}",
        "[\\x00-\\x7f]{0,40}",
        "[/%.a-zA-Z0-9?\\\\]{0,60}",
        Just("x".repeat(MAX_KEY_BYTES + 1)),
        Just("é".repeat(MAX_KEY_BYTES)),
        Just("a\r\nb: c".to_string()),
        Just("\u{1f}\u{1e}".to_string()),
        Just("%2e%2E/%2f%5c..%00%ff%".to_string()),
        (0..4_096usize).prop_map(|n| "/".repeat(n)),
    ]
}

fn address() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|a| std::net::Ipv4Addr::from(a).to_string()),
        any::<[u8; 16]>().prop_map(|a| std::net::Ipv6Addr::from(a).to_string()),
        (any::<[u8; 4]>(), any::<u16>())
            .prop_map(|(a, p)| format!("{}:{p}", std::net::Ipv4Addr::from(a))),
        (any::<[u8; 16]>(), any::<u16>())
            .prop_map(|(a, p)| format!("[{}]:{p}", std::net::Ipv6Addr::from(a))),
        "[0-9a-fA-F:.\\[\\]%]{0,48}",
        ".{0,24}",
    ]
}

/// A header value a proxy may send: visible ASCII and spaces, nothing that ends a header.
fn header_value_ok(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b' ' || b == b'\t' || (0x21..0x7f).contains(&b))
}

#[test]
fn key_corpus_never_panics_and_keys_are_bounded() {
    let policy = sluice_core::parse(KEYED.as_bytes()).unwrap();
    for (_, bytes) in corpus("keys") {
        let text = String::from_utf8_lossy(&bytes).into_owned();
        check_keys(&policy, &text, &text, &text).unwrap();
        let _ = sluice_core::limiter::key::header_value(&bytes);
    }
}

fn check_keys(
    policy: &sluice_core::Policy,
    path: &str,
    value: &str,
    address: &str,
) -> Result<(), TestCaseError> {
    let normal = sluice_core::request::path::normalize(path);
    prop_assert!(normal.starts_with('/'), "{path:?} → {normal:?}");
    prop_assert!(!normal.contains('?'), "{path:?} → {normal:?}");
    let again = sluice_core::request::path::normalize(&normal).into_owned();
    prop_assert_eq!(
        &again,
        normal.as_ref(),
        "normalizing twice changes {:?}",
        path
    );
    let client = sluice_core::request::net::client_address(address, Some(value), 1);
    if let Some(client) = &client {
        prop_assert!(
            client.parse::<std::net::IpAddr>().is_ok() || address.contains(client.as_str())
        );
    }
    let _ = sluice_core::request::net::forwarded_address(value);
    let _ = sluice_core::request::net::strip_port(address);
    let _ = sluice_core::request::query_values(path, value, false);
    let _ = sluice_core::request::claims::Payload::from_metadata(value.as_bytes(), "jwt_payload");
    let _ = sluice_core::request::net::Cidr::parse(value);
    let _ = sluice_core::request::net::Cidr::parse(address);
    let mut request = PlainRequest::get(path)
        .with_header("x-a", value)
        .with_header("x-a", address)
        .with_header("x-c", value)
        .with_claim("sub", value);
    request.method = value.to_string();
    request.client_ip = client;
    for rule in &policy.rules {
        let _ = rule.applies(&mut request as &mut dyn RequestView);
        let keys = sluice_core::limiter::key::build(rule, &mut request);
        prop_assert!(keys.len() <= sluice_core::limiter::key::MAX_KEYS);
        for key in &keys {
            prop_assert!(key.len() <= MAX_KEY_BYTES, "{} bytes", key.len());
            prop_assert!(key.starts_with(rule.name.as_str()));
        }
    }
    let limiter = Limiter::new(policy.clone());
    let mut store = MemoryStore::default();
    let _ = limiter.decide(&mut request, conditions(T0), &mut store);
    let (_, step, _) = Exchange::start(&limiter, &mut request, None, Moment::at(T0), &mut store);
    if let sluice_core::Step::Respond(reply) = step {
        for (name, value) in reply.headers.iter() {
            prop_assert!(header_value_ok(value), "{name}: {value:?}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1))]

    #[test]
    fn keys_paths_and_addresses_from_any_client(
        path in client_text(),
        value in client_text(),
        address in address(),
    ) {
        let policy = sluice_core::parse(KEYED.as_bytes()).unwrap();
        let path = format!("/{path}");
        check_keys(&policy, &path, &value, &address)?;
        check_keys(&policy, &value, &path, &value)?;
    }

    #[test]
    fn header_values_of_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let key_part = sluice_core::limiter::key::header_value(&bytes);
        match std::str::from_utf8(&bytes) {
            // A client's value that starts with sluice's marker gets one more in front, so it
            // never equals a key part sluice writes (the missing bucket, a digest, hex).
            Ok(text) if text.starts_with('\u{1e}') => {
                prop_assert_eq!(key_part, format!("\u{1e}{text}"));
            }
            Ok(text) => prop_assert_eq!(key_part, text),
            Err(_) => {
                prop_assert!(key_part.is_ascii());
                prop_assert!(key_part.starts_with("\u{1e}hex:"), "{key_part:?}");
            }
        }
    }

    #[test]
    fn rate_limit_headers_are_valid_for_any_quota(
        requests in 1..u32::MAX as u64,
        period in prop::sample::select(vec![Period::Second, Period::Minute, Period::Hour, Period::Day, Period::Week, Period::Month]),
        remaining in any::<u64>(),
        reset_us in any::<u64>(),
        retry_us in any::<u64>(),
        name in "[A-Za-z0-9._-]{1,64}",
    ) {
        let Ok(limit) = Limit::new(requests, period, None) else { return Ok(()) };
        let quota = Quota { limit, remaining, reset_us };
        for style in [HeaderStyle::None, HeaderStyle::Legacy, HeaderStyle::Draft, HeaderStyle::Both] {
            for (header, value) in sluice_core::reply::headers::render(style, &name, &quota, sluice_core::reply::headers::Reset::UnixAt { now_us: reset_us }) {
                prop_assert!(header_value_ok(&value), "{header}: {value:?}");
                prop_assert!(!value.is_empty());
            }
        }
        let retry = sluice_core::reply::headers::retry_after_seconds(retry_us);
        prop_assert!(retry >= 1);
        let body = sluice_core::reply::rate_limited_body(&name, None, &quota, retry);
        let parsed: Value = serde_json::from_str(&body).map_err(|e| TestCaseError::fail(format!("{body}: {e}")))?;
        prop_assert_eq!(&parsed["rule"], &json!(name));
    }
}

// ---------------------------------------------------------------------------------------------
// Panics the fuzzing found, each at its root; kept as plain tests
// ---------------------------------------------------------------------------------------------

/// A token bucket record read with tokens far below zero (or not a number): its ghost time
/// overflowed `now + wait` (a panic in debug builds, a wrapped time in release).
#[test]
fn a_corrupt_bucket_leaves_a_ghost_without_overflow() {
    let limits = vec![Limit::new(10, Period::Second, None).unwrap()];
    for tokens in [-1e300, f64::NEG_INFINITY, f64::NAN] {
        let mut record = Record::fresh(1, &limits, T0);
        record.buckets[0].tokens = tokens;
        let ghost = record.full_at_us(&limits, T0);
        assert!(ghost >= T0, "tokens {tokens}: ghost {ghost}");
    }
}

/// A sliding log whose head (stored in the record) is any u64, and whose newest place is the
/// largest time: advancing the head and the ghost time overflowed.
#[test]
fn a_corrupt_sliding_log_never_overflows() {
    let limits = vec![Limit::logged(4, Period::Second).unwrap()];
    let mut record = Record::fresh(1, &limits, T0);
    record.buckets[0].stamp_us = u64::MAX;
    record.logs.iter_mut().for_each(|t| *t = u64::MAX);
    assert!(
        record.full_at_us(&limits, T0) > T0,
        "every place still counts"
    );
    record.logs.iter_mut().for_each(|t| *t = 0);
    for (limit, mut state) in record.states(&limits) {
        assert!(state.admit(limit, T0, 1).allowed);
        state.give_back(limit, 1);
        state.spend(limit, T0, 2);
    }
}

/// The sync state's round counter read from shared data at its largest: claiming a round
/// overflowed it. It wraps.
#[test]
fn a_corrupt_round_counter_wraps() {
    let mut store = MemoryStore::default();
    let state = SyncState {
        rounds: u64::MAX,
        ..SyncState::default()
    };
    store.set(proxy::STATE_KEY, &state.encode(), 0).unwrap();
    let claimed = proxy::claim_round(&mut store, T0, 100, 50_000, 3).expect("due");
    assert_eq!(claimed.rounds, 0);
}

/// A GCRA record whose theoretical arrival time is far in the future: the denial's wait is
/// enormous, and remembering it (`now + wait`) overflowed. The denial stands.
#[test]
fn a_corrupt_record_with_an_endless_wait_is_denied_without_overflow() {
    let limiter = Limiter::with_secret(
        sluice_core::parse(
            br#"{"rules": [{"name": "g", "key": ["client_ip"],
                "limits": [{"requests": 3, "per": "second", "algorithm": "gcra"}]}]}"#,
        )
        .unwrap(),
        [5, 6],
    );
    let rule = sluice_core::policy::RuleId::new(0);
    let mut request = PlainRequest::get("/").from_ip("192.0.2.9");
    let key = sluice_core::limiter::key::build(limiter.policy().rule(rule).unwrap(), &mut request)
        .pop()
        .unwrap();
    let table = limiter.table(rule).unwrap();
    let fingerprint = table.fingerprint(&key);
    let limits = &limiter.policy().rule(rule).unwrap().limits;
    let mut record = Record::fresh(fingerprint, limits, T0);
    record.buckets[0].tokens = 1e300;
    let mut set = Vec::new();
    table.store(&mut set, &record, limits, T0);
    let mut store = MemoryStore::default();
    store.set(&table.set_key(fingerprint), &set, 0).unwrap();
    for _ in 0..2 {
        let evaluation = limiter.decide(&mut request, conditions(T0), &mut store);
        assert!(
            matches!(evaluation.decision, sluice_core::Decision::Deny { .. }),
            "{evaluation:?}"
        );
    }
}

/// A field name holding a newline (`"cli\nt_ip"`, valid JSON) made a message of two log lines.
#[test]
fn an_unknown_field_with_a_newline_is_one_line() {
    let error = sluice_core::parse(br#"{"cli\nt_ip": 1, "rules": []}"#).unwrap_err();
    assert!(!error.to_string().contains('\n'), "{error}");
    assert!(
        error.to_string().starts_with(r"cli\nt_ip: unknown field"),
        "{error}"
    );
}

/// A syntax error has no field: the message was "?: EOF while parsing…", naming a field "?".
#[test]
fn a_syntax_error_names_no_field() {
    let error = sluice_core::parse(b"{").unwrap_err();
    assert_eq!(error.field, "", "{error}");
    for bytes in [&b"{"[..], b"[1,", b"{\"rules\" 1}", b"\"x"] {
        let error = sluice_core::parse(bytes).unwrap_err();
        assert!(!error.to_string().starts_with('?'), "{error}");
    }
}

/// The case proptest found: a header value starting with the marker byte is kept apart from
/// sluice's own key parts by one more marker.
#[test]
fn a_header_value_starting_with_the_marker_is_marked_again() {
    let key_part = sluice_core::limiter::key::header_value(b"\x1emissing");
    assert_eq!(key_part, "\u{1e}\u{1e}missing");
    assert_ne!(key_part, sluice_core::limiter::key::MISSING);
}
