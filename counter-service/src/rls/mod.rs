//! Envoy's global rate limit service (`envoy.service.ratelimit.v3.RateLimitService`), on its own
//! port (`--grpc-bind`): what Envoy's `envoy.filters.http.ratelimit` filter, Istio and Envoy
//! Gateway call. Its limits are the descriptors of `--rls-config` ([`config`]); each request
//! descriptor that matches one is counted by the strict checks' scripts (`lua/window.lua`,
//! `lua/check.lua`) on Redis's clock, so a limit is exact across every Envoy and every replica,
//! and a denied descriptor spends nothing.
//!
//! The answer: `OVER_LIMIT` if any descriptor not in `shadow_mode` is over; per descriptor its
//! code, `current_limit`, `limit_remaining` and `duration_until_reset`: for a descriptor over
//! its limit, the time until the same request would be admitted (what Envoy's `Retry-After`
//! and `X-RateLimit-Reset` then say), else until its window ends (a bucket: until it is full),
//! in whole seconds rounded up.
//!
//! The descriptors of one request are counted each alone, concurrently (they live in different
//! Redis Cluster slots), as envoyproxy/ratelimit counts them: a request one descriptor denies
//! still spends the descriptors that admitted it.
//!
//! Who may call: a proxy credential, as on `/v1`: a bearer token in the `authorization`
//! metadata, or a client certificate mapped to a name (`--client-certs-file`); without one,
//! `UNAUTHENTICATED`. Bounds: [`MAX_MESSAGE_BYTES`], [`MAX_DESCRIPTORS`], [`MAX_ENTRIES`],
//! `hits_addend` at most 2^31; a descriptor key longer than `--max-key-bytes` is counted under
//! its SHA-256 digest, so a long value is never an exemption.

pub mod config;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit as ProtoUnit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration;
use sluice_protocol::{CheckRequest, CheckResponse, KEY_PART_SEPARATOR};
use tonic::{Request, Response, Status};

use crate::client_certs::PeerCertificate;
use crate::state::AppState;
pub use config::Config;
use config::{Limit, Verdict};

/// Largest request message decoded (Envoy's headers are 60 KiB at most by default).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Most descriptors in one request (route actions the operator configured).
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = config::MAX_DEPTH;

/// The gRPC service: the configuration in force (replaced whole on a reload) and the state of
/// the HTTP API it shares (Redis, scripts, credentials, metrics).
#[derive(Clone)]
pub struct RateLimiter {
    state: AppState,
    config: Arc<RwLock<Arc<Config>>>,
}

impl RateLimiter {
    pub fn new(state: AppState, config: Arc<RwLock<Arc<Config>>>) -> RateLimiter {
        RateLimiter { state, config }
    }

    /// The tonic service, with its message bound.
    pub fn server(self) -> RateLimitServiceServer<RateLimiter> {
        RateLimitServiceServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// An axum router serving it (gRPC over HTTP/2), for [`crate::server`].
    pub fn router(self) -> axum::Router {
        tonic::service::Routes::new(self.server()).into_axum_router()
    }

    fn config(&self) -> Arc<Config> {
        match self.config.read() {
            Ok(config) => config.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn authenticate<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let certs = self.state.proxy_certs();
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|value| value.as_bytes());
        crate::auth::identify(
            &self.state.proxies(),
            certs.as_deref(),
            request.extensions().get::<PeerCertificate>(),
            authorization,
        )
        .map(|_| ())
        .map_err(|error| match error {
            crate::error::AppError::Unauthorized => Status::unauthenticated(
                "a proxy credential is required: a bearer token in the authorization metadata or a client certificate",
            ),
            other => Status::permission_denied(other.to_string()),
        })
    }
}

/// One descriptor of a request, matched: what to count, and how to report it.
struct Planned {
    limit: Option<Limit>,
    shadow_mode: bool,
    key: String,
    cost: u64,
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.authenticate(&request)?;
        let _in_flight = self.state.enter();
        let request = request.into_inner();
        tracing::debug!(?request, "ShouldRateLimit");
        let plans = plan(&self.config(), &request, self.state.settings.max_key_bytes)?;
        let checks = plans.iter().map(|planned| async move {
            let limit = planned.limit.as_ref()?;
            if planned.cost > limit.spec.burst {
                // More than the limit ever admits at once: over, and neither counted nor a
                // penalty's start (as `/v1/check` refuses such a cost).
                let period_ms = limit.spec.period_ms;
                return Some(Ok(CheckResponse {
                    allowed: false,
                    remaining: 0,
                    retry_after_ms: period_ms,
                    reset_ms: period_ms,
                    lease: None,
                }));
            }
            let check = CheckRequest {
                key: planned.key.clone(),
                limits: vec![limit.spec],
                cost: planned.cost,
                penalty_ms: limit.penalty_ms,
                proxy: None,
            };
            Some(crate::check_handler::decide(&self.state, &check, None, 0).await)
        });
        let answers = futures_util::future::join_all(checks).await;
        let mut overall = Code::Ok;
        let mut statuses = Vec::with_capacity(plans.len());
        for (planned, answer) in plans.iter().zip(answers) {
            let (Some(limit), Some(answer)) = (&planned.limit, answer) else {
                statuses.push(DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                });
                continue;
            };
            let answer = answer.map_err(|error| {
                tracing::warn!(%error, "a rate limit descriptor could not be counted");
                Status::unavailable("the counters cannot be reached")
            })?;
            self.state
                .metrics
                .rls_decided(answer.allowed, planned.shadow_mode);
            let over = !answer.allowed && !planned.shadow_mode;
            if over {
                overall = Code::OverLimit;
            }
            statuses.push(status(limit, &answer, over));
        }
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            ..Default::default()
        }))
    }
}

/// Matches every descriptor of `request` (its bounds checked), drops the limits another matched
/// limit `replaces`, and says what each costs and under which key it is counted.
fn plan(
    config: &Config,
    request: &RateLimitRequest,
    max_key_bytes: usize,
) -> Result<Vec<Planned>, Status> {
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(Status::invalid_argument(format!(
            "descriptors: more than {MAX_DESCRIPTORS}"
        )));
    }
    let mut plans = Vec::with_capacity(request.descriptors.len());
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.len() > MAX_ENTRIES {
            return Err(Status::invalid_argument(format!(
                "descriptors[{i}].entries: more than {MAX_ENTRIES}"
            )));
        }
        let entries: Vec<(&str, &str)> = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        // The descriptor's own hits_addend, else the request's; 0 or absent: 1.
        let hits = descriptor
            .hits_addend
            .map(|h| h.value)
            .unwrap_or(u64::from(request.hits_addend));
        let cost = hits.max(1);
        if cost > sluice_protocol::MAX_TOKENS {
            return Err(Status::invalid_argument(format!(
                "descriptors[{i}].hits_addend: more than {}",
                sluice_protocol::MAX_TOKENS
            )));
        }
        let matched = config.find(&request.domain, &entries);
        let (limit, shadow_mode) = match matched {
            Some(m) => match m.verdict {
                Verdict::Limited(limit) => (Some(limit.clone()), m.shadow_mode),
                Verdict::Unlimited => (None, false),
            },
            None => (None, false),
        };
        plans.push(Planned {
            limit,
            shadow_mode,
            key: key(&request.domain, &entries, max_key_bytes),
            cost,
        });
    }
    let replaced: Vec<String> = plans
        .iter()
        .filter_map(|p| p.limit.as_ref())
        .flat_map(|l| l.replaces.iter().cloned())
        .collect();
    for planned in &mut plans {
        if planned
            .limit
            .as_ref()
            .is_some_and(|l| !l.name.is_empty() && replaced.contains(&l.name))
        {
            planned.limit = None;
        }
    }
    Ok(plans)
}

/// The key a descriptor is counted under: its domain and entries, each key and value, joined
/// by the filter's separator; past `max_key_bytes`, `rls`, the domain's length and a SHA-256
/// digest of the whole, so every replica counts a long key under the same name and no value's
/// length escapes its count.
pub fn key(domain: &str, entries: &[(&str, &str)], max_key_bytes: usize) -> String {
    let separator = KEY_PART_SEPARATOR;
    let mut key = format!("rls{separator}{domain}");
    for (k, v) in entries {
        key.push(separator);
        key.push_str(k);
        key.push('=');
        key.push_str(v);
    }
    if key.len() <= max_key_bytes {
        return key;
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("rls{separator}sha256{separator}{hex}")
}

fn status(limit: &Limit, answer: &CheckResponse, over: bool) -> DescriptorStatus {
    let until_ms = match answer.allowed {
        false => answer.retry_after_ms,
        true => answer.reset_ms,
    };
    DescriptorStatus {
        code: match over {
            true => Code::OverLimit as i32,
            false => Code::Ok as i32,
        },
        current_limit: Some(RateLimit {
            name: limit.name.clone(),
            requests_per_unit: u32::try_from(limit.requests_per_unit).unwrap_or(u32::MAX),
            unit: ProtoUnit::try_from(limit.unit.proto()).map_or(0, |u| u as i32),
        }),
        limit_remaining: u32::try_from(answer.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(Duration {
            seconds: i64::try_from(until_ms.div_ceil(1_000)).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        quota: None,
    }
}

/// Reads `--rls-config`: the reason, naming the file, if it cannot be read or is not a valid
/// configuration.
pub fn load(path: &std::path::Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--rls-config {}: {e}", path.display()))?;
    Config::parse(&text).map_err(|e| format!("--rls-config {}: {e}", path.display()))
}

/// Reads `path` again within [`crate::reload::WATCH_INTERVAL`] of a change, for as long as the
/// process runs: a configuration that fails its check keeps the one in force (the reason is
/// logged), a valid one is in force for every request from then on.
pub fn watch(path: PathBuf, config: Arc<RwLock<Arc<Config>>>) {
    let modified = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut stamp: Option<SystemTime> = modified(&path);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(crate::reload::WATCH_INTERVAL);
        loop {
            every.tick().await;
            let now = modified(&path);
            if now == stamp {
                continue;
            }
            stamp = now;
            match load(&path) {
                Ok(fresh) => {
                    if let Ok(mut slot) = config.write() {
                        *slot = Arc::new(fresh);
                    }
                    tracing::info!(path = %path.display(), "rate limit configuration reloaded");
                }
                Err(reason) => {
                    tracing::warn!(%reason, "rate limit configuration not reloaded: the last one is kept")
                }
            }
        }
    });
}
