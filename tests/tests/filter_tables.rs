//! Old key tables in the wasmtime host (the filter's host calls; the decisions are unit-tested in
//! `core/src/limit/registry.rs`): a table of an earlier configuration that nobody stamps any more is
//! emptied and leaves the registry; the live table is stamped on every tick and keeps its counts.
//! Live overrides, however many, keep a rule's shared-data keys to two tables' worth. Time is a
//! virtual clock. Every scenario runs under both hosts, Envoy and nginx.

#[path = "support/hosts.rs"]
mod hosts;

use std::sync::OnceLock;
use std::time::Duration;

use sluice_core::limit::registry::{Entry, Registry, GRACE_US, REGISTRY_KEY};
use sluice_core::protocol::{Hints, Lease, LiveOverrides, SyncRequest, SyncResponse};
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, HostProfile, Proxy, ProxyOptions, RequestSpec,
};

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        FilterModule::load(filter_wasm_path())
            .unwrap_or_else(|e| panic!("{e}: build the filter first (`make test` does)"))
    })
}

fn proxy(config: &str, workers: usize) -> Proxy {
    let options = ProxyOptions {
        workers,
        profile: hosts::profile(),
        ..ProxyOptions::new(hosts::config(config))
    };
    Proxy::new(module(), options).unwrap_or_else(|e| panic!("proxy did not start: {e:?}"))
}

const CONFIG: &str = r#"{"max_keys": 64, "rules": [{"name": "r", "key": ["client_ip"],
  "limits": [{"requests": 3, "per": "hour"}]}]}"#;

fn status(proxy: &Proxy, worker: usize) -> u32 {
    let exchange = proxy
        .worker(worker)
        .request(RequestSpec::get("/x").from("203.0.113.7:40000"))
        .unwrap();
    match exchange.state().unwrap() {
        ExchangeState::Continued { .. } => {
            exchange.respond(200, &[]).unwrap();
            exchange.finish().unwrap();
            200
        }
        ExchangeState::LocalResponse { status, .. } => status,
        other => panic!("unexpected state {other:?}"),
    }
}

fn registry(proxy: &Proxy) -> Registry {
    Registry::decode(&proxy.shared_data(REGISTRY_KEY).unwrap_or_default().0)
}

fn an_unused_table_is_emptied_and_the_live_one_kept() {
    let proxy = proxy(CONFIG, 2);
    let live: Vec<String> = registry(&proxy)
        .entries
        .iter()
        .map(|e| e.prefix.clone())
        .collect();
    assert_eq!(
        live.len(),
        1,
        "the configuration's table is registered when configured"
    );
    // The live table's key spends its 3 (an hour's worth: nothing comes back during the test).
    let admitted = (0..4).filter(|i| status(&proxy, i % 2) == 200).count();
    assert_eq!(admitted, 3);

    // A table an earlier configuration left: 3 sets with records, last stamped long ago.
    let old = "sluice/r/0badc0de/";
    for set in 0..3 {
        proxy.set_shared_data(&format!("{old}{set}"), &[7; 200]);
    }
    let mut with_old = registry(&proxy);
    with_old.entries.push(Entry {
        prefix: old.to_owned(),
        sets: 3,
        set_bytes: 200,
        stamped_us: 0,
        claimed: 0,
    });
    proxy.set_shared_data(REGISTRY_KEY, &with_old.encode());

    // Well past the grace period: ticks stamp the live table and empty the old one.
    let grace = Duration::from_micros(GRACE_US);
    for _ in 0..3 {
        proxy.advance(grace).unwrap();
    }
    for set in 0..3 {
        let (bytes, _) = proxy.shared_data(&format!("{old}{set}")).unwrap();
        assert!(
            bytes.is_empty(),
            "set {set} of the old table: {} bytes",
            bytes.len()
        );
    }
    let left: Vec<String> = registry(&proxy)
        .entries
        .iter()
        .map(|e| e.prefix.clone())
        .collect();
    assert_eq!(
        left, live,
        "the emptied table left the registry, the live one stays"
    );
    let done = proxy
        .log_messages(sluice_host::LogLevel::Info)
        .into_iter()
        .filter(|m| m.contains(old) && m.ends_with(", done"))
        .count();
    assert_eq!(done, 1, "{:?}", proxy.logs());
    // The live table kept its count: the key is still denied.
    assert_eq!(status(&proxy, 0), 429);
    assert_eq!(status(&proxy, 1), 429);
}

/// A local rule of 64 keys (8 sets) on a proxy that syncs with a counter service every 100 ms (the test plays the
/// service): the way live overrides arrive.
fn synced() -> String {
    format!(
        r#"{{"max_keys": 64,
          "service": {{{service}, "token": "t", "timeout_ms": 100, "sync_interval_ms": 100}},
          "rules": [{{"name": "r", "key": ["header:x-user"], "consistency": "local",
                     "limits": [{{"requests": 3, "per": "hour"}}]}}]}}"#,
        service = hosts::service()
    )
}

fn user_status(proxy: &Proxy, worker: usize, user: &str) -> u32 {
    let exchange = proxy
        .worker(worker)
        .request(RequestSpec::get("/x").header("x-user", user))
        .unwrap();
    match exchange.state().unwrap() {
        ExchangeState::Continued { .. } => {
            exchange.respond(200, &[]).unwrap();
            exchange.finish().unwrap();
            200
        }
        ExchangeState::LocalResponse { status, .. } => status,
        other => panic!("unexpected state {other:?}"),
    }
}

/// Lets the next sync go out and answers it with `live`: every worker applies it on its next tick.
fn push_overrides(proxy: &Proxy, live: &LiveOverrides) {
    proxy.advance(Duration::from_millis(100)).unwrap();
    let calls: Vec<_> = proxy
        .pending_calls()
        .into_iter()
        .filter(|c| c.header(":path") == Some("/v1/sync"))
        .collect();
    assert!(!calls.is_empty(), "no sync went out");
    for call in calls {
        let request: SyncRequest = serde_json::from_slice(&call.body).unwrap();
        let mut response = SyncResponse {
            grants: vec![
                Lease {
                    tokens: 0,
                    ttl_ms: 0,
                    remaining: 0,
                    reset_ms: 0,
                    token_ms: None,
                    refused: None,
                    penalty_ms: 0,
                };
                request.entries.len()
            ],
            hints: Hints {
                next_sync_ms: 100,
                ..Hints::default()
            },
        };
        response.hints.overrides.live = Some(live.clone());
        let body = serde_json::to_vec(&response).unwrap();
        proxy.answer_call(call.token, 200, &[], &body).unwrap();
    }
    proxy.advance(Duration::from_millis(20)).unwrap();
}

/// 120 live overrides, each with a new limit (every tenth of another layout: a sliding log of a new length), while
/// requests with new keys flow: the rule's sets in shared data stay within two tables (its configured layout's
/// and its one table for overridden layouts), where each override used to make a table of its own: 8 sets a
/// change, whose keys proxy-wasm can never delete (about 90 bytes each in Envoy, 0.75 MB a change for the
/// default 65,536 keys).
fn overrides_keep_a_rule_to_two_tables() {
    let proxy = proxy(&synced(), 2);
    let sets = |proxy: &Proxy| {
        proxy
            .shared_data_keys()
            .into_iter()
            .filter(|k| k.starts_with("sluice/r/"))
            .count()
    };
    assert_eq!(sets(&proxy), 8, "the configured table");
    let overrides = 120;
    for version in 1..=overrides {
        let limit = if version == overrides {
            serde_json::json!({"requests": 2, "per": "hour"})
        } else if version % 10 == 0 {
            serde_json::json!({"requests": version, "per": "hour", "algorithm": "sliding_log"})
        } else {
            serde_json::json!({"requests": 1000 + version, "per": "minute"})
        };
        let live = LiveOverrides {
            version,
            limits: [("r".to_owned(), vec![limit])].into(),
            ..LiveOverrides::default()
        };
        push_overrides(&proxy, &live);
        for i in 0..8 {
            let user = format!("u{version}-{i}");
            assert_eq!(user_status(&proxy, i % 2, &user), 200, "{user}");
        }
    }
    let applied = proxy
        .log_messages(sluice_host::LogLevel::Info)
        .into_iter()
        .filter(|m| m.contains(&format!("live overrides version {overrides} applied")))
        .count();
    assert_eq!(applied, 2, "each worker applied the last override");
    let refused = proxy.log_messages(sluice_host::LogLevel::Warn);
    assert!(refused.is_empty(), "{refused:?}");
    // The last override is in force: 2 an hour.
    let last: Vec<u32> = (0..3).map(|i| user_status(&proxy, i % 2, "last")).collect();
    assert_eq!(last, [200, 200, 429]);
    let keys = sets(&proxy);
    eprintln!("{overrides} overrides: {keys} sets of rule r in shared data");
    assert!(
        keys <= 2 * 8,
        "{keys} sets of rule r after {overrides} overrides: more than two tables of 8"
    );
    assert!(
        proxy
            .shared_data_keys()
            .iter()
            .any(|k| k.starts_with("sluice/r/live-64/")),
        "the sliding logs counted in the rule's table for overridden layouts"
    );
    let tables: Vec<String> = registry(&proxy)
        .entries
        .into_iter()
        .map(|e| e.prefix)
        .collect();
    assert!(tables.len() <= 2, "{tables:?}");
}

/// A live override that would bring a leaky bucket in: Envoy applies it; nginx cannot resume the
/// requests a leaky bucket holds, so with `"host": "nginx"` each worker leaves it out, says so, and
/// keeps the rule as configured.
fn a_live_leaky_bucket_applies_in_envoy_and_is_left_out_in_nginx() {
    let proxy = proxy(&synced(), 2);
    let live = LiveOverrides {
        version: 1,
        limits: [(
            "r".to_owned(),
            vec![serde_json::json!({"requests": 2, "per": "hour", "algorithm": "leaky_bucket"})],
        )]
        .into(),
        ..LiveOverrides::default()
    };
    push_overrides(&proxy, &live);
    let applied = proxy
        .log_messages(sluice_host::LogLevel::Info)
        .into_iter()
        .filter(|m| m.contains("live overrides version 1 applied"))
        .count();
    assert_eq!(applied, 2, "each worker took the set");
    let left_out: Vec<String> = proxy
        .log_messages(sluice_host::LogLevel::Warn)
        .into_iter()
        .filter(|m| m.contains("live override not applied"))
        .collect();
    match hosts::profile() {
        HostProfile::Envoy => {
            assert!(left_out.is_empty(), "{left_out:?}");
            // The bucket in force: the first leaves at once, the next slot is half an hour away,
            // far past the longest wait.
            let seen: Vec<u32> = (0..4).map(|i| user_status(&proxy, i % 2, "u")).collect();
            assert_eq!(seen, [200, 429, 429, 429]);
        }
        HostProfile::NgxWasmModule => {
            assert_eq!(left_out.len(), 2, "one line a worker: {left_out:?}");
            assert!(
                left_out.iter().all(|m| m.contains("limits.r")
                    && m.contains("algorithm")
                    && m.contains("nginx")),
                "{left_out:?}"
            );
            // The rule as configured: 3 an hour, counted across both workers.
            let seen: Vec<u32> = (0..4).map(|i| user_status(&proxy, i % 2, "u")).collect();
            assert_eq!(seen, [200, 200, 200, 429]);
        }
    }
    assert!(proxy.is_alive(0) && proxy.is_alive(1));
}

/// The registry tracks at most 256 tables: a configuration of 260 rules leaves 4 out, and the filter says so
/// (which ones, and that they are not emptied if unused before room is made) instead of leaving them out silently.
fn tables_a_full_registry_leaves_out_are_logged() {
    let rules: Vec<String> = (0..260)
        .map(|i| {
            format!(
                r#"{{"name": "r{i}", "key": ["client_ip"], "limits": [{{"requests": 3, "per": "hour"}}]}}"#
            )
        })
        .collect();
    let config = format!(r#"{{"max_keys": 8, "rules": [{}]}}"#, rules.join(","));
    let proxy = proxy(&config, 1);
    assert_eq!(
        registry(&proxy).entries.len(),
        sluice_core::limit::registry::MAX_TABLES
    );
    let warned: Vec<String> = proxy
        .log_messages(sluice_host::LogLevel::Warn)
        .into_iter()
        .filter(|m| m.contains("key table registry is full"))
        .collect();
    assert!(!warned.is_empty(), "{:?}", proxy.logs());
    assert!(
        warned
            .iter()
            .all(|m| m.contains("4 table(s)") && m.contains("sluice/r259/")),
        "{warned:?}"
    );
    // Said once, not on every heartbeat.
    let before = warned.len();
    for _ in 0..3 {
        proxy.advance(Duration::from_secs(1)).unwrap();
    }
    let after = proxy
        .log_messages(sluice_host::LogLevel::Warn)
        .iter()
        .filter(|m| m.contains("key table registry is full"))
        .count();
    assert_eq!(after, before);
}

both_hosts!(
    an_unused_table_is_emptied_and_the_live_one_kept,
    overrides_keep_a_rule_to_two_tables,
    a_live_leaky_bucket_applies_in_envoy_and_is_left_out_in_nginx,
    tables_a_full_registry_leaves_out_are_logged,
);
