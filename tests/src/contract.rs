//! The client contract of sluice's local replies: a body checked against `schema/reply.schema.json`.

use serde_json::Value;

use crate::envoy::repo_root;

/// `body` parsed, after checking it against the committed JSON Schema of local replies; panics (for tests)
/// with every violation when it is not valid.
#[track_caller]
pub fn checked_body(body: &str) -> Value {
    let path = repo_root().join("schema/reply.schema.json");
    let schema: Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_else(|| panic!("{} is not readable JSON", path.display()));
    let validator =
        jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("the schema: {e}"));
    let value: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{body} breaks the contract: {errors:?}");
    value
}
