//! The playground as a person uses it, in headless Chromium through chromedriver (WebDriver):
//! load the page, enter a configuration, enter an invalid one and see the field named, run a
//! traffic pattern, and check that the admitted and denied counts the page shows are exactly
//! core's own decisions on the same trace, computed here with `Limiter::decide`. Then compare
//! two configurations, open a denied request's answer, reopen the shared link, and save a
//! screenshot in `target/playground-screenshot.png`.
//!
//! Needs the built page (`make build-playground`), `chromium` and `chromedriver` (`make deps`);
//! `make test` runs it. `SLUICE_CHROMEDRIVER` and `SLUICE_CHROMIUM` override the commands.
#![cfg(feature = "browser")]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use sluice_core::limiter::Conditions;
use sluice_core::{Decision, Limiter, MemoryStore, PlainRequest};
use sluice_playground::EPOCH_US;

const WAIT: Duration = Duration::from_secs(30);

const TOKEN_BUCKET: &str = r#"{"rules": [{"name": "per-client", "key": ["client_ip"],
  "limits": [{"requests": 60, "per": "minute", "burst": 10}]}]}"#;
const SLIDING_WINDOW: &str = r#"{"headers": "both", "rules": [{"name": "per-client", "key": ["client_ip"],
  "limits": [{"requests": 60, "per": "minute", "algorithm": "sliding_window"}]}]}"#;
const INVALID: &str = r#"{"rules": [{"name": "per-client", "key": ["client_ip"],
  "limits": [{"requests": 60, "per": "fortnight"}]}]}"#;

fn www() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("www")
}

fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target")
}

/// The page's files over HTTP on 127.0.0.1 (modules and WebAssembly need a server): GET only,
/// files under `www/` only.
fn serve(root: PathBuf) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the page");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let root = root.clone();
            std::thread::spawn(move || answer(stream, &root));
        }
    });
    port
}

fn answer(mut stream: TcpStream, root: &Path) {
    let mut line = String::new();
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    if reader.read_line(&mut line).is_err() {
        return;
    }
    // The rest of the request's head.
    let mut header = String::new();
    while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
        header.clear();
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let path = path.split(['?', '#']).next().unwrap_or("/");
    let file = if path == "/" { "/index.html" } else { path };
    let body = (!file.contains(".."))
        .then(|| std::fs::read(root.join(&file[1..])).ok())
        .flatten();
    let kind = match file.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript",
        Some("css") => "text/css",
        Some("wasm") => "application/wasm",
        _ => "application/octet-stream",
    };
    let head = match &body {
        Some(b) => format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            b.len()
        ),
        None => "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into(),
    };
    let _ = stream.write_all(head.as_bytes());
    if let Some(b) = body {
        let _ = stream.write_all(&b);
    }
}

/// chromedriver, stopped when dropped.
struct Driver {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_driver() -> Driver {
    let command = std::env::var("SLUICE_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let log = target_dir().join("playground-chromedriver.log");
    let child = Command::new(&command)
        .arg(format!("--port={port}"))
        .arg(format!("--log-path={}", log.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{command} did not start ({e}): run make deps"));
    let driver = Driver { child, port, log };
    let deadline = Instant::now() + WAIT;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{command} never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    driver
}

async fn browser(driver: &Driver) -> Client {
    let chromium = std::env::var("SLUICE_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let binary = which(&chromium).unwrap_or_else(|| panic!("{chromium} is missing: run make deps"));
    // Headless, and without the sandbox: as root (CI containers) Chromium refuses to start
    // with it; /dev/shm is often tiny in containers.
    let options = json!({
        "binary": binary,
        "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1440,1820", "--hide-scrollbars", "--force-device-scale-factor=1"],
    });
    let mut caps = serde_json::Map::new();
    caps.insert("goog:chromeOptions".into(), options);
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .unwrap_or_else(|e| {
            let log = std::fs::read_to_string(&driver.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "Chromium did not start through chromedriver: {e}\nchromedriver log ({}), last lines:\n{}",
                driver.log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )
        })
}

fn which(command: &str) -> Option<PathBuf> {
    if command.contains('/') {
        return Some(PathBuf::from(command));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(command))
            .find(|p| p.is_file())
    })
}

/// Polls `probe` (a JavaScript expression) until it is true.
async fn until(client: &Client, what: &str, probe: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let value = client
            .execute(&format!("return Boolean({probe});"), vec![])
            .await
            .expect("a script runs");
        if value == json!(true) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what} ({probe})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn js(client: &Client, expression: &str) -> serde_json::Value {
    client
        .execute(&format!("return {expression};"), vec![])
        .await
        .expect("a script runs")
}

async fn runs(client: &Client) -> u64 {
    js(client, "Number(document.body.dataset.runs || 0)")
        .await
        .as_u64()
        .unwrap_or(0)
}

/// Types `text` into the textarea or input `id`, as a person would (after clearing it).
async fn type_into(client: &Client, id: &str, text: &str) {
    let field = client.find(Locator::Id(id)).await.expect(id);
    field.clear().await.expect("clear");
    field.send_keys(text).await.expect("type");
}

/// What the page shows in column `side` for `k` (offered, admitted, denied...).
async fn shown(client: &Client, side: &str, k: &str) -> u64 {
    let text = client
        .find(Locator::Css(&format!(
            "#result-{side} .stat[data-k=\"{k}\"] b"
        )))
        .await
        .unwrap_or_else(|_| panic!("the {k} count of {side}"))
        .text()
        .await
        .expect("its text");
    text.replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("{k} of {side}: {text:?} is not a count"))
}

/// Core's decisions on the trace, request by request: (admitted, denied).
fn native(config: &str, csv: &str) -> (u64, u64) {
    let limiter = Limiter::new(sluice_core::parse(config.as_bytes()).expect("a valid config"));
    let mut store = MemoryStore::default();
    let (mut admitted, mut denied) = (0, 0);
    for line in csv.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').collect();
        let seconds: f64 = fields[0].parse().expect("seconds");
        let mut request = PlainRequest::get(fields[2]).from_ip(fields[1]);
        let conditions = Conditions {
            now_us: EPOCH_US + (seconds * 1e6).round() as u64,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        match limiter
            .decide(&mut request, conditions, &mut store)
            .decision
        {
            Decision::Allow { .. } => admitted += 1,
            _ => denied += 1,
        }
    }
    (admitted, denied)
}

#[tokio::test]
async fn the_page_decides_as_core_does() {
    assert!(
        www().join("pkg/sluice_playground_bg.wasm").is_file(),
        "the playground is not built: run make build-playground"
    );
    let port = serve(www());
    let driver = start_driver();
    let client = browser(&driver).await;
    let page = format!("http://127.0.0.1:{port}/");
    client.goto(&page).await.expect("the page loads");
    until(
        &client,
        "the WebAssembly module",
        "document.body.dataset.state === 'ready'",
    )
    .await;

    // A configuration, validated as it is typed.
    type_into(&client, "config-a", TOKEN_BUCKET).await;
    until(
        &client,
        "A valid",
        "document.getElementById('status-a').textContent.startsWith('✓ valid')",
    )
    .await;

    // An invalid one: the field is named, with the parser's message.
    type_into(&client, "config-a", INVALID).await;
    until(
        &client,
        "A invalid",
        "document.getElementById('status-a').dataset.field === 'rules[0].limits[0].per'",
    )
    .await;
    let status = client
        .find(Locator::Id("status-a"))
        .await
        .expect("status")
        .text()
        .await
        .expect("text");
    let parser = sluice_core::parse(INVALID.as_bytes()).expect_err("invalid");
    assert!(
        status.contains("rules[0].limits[0].per") && status.contains(&parser.problem),
        "the page says {status:?}, the parser {parser}"
    );

    // The valid one again, on bursts from three clients.
    type_into(&client, "config-a", TOKEN_BUCKET).await;
    until(
        &client,
        "A valid again",
        "document.getElementById('status-a').textContent.startsWith('✓ valid')",
    )
    .await;
    client
        .find(Locator::Css("#pattern option[value='bursts']"))
        .await
        .expect("the bursts pattern")
        .click()
        .await
        .expect("pick it");
    type_into(&client, "rate", "3").await;
    type_into(&client, "clients", "3").await;
    type_into(&client, "duration", "90").await;
    let before = runs(&client).await;
    client
        .find(Locator::Id("run"))
        .await
        .expect("Run")
        .click()
        .await
        .expect("run");
    until(
        &client,
        "a run",
        &format!("Number(document.body.dataset.runs) > {before}"),
    )
    .await;
    // Typing schedules runs of its own: wait until none is pending, then read.
    tokio::time::sleep(Duration::from_millis(600)).await;

    let csv = js(&client, "document.getElementById('trace-out').value")
        .await
        .as_str()
        .expect("the trace")
        .to_string();
    let (admitted, denied) = native(TOKEN_BUCKET, &csv);
    assert!(
        admitted > 0 && denied > 0,
        "the trace must test both answers: {admitted} admitted, {denied} denied"
    );
    assert_eq!(
        shown(&client, "a", "offered").await,
        admitted + denied,
        "offered"
    );
    assert_eq!(
        shown(&client, "a", "admitted").await,
        admitted,
        "admitted, page vs core"
    );
    assert_eq!(
        shown(&client, "a", "denied").await,
        denied,
        "denied, page vs core"
    );

    // Side by side with a sliding window, on the same trace.
    client
        .find(Locator::Id("compare"))
        .await
        .expect("compare")
        .click()
        .await
        .expect("tick");
    until(
        &client,
        "B shown",
        "!document.getElementById('b-box').hidden",
    )
    .await;
    type_into(&client, "config-b", SLIDING_WINDOW).await;
    until(
        &client,
        "B valid",
        "document.getElementById('status-b').textContent.startsWith('✓ valid')",
    )
    .await;
    let before = runs(&client).await;
    client
        .find(Locator::Id("run"))
        .await
        .expect("Run")
        .click()
        .await
        .expect("run");
    until(
        &client,
        "a run with B",
        &format!("Number(document.body.dataset.runs) > {before}"),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (b_admitted, b_denied) = native(SLIDING_WINDOW, &csv);
    assert_eq!(
        shown(&client, "b", "admitted").await,
        b_admitted,
        "B admitted, page vs core"
    );
    assert_eq!(
        shown(&client, "b", "denied").await,
        b_denied,
        "B denied, page vs core"
    );
    assert_eq!(
        shown(&client, "a", "admitted").await,
        admitted,
        "A unchanged"
    );

    // A denied request's answer: a 429 with Retry-After and the rate-limit headers.
    client
        .find(Locator::Id("next-denied"))
        .await
        .expect("next 429")
        .click()
        .await
        .expect("click");
    until(
        &client,
        "the request's answer",
        "document.querySelector('#detail .answer pre')",
    )
    .await;
    let detail = client
        .find(Locator::Css("#detail .answer[data-side='a'] pre"))
        .await
        .expect("A's answer")
        .text()
        .await
        .expect("text");
    assert!(
        detail.starts_with("HTTP/1.1 429 Too Many Requests") && detail.contains("retry-after: "),
        "{detail}"
    );
    assert!(
        detail.contains("ratelimit: \"per-client\";r=0;"),
        "{detail}"
    );

    let png = client.screenshot().await.expect("a screenshot");
    let shot = target_dir().join("playground-screenshot.png");
    std::fs::write(&shot, &png).expect("the screenshot is saved");
    eprintln!("screenshot: {}", shot.display());

    // The scenario travels in the link: a fresh load of it shows the same configurations.
    let link = client.current_url().await.expect("the URL").to_string();
    assert!(link.contains("#z=") || link.contains("#j="), "{link}");
    client.goto("about:blank").await.expect("away");
    client.goto(&link).await.expect("the shared link");
    until(
        &client,
        "the shared page",
        "document.body.dataset.state === 'ready'",
    )
    .await;
    let b = js(&client, "document.getElementById('config-b').value").await;
    assert_eq!(b.as_str(), Some(SLIDING_WINDOW), "B travels in the link");
    assert_eq!(
        shown(&client, "b", "denied").await,
        b_denied,
        "and so does the traffic"
    );

    client.close().await.expect("the session ends");
}
