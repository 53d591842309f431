//! Parsing and validating the `shedding` section. Every error names its field.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{err, matcher, ConfigError, RawMatch};
use crate::shed::policy::{
    default_classes, Adaptive, Bulkhead, Class, Curve, Drop, Levels, LimitKind, QueuePolicy,
    ShedMode, Shedding, SuccessRate,
};

/// Load shedding: bulkheads that bound the requests in flight, shed by class and load.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Shedding")
)]
pub(crate) struct RawShedding {
    /// The default of every bulkhead's mode: enforce (the default); monitor: shed nothing, count what would be shed; warn: as monitor, say so in headers and log a line.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["monitor", "warn", "enforce", null])))]
    mode: Option<String>,
    /// The request header naming the class (only a trusted filter may set it); none: every request is of default_class.
    #[serde(default)]
    class_header: Option<String>,
    /// The class of requests without a (known) class (default basic).
    #[serde(default)]
    default_class: Option<String>,
    /// Name → threshold; `null` never sheds. Merged over the defaults.
    #[serde(default)]
    classes: BTreeMap<String, Option<f64>>,
    /// Classes by route for requests the class header does not name; the first match wins.
    #[serde(default)]
    class_routes: Vec<RawClassRoute>,
    /// Exact paths never shed nor counted (default /healthz, /readyz, /livez).
    #[serde(default)]
    never_shed_paths: Option<Vec<String>>,
    /// The utilizations at which the degradation level becomes elevated, high, critical (default 0.7, 0.85, 0.95).
    #[serde(default)]
    levels: Option<RawLevels>,
    /// The request header that tells the upstream the load level (default x-sluice-load-level; "" sends none).
    #[serde(default)]
    degradation_header: Option<String>,
    /// Whether the fleet level from the counter service counts (default true; needs service).
    #[serde(default)]
    fleet: Option<bool>,
    /// How far above a bulkhead's own smoothed utilization the fleet level is believed, 0 to 1 (default 0.3; 1 believes it fully).
    #[serde(default)]
    fleet_margin: Option<f64>,
    /// The base of Retry-After on a 503, in seconds (1 to 3600; default 1).
    #[serde(default)]
    retry_after_s: Option<u64>,
    /// The bulkheads: a request belongs to the first whose match it matches. At least one, at most 64.
    bulkheads: Vec<RawBulkhead>,
    /// Class name → its guaranteed share of every bulkhead's limit (0.01 to 1; the shares add up to 1 at most). A request of a class under its share is never shed for concurrency or priority, even with the bulkhead full, as in Netflix's partitioned limiter.
    #[serde(default)]
    guaranteed: BTreeMap<String, f64>,
}

/// A class for the requests of a route.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "ClassRoute")
)]
struct RawClassRoute {
    /// The route's requests.
    #[serde(rename = "match")]
    matcher: RawMatch,
    /// Their class: a name in classes.
    class: String,
}

/// Utilizations (in flight / limit, 0.01 to 1) at which the degradation level rises, in order.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Levels")
)]
struct RawLevels {
    /// The utilization at which the level becomes elevated.
    elevated: f64,
    /// The utilization at which the level becomes high (expensive routes are shed first).
    high: f64,
    /// The utilization at which the level becomes critical.
    critical: f64,
}

/// A bulkhead: at most so many requests of its match in flight.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Bulkhead")
)]
struct RawBulkhead {
    /// Unique; 1 to 64 of a-z A-Z 0-9 - _ . Names the metrics.
    name: String,
    /// Which requests the bulkhead governs (none: every request).
    #[serde(default, rename = "match")]
    matcher: Option<RawMatch>,
    /// The limit of requests in flight: static or adaptive.
    limit: RawLimit,
    /// Requests that wait for a slot instead of an immediate 503 (none: 503 at once).
    #[serde(default)]
    queue: Option<RawQueue>,
    /// The deadline, in milliseconds, of requests that carry none of their own.
    #[serde(default)]
    timeout_ms: Option<u64>,
    /// Rejection by the recent success rate, as Envoy's admission_control.
    #[serde(default)]
    success_rate: Option<RawSuccessRate>,
    /// Matchers of the routes shed from level high on, before any class is.
    #[serde(default)]
    expensive: Vec<RawMatch>,
    /// This bulkhead's mode (default: the shedding's mode): enforce; monitor: shed nothing, count what would be shed; warn: as monitor, say so in headers and log a line.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["monitor", "warn", "enforce", null])))]
    mode: Option<String>,
    /// In enforce mode, the share of would-be sheds actually shed, in percent (0 to 100; default 100).
    #[serde(default)]
    ramp_percent: Option<u8>,
    /// This bulkhead's thresholds of some classes (name → threshold, null never sheds), over the shedding's; only classes the shedding has.
    #[serde(default)]
    classes: BTreeMap<String, Option<f64>>,
    /// A probabilistic shedding curve: below its class's threshold, a request of a class that can be shed is shed at random with the curve's share at the utilization (1 to 8 points, increasing; none below the first, interpolated between them, the last's above).
    #[serde(default)]
    curve: Option<Vec<RawCurvePoint>>,
    /// The response header in which the upstream reports its own saturation, a utilization as 0.85 or 85%; it counts as the bulkhead's utilization when higher, and at the critical level shrinks an adaptive limit. Only the upstream's response is read; a value that does not parse is ignored.
    #[serde(default)]
    saturation_header: Option<String>,
}

/// A point of a shedding curve: shed this share at this utilization.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "CurvePoint")
)]
struct RawCurvePoint {
    /// The utilization (in flight / limit, 0.01 to 1).
    at: f64,
    /// The share of requests shed there (0 to 1).
    shed: f64,
}

/// A live override of one bulkhead (the admin API's `PUT /admin/v1/overrides/bulkheads/NAME`):
/// what it gives replaces the bulkhead's, checked as the configuration checks it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBulkheadOverride {
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    ramp_percent: Option<u8>,
    #[serde(default)]
    limit: Option<RawLimit>,
    #[serde(default)]
    classes: BTreeMap<String, Option<f64>>,
}

/// A bulkhead's limit of requests in flight.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "BulkheadLimit")
)]
enum RawLimit {
    /// At most this many requests in flight (1 to 1000000).
    Static(u32),
    /// A limit that follows the upstream's latency.
    Adaptive(RawAdaptive),
}

/// An adaptive limit: it follows the upstream's latency between min and max.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "AdaptiveLimit")
)]
struct RawAdaptive {
    /// The lowest limit.
    min: u32,
    /// The highest limit.
    max: u32,
    /// The limit at start (default 20, within min and max).
    #[serde(default)]
    initial: Option<u32>,
    /// How far above its no-load latency the upstream may answer before the limit shrinks, as a factor (1.05 to 10; default 1.5).
    #[serde(default)]
    tolerance: Option<f64>,
    /// How often the limit moves toward the measured latency, in milliseconds (10 to 60000; default 100).
    #[serde(default)]
    window_ms: Option<u64>,
    /// How often the no-load latency is measured again by holding the limit at min, in milliseconds (0: never; default 30000). It is also measured again after 5 busy windows in a row at min.
    #[serde(default)]
    probe_interval_ms: Option<u64>,
    /// The latency percentile the controller measures, each window's and the no-load one (0 to 100; default 90, as Envoy's adaptive_concurrency; 0: the mean).
    #[serde(default)]
    percentile: Option<f64>,
}

/// Requests that wait for a slot instead of an immediate 503.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Queue")
)]
struct RawQueue {
    /// How many requests per worker may wait (1 to 10000).
    size: u32,
    /// The longest a request waits, in milliseconds (1 to 60000).
    max_wait_ms: u64,
    /// Which request a full queue refuses: oldest (pushes out its oldest waiter; the default) or newest (refuses the arrival).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["oldest", "newest", null])))]
    drop: Option<String>,
}

/// Rejection by the recent success rate (status below 500), as Envoy's admission_control.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "SuccessRate")
)]
struct RawSuccessRate {
    /// The success rate below which requests are rejected (0.01 to 1; default 0.95).
    #[serde(default)]
    threshold: Option<f64>,
    /// How steeply rejection grows (0.1 to 10; default 1).
    #[serde(default)]
    aggression: Option<f64>,
    /// Requests in the window below which nothing is rejected (default 20).
    #[serde(default)]
    min_requests: Option<u32>,
    /// The window successes fade over, in milliseconds (100 to 600000; default 10000).
    #[serde(default)]
    window_ms: Option<u64>,
    /// The highest rejection probability, so the upstream is still probed (0 to 1; default 0.95).
    #[serde(default)]
    max_rejection: Option<f64>,
}

/// Paths never shed unless the configuration says otherwise: the usual health checks.
pub const DEFAULT_NEVER_SHED: [&str; 3] = ["/healthz", "/readyz", "/livez"];
pub const DEFAULT_DEGRADATION_HEADER: &str = "x-sluice-load-level";
/// How far above its own utilization a bulkhead believes the fleet level by default: enough for
/// the imbalance load balancing leaves between proxies, while a lie (anyone holding a proxy
/// credential can report 1.0) sheds no class of the defaults (lowest threshold 0.7) on a proxy
/// below 40% of its limit, and never moves a proxy's level more than 0.3 above its own.
pub const DEFAULT_FLEET_MARGIN: f64 = 0.3;

fn in_range(field: &str, value: f64, low: f64, high: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value >= low && value <= high {
        Ok(value)
    } else {
        Err(err(
            field,
            format!("must be between {low} and {high}, got {value}"),
        ))
    }
}

fn int_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    value: T,
    low: T,
    high: T,
) -> Result<T, ConfigError> {
    if value >= low && value <= high {
        Ok(value)
    } else {
        Err(err(
            field,
            format!("must be between {low} and {high}, got {value}"),
        ))
    }
}

/// A lower-case HTTP header name.
fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
    if ok {
        Ok(name.to_ascii_lowercase())
    } else {
        Err(err(
            field,
            format!("must be an HTTP header name such as x-priority, got {name:?}"),
        ))
    }
}

fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

fn shed_mode(field: &str, mode: &str) -> Result<ShedMode, ConfigError> {
    match mode {
        "monitor" => Ok(ShedMode::Monitor),
        "warn" => Ok(ShedMode::Warn),
        "enforce" => Ok(ShedMode::Enforce),
        other => Err(err(
            field,
            format!("expected one of monitor, warn, enforce, got {other:?}"),
        )),
    }
}

/// A ramp of `mode`: 0 to 100, and only of an enforce mode (as a rule's).
fn ramp(field: &str, ramp_percent: Option<u8>, mode: ShedMode) -> Result<u8, ConfigError> {
    match ramp_percent {
        None => Ok(100),
        Some(p) if p > 100 => Err(err(field, format!("must be between 0 and 100, got {p}"))),
        Some(_) if mode != ShedMode::Enforce => Err(err(
            field,
            "ramps an enforce bulkhead (the share of would-be sheds it sheds); this bulkhead does not enforce",
        )),
        Some(p) => Ok(p),
    }
}

/// A bulkhead's own thresholds over the shedding's `classes`: only classes the shedding has
/// (each is a waiting count in the bulkhead's shared gauge, so none is added here).
fn thresholds(
    at: &str,
    classes: &[Class],
    own: BTreeMap<String, Option<f64>>,
    mut thresholds: Vec<Option<f64>>,
) -> Result<Vec<Option<f64>>, ConfigError> {
    for (name, threshold) in own {
        let field = format!("{at}.{name}");
        let Some(id) = classes.iter().position(|c| c.name == name) else {
            let names: Vec<&str> = classes.iter().map(|c| c.name.as_str()).collect();
            return Err(err(
                field,
                format!(
                    "{name:?} is not a class of shedding.classes ({}); a bulkhead sets the thresholds of those only",
                    names.join(", ")
                ),
            ));
        };
        let threshold = threshold
            .map(|t| in_range(&field, t, 0.01, 1.0))
            .transpose()?;
        if let Some(slot) = thresholds.get_mut(id) {
            *slot = threshold;
        }
    }
    Ok(thresholds)
}

pub(crate) fn shedding(raw: RawShedding) -> Result<Shedding, ConfigError> {
    let mode = shed_mode("shedding.mode", raw.mode.as_deref().unwrap_or("enforce"))?;
    let class_header = raw
        .class_header
        .as_deref()
        .map(|h| header_name("shedding.class_header", h))
        .transpose()?;

    let mut classes = default_classes();
    for (name, threshold) in raw.classes {
        let at = format!("shedding.classes.{name}");
        if !name_ok(&name) {
            return Err(err(
                at,
                "a class name must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.'",
            ));
        }
        let threshold = threshold.map(|t| in_range(&at, t, 0.01, 1.0)).transpose()?;
        match classes.iter_mut().find(|c| c.name == name) {
            Some(class) => class.threshold = threshold,
            None => classes.push(Class { name, threshold }),
        }
    }
    if classes.len() > 32 {
        return Err(err("shedding.classes", "at most 32 classes"));
    }
    let default_name = raw.default_class.unwrap_or_else(|| "basic".into());
    let Some(default_class) = classes.iter().position(|c| c.name == default_name) else {
        let names: Vec<&str> = classes.iter().map(|c| c.name.as_str()).collect();
        return Err(err(
            "shedding.default_class",
            format!(
                "{default_name:?} is not a class; the classes are {}",
                names.join(", ")
            ),
        ));
    };

    let mut class_routes = Vec::with_capacity(raw.class_routes.len());
    for (i, route) in raw.class_routes.into_iter().enumerate() {
        let at = format!("shedding.class_routes[{i}]");
        let matched = matcher(&format!("{at}.match"), Some(route.matcher))?;
        let Some(class) = classes.iter().position(|c| c.name == route.class) else {
            return Err(err(
                format!("{at}.class"),
                format!("{:?} is not a class", route.class),
            ));
        };
        class_routes.push((matched, class));
    }

    let never_shed_paths = match raw.never_shed_paths {
        None => DEFAULT_NEVER_SHED.iter().map(|p| p.to_string()).collect(),
        Some(paths) => {
            for (i, path) in paths.iter().enumerate() {
                if !path.starts_with('/') {
                    return Err(err(
                        format!("shedding.never_shed_paths[{i}]"),
                        format!("must start with '/', got {path:?}"),
                    ));
                }
            }
            paths
        }
    };

    let levels = match raw.levels {
        None => Levels::default(),
        Some(l) => {
            let elevated = in_range("shedding.levels.elevated", l.elevated, 0.01, 1.0)?;
            let high = in_range("shedding.levels.high", l.high, elevated, 1.0)?;
            let critical = in_range("shedding.levels.critical", l.critical, high, 1.0)?;
            Levels {
                elevated,
                high,
                critical,
            }
        }
    };

    let degradation_header = match raw.degradation_header.as_deref() {
        None => Some(DEFAULT_DEGRADATION_HEADER.to_string()),
        Some("") => None,
        Some(h) => Some(header_name("shedding.degradation_header", h)?),
    };
    let fleet_margin = in_range(
        "shedding.fleet_margin",
        raw.fleet_margin.unwrap_or(DEFAULT_FLEET_MARGIN),
        0.0,
        1.0,
    )?;
    let retry_after_s = int_range(
        "shedding.retry_after_s",
        raw.retry_after_s.unwrap_or(1),
        1,
        3_600,
    )?;

    let mut guaranteed = Vec::new();
    if !raw.guaranteed.is_empty() {
        guaranteed = vec![0.0; classes.len()];
        let mut total = 0.0;
        for (name, share) in &raw.guaranteed {
            let field = format!("shedding.guaranteed.{name}");
            let Some(id) = classes.iter().position(|c| &c.name == name) else {
                return Err(err(field, format!("{name:?} is not a class")));
            };
            let share = in_range(&field, *share, 0.01, 1.0)?;
            total += share;
            if let Some(slot) = guaranteed.get_mut(id) {
                *slot = share;
            }
        }
        if total > 1.0 + 1e-9 {
            return Err(err(
                "shedding.guaranteed",
                format!("the shares add up to {total}, more than the whole limit (1)"),
            ));
        }
    }
    if raw.bulkheads.is_empty() {
        return Err(err("shedding.bulkheads", "must hold at least one bulkhead"));
    }
    if raw.bulkheads.len() > 64 {
        return Err(err("shedding.bulkheads", "at most 64 bulkheads"));
    }
    let mut bulkheads: Vec<Bulkhead> = Vec::with_capacity(raw.bulkheads.len());
    for (i, b) in raw.bulkheads.into_iter().enumerate() {
        let b = bulkhead(&format!("shedding.bulkheads[{i}]"), b, mode, &classes)?;
        if bulkheads.iter().any(|other| other.name == b.name) {
            return Err(err(
                format!("shedding.bulkheads[{i}].name"),
                format!(
                    "{:?} is used by an earlier bulkhead; names must be unique",
                    b.name
                ),
            ));
        }
        bulkheads.push(b);
    }

    Ok(Shedding {
        mode,
        class_header,
        classes,
        class_routes,
        default_class,
        never_shed_paths,
        levels,
        degradation_header,
        fleet: raw.fleet.unwrap_or(true),
        fleet_margin,
        retry_after_s,
        bulkheads,
        docs_url: None,
        guaranteed,
    })
}

fn bulkhead(
    at: &str,
    raw: RawBulkhead,
    default_mode: ShedMode,
    classes: &[Class],
) -> Result<Bulkhead, ConfigError> {
    if !name_ok(&raw.name) {
        return Err(err(
            format!("{at}.name"),
            format!(
                "must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.', got {:?}",
                raw.name
            ),
        ));
    }
    let request_matcher = matcher(&format!("{at}.match"), raw.matcher)?;
    let limit = limit(&format!("{at}.limit"), raw.limit)?;
    let mode = match raw.mode.as_deref() {
        Some(m) => shed_mode(&format!("{at}.mode"), m)?,
        None => default_mode,
    };
    let ramp_percent = ramp(&format!("{at}.ramp_percent"), raw.ramp_percent, mode)?;
    let global: Vec<Option<f64>> = classes.iter().map(|c| c.threshold).collect();
    let thresholds = thresholds(&format!("{at}.classes"), classes, raw.classes, global)?;
    let queue = raw
        .queue
        .map(|q| {
            let size = int_range(&format!("{at}.queue.size"), q.size, 1, 10_000)?;
            let max_wait_ms =
                int_range(&format!("{at}.queue.max_wait_ms"), q.max_wait_ms, 1, 60_000)?;
            let drop = match q.drop.as_deref().unwrap_or("oldest") {
                "oldest" => Drop::Oldest,
                "newest" => Drop::Newest,
                other => {
                    return Err(err(
                        format!("{at}.queue.drop"),
                        format!("expected oldest or newest, got {other:?}"),
                    ))
                }
            };
            Ok(QueuePolicy {
                size,
                max_wait_ms,
                drop,
            })
        })
        .transpose()?;
    let timeout_ms = raw
        .timeout_ms
        .map(|t| int_range(&format!("{at}.timeout_ms"), t, 1, 3_600_000))
        .transpose()?;
    let success_rate = raw
        .success_rate
        .map(|s| {
            let field = |f: &str| format!("{at}.success_rate.{f}");
            Ok(SuccessRate {
                threshold: in_range(&field("threshold"), s.threshold.unwrap_or(0.95), 0.01, 1.0)?,
                aggression: in_range(&field("aggression"), s.aggression.unwrap_or(1.0), 0.1, 10.0)?,
                min_requests: int_range(
                    &field("min_requests"),
                    s.min_requests.unwrap_or(20),
                    1,
                    1_000_000,
                )?,
                window_ms: int_range(
                    &field("window_ms"),
                    s.window_ms.unwrap_or(10_000),
                    100,
                    600_000,
                )?,
                max_rejection: in_range(
                    &field("max_rejection"),
                    s.max_rejection.unwrap_or(0.95),
                    0.0,
                    1.0,
                )?,
            })
        })
        .transpose()?;
    let expensive = raw
        .expensive
        .into_iter()
        .enumerate()
        .map(|(j, m)| matcher(&format!("{at}.expensive[{j}]"), Some(m)))
        .collect::<Result<Vec<_>, _>>()?;
    let curve = raw
        .curve
        .map(|points| curve(&format!("{at}.curve"), points, &thresholds))
        .transpose()?;
    let saturation_header = raw
        .saturation_header
        .map(|h| header_name(&format!("{at}.saturation_header"), &h))
        .transpose()?;
    Ok(Bulkhead {
        curve,
        saturation_header,
        gauge_key: format!("sluice/shed/{}", raw.name),
        window_key: format!("sluice/shed/{}/window", raw.name),
        saturation_key: format!("sluice/shed/{}/saturation", raw.name),
        name: raw.name,
        matcher: request_matcher,
        limit,
        queue,
        timeout_ms,
        success_rate,
        expensive,
        mode,
        ramp_percent,
        thresholds,
    })
}

/// A bulkhead's shedding curve; `at` names it (`shedding.bulkheads[0].curve`).
fn curve(
    at: &str,
    raw: Vec<RawCurvePoint>,
    thresholds: &[Option<f64>],
) -> Result<Curve, ConfigError> {
    if raw.is_empty() || raw.len() > 8 {
        return Err(err(
            at,
            format!("must hold 1 to 8 points, got {}", raw.len()),
        ));
    }
    let mut points: Vec<(f64, f64)> = Vec::with_capacity(raw.len());
    for (i, p) in raw.iter().enumerate() {
        let field = |f: &str| format!("{at}[{i}].{f}");
        let point = (
            in_range(&field("at"), p.at, 0.01, 1.0)?,
            in_range(&field("shed"), p.shed, 0.0, 1.0)?,
        );
        if let Some(&(at_before, shed_before)) = points.last() {
            if point.0 <= at_before {
                return Err(err(
                    field("at"),
                    format!(
                        "must be above the point before's ({at_before}), got {}",
                        point.0
                    ),
                ));
            }
            if point.1 < shed_before {
                return Err(err(
                    field("shed"),
                    format!(
                        "must be at least the point before's ({shed_before}): more load never sheds less, got {}",
                        point.1
                    ),
                ));
            }
        }
        points.push(point);
    }
    if points.iter().all(|&(_, shed)| shed <= 0.0) {
        return Err(err(at, "sheds nothing: give some point a share above 0"));
    }
    if thresholds.iter().all(Option::is_none) {
        return Err(err(
            at,
            "every class of this bulkhead is never shed (null): the curve would shed nothing",
        ));
    }
    Ok(Curve { points })
}

/// A bulkhead's limit; `at` names it (`shedding.bulkheads[0].limit`).
fn limit(at: &str, raw: RawLimit) -> Result<LimitKind, ConfigError> {
    Ok(match raw {
        RawLimit::Static(n) => {
            LimitKind::Static(int_range(&format!("{at}.static"), n, 1, 1_000_000)?)
        }
        RawLimit::Adaptive(a) => {
            let field = |f: &str| format!("{at}.adaptive.{f}");
            let min = int_range(&field("min"), a.min, 1, 1_000_000)?;
            let max = int_range(&field("max"), a.max, min, 1_000_000)?;
            let initial = int_range(
                &field("initial"),
                a.initial.unwrap_or(20.clamp(min, max)),
                min,
                max,
            )?;
            let tolerance = in_range(&field("tolerance"), a.tolerance.unwrap_or(1.5), 1.05, 10.0)?;
            let window_ms = int_range(&field("window_ms"), a.window_ms.unwrap_or(100), 10, 60_000)?;
            let probe_interval_ms = a.probe_interval_ms.unwrap_or(30_000);
            if probe_interval_ms != 0 && probe_interval_ms < window_ms * 10 {
                return Err(err(
                    field("probe_interval_ms"),
                    format!(
                        "must be 0 (never probe) or at least 10 windows ({} ms), got {probe_interval_ms}",
                        window_ms * 10
                    ),
                ));
            }
            let percentile = in_range(
                &field("percentile"),
                a.percentile.unwrap_or(90.0),
                0.0,
                100.0,
            )?;
            LimitKind::Adaptive(Adaptive {
                min,
                max,
                initial,
                tolerance,
                window_ms,
                probe_interval_ms,
                percentile,
            })
        }
    })
}

/// The checks of a bulkhead override (`json`) that need no configuration, for a counter service
/// that was not given the proxies': its fields, the mode, the ramp's range (and of an enforce
/// mode, when it gives one), the limit's bounds, the thresholds' range and the class names' form.
/// The proxies check the rest ([`override_bulkhead`]) and leave out what fails.
pub fn check_bulkhead_override(json: &serde_json::Value) -> Result<(), ConfigError> {
    let raw: RawBulkheadOverride = serde_path_to_error::deserialize(json).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { "bulkhead".into() } else { path };
        err(field, e.into_inner().to_string())
    })?;
    if raw.mode.is_none()
        && raw.ramp_percent.is_none()
        && raw.limit.is_none()
        && raw.classes.is_empty()
    {
        return Err(err(
            "bulkhead",
            "give at least one of mode, ramp_percent, limit, classes",
        ));
    }
    if let Some(l) = raw.limit {
        limit("limit", l)?;
    }
    let mode = raw
        .mode
        .as_deref()
        .map(|m| shed_mode("mode", m))
        .transpose()?
        .unwrap_or(ShedMode::Enforce);
    ramp("ramp_percent", raw.ramp_percent, mode)?;
    for (name, threshold) in raw.classes {
        let field = format!("classes.{name}");
        if !name_ok(&name) {
            return Err(err(
                field,
                "a class name must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.'",
            ));
        }
        threshold
            .map(|t| in_range(&field, t, 0.01, 1.0))
            .transpose()?;
    }
    Ok(())
}

/// `bulkhead` with a live override (`json`, the admin API's format) applied, checked as the
/// configuration checks a bulkhead, every error naming its field under `at`
/// (`bulkheads.api.limit.static`): the mode, the ramp (of an enforce mode only), the limit
/// (static or adaptive, each bound), the thresholds of classes the shedding has (a class cannot
/// be added live: the shared gauge keeps a waiting count per class). What it does not give is
/// kept; a mode without a ramp is the whole mode.
pub fn override_bulkhead(
    shedding: &Shedding,
    bulkhead: &Bulkhead,
    json: &serde_json::Value,
    at: &str,
) -> Result<Bulkhead, ConfigError> {
    let field = |f: &str| {
        if at.is_empty() {
            f.to_string()
        } else {
            format!("{at}.{f}")
        }
    };
    let raw: RawBulkheadOverride = serde_path_to_error::deserialize(json).map_err(|e| {
        let path = e.path().to_string();
        let name = match path.as_str() {
            "." if at.is_empty() => "bulkhead".to_string(),
            "." => at.to_string(),
            seq if seq.starts_with('[') => format!("{at}{seq}"),
            _ => field(&path),
        };
        err(name, e.into_inner().to_string())
    })?;
    if raw.mode.is_none()
        && raw.ramp_percent.is_none()
        && raw.limit.is_none()
        && raw.classes.is_empty()
    {
        return Err(err(
            if at.is_empty() { "bulkhead" } else { at },
            "give at least one of mode, ramp_percent, limit, classes",
        ));
    }
    let mut out = bulkhead.clone();
    if let Some(limit) = raw.limit {
        out.limit = self::limit(&field("limit"), limit)?;
    }
    if let Some(mode) = raw.mode.as_deref() {
        out.mode = shed_mode(&field("mode"), mode)?;
        out.ramp_percent = 100;
    }
    if raw.ramp_percent.is_some() {
        out.ramp_percent = ramp(&field("ramp_percent"), raw.ramp_percent, out.mode)?;
    }
    out.thresholds = thresholds(
        &field("classes"),
        &shedding.classes,
        raw.classes,
        bulkhead.thresholds.clone(),
    )?;
    // As `curve` checks a configured bulkhead: a curve with no class left to shed sheds nothing.
    if out.curve.is_some() && out.thresholds.iter().all(Option::is_none) {
        return Err(err(
            field("classes"),
            "every class of this bulkhead is never shed (null): the curve would shed nothing",
        ));
    }
    Ok(out)
}
