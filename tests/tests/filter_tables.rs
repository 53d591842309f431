//! Old key tables in the wasmtime host (the filter's host calls; the decisions are unit-tested in
//! `core/src/tables.rs`): a table of an earlier configuration that nobody stamps any more is
//! emptied and leaves the registry; the live table is stamped on every tick and keeps its counts.
//! Time is a virtual clock.

use std::sync::OnceLock;
use std::time::Duration;

use sluice_core::tables::{Entry, Registry, GRACE_US, REGISTRY_KEY};
use sluice_host::{
    filter_wasm_path, ExchangeState, FilterModule, Proxy, ProxyOptions, RequestSpec,
};

fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        FilterModule::load(filter_wasm_path())
            .unwrap_or_else(|e| panic!("{e}: build the filter first (`make test` does)"))
    })
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

#[test]
fn an_unused_table_is_emptied_and_the_live_one_kept() {
    let proxy = Proxy::new(
        module(),
        ProxyOptions {
            workers: 2,
            ..ProxyOptions::new(CONFIG)
        },
    )
    .unwrap();
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
