//! The counter service on a Redis that listens over TLS only (`--port 0 --tls-port`, certificates
//! made by the test), asks for client certificates, and knows the service only as an ACL user
//! with exactly the ACL docs/redis.md documents. Then what an operator (or an attacker with
//! write access to the service's files or environment) can get wrong: each refused at start with
//! one line naming the flag, and no secret in a process's arguments, a log line or a message. And a
//! Redis Cluster whose nodes listen over TLS only, under the same ACL plus docs/redis.md's Cluster
//! addition.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::redis::{ClusterOptions, Redis, RedisCluster, TestCertificates};
use sluice_tests::service::{service_binary, Service, ServiceOptions};

const ADMIN_TOKEN: &str = "tls-admin-token";

/// A password no test could guess by chance, so that finding it anywhere is a leak.
fn password() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("pw-{}-{nanos}-Zq7", std::process::id())
}

/// The ACL line of docs/redis.md, between its markers, with `<password>` replaced.
fn documented_acl(password: &str) -> String {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/redis.md");
    let text = std::fs::read_to_string(&docs).unwrap();
    let (_, rest) = text.split_once("<!-- acl:begin -->").unwrap();
    let (block, _) = rest.split_once("<!-- acl:end -->").unwrap();
    let line = block
        .lines()
        .find(|line| line.starts_with("user sluice "))
        .expect("the documented ACL line");
    assert!(line.contains("><password>"), "{line}");
    line.replace("<password>", password)
}

/// What docs/redis.md says to add to the ACL line on a Redis Cluster: the backquoted `+…` of its
/// bullet "On a Redis Cluster, add …".
fn documented_cluster_additions() -> Vec<String> {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/redis.md");
    let text = std::fs::read_to_string(&docs).unwrap();
    let bullet = text
        .lines()
        .find(|line| line.starts_with("- On a Redis Cluster, add"))
        .expect("the documented Cluster addition");
    bullet
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| word.starts_with('+'))
        .map(str::to_owned)
        .collect()
}

/// A file in `dir`.
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A TLS-only Redis that requires client certificates, with the fixture's own `default` user
/// and `sluice` under the documented ACL.
fn tls_redis(certs: &TestCertificates, password: &str, more: &[&str]) -> Redis {
    let acl = format!(
        "user default on nopass ~* &* +@all\n{}\n",
        documented_acl(password)
    );
    let acl = write(certs.dir(), "users.acl", &acl);
    let mut args = vec![
        "--aclfile",
        acl.to_str().unwrap(),
        "--tls-auth-clients",
        "yes",
    ];
    args.extend_from_slice(more);
    Redis::start_tls(certs, &args).unwrap()
}

/// The flags for the service to reach `redis` as `sluice` with the test's certificates.
fn tls_flags(certs: &TestCertificates, password_file: &Path) -> Vec<String> {
    let path = |name: &str| certs.path(name).display().to_string();
    vec![
        "--redis-ca-file".into(),
        path("ca.pem"),
        "--redis-client-cert-file".into(),
        path("client.pem"),
        "--redis-client-key-file".into(),
        path("client.key"),
        "--redis-password-file".into(),
        password_file.display().to_string(),
        "--redis-timeout-ms".into(),
        "1000".into(),
    ]
}

fn user_url(redis: &Redis, user: &str) -> String {
    format!("rediss://{user}@localhost:{}", redis.port())
}

/// What the process's arguments and environment hold (`/proc`).
fn process_text(pid: u32) -> String {
    let mut text = String::new();
    for file in ["cmdline", "environ"] {
        let bytes = std::fs::read(format!("/proc/{pid}/{file}")).unwrap_or_default();
        text.push_str(&String::from_utf8_lossy(&bytes).replace('\0', " "));
        text.push('\n');
    }
    text
}

#[test]
fn the_service_works_over_tls_as_an_acl_user_under_the_documented_acl() {
    let certs = TestCertificates::generate().unwrap();
    let secret = password();
    let redis = tls_redis(&certs, &secret, &[]);
    // the operator's editor added a newline: trimmed
    let password_file = write(certs.dir(), "redis-password", &format!("{secret}\n"));
    let admins = write(certs.dir(), "admins", &format!("ops {ADMIN_TOKEN}\n"));
    let mut options = ServiceOptions::new(user_url(&redis, "sluice"));
    options.log_filter = "debug".into();
    for flag in tls_flags(&certs, &password_file) {
        options = options.arg(flag);
    }
    let service = Service::start_with(
        options
            .arg("--admin-tokens-file")
            .arg(admins.display().to_string()),
    )
    .unwrap();

    let ok = |what: &str, reply: anyhow::Result<sluice_tests::service::Reply>| {
        let reply = reply.unwrap_or_else(|error| panic!("{what}: {error:#}"));
        assert_eq!(reply.status, 200, "{what}: {reply:?}\n{}", service.log());
        reply
    };
    ok("readyz", service.get("/readyz"));
    let bucket = json!({"requests": 10, "period_ms": 1000, "burst": 10});
    let sliding =
        json!({"requests": 10, "period_ms": 60000, "burst": 10, "algorithm": "sliding_window"});
    let fixed =
        json!({"requests": 10, "period_ms": 60000, "burst": 10, "algorithm": "fixed_window"});
    let log = json!({"requests": 3, "period_ms": 60000, "burst": 3, "algorithm": "sliding_log"});
    let sync = json!({
        "proxy": "p1",
        "interval_ms": 100,
        "entries": [
            {"key": "api\u{1f}alice", "limits": [bucket], "spent": 2, "denied": 1},
            {"key": "win\u{1f}alice", "limits": [sliding], "spent": 2, "denied": 0},
            {"key": "fixed\u{1f}alice", "limits": [fixed], "spent": 2, "denied": 0},
        ],
        "load": {"utilization": 0.5, "shed_rate": 0.0, "latency_ms": 3.0},
        "fleet_share": true,
        "top": [{"rule": "api", "admitted": {"total": 2, "error": 0, "keys": [{"key": "api\u{1f}alice", "count": 2}]},
                 "denied": {"total": 1, "error": 0}}],
    });
    let reply = ok("sync", service.post("/v1/sync", &sync.to_string()));
    assert!(reply.body.contains("grant"), "{reply:?}");
    let check = json!({"key": "strict\u{1f}alice", "limits": [log]});
    let reply = ok("check", service.post("/v1/check", &check.to_string()));
    assert!(reply.body.contains("\"allowed\":true"), "{reply:?}");

    let admin = |method: &str, path: &str, body: Option<serde_json::Value>| {
        let body = body.map(|body| body.to_string());
        ok(
            &format!("{method} {path}"),
            service.request(method, path, Some(ADMIN_TOKEN), body.as_deref()),
        )
    };
    admin(
        "PUT",
        "/admin/v1/overrides/limits/api",
        Some(json!({"limits": [{"requests": 5, "per": "minute"}], "ttl_s": 600, "reason": "tls"})),
    );
    admin(
        "PUT",
        "/admin/v1/overrides/keys/api",
        Some(json!({"key": "mallory", "action": "block"})),
    );
    admin(
        "PUT",
        "/admin/v1/overrides/bypass",
        Some(json!({"enabled": true, "ttl_s": 60, "reason": "tls"})),
    );
    admin("DELETE", "/admin/v1/overrides/bypass", None);
    admin("DELETE", "/admin/v1/overrides/keys/api?key=mallory", None);
    admin("GET", "/admin/v1/overrides", None);
    admin("GET", "/admin/v1/audit", None);
    admin("GET", "/admin/v1/top?rule=api", None);
    // `[{"requests":10,"per":"second","burst":10}]`, the bucket the syncs used, percent-encoded
    let limits = "%5B%7B%22requests%22%3A10%2C%22per%22%3A%22second%22%2C%22burst%22%3A10%7D%5D";
    admin(
        "GET",
        &format!("/admin/v1/keys/api?key=alice&limits={limits}"),
        None,
    );
    admin(
        "DELETE",
        &format!("/admin/v1/keys/api?key=alice&limits={limits}"),
        None,
    );
    // a sync after the changes reads them (the overrides script's read and delta paths)
    ok(
        "sync after overrides",
        service.post("/v1/sync", &sync.to_string()),
    );
    let status = ok("status", service.get("/v1/status"));
    assert!(status.body.contains("\"limiter\":\"up\""), "{status:?}");
    assert_eq!(
        service.metric("sluice_errors_total"),
        0,
        "{}",
        service.log()
    );

    // Redis checks every command a script runs against the user's ACL: without HSET the sync's
    // script fails (so a command missing from the documented line would fail this test).
    redis.query(&["ACL", "SETUSER", "sluice", "-hset"]).unwrap();
    let fresh = json!({"proxy": "p1", "interval_ms": 100, "entries": [
        {"key": "api\u{1f}bob", "limits": [bucket], "spent": 1, "denied": 0}]});
    let reply = service.post("/v1/sync", &fresh.to_string()).unwrap();
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(
        service.log().contains("can't run this command"),
        "{}",
        service.log()
    );

    // The password is nowhere: not in the service's arguments or environment, not in its log
    // (at debug), not in Redis's log.
    let pid = service.pid().unwrap();
    assert!(!process_text(pid).contains(&secret));
    assert!(!service.log().contains(&secret));
    let redis_log = std::fs::read_to_string(redis.log_path()).unwrap_or_default();
    assert!(!redis_log.contains(&secret));
}

/// A Redis Cluster of three primaries that listen over TLS only (client certificates required,
/// the bus and replication over TLS), the service a user of each under the documented ACL plus
/// what docs/redis.md adds for a Cluster. A sync whose keys fall on every primary and a strict
/// check answer as on one Redis. Without the Cluster addition the client cannot read the slot map:
/// the line is needed, not decoration.
#[test]
fn the_service_works_on_a_redis_cluster_over_tls_under_the_documented_acl() {
    let certs = TestCertificates::generate().unwrap();
    let secret = password();
    let additions = documented_cluster_additions();
    assert!(!additions.is_empty(), "docs/redis.md names no addition");
    let acl = format!(
        "user default on nopass ~* &* +@all\n{} {}\n",
        documented_acl(&secret),
        additions.join(" ")
    );
    let acl = write(certs.dir(), "users.acl", &acl);
    let acl = acl.display().to_string();
    let cluster = RedisCluster::start_tls(
        ClusterOptions::new(3),
        &certs,
        &["--aclfile", &acl, "--tls-auth-clients", "yes"],
    )
    .unwrap();
    let password_file = write(certs.dir(), "redis-password", &format!("{secret}\n"));
    let urls = cluster
        .nodes()
        .iter()
        .map(|node| user_url(node, "sluice"))
        .collect::<Vec<_>>()
        .join(",");
    let mut options = ServiceOptions::new(urls.clone());
    options.log_filter = "debug".into();
    for flag in tls_flags(&certs, &password_file) {
        options = options.arg(flag);
    }
    let service = Service::start_with(options).unwrap();
    let ready = service.get("/readyz").unwrap();
    assert_eq!(ready.status, 200, "{ready:?}\n{}", service.log());

    // 30 keys: every primary holds some (each runs the sync's script), all over TLS.
    let bucket = json!({"requests": 10, "period_ms": 1000, "burst": 10});
    let entries: Vec<serde_json::Value> = (0..30)
        .map(|i| json!({"key": format!("api\u{1f}user-{i}"), "limits": [bucket], "spent": 1, "denied": 0}))
        .collect();
    let sync = json!({"proxy": "p1", "interval_ms": 100, "entries": entries});
    let reply = service.post("/v1/sync", &sync.to_string()).unwrap();
    assert_eq!(reply.status, 200, "{reply:?}\n{}", service.log());
    let grants = reply.json().unwrap()["grants"].as_array().cloned().unwrap();
    assert_eq!(grants.len(), 30, "{reply:?}");
    assert!(
        grants
            .iter()
            .all(|g| g.get("refused").is_none() && g["tokens"].as_u64() > Some(0)),
        "{reply:?}"
    );
    for (i, node) in cluster.nodes().iter().enumerate() {
        assert!(
            node.command_calls("evalsha").unwrap() > 0,
            "primary {i} ran no script: the keys did not reach it"
        );
    }
    let log = json!({"requests": 2, "period_ms": 60000, "burst": 2, "algorithm": "sliding_log"});
    let check = json!({"key": "strict\u{1f}alice", "limits": [log]}).to_string();
    let answers: Vec<String> = (0..3)
        .map(|_| {
            let reply = service.post("/v1/check", &check).unwrap();
            assert_eq!(reply.status, 200, "{reply:?}\n{}", service.log());
            reply.body
        })
        .collect();
    assert!(answers[0].contains("\"allowed\":true"), "{answers:?}");
    assert!(answers[1].contains("\"allowed\":true"), "{answers:?}");
    assert!(answers[2].contains("\"allowed\":false"), "{answers:?}");
    assert_eq!(
        service.metric("sluice_errors_total"),
        0,
        "{}",
        service.log()
    );
    assert!(!service.log().contains(&secret));
    drop(service);

    // The documented line without the Cluster addition: the slot map cannot be read.
    for node in cluster.nodes() {
        for addition in &additions {
            let removed = addition.replacen('+', "-", 1);
            node.query(&["ACL", "SETUSER", "sluice", &removed]).unwrap();
        }
    }
    let mut args = vec!["--redis-url".to_owned(), urls];
    args.extend(tls_flags(&certs, &password_file));
    let (code, text) = start_refused(&args, &[]);
    assert_eq!(code, Some(2), "{text}");
    let first = text
        .lines()
        .find(|line| line.starts_with("sluice-counter-service: "));
    assert!(
        first.is_some_and(|line| line.contains(
            "Redis's ACL refuses the user in --redis-url (SLUICE_REDIS_URL) a command the service needs"
        ) && line.contains("'cluster|slots'")),
        "{text}"
    );
    assert!(!text.contains(&secret), "{text}");
}

/// The service started with `args` (and `env`) exits by itself: its status and stderr. Panics
/// if it is still running after 20 s (it started).
fn start_refused(args: &[String], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let mut child = Command::new(service_binary().unwrap())
        .args(["--bind", "127.0.0.1:0", "--insecure-no-auth"])
        .args(args)
        .env_remove("SLUICE_REDIS_PASSWORD")
        .envs(env.iter().copied())
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = String::new();
    let status = loop {
        if seen.is_empty() {
            seen = process_text(pid);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
            panic!("the service started with {args:?}: {text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    text.push_str(&seen);
    (status.code(), text)
}

/// The line a wrong user or password stops the service with: it names both places to look, the
/// URL's user and the password's file (or variable).
const REFUSED_USER_OR_PASSWORD: &str = "Redis refused the user or password: check the user in \
    --redis-url (SLUICE_REDIS_URL) and the password in --redis-password-file \
    (SLUICE_REDIS_PASSWORD_FILE) or SLUICE_REDIS_PASSWORD";

/// Each thing an operator can get wrong about TLS or the user stops the service at start, with
/// one line naming what to fix and not quoting the password.
#[test]
fn wrong_certificates_users_and_passwords_stop_the_service_naming_the_flag() {
    let certs = TestCertificates::generate().unwrap();
    let secret = password();
    let redis = tls_redis(&certs, &secret, &[]);
    let good_password = write(certs.dir(), "password", &secret);
    let wrong_password = write(certs.dir(), "wrong", "not-the-password\n");
    let url = |user: &str| vec!["--redis-url".to_owned(), user_url(&redis, user)];
    let with = |url: Vec<String>, flags: Vec<String>, swap: &[(&str, &str)]| {
        let mut args = url;
        let mut flags = flags;
        for (from, to) in swap {
            if let Some(i) = flags.iter().position(|f| f == from) {
                if to.is_empty() {
                    flags.drain(i..i + 2);
                } else {
                    flags[i + 1] = (*to).to_owned();
                }
            }
        }
        args.extend(flags);
        args
    };
    let flags = tls_flags(&certs, &good_password);
    let other_ca = certs.path("other-ca.pem").display().to_string();
    let stranger = certs.path("stranger.pem").display().to_string();
    let stranger_key = certs.path("stranger.key").display().to_string();
    let wrong = wrong_password.display().to_string();

    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        (
            "a CA that did not sign Redis's certificate",
            with(url("sluice"), flags.clone(), &[("--redis-ca-file", &other_ca)]),
            "--redis-ca-file (SLUICE_REDIS_CA_FILE): Redis's certificate is not trusted",
        ),
        (
            "no CA file: the system's roots do not know the test CA",
            with(url("sluice"), flags.clone(), &[("--redis-ca-file", "")]),
            "--redis-ca-file (SLUICE_REDIS_CA_FILE): Redis's certificate is not trusted",
        ),
        (
            "a wrong password",
            with(url("sluice"), flags.clone(), &[("--redis-password-file", &wrong)]),
            REFUSED_USER_OR_PASSWORD,
        ),
        (
            "a user Redis does not know",
            with(url("nobody"), flags.clone(), &[]),
            REFUSED_USER_OR_PASSWORD,
        ),
        (
            "no client certificate where Redis asks for one",
            with(
                url("sluice"),
                flags.clone(),
                &[("--redis-client-cert-file", ""), ("--redis-client-key-file", "")],
            ),
            "--redis-client-cert-file (SLUICE_REDIS_CLIENT_CERT_FILE): Redis refused the client certificate",
        ),
        (
            "a client certificate from a CA Redis does not trust",
            with(
                url("sluice"),
                flags.clone(),
                &[
                    ("--redis-client-cert-file", &stranger),
                    ("--redis-client-key-file", &stranger_key),
                ],
            ),
            "--redis-client-cert-file (SLUICE_REDIS_CLIENT_CERT_FILE): Redis refused the client certificate",
        ),
    ];
    for (what, args, expected) in cases {
        let (code, text) = start_refused(&args, &[]);
        assert_eq!(code, Some(2), "{what}: {text}");
        assert!(
            text.contains(expected),
            "{what}: expected {expected:?} in {text}"
        );
        assert!(
            !text.contains(&secret),
            "{what}: the password leaked: {text}"
        );
    }

    // The same password from the environment starts it (and it is not in its arguments).
    let mut args = url("sluice");
    args.extend(with(
        Vec::new(),
        flags.clone(),
        &[("--redis-password-file", "")],
    ));
    let mut options = ServiceOptions::new(user_url(&redis, "sluice"));
    for arg in &args[2..] {
        options = options.arg(arg.clone());
    }
    let service = Service::start_with(options.env("SLUICE_REDIS_PASSWORD", &secret)).unwrap();
    assert_eq!(
        service.get("/readyz").unwrap().status,
        200,
        "{}",
        service.log()
    );
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", service.pid().unwrap())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(&secret));
    assert!(
        process_text(service.pid().unwrap()).contains(&secret),
        "in its environment"
    );
    assert!(!service.log().contains(&secret));
}

/// Redis's certificate is valid and from the right CA, but for another host (`localhost`, where
/// the URL says `127.0.0.1`): refused, naming `--redis-url`.
#[test]
fn a_certificate_for_another_host_stops_the_service() {
    let certs = TestCertificates::generate().unwrap();
    let secret = password();
    let named = certs.path("localhost-only.pem").display().to_string();
    let named_key = certs.path("localhost-only.key").display().to_string();
    let redis = tls_redis(
        &certs,
        &secret,
        &["--tls-cert-file", &named, "--tls-key-file", &named_key],
    );
    let password_file = write(certs.dir(), "password", &secret);
    let url = format!("rediss://sluice@127.0.0.1:{}", redis.port());
    let mut args = vec!["--redis-url".to_owned(), url];
    args.extend(tls_flags(&certs, &password_file));
    let (code, text) = start_refused(&args, &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains(
            "--redis-url (SLUICE_REDIS_URL): Redis's certificate is not for the URL's host"
        ),
        "{text}"
    );
}

/// What is wrong in the files or the URL is refused before Redis is asked anything; a message
/// never quotes a password, even one put where it does not belong.
#[test]
fn malformed_tls_and_password_inputs_are_refused_naming_the_flag() {
    let certs = TestCertificates::generate().unwrap();
    let dir = certs.dir();
    let secret = password();
    let good = write(dir, "password", &secret);
    let garbage = write(dir, "garbage.pem", "this is not a certificate\n");
    let key_as_ca = certs.path("client.key");
    let empty = write(dir, "empty", "");
    let newline = write(dir, "newline", "\n");
    let two_lines = write(dir, "two-lines", &format!("{secret}\nsecond\n"));
    let blank_second = write(dir, "blank-second", &format!("{secret}\n\n"));
    // Nothing listens here: these must be refused before any connection.
    let url = "rediss://sluice@localhost:1".to_owned();
    let base = |extra: &[&str]| {
        let mut args = vec!["--redis-url".to_owned(), url.clone()];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let p = |path: &Path| path.display().to_string();
    // (flags, environment, the start of the message)
    type Case<'a> = (Vec<String>, Vec<(&'a str, String)>, String);
    let cases: Vec<Case> = vec![
        (
            base(&["--redis-ca-file", &p(&garbage), "--redis-password-file", &p(&good)]),
            vec![],
            format!("--redis-ca-file {}: no certificate in it", p(&garbage)),
        ),
        (
            base(&["--redis-ca-file", &p(&key_as_ca), "--redis-password-file", &p(&good)]),
            vec![],
            format!("--redis-ca-file {}: no certificate in it", p(&key_as_ca)),
        ),
        (
            base(&["--redis-ca-file", "/nonexistent/ca.pem", "--redis-password-file", &p(&good)]),
            vec![],
            "--redis-ca-file /nonexistent/ca.pem: ".to_owned(),
        ),
        (
            base(&[
                "--redis-client-cert-file",
                &p(&garbage),
                "--redis-client-key-file",
                &p(&certs.path("client.key")),
                "--redis-password-file",
                &p(&good),
            ]),
            vec![],
            format!("--redis-client-cert-file {}: no certificate in it", p(&garbage)),
        ),
        (
            base(&[
                "--redis-client-cert-file",
                &p(&certs.path("client.pem")),
                "--redis-client-key-file",
                &p(&garbage),
                "--redis-password-file",
                &p(&good),
            ]),
            vec![],
            format!("--redis-client-key-file {}: no PEM private key in it", p(&garbage)),
        ),
        (
            base(&["--redis-client-cert-file", &p(&certs.path("client.pem")), "--redis-password-file", &p(&good)]),
            vec![],
            "--redis-client-cert-file needs --redis-client-key-file".to_owned(),
        ),
        (
            base(&["--redis-password-file", &p(&empty)]),
            vec![],
            format!("--redis-password-file {}: the password is empty", p(&empty)),
        ),
        (
            base(&["--redis-password-file", &p(&newline)]),
            vec![],
            format!("--redis-password-file {}: the password is empty", p(&newline)),
        ),
        (
            base(&["--redis-password-file", &p(&two_lines)]),
            vec![],
            format!("--redis-password-file {}: the password holds a line break", p(&two_lines)),
        ),
        (
            base(&["--redis-password-file", &p(&blank_second)]),
            vec![],
            format!("--redis-password-file {}: the password holds a line break", p(&blank_second)),
        ),
        (
            base(&[]),
            vec![],
            "--redis-url (SLUICE_REDIS_URL) names a user but no password is given".to_owned(),
        ),
        (
            base(&[]),
            vec![("SLUICE_REDIS_PASSWORD", String::new())],
            "SLUICE_REDIS_PASSWORD: the password is empty".to_owned(),
        ),
        (
            base(&["--redis-password-file", &p(&good)]),
            vec![("SLUICE_REDIS_PASSWORD", secret.clone())],
            "give only one of --redis-password-file (SLUICE_REDIS_PASSWORD_FILE) and SLUICE_REDIS_PASSWORD".to_owned(),
        ),
        (
            vec!["--redis-url".into(), "redis://127.0.0.1:1".into(), "--redis-ca-file".into(), p(&certs.path("ca.pem"))],
            vec![],
            "--redis-ca-file is for TLS: give rediss:// URLs".to_owned(),
        ),
        (
            vec!["--redis-url".into(), format!("redis://sluice:{secret}@127.0.0.1:1")],
            vec![],
            "--redis-url (SLUICE_REDIS_URL) holds a password".to_owned(),
        ),
        (
            vec![],
            vec![("SLUICE_REDIS_URL", format!("rediss://:{secret}@localhost:1"))],
            "--redis-url (SLUICE_REDIS_URL) holds a password".to_owned(),
        ),
        (
            vec!["--redis-url".into(), "rediss://localhost:1/#insecure".into()],
            vec![],
            "--redis-url (SLUICE_REDIS_URL): a URL fragment (such as #insecure".to_owned(),
        ),
    ];
    for (args, env, expected) in cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (code, text) = start_refused(&args, &env);
        assert_eq!(code, Some(2), "{args:?}: {text}");
        let first = text.lines().next().unwrap_or_default();
        assert!(
            first.starts_with(&format!("sluice-counter-service: {expected}")),
            "{args:?}: expected {expected:?}, got {text}"
        );
        assert!(
            !first.contains(&secret),
            "{args:?}: the password leaked: {first}"
        );
    }
}
