//! One fixture per configuration error: `tests/config/NAME.json` must be refused with exactly
//! the message in `tests/config/NAME.err`, which names the field.

use std::fs;
use std::path::Path;

#[test]
fn every_bad_config_is_refused_with_its_message() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config");
    let mut checked = 0;
    let mut entries: Vec<_> = fs::read_dir(&dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let json = fs::read(&path).unwrap();
        let expected = fs::read_to_string(path.with_extension("err"))
            .unwrap_or_else(|_| panic!("{} has no .err beside it", path.display()));
        let error = sluice_core::parse(&json)
            .err()
            .unwrap_or_else(|| panic!("{} was accepted", path.display()));
        assert_eq!(
            error.to_string(),
            expected.trim_end(),
            "fixture {}",
            path.display()
        );
        checked += 1;
    }
    assert!(
        checked >= 25,
        "only {checked} fixtures found in {}",
        dir.display()
    );
}

#[test]
fn the_documented_example_is_accepted() {
    let json = br#"{
      "headers": "draft",
      "bypass": {"paths": ["/healthz"]},
      "client_ip": {"trusted_hops": 0},
      "rules": [
        {"name": "per-ip", "match": {"path_prefix": "/api/", "methods": ["GET", "POST"]},
         "key": ["client_ip"],
         "limits": [{"requests": 100, "per": "minute", "burst": 20}],
         "mode": "enforce"}
      ]
    }"#;
    let policy = sluice_core::parse(json).unwrap();
    let rule = &policy.rules[0];
    assert_eq!(rule.name, "per-ip");
    assert_eq!(rule.limits[0].requests(), 100);
    assert_eq!(rule.limits[0].burst(), 20);
    assert_eq!(rule.matcher.methods, vec!["GET", "POST"]);
    assert_eq!(rule.consistency, sluice_core::policy::Consistency::Local);
    assert_eq!(policy.max_keys, sluice_core::config::DEFAULT_MAX_KEYS);
}

#[test]
fn a_service_makes_cached_the_default() {
    let json = br#"{"service": {"cluster": "sluice_service", "token": "t"},
      "rules": [{"name": "a", "key": ["const:all"], "limits": [{"requests": 5, "per": "second"}]}]}"#;
    let policy = sluice_core::parse(json).unwrap();
    assert_eq!(
        policy.rules[0].consistency,
        sluice_core::policy::Consistency::Cached
    );
    let service = policy.service.unwrap();
    assert_eq!(service.authority, "sluice_service");
    assert_eq!(service.sync_interval_ms, 100);
}

/// The counter service by address (nginx): the forms nginx's dispatch takes are accepted, the
/// authority defaults to the address, and the callout goes to it. (The bad addresses, from a
/// hostile configuration, are the `service_address_*` fixtures.)
#[test]
fn a_service_address_is_accepted_in_every_form_nginx_dispatches_to() {
    use sluice_core::policy::Upstream;
    for address in [
        "127.0.0.1:8081",
        "[::1]:8081",
        "counter.internal:65535",
        "c-1:1",
    ] {
        let json = format!(
            r#"{{"host": "nginx", "service": {{"address": "{address}"}}, "rules": [{{"name": "r",
                "key": ["client_ip"], "limits": [{{"requests": 1, "per": "second"}}]}}]}}"#
        );
        let policy = sluice_core::parse(json.as_bytes())
            .unwrap_or_else(|e| panic!("{address} refused: {e}"));
        let service = policy.service.unwrap();
        assert_eq!(service.upstream, Upstream::Address(address.to_string()));
        assert_eq!(service.upstream.target(), address);
        assert_eq!(service.authority, address);
    }
}
