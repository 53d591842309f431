//! What every request of a VM shares: the limiter, metric ids, the announcer, and what the last
//! tick learned about the counter service.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use sluice_core::policy::Service;
use sluice_core::sync::proxy::SyncState;
use sluice_core::{overrides, Effect, Limiter, Policy, Store};

use crate::announce::Announcer;
use crate::host::SharedData;
use crate::metrics::Metrics;
use crate::shaper::Shaper;
use crate::shedder::Shedder;

pub struct Shared {
    /// The limiter new requests use: the configured policy with the live overrides last
    /// heard. A request keeps the one it started with.
    limiter: RefCell<Rc<Limiter>>,
    /// The configured policy, before overrides, and the key tables' secret.
    base: (Policy, [u64; 2]),
    /// The version of the live overrides `limiter` was built with.
    overrides_version: Cell<u64>,
    /// The configured policy with the live overrides last applied (`None`: none applied), before
    /// the fleet-share fallbacks are sized.
    overridden: RefCell<Option<Policy>>,
    /// The proxies the fleet-share fallbacks of `limiter` are divided among, as the sync state
    /// had them (0: none heard, each rule's `assume_proxies`; always 0 without such a rule).
    fleet_proxies: Cell<u32>,
    pub metrics: Metrics,
    /// This proxy's id towards the counter service (empty without one), named in the checks
    /// of cached keys as in its syncs.
    pub proxy_id: String,
    /// Announces keys with unsynced counts to the worker that syncs.
    pub announcer: Announcer,
    /// The breaker is closed: leases and strict checks may be used.
    pub service_up: Cell<bool>,
    /// The service's emergency bypass override is on.
    pub bypass: Cell<bool>,
    /// This worker already asked for an early sync since its last tick.
    pub hurried: Cell<bool>,
    /// Load shedding's worker side, when configured.
    pub shedder: Option<Shedder>,
    /// Requests a leaky bucket holds until their slot.
    pub shaper: Shaper,
    /// When this worker last logged a warn rule's would-be denial, and how many it did not
    /// log since (one line a second per worker).
    pub warn_log: Cell<(u64, u64)>,
    /// The same for a warn bulkhead's would-be sheds (a line of its own, so that one kind does
    /// not silence the other).
    pub shed_warn_log: Cell<(u64, u64)>,
    /// The vector a request's effects are collected in, kept between requests (empty).
    pub effects: RefCell<Vec<Effect>>,
}

/// Least time between two warn log lines of one worker.
const WARN_LOG_EVERY_US: u64 = 1_000_000;

impl Shared {
    /// Logs that a warn rule would have denied `key`, at most once a second per worker (the
    /// lines it skips are counted in the next).
    pub fn warn(&self, rule: &str, key: &str, now_us: u64) {
        let Some(more) = throttled(&self.warn_log, now_us) else {
            return;
        };
        let shown: String = key
            .chars()
            .map(|c| {
                if c == sluice_core::limiter::key::SEPARATOR {
                    ':'
                } else {
                    c
                }
            })
            .filter(|c| !c.is_control())
            .collect();
        crate::host::log_warn(&format!(
            "sluice: rule {rule} (warn) would deny key {shown:?}{more}"
        ));
    }

    /// Logs that a warn bulkhead would have shed a request of `class` for `reason`, at most once
    /// a second per worker (the lines it skips are counted in the next). The names are the
    /// configuration's (a class header's value is only ever one of its class names).
    pub fn warn_shed(&self, bulkhead: &str, class: &str, reason: &str, now_us: u64) {
        let Some(more) = throttled(&self.shed_warn_log, now_us) else {
            return;
        };
        crate::host::log_warn(&format!(
            "sluice: bulkhead {bulkhead} (warn) would shed class {class} ({reason}){more}"
        ));
    }
}

/// Whether a line may be logged now (at most one a second per `log`): `Some` of what to add to
/// it (how many were skipped since the last), or `None` (skipped, and counted).
fn throttled(log: &Cell<(u64, u64)>, now_us: u64) -> Option<String> {
    let (last, skipped) = log.get();
    if last != 0 && now_us.saturating_sub(last) < WARN_LOG_EVERY_US {
        log.set((last, skipped + 1));
        return None;
    }
    log.set((now_us, 0));
    Some(if skipped > 0 {
        format!(" ({skipped} more since the last line)")
    } else {
        String::new()
    })
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        limiter: Limiter,
        secret: [u64; 2],
        metrics: Metrics,
        proxy_id: String,
        announcer: Announcer,
        shedder: Option<Shedder>,
    ) -> Shared {
        let base = (limiter.policy().clone(), secret);
        Shared {
            limiter: RefCell::new(Rc::new(limiter)),
            base,
            overrides_version: Cell::new(0),
            overridden: RefCell::new(None),
            fleet_proxies: Cell::new(0),
            metrics,
            proxy_id,
            announcer,
            service_up: Cell::new(true),
            bypass: Cell::new(false),
            hurried: Cell::new(false),
            shedder,
            shaper: Default::default(),
            warn_log: Cell::new((0, 0)),
            shed_warn_log: Cell::new((0, 0)),
            effects: RefCell::default(),
        }
    }

    /// The limiter for a new request.
    pub fn limiter(&self) -> Rc<Limiter> {
        Rc::clone(&self.limiter.borrow())
    }

    /// Applies the live overrides again when the ones in shared data changed (their version in
    /// the sync state): the configured policy with the overrides applied. What cannot apply is
    /// logged and left as configured. Returns whether the limiter must be built again.
    fn apply_overrides(&self, version: u64) -> bool {
        if version == self.overrides_version.get() {
            return false;
        }
        self.overrides_version.set(version);
        let (policy, _) = &self.base;
        let live = match SharedData.get(overrides::OVERRIDES_KEY) {
            Ok(Some((bytes, _))) => overrides::decode(&bytes),
            _ => None,
        };
        let Some(live) = live else {
            return false;
        };
        let (overridden, problems) = overrides::apply(policy, &live);
        let bulkheads = live
            .limits
            .keys()
            .filter(|t| t.starts_with(overrides::BULKHEAD_PREFIX))
            .count();
        for problem in problems.iter().take(overrides::MAX_LOGGED_PROBLEMS) {
            crate::host::log_warn(&format!("sluice: live override not applied: {problem}"));
        }
        if problems.len() > overrides::MAX_LOGGED_PROBLEMS {
            crate::host::log_warn(&format!(
                "sluice: live overrides: {} more not applied",
                problems.len() - overrides::MAX_LOGGED_PROBLEMS
            ));
        }
        self.metrics.overrides_not_applied(problems.len());
        *self.overridden.borrow_mut() = Some(overridden);
        let _ = proxy_wasm::hostcalls::log(
            proxy_wasm::types::LogLevel::Info,
            &format!(
                "sluice: live overrides version {version} applied ({} limit(s), {} bulkhead(s), {} key rule(s))",
                live.limits.len() - bulkheads,
                bulkheads,
                live.keys.len()
            ),
        );
        true
    }

    /// Whether the fleet-share fallbacks must be sized again: the count in the sync state is not
    /// the one `limiter` was built with (never without a fleet-share rule).
    fn count_fleet(&self, proxies: u32) -> bool {
        if !self.base.0.fleet_share() || proxies == self.fleet_proxies.get() {
            return false;
        }
        self.fleet_proxies.set(proxies);
        self.metrics.fleet_proxies(proxies);
        let _ = proxy_wasm::hostcalls::log(
            proxy_wasm::types::LogLevel::Info,
            &format!("sluice: fleet-share fallbacks divided among {proxies} proxies"),
        );
        true
    }

    /// Builds the limiter again from the configured policy, the live overrides last applied and
    /// the fleet's count. A rule keeps its table while its layout does (new numbers read its
    /// counts; a share never changes a layout); another layout counts in the rule's one table
    /// for overridden layouts ([`Limiter::with_overrides`]), so overrides never add more than one
    /// table a rule.
    fn rebuild(&self) {
        let (configured, secret) = &self.base;
        let mut policy = match &*self.overridden.borrow() {
            Some(overridden) => overridden.clone(),
            None => configured.clone(),
        };
        policy.size_to_fleet(self.fleet_proxies.get());
        let limiter = Limiter::with_overrides(policy, configured, *secret);
        prepare(&limiter);
        *self.limiter.borrow_mut() = Rc::new(limiter);
    }

    /// Publishes the proxy-wide sync state to this worker's requests.
    pub fn publish(&self, state: &SyncState, service: &Service, now_us: u64) {
        let overridden = self.apply_overrides(state.overrides_version);
        if self.count_fleet(state.fleet_proxies) | overridden {
            self.rebuild();
        }
        let breaker = state.breaker.state(service.breaker_failures, now_us);
        self.service_up
            .set(state.breaker.service_up(service.breaker_failures, now_us));
        self.bypass.set(state.bypass);
        self.hurried.set(false);
        self.metrics.breaker(breaker);
        if let Some(shedder) = &self.shedder {
            shedder
                .fleet
                .set(state.fresh_fleet_level(service.sync_interval_ms, now_us));
        }
    }
}

/// Creates every set of every rule's key table, and every bulkhead's gauge and window, before
/// the first request.
///
/// proxy-wasm's compare-and-swap cannot create a key atomically (cas 0 writes unconditionally),
/// so two workers creating the same set at once could lose a count. The first VM to configure
/// (Envoy's main-thread VM, before any worker serves) creates them all; later VMs find them.
pub fn prepare(limiter: &Limiter) {
    let mut store = SharedData;
    for rule in limiter.rules() {
        let table = rule.table;
        if matches!(store.get(&table.set_key_at(0)), Ok(Some(_))) {
            continue;
        }
        for set in 0..table.sets() {
            let _ = store.set(&table.set_key_at(set), &[], 0);
        }
    }
    let bulkheads = limiter.policy().shedding.iter().flat_map(|s| &s.bulkheads);
    for key in bulkheads.flat_map(|b| [&b.gauge_key, &b.window_key]) {
        // A gauge left by an earlier configuration keeps its requests in flight.
        if !matches!(store.get(key), Ok(Some(_))) {
            let _ = store.set(key, &[], 0);
        }
    }
}

/// Stamps the key tables `limiter` uses in the proxy-wide registry, and empties the next sets of
/// a table no configuration stamped for the grace period ([`sluice_core::limit::registry`]): at most
/// [`sluice_core::limit::registry::SWEEP_BYTES`] of full sets (and one set more) per call. Returns the
/// prefixes of its tables the registry does not track (it is full), if it could read it.
pub fn keep_tables(limiter: &Limiter, now_us: u64) -> Option<Vec<String>> {
    use sluice_core::limit::registry::{InUse, Registry, REGISTRY_KEY};
    let in_use: Vec<InUse> = limiter
        .rules()
        .map(|r| InUse {
            prefix: r.table.prefix(),
            sets: r.table.sets(),
            set_bytes: u32::try_from(r.table.set_bytes()).unwrap_or(u32::MAX),
        })
        .collect();
    let mut store = SharedData;
    let mut budget = sluice_core::limit::registry::SWEEP_BYTES;
    let mut stamp = true;
    let mut untracked = None;
    // Stale tables are emptied one claim at a time, up to a batch of bytes per call.
    for _ in 0..MAX_CLAIMS {
        let sweep = sluice_core::store::update(&mut store, REGISTRY_KEY, |bytes| {
            let mut registry = Registry::decode(bytes);
            let stamped = stamp && registry.stamp(&in_use, now_us);
            if stamp {
                untracked = Some(registry.untracked(&in_use));
            }
            let sweep = registry.claim(now_us, budget);
            let changed = stamped || sweep.is_some();
            if changed {
                *bytes = registry.encode();
            }
            (sweep, changed)
        });
        stamp = false;
        let Ok(Some(sweep)) = sweep else {
            break;
        };
        budget = budget.saturating_sub(sweep.bytes.max(1));
        empty(&mut store, &sweep);
        if budget == 0 {
            break;
        }
    }
    untracked.map(|prefixes| prefixes.into_iter().map(str::to_owned).collect())
}

/// Most registry claims of one [`keep_tables`] call.
const MAX_CLAIMS: usize = 16;

/// Overwrites the claimed sets of an old table with nothing.
fn empty(store: &mut SharedData, sweep: &sluice_core::limit::registry::Sweep) {
    let (mut emptied, mut kept) = (0u32, 0u32);
    let began = crate::host::now_us();
    for set in sweep.from..sweep.to {
        let key = format!("{}{set}", sweep.prefix);
        // Overwritten only if nobody wrote it between the read and the write: a late writer's
        // record is left as it is (and counted below).
        match store.get(&key) {
            Ok(Some((bytes, version))) if !bytes.is_empty() && version != 0 => {
                match store.set(&key, &[], version) {
                    Ok(true) => emptied += 1,
                    _ => kept += 1,
                }
            }
            _ => {}
        }
    }
    let _ = proxy_wasm::hostcalls::log(
        proxy_wasm::types::LogLevel::Info,
        &format!(
            "sluice: old key table {} unused: sets {}..{} emptied ({} held records, {} written meanwhile left) in {} µs{}",
            sweep.prefix,
            sweep.from,
            sweep.to,
            emptied,
            kept,
            crate::host::now_us().saturating_sub(began),
            if sweep.last { ", done" } else { "" },
        ),
    );
}
