//! Property-based fuzzing of what the service reads from the network: sync and check bodies and
//! the admin API's bodies and paths, arbitrary and mutated, through the service's own parsing
//! and validation, and through the whole router (`tower::ServiceExt::oneshot`, no socket).
//!
//! No Redis is needed: the Redis URL is never dialed, because only bodies that validation
//! refuses are sent through the router (those must be answered 4xx with a JSON reason before
//! Redis is asked anything). Stable Rust has no coverage-guided fuzzing, so these are `proptest`
//! properties; every test first replays the committed seed corpus (`tests/fuzz-corpus/`), then
//! `SLUICE_FUZZ_CASES` generated cases (default [`DEFAULT_CASES`]; `make fuzz` runs many more).
//! Failures are saved by proptest in `tests/fuzz.proptest-regressions` and replayed first.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::StatusCode;
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Value};
use sluice_counter_service::admin::{self, BypassBody, KeyBody, LimitsBody};
use sluice_counter_service::{body, validate, AppError, AppState, Settings};
use sluice_protocol::{CheckRequest, SyncRequest};

/// Cases per property when `SLUICE_FUZZ_CASES` is not set: a few seconds in `make test`.
const DEFAULT_CASES: u32 = 256;

fn config() -> Config {
    let cases = std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    Config {
        cases,
        max_shrink_iters: 2_048,
        ..Config::default()
    }
}

/// Never dialed: see the module.
const NO_REDIS: &str = "redis://127.0.0.1:1";
const ADMIN_TOKEN: &str = "fuzz-admin-token";

/// One state and one runtime for every case: the router is built per call, as in production.
fn fixture() -> &'static (AppState, tokio::runtime::Runtime) {
    static FIXTURE: OnceLock<(AppState, tokio::runtime::Runtime)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let admins =
            std::env::temp_dir().join(format!("sluice-fuzz-{}-admins", std::process::id()));
        fs::write(&admins, format!("fuzzer {ADMIN_TOKEN}\n")).unwrap();
        let settings =
            common::settings(NO_REDIS, &["--admin-tokens-file", admins.to_str().unwrap()]);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // The Redis client is made (never dialed) inside the runtime.
        let state = {
            let _inside = runtime.enter();
            AppState::new(settings).unwrap()
        };
        let _ = fs::remove_file(&admins);
        (state, runtime)
    })
}

fn settings() -> &'static Settings {
    &fixture().0.settings
}

/// The error kinds a refused body may be answered with.
const CLIENT_ERRORS: [&str; 4] = [
    "malformed_json",
    "invalid_request",
    "payload_too_large",
    "not_found",
];

/// Refusals sent through the router so far (every test's, in this process).
static ROUTED: AtomicUsize = AtomicUsize::new(0);

/// Sends `bytes` through the whole router and checks the answer is the 4xx JSON error that
/// `expected` (the service's own parsing and validation, called directly) says.
fn refused_through_router(
    method: &str,
    path: &str,
    token: &str,
    bytes: &[u8],
    expected: &AppError,
) -> Result<(), TestCaseError> {
    let (state, runtime) = fixture();
    ROUTED.fetch_add(1, Ordering::Relaxed);
    let answer = runtime.block_on(common::call(
        state,
        method,
        path,
        Some(token),
        Body::from(bytes.to_vec()),
    ));
    prop_assert!(
        answer.status.is_client_error(),
        "{method} {path} with {:?}: {} {}",
        String::from_utf8_lossy(bytes),
        answer.status,
        answer.body
    );
    prop_assert_eq!(answer.status, expected.status(), "{}", answer.body);
    let kind = answer.body["error"].as_str().unwrap_or_default();
    prop_assert!(CLIENT_ERRORS.contains(&kind), "{}", answer.body);
    let message = answer.body["message"].as_str().unwrap_or_default();
    prop_assert!(!message.is_empty(), "{}", answer.body);
    prop_assert_eq!(message, expected.to_string());
    Ok(())
}

/// What an error must say: a field for a value out of bounds, a message for malformed JSON.
fn names_the_problem(error: &AppError) -> Result<(), TestCaseError> {
    match error {
        AppError::Invalid { field, reason } => {
            prop_assert!(!field.is_empty() && !reason.is_empty(), "{error}");
        }
        AppError::MalformedJson(message) => prop_assert!(!message.is_empty()),
        other => prop_assert!(false, "not a 4xx of the body: {other:?}"),
    }
    prop_assert!(error.status().is_client_error());
    Ok(())
}

/// The sync endpoint's parsing and validation, as the handler runs them.
fn sync(bytes: &[u8]) -> Result<(), TestCaseError> {
    let request = match body::parse::<SyncRequest>(bytes) {
        Ok(request) => request,
        Err(error) => {
            names_the_problem(&error)?;
            return refused_through_router("POST", "/v1/sync", common::TOKEN, bytes, &error);
        }
    };
    if let Err(error) = validate::sync_batch(&request, settings()) {
        names_the_problem(&error)?;
        return refused_through_router("POST", "/v1/sync", common::TOKEN, bytes, &error);
    }
    // Entries are refused one by one; the rest are cut to what their limits make possible.
    let window = validate::report_window_ms(settings(), request.interval_ms);
    for (i, entry) in request.entries.iter().enumerate() {
        match validate::sync_entry(i, entry, settings()) {
            Ok(()) => {
                let cap = validate::report_cap(&entry.limits, window);
                prop_assert!(cap <= validate::MAX_COUNT);
            }
            Err(error) => {
                names_the_problem(&error)?;
                let prefix = format!("entries[{i}].");
                prop_assert!(error.to_string().starts_with(&prefix), "{}", error);
            }
        }
    }
    let _ = settings().sync_interval_ms(request.interval_ms);
    Ok(())
}

/// The check endpoint's parsing and validation.
fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    let error = match body::parse::<CheckRequest>(bytes) {
        Ok(request) => match validate::check_request(&request, settings()) {
            Ok(()) => return Ok(()),
            Err(error) => error,
        },
        Err(error) => error,
    };
    names_the_problem(&error)?;
    refused_through_router("POST", "/v1/check", common::TOKEN, bytes, &error)
}

/// The admin API's bodies and paths: `target` is the rule (or rule/tier) in the path.
fn admin_bodies(target: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    let encoded: String = form_path(target);
    // limits
    let limits = body::parse::<LimitsBody>(bytes).and_then(|body| {
        admin::target_name("target", target)?;
        sluice_core::config::parse_limits("limits", &body.limits)
            .map_err(|e| AppError::invalid(e.field, e.problem))?;
        Ok(body)
    });
    match limits {
        Ok(body) => {
            if body.ttl_s.is_some_and(|t| t == 0 || t > admin::MAX_TTL_S)
                || body
                    .reason
                    .as_ref()
                    .is_some_and(|r| r.len() > admin::MAX_REASON_BYTES)
            {
                check_admin_refusal(
                    "PUT",
                    &format!("/admin/v1/overrides/limits/{encoded}"),
                    bytes,
                )?;
            }
        }
        Err(error) => {
            names_the_problem(&error)?;
            if !target.is_empty() && !target.contains(['?', '#']) {
                refused_through_router(
                    "PUT",
                    &format!("/admin/v1/overrides/limits/{encoded}"),
                    ADMIN_TOKEN,
                    bytes,
                    &error,
                )?;
            }
        }
    }
    // keys
    let key = body::parse::<KeyBody>(bytes).and_then(|body| {
        admin::rule_name("rule", target)?;
        let given = admin::one_key(body.key.clone(), None)?;
        let key = admin::key_parts(&given, target, settings())?;
        admin::matchable(&key, &given, target, None)?;
        Ok(body)
    });
    match key {
        Ok(_) => {}
        Err(error) => {
            names_the_problem(&error)?;
            if !target.is_empty() && !target.contains(['?', '#']) {
                refused_through_router(
                    "PUT",
                    &format!("/admin/v1/overrides/keys/{encoded}"),
                    ADMIN_TOKEN,
                    bytes,
                    &error,
                )?;
            }
        }
    }
    // bypass
    if let Err(error) = body::parse::<BypassBody>(bytes) {
        names_the_problem(&error)?;
        refused_through_router(
            "PUT",
            "/admin/v1/overrides/bypass",
            ADMIN_TOKEN,
            bytes,
            &error,
        )?;
    }
    Ok(())
}

/// A refusal the handler makes after the checks above (ttl_s, reason): 400 naming the field.
fn check_admin_refusal(method: &str, path: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    let (state, runtime) = fixture();
    let answer = runtime.block_on(common::call(
        state,
        method,
        path,
        Some(ADMIN_TOKEN),
        Body::from(bytes.to_vec()),
    ));
    prop_assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
    prop_assert_eq!(&answer.body["error"], &json!("invalid_request"));
    Ok(())
}

/// A path segment as a client would send it: percent-encoded where a URI needs it.
fn form_path(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_./".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn corpus(dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(dir);
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
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

/// Runs every corpus file of `dir`; most are refusals, so the router must have answered some.
fn replay(dir: &str, mut run: impl FnMut(&[u8]) -> Result<(), TestCaseError>) {
    let before = ROUTED.load(Ordering::Relaxed);
    let files = corpus(dir);
    for (path, bytes) in &files {
        if let Err(error) = run(bytes) {
            panic!("{}: {error}", path.display());
        }
    }
    let routed = ROUTED.load(Ordering::Relaxed) - before;
    assert!(
        routed >= files.len() / 2,
        "only {routed} refusals went through the router"
    );
}

#[test]
fn the_sync_corpus() {
    replay("sync", sync);
}

#[test]
fn the_check_corpus() {
    replay("check", check);
}

#[test]
fn the_admin_corpus() {
    replay("admin", |bytes| {
        for target in ["api", "api/pro", "", "a/b/c", "é", "x".repeat(65).as_str()] {
            admin_bodies(target, bytes)?;
        }
        Ok(())
    });
}

/// Valid bodies to mutate.
fn seeds() -> Vec<Value> {
    let limit = json!({"requests": 10, "period_ms": 1000, "burst": 10});
    vec![
        json!({"proxy": "p1", "interval_ms": 100, "overrides_version": 3,
               "load": {"utilization": 0.5, "shed_rate": 0.0, "latency_ms": 12.5},
               "entries": [{"key": "api\u{1f}10.0.0.1", "limits": [limit], "spent": 3, "denied": 1},
                           {"key": "k", "limits": [{"requests": 5, "period_ms": 60000, "burst": 5,
                                                     "algorithm": "sliding_window"}],
                            "spent": 0, "denied": 0}]}),
        json!({"key": "strict\u{1f}k", "limits": [limit], "cost": 1}),
        json!({"key": "k", "limits": [{"requests": 3, "period_ms": 1000, "burst": 3,
                                        "algorithm": "sliding_log"}], "cost": 2}),
        json!({"limits": [{"requests": 100, "per": "minute"}], "ttl_s": 600, "reason": "incident"}),
        json!({"key": ["alice"], "action": "block", "ttl_s": 60}),
        json!({"key": "bob", "action": "allow"}),
        json!({"enabled": true, "ttl_s": 600, "reason": "redis migration"}),
    ]
}

fn interesting_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 53)),
        Just(json!((1u64 << 53) + 1)),
        Just(json!(i64::MIN)),
        Just(json!(1e308)),
        Just(json!(0.5)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        Just(json!("")),
        Just(json!("\u{1f}")),
        Just(json!("x".repeat(300))),
        Just(json!("é\u{0}\u{1F600}")),
        Just(json!("sliding_log")),
        Just(json!("fixed_window")),
        "\\PC{0,16}".prop_map(Value::String),
        Just(json!([])),
        Just(json!({})),
        Just(nested(40)),
        Just(json!([{"requests": 0, "period_ms": 0, "burst": 0}])),
        Just(json!([{"requests": u64::MAX, "period_ms": u64::MAX, "burst": u64::MAX}])),
        Just(json!((0..20)
            .map(|_| json!({"requests": 1, "period_ms": 1, "burst": 1}))
            .collect::<Vec<_>>())),
    ]
}

fn nested(levels: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..levels {
        v = json!([v]);
    }
    v
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("proxy".to_string()),
                    Just("entries".to_string()),
                    Just("key".to_string()),
                    Just("limits".to_string()),
                    Just("cost".to_string()),
                    "[a-z_]{1,10}"
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every node of `value` but the root, as JSON pointers.
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

/// Replaces, drops or duplicates the node `at`.
#[derive(Debug, Clone)]
enum Mutation {
    Replace(usize, Value),
    Drop(usize),
    Duplicate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), interesting_value()).prop_map(|(at, v)| Mutation::Replace(at, v)),
        1 => any::<usize>().prop_map(Mutation::Drop),
        1 => any::<usize>().prop_map(Mutation::Duplicate),
    ]
}

fn apply(doc: &mut Value, mutation: &Mutation) {
    let mut nodes = Vec::new();
    pointers(doc, String::new(), &mut nodes);
    let (Mutation::Replace(at, _) | Mutation::Drop(at) | Mutation::Duplicate(at)) = mutation;
    let Some(pointer) = nodes.get(at % nodes.len().max(1)).cloned() else {
        return;
    };
    let (parent, last) = pointer.rsplit_once('/').unwrap_or(("", &pointer));
    let last = last.replace("~1", "/").replace("~0", "~");
    match mutation {
        Mutation::Replace(_, value) => *doc.pointer_mut(&pointer).unwrap() = value.clone(),
        Mutation::Drop(_) => match doc.pointer_mut(parent) {
            Some(Value::Object(map)) => {
                map.remove(&last);
            }
            Some(Value::Array(items)) => {
                items.remove(last.parse::<usize>().unwrap());
            }
            _ => {}
        },
        Mutation::Duplicate(_) => {
            let node = doc.pointer(&pointer).unwrap().clone();
            match doc.pointer_mut(parent) {
                Some(Value::Object(map)) => {
                    map.insert(format!("{last}_"), node);
                }
                Some(Value::Array(items)) => items.push(node),
                _ => {}
            }
        }
    }
}

/// Byte damage: truncation, a flipped byte, inserted bytes.
fn damage(bytes: &mut Vec<u8>, at: usize, how: u8, more: &[u8]) {
    let len = bytes.len();
    match how % 3 {
        0 => bytes.truncate(at % (len + 1)),
        1 if len > 0 => bytes[at % len] ^= how | 1,
        _ => {
            let at = at % (len + 1);
            bytes.splice(at..at, more.iter().copied());
        }
    }
}

fn every_endpoint(bytes: &[u8], target: &str) -> Result<(), TestCaseError> {
    sync(bytes)?;
    check(bytes)?;
    admin_bodies(target, bytes)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        every_endpoint(&bytes, "api")?;
    }

    #[test]
    fn arbitrary_json_is_refused_cleanly(value in arbitrary_json(), target in "[a-z/é.]{0,8}") {
        every_endpoint(&serde_json::to_vec(&value).unwrap(), &target)?;
    }

    #[test]
    fn mutated_bodies_are_refused_cleanly(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..4),
        damages in prop::collection::vec((any::<usize>(), any::<u8>(), prop::collection::vec(any::<u8>(), 1..6)), 0..2),
        target in prop_oneof![Just("api".to_string()), Just("api/pro".to_string()), "\\PC{0,70}"],
    ) {
        let mut doc = seed.get(&seeds()).clone();
        for m in &mutations {
            apply(&mut doc, m);
        }
        let mut bytes = serde_json::to_vec(&doc).unwrap();
        for (at, how, more) in &damages {
            damage(&mut bytes, *at, *how, more);
        }
        every_endpoint(&bytes, &target)?;
    }
}
