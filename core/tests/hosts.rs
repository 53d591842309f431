//! `host`: what a configuration may ask depends on the proxy it runs in. nginx with
//! ngx_wasm_module cannot resume a request the filter holds, so a wait queue or a leaky bucket
//! would hold requests until their clients give up; it dispatches to an address, Envoy to a
//! cluster. Each refusal names its field, and a live override passes the same check.

use serde_json::json;
use sluice_core::overrides::check_limits;
use sluice_core::policy::Host;

fn field(json: serde_json::Value) -> String {
    sluice_core::parse(json.to_string().as_bytes())
        .expect_err("refused")
        .field
}

fn local_rule() -> serde_json::Value {
    json!({"name": "api", "key": ["client_ip"], "limits": [{"requests": 10, "per": "second"}]})
}

#[test]
fn the_host_is_envoy_unless_it_says_nginx_and_nothing_else_is_taken() {
    let policy =
        sluice_core::parse(json!({"rules": [local_rule()]}).to_string().as_bytes()).unwrap();
    assert_eq!(policy.host, Host::Envoy);
    let policy = sluice_core::parse(
        json!({"host": "nginx", "rules": [local_rule()]})
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(policy.host, Host::Nginx);
    for bad in [
        json!("NGINX"),
        json!(""),
        json!("apache"),
        json!("nginx\n"),
        json!(1),
        json!(null),
    ] {
        let config = json!({"host": bad, "rules": [local_rule()]});
        if bad.is_null() {
            assert!(sluice_core::parse(config.to_string().as_bytes()).is_ok());
            continue;
        }
        let error = sluice_core::parse(config.to_string().as_bytes()).unwrap_err();
        assert_eq!(error.field, "host", "{bad}: {error}");
        assert!(!error.to_string().contains('\n'), "one line: {error}");
    }
}

#[test]
fn each_host_names_the_service_its_own_way() {
    let rule = json!({"name": "api", "key": ["client_ip"], "consistency": "cached",
                      "limits": [{"requests": 10, "per": "second"}]});
    assert_eq!(
        field(json!({"host": "nginx", "service": {"cluster": "sluice_service"}, "rules": [rule]})),
        "service.cluster"
    );
    assert_eq!(
        field(json!({"service": {"address": "127.0.0.1:8081"}, "rules": [rule]})),
        "service.address"
    );
    assert_eq!(
        field(json!({"host": "envoy", "service": {"address": "127.0.0.1:8081"}, "rules": [rule]})),
        "service.address"
    );
    for ok in [
        json!({"host": "nginx", "service": {"address": "127.0.0.1:8081"}, "rules": [rule]}),
        json!({"service": {"cluster": "sluice_service"}, "rules": [rule]}),
    ] {
        sluice_core::parse(ok.to_string().as_bytes()).unwrap();
    }
}

#[test]
fn nginx_refuses_what_would_hold_a_request_it_cannot_resume() {
    let queue = json!({"shedding": {"bulkheads": [
        {"name": "a", "limit": {"static": 4}},
        {"name": "b", "limit": {"static": 4}, "queue": {"size": 8, "max_wait_ms": 100}}]}});
    let mut nginx = queue.clone();
    nginx["host"] = json!("nginx");
    let error = sluice_core::parse(nginx.to_string().as_bytes()).unwrap_err();
    assert_eq!(error.field, "shedding.bulkheads[1].queue");
    assert!(error.problem.contains("nginx"), "{error}");
    sluice_core::parse(queue.to_string().as_bytes()).unwrap();
    // A bulkhead without a queue is fine in nginx: a request with no slot is shed at once.
    let shed = json!({"host": "nginx", "shedding": {"bulkheads": [{"name": "a", "limit": {"static": 4}}]}});
    sluice_core::parse(shed.to_string().as_bytes()).unwrap();

    let shaped = |host: &str| {
        json!({"host": host, "rules": [local_rule(), {"name": "shaped", "key": ["client_ip"],
            "limits": [{"requests": 100, "per": "minute", "algorithm": "leaky_bucket"},
                       {"requests": 10, "per": "second", "algorithm": "leaky_bucket"}]}]})
    };
    let error = sluice_core::parse(shaped("nginx").to_string().as_bytes()).unwrap_err();
    assert_eq!(error.field, "rules[1].limits[0].algorithm");
    assert!(error.problem.contains("nginx"), "{error}");
    sluice_core::parse(shaped("envoy").to_string().as_bytes()).unwrap();
    // The same rate as gcra denies instead of delaying: nginx takes it.
    let gcra = json!({"host": "nginx", "rules": [{"name": "r", "key": ["client_ip"],
        "limits": [{"requests": 10, "per": "second", "algorithm": "gcra"}]}]});
    sluice_core::parse(gcra.to_string().as_bytes()).unwrap();
}

#[test]
fn a_live_override_cannot_bring_a_leaky_bucket_into_nginx() {
    let policy = |host: &str| {
        sluice_core::parse(
            json!({"host": host, "rules": [local_rule()]})
                .to_string()
                .as_bytes(),
        )
        .unwrap()
    };
    let limits = [json!({"requests": 5, "per": "second", "algorithm": "leaky_bucket"})];
    let error = check_limits(&policy("nginx"), "api", &limits, "target", "limits").unwrap_err();
    assert_eq!(error.field, "limits[0].algorithm", "{error}");
    assert!(error.problem.contains("nginx"), "{error}");
    check_limits(&policy("envoy"), "api", &limits, "target", "limits").unwrap();
}
