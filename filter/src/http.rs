//! One HTTP context per request: headers in, one core decision, an action out. Strict rules
//! add one counter-service check each, with the request paused until the answers are in.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};
use sluice_core::decision::Spent;
use sluice_core::headers::{denial_body, render, retry_after_seconds};
use sluice_core::limiter::{Conditions, RuleAnswer};
use sluice_core::net::client_address;
use sluice_core::protocol::{CheckRequest, CheckResponse};
use sluice_core::{sync, Decision, Outcome, Quota};

use crate::callout;
use crate::host::{self, HostRequest, SharedData};
use crate::shared::Shared;

pub struct Request {
    shared: Rc<Shared>,
    /// The rule and quota whose headers go on the response.
    quota: Option<(usize, Quota)>,
    /// Strict checks in flight: (callout token, rule, key).
    pending: Vec<(u32, usize, String)>,
    /// What the local and cached rules spent, given back if a strict check denies.
    spent: Vec<Spent>,
    /// The first strict denial: (rule, answer).
    denied: Option<(usize, RuleAnswer)>,
}

impl Request {
    pub fn new(shared: Rc<Shared>) -> Request {
        Request {
            shared,
            quota: None,
            pending: Vec::new(),
            spent: Vec::new(),
            denied: None,
        }
    }

    fn read_request(&self) -> HostRequest {
        let policy = self.shared.limiter.policy();
        let mut path = host::request_header(":path").unwrap_or_default();
        if let Some(query) = path.find('?') {
            path.truncate(query);
        }
        let headers = std::cell::OnceCell::new();
        let client_ip = policy.needs_client_ip().then(|| {
            let peer = host::property(vec!["source", "address"]).unwrap_or_default();
            let hops = policy.client_ip.trusted_hops;
            // A repeated X-Forwarded-For is one list (RFC 9110 5.3): counted from the right
            // across all of its lines.
            let xff = (hops > 0).then(|| {
                headers
                    .get_or_init(host::request_headers)
                    .iter()
                    .filter(|(name, _)| name.eq_ignore_ascii_case(b"x-forwarded-for"))
                    .map(|(_, value)| String::from_utf8_lossy(value).into_owned())
                    .collect::<Vec<_>>()
                    .join(",")
            });
            let xff = xff.filter(|xff| !xff.is_empty());
            client_address(&peer, xff.as_deref(), hops).to_string()
        });
        HostRequest {
            method: Default::default(),
            path,
            normal: Default::default(),
            client_ip,
            headers,
        }
    }

    /// Keeps the most restrictive quota for the response headers.
    fn offer(&mut self, rule: usize, quota: Quota) {
        if self
            .quota
            .is_none_or(|(_, q)| quota.remaining < q.remaining)
        {
            self.quota = Some((rule, quota));
        }
    }

    fn deny(&self, rule: usize, quota: &Quota, retry_after_us: u64) {
        let policy = self.shared.limiter.policy();
        let name = policy.rules.get(rule).map_or("", |r| r.name.as_str());
        let retry_after = retry_after_seconds(retry_after_us);
        let rendered = render(policy.headers, name, quota);
        let retry = retry_after.to_string();
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(rendered.len() + 2);
        headers.push(("retry-after", &retry));
        headers.push(("content-type", "application/json"));
        headers.extend(rendered.iter().map(|(k, v)| (*k, v.as_str())));
        let body = denial_body(name, quota, retry_after);
        let _ = hostcalls::send_http_response(429, headers, Some(body.as_bytes()));
    }

    /// Sends one strict check; `false` if it could not be sent.
    fn check(&mut self, rule: usize, key: String) -> bool {
        let shared = Rc::clone(&self.shared);
        let policy = shared.limiter.policy();
        let (Some(service), Some(spec)) = (policy.service.as_ref(), policy.rules.get(rule)) else {
            return false;
        };
        let request = CheckRequest {
            key: key.clone(),
            limits: spec.limits.iter().map(|l| l.spec()).collect(),
            cost: 1,
        };
        match callout::post(service, "/v1/check", &request) {
            Ok(token) => {
                shared.metrics.check_sent();
                self.pending.push((token, rule, key));
                true
            }
            Err(_) => false,
        }
    }

    /// A strict rule decided locally, by its fallback.
    fn fall_back(&mut self, rule: usize, key: &str) {
        let shared = Rc::clone(&self.shared);
        let answer = shared
            .limiter
            .fallback(rule, key, host::now_us(), &mut SharedData);
        match answer {
            Some(answer) => self.record(rule, answer),
            None => shared.metrics.outcome(rule, Outcome::Unavailable),
        }
    }

    fn record(&mut self, rule: usize, answer: RuleAnswer) {
        let shadow = self
            .shared
            .limiter
            .policy()
            .rules
            .get(rule)
            .is_some_and(|r| r.mode == sluice_core::policy::Mode::Shadow);
        let outcome = match (answer.allowed, shadow) {
            (true, _) => Outcome::Allowed,
            (false, true) => Outcome::ShadowDenied,
            (false, false) => Outcome::Denied,
        };
        self.shared.metrics.outcome(rule, outcome);
        if outcome == Outcome::Denied {
            if self.denied.is_none() {
                self.denied = Some((rule, answer));
            }
        } else {
            self.offer(rule, answer.quota);
        }
    }

    /// All strict answers are in: deny (giving back what was spent) or let the request go on.
    fn finish(&mut self) -> Action {
        if let Some((rule, answer)) = self.denied.take() {
            self.shared.limiter.refund(&self.spent, &mut SharedData);
            self.deny(rule, &answer.quota, answer.retry_after_us);
            return Action::Pause;
        }
        Action::Continue
    }
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(at) = self.pending.iter().position(|(t, _, _)| *t == token_id) else {
            return;
        };
        let (_, rule, key) = self.pending.swap_remove(at);
        let answer = callout::answer::<CheckResponse>(num_headers, body_size).ok();
        match answer {
            Some(check) => {
                let limit = self
                    .shared
                    .limiter
                    .policy()
                    .rules
                    .get(rule)
                    .and_then(|r| r.limits.first().copied())
                    .unwrap_or(sluice_core::Limit::UNIT);
                let answer = RuleAnswer {
                    allowed: check.allowed,
                    quota: Quota {
                        limit,
                        remaining: check.remaining,
                        reset_us: check.reset_ms * 1_000,
                    },
                    retry_after_us: check.retry_after_ms * 1_000,
                };
                self.record(rule, answer);
            }
            None => {
                self.shared.metrics.check_failed();
                if let Some(service) = self.shared.limiter.policy().service.as_ref() {
                    // A failed check counts against the breaker; it leaves the sync round alone.
                    self.shared.breaker_failed(service, host::now_us(), false);
                }
                self.fall_back(rule, &key);
            }
        }
        if self.pending.is_empty() && self.finish() == Action::Continue {
            let _ = hostcalls::resume_http_request();
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let shared = Rc::clone(&self.shared);
        let limiter = &shared.limiter;
        let mut request = self.read_request();
        let client = request.client_ip.as_deref().and_then(|ip| ip.parse().ok());
        if shared.bypass.get() || limiter.bypassed(&request.path, client) {
            shared.metrics.bypassed();
            return Action::Continue;
        }

        let service_up = shared.service_up.get();
        let conditions = Conditions {
            now_us: host::now_us(),
            service_up,
        };
        let evaluation = limiter.decide(&mut request, conditions, &mut SharedData);
        for (rule, outcome) in &evaluation.outcomes {
            shared.metrics.outcome(*rule, *outcome);
        }
        if evaluation.lease_exhausted && !shared.hurried.replace(true) {
            if let Some(service) = limiter.policy().service.as_ref() {
                sync::hurry(&mut SharedData, conditions.now_us, service.sync_interval_ms);
            }
        }
        for (rule, key) in evaluation.newly_unsynced {
            let forgotten = shared.announcer.announce(limiter, rule, key);
            shared.metrics.sync_dropped(forgotten);
        }

        match evaluation.decision {
            Decision::Allow { quota } => {
                if let Some((rule, quota)) = quota {
                    self.offer(rule, quota);
                }
                self.spent = evaluation.spent;
                for (rule, key) in limiter.strict_keys(&mut request) {
                    if !(service_up && self.check(rule, key.clone())) {
                        self.fall_back(rule, &key);
                    }
                }
                if self.pending.is_empty() {
                    self.finish()
                } else {
                    Action::Pause
                }
            }
            Decision::Deny {
                rule,
                quota,
                retry_after_us,
            } => {
                self.deny(rule, &quota, retry_after_us);
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some((rule, quota)) = self.quota.take() {
            let policy = self.shared.limiter.policy();
            let name = policy.rules.get(rule).map_or("", |r| r.name.as_str());
            for (header, value) in render(policy.headers, name, &quota) {
                let _ =
                    hostcalls::set_map_value(MapType::HttpResponseHeaders, header, Some(&value));
            }
        }
        Action::Continue
    }
}
