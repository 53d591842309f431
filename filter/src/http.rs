//! One HTTP context per request: headers in, one core decision, an action out.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};
use sluice_core::headers::{denial_body, render, retry_after_seconds};
use sluice_core::limiter::Conditions;
use sluice_core::net::client_address;
use sluice_core::{Decision, Quota};

use crate::host::{self, HostRequest, SharedData};
use crate::root::Shared;

pub struct Request {
    shared: Rc<Shared>,
    /// The rule and quota whose headers go on the response.
    quota: Option<(usize, Quota)>,
}

impl Request {
    pub fn new(shared: Rc<Shared>) -> Request {
        Request {
            shared,
            quota: None,
        }
    }

    fn read_request(&self) -> HostRequest {
        let policy = self.shared.limiter.policy();
        let method = host::request_header(":method").unwrap_or_default();
        let mut path = host::request_header(":path").unwrap_or_default();
        if let Some(query) = path.find('?') {
            path.truncate(query);
        }
        let client_ip = policy.needs_client_ip().then(|| {
            let peer = host::property(vec!["source", "address"]).unwrap_or_default();
            let hops = policy.client_ip.trusted_hops;
            let xff = (hops > 0)
                .then(|| host::request_header("x-forwarded-for"))
                .flatten();
            client_address(&peer, xff.as_deref(), hops).to_string()
        });
        HostRequest {
            method,
            path,
            client_ip,
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let shared = Rc::clone(&self.shared);
        let limiter = &shared.limiter;
        let mut request = self.read_request();
        let client = request.client_ip.as_deref().and_then(|ip| ip.parse().ok());
        if limiter.bypassed(&request.path, client) {
            shared.metrics.bypassed();
            return Action::Continue;
        }

        let conditions = Conditions {
            now_us: host::now_us(),
            service_up: true,
        };
        let evaluation = limiter.decide(&mut request, conditions, &mut SharedData);
        for (rule, outcome) in &evaluation.outcomes {
            shared.metrics.outcome(*rule, *outcome);
        }

        match evaluation.decision {
            Decision::Bypass => Action::Continue,
            Decision::Allow { quota } => {
                self.quota = quota;
                Action::Continue
            }
            Decision::Deny {
                rule,
                quota,
                retry_after_us,
            } => {
                let policy = limiter.policy();
                let name = policy.rules.get(rule).map_or("", |r| r.name.as_str());
                let retry_after = retry_after_seconds(retry_after_us);
                let rendered = render(policy.headers, name, &quota);
                let retry = retry_after.to_string();
                let mut headers: Vec<(&str, &str)> = Vec::with_capacity(rendered.len() + 2);
                headers.push(("retry-after", &retry));
                headers.push(("content-type", "application/json"));
                headers.extend(rendered.iter().map(|(k, v)| (*k, v.as_str())));
                let body = denial_body(name, &quota, retry_after);
                let _ = hostcalls::send_http_response(429, headers, Some(body.as_bytes()));
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
