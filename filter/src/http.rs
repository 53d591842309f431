//! One HTTP context per request: what the host saw goes into core's [`Exchange`], and its
//! effects and steps are carried out with host calls. Nothing is decided here.

use std::collections::HashMap;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};
use sluice_core::protocol::CheckResponse;
use sluice_core::request::net::resolve_client;
use sluice_core::shed::ShedReason;
use sluice_core::{sync::proxy, Effect, Exchange, Moment, Step};

use crate::callout;
use crate::host::{self, HostRequest, SharedData};
use crate::shared::Shared;
use crate::shedder::respond;
use sluice_core::worker::WaitEnd;

pub struct Request {
    shared: Rc<Shared>,
    /// The limiter this request started with (live overrides apply to later requests).
    limiter: Rc<sluice_core::Limiter>,
    /// The host's id of this request's context.
    id: u32,
    exchange: Exchange,
    /// Strict checks in flight: callout token → check number.
    checks: HashMap<u32, usize>,
}

impl Request {
    pub fn new(shared: Rc<Shared>, id: u32) -> Request {
        Request {
            limiter: shared.limiter(),
            shared,
            id,
            exchange: Exchange::default(),
            checks: HashMap::new(),
        }
    }

    /// If the request waited in the queue, learns how the wait ended.
    fn resolve_wait(&mut self) {
        if self.exchange.waiting().is_none() {
            return;
        }
        let shared = Rc::clone(&self.shared);
        let end = match (&shared.shedder, self.limiter.policy().shedding.as_ref()) {
            (Some(shedder), Some(shedding)) => shedder.wait_end(shedding, self.id),
            _ => None,
        };
        match end {
            Some(WaitEnd::Seated { at_us }) => self.exchange.seated(at_us),
            // Shed while waiting, or its stream ended before a slot came.
            Some(WaitEnd::Shed) | None => self.exchange.unseated(&self.limiter, &mut SharedData),
        }
    }

    /// The stream ended, however: its slot goes back, its latency becomes a sample.
    fn end(&mut self) {
        self.resolve_wait();
        if self.shared.shaper.cancel(self.id) {
            let limiter = Rc::clone(&self.limiter);
            self.exchange.cancel_delay(&limiter, &mut SharedData);
        }
        let effects = self.exchange.finish(&self.limiter, &mut SharedData);
        let _ = self.carry_out(effects);
    }

    fn read_request<'a>(&self, limiter: &'a sluice_core::Limiter) -> HostRequest<'a> {
        let policy = limiter.policy();
        let mut path = host::request_header(":path").unwrap_or_default();
        let mut query = None;
        // A byte search: cheaper here than a `char` pattern's.
        if let Some(at) = path.bytes().position(|b| b == b'?') {
            query = Some(path[at + 1..].to_string());
            path.truncate(at);
        }
        let headers = std::cell::OnceCell::new();
        let client_ip = limiter.needs_client_ip().then(|| {
            let peer = host::source_address().unwrap_or_default();
            let xff = || {
                headers
                    .get_or_init(host::request_headers)
                    .iter()
                    .filter(|(name, _)| name.eq_ignore_ascii_case(b"x-forwarded-for"))
                    .map(|(_, value)| value.as_slice())
            };
            resolve_client(peer, xff, policy.client_ip.trusted_hops).0
        });
        HostRequest {
            method: Default::default(),
            path,
            normal: Default::default(),
            client_ip: client_ip.flatten(),
            headers,
            query,
            host: Default::default(),
            jwt_payload: &policy.jwt_payload_in_metadata,
            claims: Default::default(),
        }
    }

    fn moment(&self) -> Moment {
        let now_us = host::now_us();
        let policy = self.limiter.policy();
        // Drawn only where read: the jitter by the breaker of a counter service, the draw by
        // load shedding (a fixed middle value otherwise, as in `Moment::at`).
        Moment {
            now_us,
            service_up: self.shared.service_up.get(),
            bypass: self.shared.bypass.get(),
            jitter: match policy.service {
                Some(_) => host::jitter(now_us),
                None => 1.0,
            },
            draw: match policy.shedding {
                Some(_) => host::draw(now_us),
                None => 0.5,
            },
            fleet: self.shared.shedder.as_ref().and_then(|s| s.fleet.get()),
        }
    }

    /// Carries out what core asked for. Checks that cannot be sent are answered as failed at
    /// once; the step they lead to, if any, is returned.
    fn carry_out(&mut self, mut effects: Vec<Effect>) -> Option<Step> {
        self.carry_out_from(&mut effects)
    }

    /// [`carry_out`](Self::carry_out), taking the effects out of `effects` (left empty, its
    /// room kept for the next request).
    fn carry_out_from(&mut self, effects: &mut Vec<Effect>) -> Option<Step> {
        // Most calls, at a stream's end, have nothing to carry out.
        if effects.is_empty() {
            return None;
        }
        let shared = Rc::clone(&self.shared);
        let limiter = Rc::clone(&self.limiter);
        let limiter = &*limiter;
        let mut failed = Vec::new();
        for effect in effects.drain(..) {
            match effect {
                Effect::Outcome { rule, outcome } => shared.metrics.outcome(rule, outcome),
                Effect::Bypassed => shared.metrics.bypassed(),
                Effect::Warn { rule, key } => {
                    let name = limiter.rule(rule).map_or("", |r| r.rule.name.as_str());
                    shared.warn(name, &key, host::now_us());
                }
                Effect::WarnShed { seat, reason } => {
                    if let Some(shedding) = limiter.policy().shedding.as_ref() {
                        let bulkhead = shedding.bulkheads.get(seat.bulkhead);
                        let class = shedding.classes.get(seat.class);
                        shared.warn_shed(
                            bulkhead.map_or("", |b| b.name.as_str()),
                            class.map_or("", |c| c.name.as_str()),
                            reason.name(),
                            host::now_us(),
                        );
                    }
                }
                Effect::Charged { rule, cost } => shared.metrics.charged(rule, cost),
                Effect::Announce { rule, key } => {
                    let forgotten = shared.announcer.announce(limiter, rule, key);
                    shared.metrics.sync_dropped(forgotten);
                }
                Effect::Hurry => {
                    if let Some(service) = limiter.policy().service.as_ref() {
                        if !shared.hurried.replace(true) {
                            proxy::hurry(&mut SharedData, host::now_us(), service.sync_interval_ms);
                        }
                    }
                }
                Effect::Check {
                    check,
                    mut request,
                    asks,
                } => {
                    if asks && !shared.proxy_id.is_empty() {
                        request.proxy = Some(shared.proxy_id.clone());
                    }
                    let sent = limiter
                        .policy()
                        .service
                        .as_ref()
                        .map(|service| callout::post(service, "/v1/check", &request));
                    match sent {
                        Some(Ok(token)) => {
                            shared.metrics.check_sent();
                            self.checks.insert(token, check);
                        }
                        _ => failed.push(check),
                    }
                }
                Effect::Admitted { seat, queued } => {
                    if let Some(shedder) = &shared.shedder {
                        shedder.admitted(seat, queued);
                    }
                }
                Effect::Shed {
                    seat,
                    reason,
                    would,
                } => {
                    if let Some(shedder) = &shared.shedder {
                        shedder.shed(seat, reason, would);
                    }
                }
                Effect::RequestHeader { name, value } => {
                    let _ =
                        hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value));
                }
                Effect::ClearRequestHeader { name } => {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, None);
                }
                Effect::Finished {
                    bulkhead,
                    latency_us,
                    status,
                    grpc_status,
                } => {
                    if let Some(shedder) = &shared.shedder {
                        shedder.finished(bulkhead, latency_us, status, grpc_status);
                    }
                }
                Effect::CheckFailed => {
                    shared.metrics.check_failed();
                    if let Some(service) = limiter.policy().service.as_ref() {
                        let state = proxy::read_state(&mut SharedData);
                        shared.publish(&state, service, host::now_us());
                    }
                }
            }
        }
        let mut step = None;
        for check in failed {
            let moment = self.moment();
            let (next, effects) =
                self.exchange
                    .answered(limiter, check, None, moment, &mut SharedData);
            step = self.carry_out(effects).or(next).or(step);
        }
        step
    }

    /// Turns core's step into the host's action.
    fn act(&mut self, step: Step) -> Action {
        match step {
            Step::Continue => Action::Continue,
            Step::Wait => Action::Pause,
            Step::Delay { until_us } => {
                self.shared.shaper.hold(self.id, until_us);
                Action::Pause
            }
            Step::Respond(reply) => {
                respond(&reply, self.limiter.policy());
                Action::Pause
            }
            Step::Queue {
                seat,
                level,
                wait_budget_us,
            } => {
                let shared = Rc::clone(&self.shared);
                let (Some(shedder), Some(shedding)) =
                    (&shared.shedder, self.limiter.policy().shedding.as_ref())
                else {
                    return Action::Continue;
                };
                let protocol = self.exchange.protocol();
                let now_us = host::now_us();
                if shedder.enqueue(shedding, self.id, seat, now_us, wait_budget_us, protocol) {
                    return Action::Pause;
                }
                // The queue is full and keeps its waiters: core sheds the request.
                let draw = host::draw(now_us);
                let shed = self
                    .exchange
                    .queue_full(&self.limiter, level, draw, &mut SharedData);
                let Some((seat, reply)) = shed else {
                    return Action::Continue;
                };
                shedder.shed(seat, ShedReason::QueueFull, false);
                respond(&reply, self.limiter.policy());
                Action::Pause
            }
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // The last chance to give the slot back, whatever the host called before.
        self.end();
    }
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        self.end();
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(check) = self.checks.remove(&token_id) else {
            return;
        };
        let answer = callout::answer::<CheckResponse>(num_headers, body_size).ok();
        let limiter = Rc::clone(&self.limiter);
        let moment = self.moment();
        let (step, effects) =
            self.exchange
                .answered(&limiter, check, answer, moment, &mut SharedData);
        let step = self.carry_out(effects).or(step);
        if let Some(step) = step {
            if self.act(step) == Action::Continue {
                let _ = hostcalls::resume_http_request();
            }
        }
    }
}

impl HttpContext for Request {
    fn on_log(&mut self) {
        self.end();
    }

    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let limiter = Rc::clone(&self.limiter);
        let mut request = self.read_request(&limiter);
        // Only bypassed address blocks ask for the address as an address: parsed only then.
        let client = match limiter.policy().bypass.cidrs.is_empty() {
            true => None,
            false => request.client_ip.as_deref().and_then(|ip| ip.parse().ok()),
        };
        let moment = self.moment();
        // The worker's vector for the effects, taken while in use (so a nested use takes an
        // empty one of its own) and given back with its room.
        let mut effects = self.shared.effects.take();
        let step = self.exchange.begin(
            &limiter,
            &mut request,
            client,
            moment,
            &mut SharedData,
            &mut effects,
        );
        let step = match self.carry_out_from(&mut effects) {
            // Every check failed to go out: the last one's answer is the step.
            Some(last) if step == Step::Wait && self.checks.is_empty() => last,
            _ => step,
        };
        self.shared.effects.replace(effects);
        self.act(step)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.resolve_wait();
        // Only a request that holds a bulkhead slot becomes a latency sample.
        if self.exchange.holds_slot() {
            let status = host::response_header(":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            self.exchange.responded(status, host::now_us());
            // A gRPC answer with no message (trailers-only) says its status here.
            if let Some(grpc_status) = host::response_header("grpc-status") {
                self.exchange.grpc_responded(&grpc_status);
            }
            // The upstream's own saturation report, from its response only.
            if let Some(name) = self.exchange.saturation_header(&self.limiter) {
                let report = host::response_header(name)
                    .and_then(|value| self.exchange.saturation_report(&self.limiter, &value));
                if let (Some((bulkhead, saturation)), Some(shedder)) =
                    (report, &self.shared.shedder)
                {
                    shedder.reported(bulkhead, saturation);
                }
            }
        }
        let limiter = Rc::clone(&self.limiter);
        // Rules that count by the answer (`count_when`): its status decides.
        if self.exchange.counts_by_status(&limiter) {
            let status = host::response_header(":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let effects =
                self.exchange
                    .response_status(&limiter, status, host::now_us(), &mut SharedData);
            let _ = self.carry_out(effects);
        }
        // What the upstream says this request cost, charged to the rules that count it.
        for name in self.exchange.cost_headers(&limiter) {
            if let Some(value) = host::response_header(name) {
                let effects = self.exchange.response_cost(
                    &limiter,
                    name,
                    &value,
                    host::now_us(),
                    &mut SharedData,
                );
                let _ = self.carry_out(effects);
            }
        }
        self.exchange
            .each_response_header(&limiter, &mut |header, value| {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, header, Some(value));
            });
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        // A gRPC answer's status, after its messages.
        if self.exchange.holds_slot() {
            if let Some(grpc_status) = host::response_trailer("grpc-status") {
                self.exchange.grpc_responded(&grpc_status);
            }
        }
        Action::Continue
    }
}
