//! Envoy's rate limit protocol (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`)
//! on the real server loop and a real Redis, through a real gRPC client (tonic): every answer's
//! fields, `hits_addend`, `shadow_mode`, `replaces`, `unlimited`, the descriptor matching of
//! envoyproxy/ratelimit's README, a reload, and the attacker's side: no credential, a wrong one,
//! too many descriptors or entries, an oversized or malformed message, a value too long to keep.
//! Needs `redis-server` (the `redis` feature).
#![cfg(feature = "redis")]

mod common;

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use sluice_counter_service::rls::{self, Config, RateLimiter};
use sluice_counter_service::{server, AppState};
use sluice_tests::redis::Redis;
use tonic::transport::Channel;
use tonic::Code as Status;

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: token_bucket}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 2}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: token_bucket}
  - key: path
    value: /internal
    rate_limit: {unlimited: true}
  - key: path
    value: /login
    rate_limit: {name: login, unit: hour, requests_per_unit: 100, algorithm: token_bucket}
  - key: vip
    value: "yes"
    rate_limit:
      unit: hour
      requests_per_unit: 1000
      algorithm: token_bucket
      replaces: [{name: login}]
"#;

/// The server on a loopback port with `config`, `flags` besides the test token.
struct Rls {
    address: std::net::SocketAddr,
    config: Arc<RwLock<Arc<Config>>>,
    state: AppState,
}

async fn start(redis: &Redis, config: &str, flags: &[&str]) -> Rls {
    let state = AppState::new(common::settings(&redis.url(), flags)).unwrap();
    let config = Arc::new(RwLock::new(Arc::new(Config::parse(config).unwrap())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let router = RateLimiter::new(state.clone(), config.clone()).router();
    let (settings, metrics) = (state.settings.clone(), state.metrics.clone());
    tokio::spawn(async move {
        server::serve_router(
            listener,
            router,
            &settings,
            metrics,
            None,
            server::Protocol::Http2,
            std::future::pending(),
        )
        .await
    });
    Rls {
        address,
        config,
        state,
    }
}

impl Rls {
    async fn client(&self) -> RateLimitServiceClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.address))
            .unwrap()
            .connect()
            .await
            .unwrap();
        RateLimitServiceClient::new(channel)
    }

    /// One call with `token` (none: no authorization metadata).
    async fn call(
        &self,
        token: Option<&str>,
        message: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = token {
            let value = format!("Bearer {token}").parse().unwrap();
            request.metadata_mut().insert("authorization", value);
        }
        let mut client = self.client().await;
        client
            .should_rate_limit(request)
            .await
            .map(|r| r.into_inner())
    }

    async fn ask(&self, message: RateLimitRequest) -> RateLimitResponse {
        self.call(Some(common::TOKEN), message).await.unwrap()
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).into(),
                value: (*value).into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors,
        hits_addend: 0,
    }
}

fn one(key: &str, value: &str) -> RateLimitRequest {
    request(vec![descriptor(&[(key, value)])])
}

fn code(status: &DescriptorStatus) -> Code {
    Code::try_from(status.code).unwrap()
}

fn seconds(status: &DescriptorStatus) -> i64 {
    status
        .duration_until_reset
        .as_ref()
        .map_or(-1, |d| d.seconds)
}

/// 3 an hour per user, as a token bucket: three answered OK with what is left, the fourth
/// OVER_LIMIT with the time until a token is back (20 minutes) and the limit that denied it;
/// another user is counted apart.
#[tokio::test]
async fn a_limit_is_exact_and_its_answer_says_what_envoy_reports() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    for left in [2, 1, 0] {
        let answer = rls.ask(one("user", "alice")).await;
        assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
        let status = &answer.statuses[0];
        assert_eq!(code(status), Code::Ok);
        assert_eq!(status.limit_remaining, left, "{answer:?}");
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 3), "3 an HOUR");
    }
    let denied = rls.ask(one("user", "alice")).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32, "{denied:?}");
    let status = &denied.statuses[0];
    assert_eq!((code(status), status.limit_remaining), (Code::OverLimit, 0));
    let wait = seconds(status);
    assert!(
        (1_190..=1_200).contains(&wait),
        "a token every 20 minutes: {wait}"
    );
    let bob = rls.ask(one("user", "bob")).await;
    assert_eq!(bob.overall_code, Code::Ok as i32, "{bob:?}");
    // A descriptor no limit matches, and an unknown domain, are OK with no limit.
    let free = rls.ask(one("nothing", "x")).await;
    assert_eq!(free.overall_code, Code::Ok as i32);
    assert_eq!(free.statuses[0].current_limit, None);
    let other = RateLimitRequest {
        domain: "nowhere".into(),
        ..one("user", "alice")
    };
    assert_eq!(rls.ask(other).await.overall_code, Code::Ok as i32);
    let metrics = common::get(&rls.state, "/metrics").await.body;
    let metrics = metrics.as_str().unwrap();
    assert!(
        metrics.contains("rls_descriptors_total{decision=\"denied\"} 1"),
        "{metrics}"
    );
}

/// The default is envoyproxy/ratelimit's: a fixed window of the unit (a day, UTC), its
/// `duration_until_reset` the window's end, for an admitted request and a denied one alike.
#[tokio::test]
async fn a_fixed_window_by_default_resets_at_the_units_end() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    let first = rls.ask(one("daily", "k")).await;
    let until_midnight = seconds(&first.statuses[0]);
    assert!((1..=86_400).contains(&until_midnight), "{first:?}");
    assert_eq!(first.statuses[0].limit_remaining, 1);
    rls.ask(one("daily", "k")).await;
    let denied = rls.ask(one("daily", "k")).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32);
    let wait = seconds(&denied.statuses[0]);
    assert!(
        (until_midnight - 2..=until_midnight).contains(&wait),
        "{wait} {until_midnight}"
    );
}

/// `hits_addend` is the request's cost: the request's, or a descriptor's own instead. A cost
/// above what the limit ever admits at once is over, and spends nothing.
#[tokio::test]
async fn hits_addend_spends_its_cost() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    let two = RateLimitRequest {
        hits_addend: 2,
        ..one("user", "carol")
    };
    assert_eq!(rls.ask(two.clone()).await.statuses[0].limit_remaining, 1);
    let denied = rls.ask(two).await;
    assert_eq!(
        denied.overall_code,
        Code::OverLimit as i32,
        "2 more than the 1 left"
    );
    let mut own = descriptor(&[("user", "dave")]);
    own.hits_addend = Some(UInt64Value { value: 3 });
    let answer = rls
        .ask(RateLimitRequest {
            hits_addend: 1,
            ..request(vec![own.clone()])
        })
        .await;
    assert_eq!(answer.statuses[0].limit_remaining, 0, "the descriptor's 3");
    own.hits_addend = Some(UInt64Value { value: 4 });
    let mut erin = own.clone();
    erin.entries[0].value = "erin".into();
    let never = rls.ask(request(vec![erin])).await;
    assert_eq!(
        never.overall_code,
        Code::OverLimit as i32,
        "4 of a burst of 3"
    );
    let after = rls.ask(one("user", "erin")).await;
    assert_eq!(after.statuses[0].limit_remaining, 2, "nothing was spent");
}

/// `shadow_mode`: counted, reported over in its status's limit, but the request is OK.
/// `unlimited`: OK, never counted. `replaces`: a matched VIP limit removes the `login` limit for
/// that request only.
#[tokio::test]
async fn shadow_mode_unlimited_and_replaces_behave_as_documented() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    assert_eq!(
        rls.ask(one("shadow", "s")).await.overall_code,
        Code::Ok as i32
    );
    let over = rls.ask(one("shadow", "s")).await;
    assert_eq!(over.overall_code, Code::Ok as i32, "{over:?}");
    assert_eq!(over.statuses[0].limit_remaining, 0);
    let metrics = common::get(&rls.state, "/metrics").await.body;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("rls_descriptors_total{decision=\"shadow_denied\"} 1"),
        "{metrics}"
    );
    for _ in 0..5 {
        let free = rls.ask(one("path", "/internal")).await;
        assert_eq!(free.statuses[0].current_limit, None, "{free:?}");
    }
    let login = rls.ask(one("path", "/login")).await;
    assert_eq!(login.statuses[0].limit_remaining, 99);
    let both = rls
        .ask(request(vec![
            descriptor(&[("path", "/login")]),
            descriptor(&[("vip", "yes")]),
        ]))
        .await;
    assert_eq!(both.statuses[0].current_limit, None, "replaced: {both:?}");
    assert_eq!(both.statuses[1].limit_remaining, 999);
    let again = rls.ask(one("path", "/login")).await;
    assert_eq!(
        again.statuses[0].limit_remaining, 98,
        "the replaced one spent nothing"
    );
}

/// envoyproxy/ratelimit's README, example 3 (nested descriptors, per-address defaults):
/// loaded, and counted as it documents.
#[tokio::test]
async fn the_readme_examples_nested_descriptors_hold() {
    let redis = Redis::start().unwrap();
    let config = r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 1000
"#;
    let rls = start(&redis, config, &[]).await;
    let at = |address: &str| RateLimitRequest {
        domain: "edge_proxy_per_ip".into(),
        descriptors: vec![descriptor(&[("remote_address", address)])],
        hits_addend: 0,
    };
    let first = rls.ask(at("10.0.0.1")).await;
    let limit = first.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (10, 1),
        "10 a SECOND"
    );
    let special = rls.ask(at("50.0.0.5")).await;
    let limit = special.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(limit.requests_per_unit, 1000);
}

/// A value longer than any key kept is counted under its digest: the limit holds for it, and
/// two long values that differ only at the end are two keys.
#[tokio::test]
async fn a_long_value_is_counted_not_exempted() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    let long = "v".repeat(10_000);
    for _ in 0..3 {
        assert_eq!(
            rls.ask(one("user", &long)).await.overall_code,
            Code::Ok as i32
        );
    }
    assert_eq!(
        rls.ask(one("user", &long)).await.overall_code,
        Code::OverLimit as i32
    );
    let other = format!("{long}w");
    assert_eq!(
        rls.ask(one("user", &other)).await.overall_code,
        Code::Ok as i32
    );
    assert_ne!(
        rls::key("edge", &[("user", &long)], 256),
        rls::key("edge", &[("user", &other)], 256)
    );
    assert!(rls::key("edge", &[("user", &long)], 256).len() <= 256);
}

/// No credential, a wrong one: UNAUTHENTICATED, nothing counted. Too many descriptors or
/// entries: INVALID_ARGUMENT naming the field. A message past the bound: refused before it is
/// decoded. Bytes that are not a request: refused, the server still serving.
#[tokio::test]
async fn the_grpc_surface_refuses_what_it_must_and_says_why() {
    let redis = Redis::start().unwrap();
    let rls = start(&redis, CONFIG, &[]).await;
    for token in [None, Some("wrong"), Some("")] {
        let refused = rls.call(token, one("user", "mallory")).await.unwrap_err();
        assert_eq!(
            refused.code(),
            Status::Unauthenticated,
            "{token:?}: {refused:?}"
        );
    }
    assert_eq!(
        rls.ask(one("user", "mallory")).await.statuses[0].limit_remaining,
        2
    );
    let many = request((0..65).map(|_| descriptor(&[("user", "x")])).collect());
    let refused = rls.call(Some(common::TOKEN), many).await.unwrap_err();
    assert_eq!(refused.code(), Status::InvalidArgument);
    assert!(refused.message().contains("descriptors"), "{refused:?}");
    let deep: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), "v".into())).collect();
    let deep: Vec<(&str, &str)> = deep.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let refused = rls
        .call(Some(common::TOKEN), request(vec![descriptor(&deep)]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Status::InvalidArgument);
    assert!(
        refused.message().contains("descriptors[0].entries"),
        "{refused:?}"
    );
    let huge = one("user", &"h".repeat(rls::MAX_MESSAGE_BYTES + 1));
    let refused = rls.call(Some(common::TOKEN), huge).await.unwrap_err();
    assert_eq!(refused.code(), Status::OutOfRange, "{refused:?}");
    // A gRPC frame whose bytes are not a RateLimitRequest, over HTTP/2.
    let garbage = raw_call(rls.address, &[0xff, 0xff, 0xff, 0x0f, 0x0a]).await;
    assert_eq!(garbage.as_deref(), Some("13"), "INTERNAL: not a message");
    assert_eq!(
        rls.ask(one("user", "mallory")).await.statuses[0].limit_remaining,
        1
    );
}

/// One gRPC call with `message` as its (length-prefixed) body: the `grpc-status` answered.
async fn raw_call(address: std::net::SocketAddr, message: &[u8]) -> Option<String> {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (mut client, connection) = h2::client::handshake(stream).await.unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!(
        "http://{address}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("authorization", format!("Bearer {}", common::TOKEN))
    .body(())
    .unwrap();
    let (response, mut body) = client.send_request(request, false).unwrap();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    body.send_data(frame.into(), true).unwrap();
    let response = response.await.unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return Some(status.to_str().unwrap().to_owned());
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let _ = chunk;
    }
    let trailers = body.trailers().await.ok()??;
    trailers
        .get("grpc-status")
        .map(|s| s.to_str().unwrap().to_owned())
}

/// A configuration written to its file is in force within about a second; one that fails its
/// check keeps the last.
#[tokio::test]
async fn a_changed_configuration_is_reloaded_and_a_broken_one_is_not() {
    let redis = Redis::start().unwrap();
    let file = common::TextFile::new(CONFIG);
    let rls = start(&redis, CONFIG, &[]).await;
    rls::watch(file.path().into(), rls.config.clone());
    let tighter = CONFIG.replace("requests_per_unit: 3,", "requests_per_unit: 5,");
    // A different length, so the file's time and size both change.
    std::fs::write(file.path(), format!("{tighter}\n# five\n")).unwrap();
    let limit_of = |answer: RateLimitResponse| {
        answer.statuses[0]
            .current_limit
            .as_ref()
            .map_or(0, |l| l.requests_per_unit)
    };
    let started = Instant::now();
    let mut seen = 0;
    while started.elapsed() < Duration::from_secs(10) {
        seen = limit_of(rls.ask(one("user", "reload")).await);
        if seen == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen, 5, "reloaded");
    std::fs::write(file.path(), "domain: edge\ndescriptors: [{key: user, rate_limit: {unit: fortnight, requests_per_unit: 1}}]\n").unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        limit_of(rls.ask(one("user", "reload")).await),
        5,
        "the last one kept"
    );
}
