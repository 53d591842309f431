//! `sluice top --once` against a real counter service on a real Redis: a proxy's report of a
//! known Zipf workload comes back as a table within its error bound; a refusal is the service's
//! message and exit status 1.

use std::process::Command;

use sluice_core::limit::table::KeyHasher;
use sluice_core::top::{self, RuleTop};
use sluice_tests::redis::Redis;
use sluice_tests::service::{Service, ServiceOptions};
use sluice_tests::zipf;

const ADMIN: &str = "ops-token-for-top";

fn sluice(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("the sluice binary runs")
}

#[test]
fn top_once_prints_the_fleets_top_keys_within_their_bound() {
    let redis = Redis::start().unwrap();
    let dir = std::env::temp_dir().join(format!("sluice-top-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let admins = dir.join("admins");
    std::fs::write(&admins, format!("ops {ADMIN}\n")).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();
    let options = ServiceOptions::new(redis.url())
        .arg("--admin-tokens-file")
        .arg(admins.to_str().unwrap());
    let service = Service::start_with(options).unwrap();

    // One proxy's sketch of 16 counters over 20,000 requests of a Zipf workload.
    let n = 20_000;
    let stream = zipf::stream(42, "api", 2_000, 1.2, n);
    let truth = zipf::counts(&stream);
    let mut sketch = RuleTop::new(16);
    let hasher = KeyHasher::new([1, 2]);
    for key in &stream {
        sketch.denied.offer(hasher.fingerprint(key), key);
    }
    let report = top::report("api", &sketch.take().unwrap());
    let body =
        serde_json::json!({"proxy": "p1", "interval_ms": 100, "entries": [], "top": [report]});
    let reply = service.post("/v1/sync", &body.to_string()).unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);

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
    let output = sluice(&args);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.starts_with("sluice top: rule api, the last 5 minute(s), 1 credential(s)"),
        "{stdout}"
    );
    let header = stdout.lines().find(|l| l.starts_with("DENIED")).unwrap();
    let error: u64 = header
        .split("at most ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        header.starts_with(&format!("DENIED {n} request(s)")),
        "{header}"
    );
    assert!(error <= n as u64 / 16, "{header}");
    // At most five rows (a key whose count is within the error is not shown): each key's count
    // within the bound, the heaviest first.
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("DENIED"))
        .skip(2)
        .take_while(|l| !l.is_empty())
        .collect();
    assert!((1..=5).contains(&rows.len()), "{stdout}");
    let mut by_truth: Vec<(&String, &u64)> = truth.iter().collect();
    by_truth.sort_by(|a, b| b.1.cmp(a.1));
    for row in &rows {
        let cells: Vec<&str> = row.split_whitespace().collect();
        let (count, at_most): (u64, u64) = (cells[1].parse().unwrap(), cells[2].parse().unwrap());
        let key = cells[4].replacen(':', "\u{1f}", 1);
        let t = truth[&key];
        assert!(count <= t && t <= at_most, "{row}: true {t}");
    }
    assert!(
        rows[0].ends_with(&by_truth[0].0.replace('\u{1f}', ":")),
        "{stdout}"
    );

    // A refusal: the service's message on standard error, status 1.
    let bad = sluice(&[
        "top",
        "--service",
        &url,
        "--token-file",
        token,
        "--rule",
        "api",
        "--once",
        "--window",
        "2h",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8(bad.stderr).unwrap();
    assert!(
        stderr.contains("400: window: must be whole minutes"),
        "{stderr}"
    );
    std::fs::write(&token_file, "not-an-admin\n").unwrap();
    let denied = sluice(&[
        "top",
        "--service",
        &url,
        "--token-file",
        token,
        "--rule",
        "api",
        "--once",
    ]);
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8(denied.stderr).unwrap().contains("401"));
    let _ = std::fs::remove_dir_all(&dir);
}
