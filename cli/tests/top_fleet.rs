//! `sluice top --once` against a real fleet: two Envoys with the filter (one proxy credential), the
//! real counter service and Redis. One client is denied far more than the others through both
//! Envoys; the command lists it first, with a count within the stated error bound of what the two
//! Envoys denied it, and the total the Envoys denied.
//!
//! Run by `make test` (feature `envoy`: it builds the filter and the service and sets
//! `SLUICE_ENVOY`, `SLUICE_WASM`, `SLUICE_SERVICE_BIN` and `SLUICE_REDIS_SERVER`).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use sluice_tests::envoy::{agent, get, Envoy, EnvoyOptions, Template};
use sluice_tests::eventually;
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions};

const ADMIN: &str = "ops-token-for-top-fleet";
/// The rule's sketch size: each count is at most `total / TOP_KEYS` below the true one.
const TOP_KEYS: u64 = 16;
/// The abuser's requests through each Envoy, and each of the others'.
const ABUSER_REQUESTS: usize = 200;
const OTHER_REQUESTS: usize = 6;
/// More clients than the sketch has counters: it must evict, and its bound is not trivially 0.
const OTHERS: usize = 20;

fn sluice(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("the sluice binary runs")
}

/// One table row: `(count, at_most, key)`.
fn rows(stdout: &str, kind: &str) -> Vec<(u64, u64, String)> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with(kind))
        .skip(2)
        .take_while(|l| !l.is_empty() && !l.trim_start().starts_with('('))
        .map(|row| {
            let cells: Vec<&str> = row.split_whitespace().collect();
            (
                cells[1].parse().unwrap(),
                cells[2].parse().unwrap(),
                cells[4].to_owned(),
            )
        })
        .collect()
}

/// The `DENIED <total> request(s); each count at most <bound> below the true one` line's numbers.
fn header(stdout: &str, kind: &str) -> Option<(u64, u64)> {
    let line = stdout.lines().find(|l| l.starts_with(kind))?;
    let total = line.split_whitespace().nth(1)?.parse().ok()?;
    let bound = line
        .split("at most ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some((total, bound))
}

#[test]
fn top_once_names_the_client_two_envoys_denied_most_within_the_bound() {
    let redis = Redis::start().unwrap();
    let dir = std::env::temp_dir().join(format!("sluice-top-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let admins = dir.join("admins");
    std::fs::write(&admins, format!("ops {ADMIN}\n")).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();
    let service = Service::start_with(
        ServiceOptions::new(redis.url())
            .arg("--admin-tokens-file")
            .arg(admins.to_str().unwrap()),
    )
    .unwrap();

    // Two requests an hour per user, decided by each Envoy alone; both Envoys sync with the one
    // proxy credential and send the rule's top keys with each sync.
    let plugin_config = json!({
        "service": {
            "cluster": "sluice_service",
            "authority": "sluice_service",
            "token": service.token(),
            "timeout_ms": 200,
            "sync_interval_ms": 100,
        },
        "rules": [{
            "name": "api", "key": ["header:x-user"], "consistency": "local",
            "limits": [{"requests": 2, "per": "hour"}], "top_keys": TOP_KEYS,
        }],
    })
    .to_string();
    let port = service.address().expect("the service listens").port();
    let envoys: Vec<Envoy> = (0..2)
        .map(|_| {
            Envoy::start(EnvoyOptions {
                template: Template::SluiceService,
                plugin_config_json: plugin_config.clone(),
                concurrency: 2,
                placeholders: vec![("SERVICE_PORT".to_owned(), port.to_string())],
            })
            .unwrap()
        })
        .collect();

    // Through each Envoy: the abuser and the others, interleaved. Every 429 is counted per user.
    let mut denied: BTreeMap<String, u64> = BTreeMap::new();
    let users: Vec<String> = (0..OTHERS).map(|i| format!("user-{i:02}")).collect();
    for envoy in &envoys {
        let client = agent();
        let url = envoy.url("/api/x");
        let mut send = |user: &str| {
            let status = get(&client, &url, &[("x-user", user)]).unwrap().status;
            assert!(status == 200 || status == 429, "{user}: {status}");
            if status == 429 {
                *denied.entry(format!("api:{user}")).or_default() += 1;
            }
        };
        for round in 0..ABUSER_REQUESTS {
            send("mallory");
            if round < OTHER_REQUESTS {
                for user in &users {
                    send(user);
                }
            }
        }
    }
    let total: u64 = denied.values().sum();
    let abuser = denied["api:mallory"];
    let runner_up = denied
        .iter()
        .filter(|(k, _)| *k != "api:mallory")
        .map(|(_, v)| *v)
        .max()
        .unwrap();
    assert!(
        abuser > 2 * (runner_up + total / TOP_KEYS),
        "the abuser must stand out beyond the bound: {denied:?}"
    );
    // Both Envoys' own counts agree with what the client saw.
    let counted: u64 = envoys
        .iter()
        .map(|e| e.stat_settled("wasmcustom.sluice.rule.api.denied"))
        .sum();
    assert_eq!(counted, total, "Envoy's denied counters vs the 429s seen");

    // `sluice top --once` until the service holds every denial both Envoys reported (a worker
    // publishes its sketches once a second, the next sync sends them).
    let url = service.url();
    let token = token_file.to_str().unwrap();
    let args = [
        "top",
        "--service",
        &url,
        "--token-file",
        token,
        "--rule",
        "api",
        "--once",
        "--limit",
        "5",
    ];
    let mut stdout = String::new();
    let complete = eventually(Duration::from_secs(15), || {
        let output = sluice(&args);
        stdout = String::from_utf8(output.stdout).unwrap();
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        header(&stdout, "DENIED").is_some_and(|(t, _)| t >= total)
    });
    assert!(
        complete,
        "the service never held all {total} denials: {stdout}\nservice log:\n{}",
        service.log()
    );
    assert!(
        stdout.starts_with("sluice top: rule api, the last 5 minute(s), 1 credential(s)"),
        "{stdout}"
    );
    eprintln!("denied through both Envoys: {denied:?}\n{stdout}");
    let (reported, bound) = header(&stdout, "DENIED").unwrap();
    assert_eq!(reported, total, "{stdout}");
    assert!(bound <= total / TOP_KEYS, "{stdout}");

    let table = rows(&stdout, "DENIED");
    assert!((1..=5).contains(&table.len()), "{stdout}");
    let (count, at_most, key) = &table[0];
    assert_eq!(key, "api:mallory", "the abuser first: {stdout}");
    assert!(
        *count <= abuser && abuser <= *at_most && at_most - count <= bound,
        "the abuser's count within the bound of the {abuser} denials: {stdout}"
    );
    // Every row within its bound of what the Envoys denied that key.
    for (count, at_most, key) in &table {
        let truth = denied.get(key).copied().unwrap_or(0);
        assert!(
            *count <= truth && truth <= *at_most,
            "{key}: {count}..={at_most}, true {truth}: {stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
