//! Who and how much: key parts for verified users and networks, richer matching, tiers,
//! costs (static and reported by the response), staged rollout, key overrides and the honest
//! answer of a limiter that cannot decide.

use sluice_core::exchange::{Effect, Exchange, Moment, Step, WARN_HEADER};
use sluice_core::limiter::key::MISSING;
use sluice_core::protocol::KeyAction;
use sluice_core::request::query_values;
use sluice_core::{Decision, Limiter, MemoryStore, Outcome, PlainRequest, RequestView};

const T0: u64 = 1_795_996_800_000_000;

fn limiter(json: &str) -> Limiter {
    Limiter::new(sluice_core::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}: {json}")))
}

fn rule(body: &str) -> String {
    format!(r#"{{"rules": [{{"name": "api", {body}}}]}}"#)
}

/// The keys rule 0 builds for `request`.
fn keys(limiter: &Limiter, request: &mut PlainRequest) -> Vec<String> {
    let rule = limiter.policy().rules[0].clone();
    sluice_core::limiter::key::build(&rule, request)
        .into_iter()
        .map(|k| k.replace(sluice_core::limiter::key::SEPARATOR, ":"))
        .collect()
}

/// Admitted of `n` requests made by `make` at one moment.
fn admitted(
    limiter: &Limiter,
    store: &mut MemoryStore,
    n: usize,
    make: impl Fn() -> PlainRequest,
) -> usize {
    (0..n)
        .filter(|_| {
            let mut request = make();
            let (_, step, _) = Exchange::start(limiter, &mut request, None, Moment::at(T0), store);
            step == Step::Continue
        })
        .count()
}

#[test]
fn key_parts_read_verified_claims_queries_networks_and_the_first_present() {
    let l = limiter(&rule(
        r#""key": ["jwt:sub", "query:tenant"], "limits": [{"requests": 5, "per": "minute"}]"#,
    ));
    let mut r = PlainRequest::get("/x?tenant=a%20b&tenant=c").with_claim("sub", "alice");
    assert_eq!(keys(&l, &mut r), ["api:alice:a b", "api:alice:c"]);
    // No verified token: counted in the rule's missing bucket for that part.
    let mut anonymous = PlainRequest::get("/x?tenant=a");
    assert_eq!(keys(&l, &mut anonymous), ["api:\u{1e}missing:a"]);

    let l = limiter(&rule(
        r#""key": ["client_ip/24"], "limits": [{"requests": 5, "per": "minute"}]"#,
    ));
    let mut v4 = PlainRequest::get("/").from_ip("203.0.113.77");
    assert_eq!(keys(&l, &mut v4), ["api:203.0.113.0/24"]);
    let mut v6 = PlainRequest::get("/").from_ip("2001:db8:1:2:aaaa::1");
    assert_eq!(
        keys(&l, &mut v6),
        ["api:2001:db8:1:2::/64"],
        "one host's /64 is one key"
    );
    let mut mapped = PlainRequest::get("/").from_ip("::ffff:203.0.113.9");
    assert_eq!(keys(&l, &mut mapped), ["api:203.0.113.0/24"]);

    let l = limiter(&rule(
        r#""key": ["jwt:sub|client_ip"], "limits": [{"requests": 5, "per": "minute"}]"#,
    ));
    let mut user = PlainRequest::get("/")
        .from_ip("192.0.2.1")
        .with_claim("sub", "alice");
    assert_eq!(keys(&l, &mut user), ["api:jwt:sub=alice"]);
    let mut anonymous = PlainRequest::get("/").from_ip("192.0.2.1");
    assert_eq!(keys(&l, &mut anonymous), ["api:client_ip=192.0.2.1"]);
    // A user named like an address never shares the address's bucket.
    let mut tricky = PlainRequest::get("/")
        .from_ip("192.0.2.1")
        .with_claim("sub", "192.0.2.1");
    assert_ne!(keys(&l, &mut tricky), keys(&l, &mut anonymous));
}

#[test]
fn matchers_take_exact_paths_templates_hosts_headers_networks_and_methods() {
    let l = limiter(&rule(
        r#""match": {"path_templates": ["/users/{id}/export"], "methods": ["post"], "hosts": ["*.example.com"],
            "headers": {"x-internal": false, "x-env": "prod"}, "client_cidrs": ["192.0.2.0/24"]},
           "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]"#,
    ));
    let base = || {
        let mut r = PlainRequest::get("/users/42/export")
            .from_ip("192.0.2.9")
            .with_header(":authority", "API.example.com:443")
            .with_header("x-env", "prod");
        r.method = "POST".into();
        r
    };
    let applies = |mut r: PlainRequest| l.policy().rules[0].applies(&mut r);
    assert!(applies(base()));
    let mut get = base();
    get.method = "GET".into();
    assert!(!applies(get), "method");
    let mut other = base();
    other.path = "/users/42/import".into();
    assert!(!applies(other), "template");
    assert!(
        !applies(base().with_header("x-internal", "1")),
        "a header that must be absent"
    );
    let mut staging = base();
    staging.headers.retain(|(n, _)| n != "x-env");
    assert!(
        !applies(staging.with_header("x-env", "staging")),
        "header value"
    );
    assert!(!applies(base().from_ip("198.51.100.1")), "client network");
    let mut host = base();
    host.headers.retain(|(n, _)| n != ":authority");
    assert!(
        !applies(host.with_header(":authority", "example.com")),
        "host"
    );

    let exact = limiter(&rule(
        r#""match": {"paths": ["/login"]}, "key": ["const:all"], "limits": [{"requests": 1, "per": "minute"}]"#,
    ));
    let applies = |mut r: PlainRequest| exact.policy().rules[0].applies(&mut r);
    assert!(applies(PlainRequest::get("/login?next=/")));
    assert!(
        applies(PlainRequest::get("/./login")),
        "the normalized path matches too"
    );
    assert!(!applies(PlainRequest::get("/login/x")));
}

const TIERS: &str = r#""key": ["jwt:sub"], "tiers": {"from": "jwt:plan", "default": "free",
    "limits": {"free": [{"requests": 2, "per": "minute"}], "pro": [{"requests": 5, "per": "minute"}]}}"#;

#[test]
fn tiers_give_each_plan_its_limits_and_unknown_or_missing_plans_the_default() {
    let l = limiter(&rule(TIERS));
    let names: Vec<&str> = l.policy().rules.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["api/free", "api/pro"]);
    let mut store = MemoryStore::default();
    let user = |sub: &str, plan: Option<&str>| {
        let mut r = PlainRequest::get("/").with_claim("sub", sub);
        if let Some(plan) = plan {
            r = r.with_claim("plan", plan);
        }
        r
    };
    assert_eq!(admitted(&l, &mut store, 10, || user("a", Some("pro"))), 5);
    assert_eq!(admitted(&l, &mut store, 10, || user("b", Some("free"))), 2);
    assert_eq!(
        admitted(&l, &mut store, 10, || user("c", Some("platinum"))),
        2,
        "unknown: default"
    );
    assert_eq!(
        admitted(&l, &mut store, 10, || user("d", None)),
        2,
        "missing: default"
    );
    // The headers describe the tier's policy.
    let mut request = user("e", Some("pro"));
    let (mut exchange, _, _) = Exchange::start(&l, &mut request, None, Moment::at(T0), &mut store);
    let headers = exchange.response_headers(&l);
    assert!(
        headers
            .iter()
            .any(|(n, v)| n.eq_ignore_ascii_case("x-ratelimit-limit") && v == "5")
            || headers.iter().any(|(_, v)| v.contains("api/pro")),
        "{headers:?}"
    );
}

#[test]
fn a_static_cost_spends_that_many_tokens() {
    let l = limiter(&rule(
        r#""key": ["const:all"], "cost": 10, "limits": [{"requests": 25, "per": "minute"}]"#,
    ));
    let mut store = MemoryStore::default();
    assert_eq!(
        admitted(&l, &mut store, 5, || PlainRequest::get("/export")),
        2
    );
}

#[test]
fn a_cost_the_response_reports_is_charged_and_the_next_requests_wait_for_the_debt() {
    let l = limiter(&rule(
        r#""key": ["header:x-user"], "cost_header": "x-tokens-used", "limits": [{"requests": 100, "per": "minute"}]"#,
    ));
    let mut store = MemoryStore::default();
    let mut request = PlainRequest::get("/llm").with_header("x-user", "alice");
    let (mut exchange, step, _) =
        Exchange::start(&l, &mut request, None, Moment::at(T0), &mut store);
    assert_eq!(step, Step::Continue);
    assert_eq!(exchange.cost_headers(&l), ["x-tokens-used"]);
    let effects = exchange.response_cost(&l, "x-tokens-used", "150", T0 + 10, &mut store);
    assert!(effects.contains(&Effect::Charged {
        rule: sluice_core::policy::RuleId::new(0),
        cost: 150
    }));
    // 1 + 150 of 100: in debt by 51 tokens, repaid at 100 a minute (about 31 s).
    let mut at = |t: u64| {
        let mut r = PlainRequest::get("/llm").with_header("x-user", "alice");
        let (_, step, _) = Exchange::start(&l, &mut r, None, Moment::at(t), &mut store);
        step
    };
    match at(T0 + 1_000_000) {
        Step::Respond(reply) => {
            assert_eq!(reply.status, 429);
            let retry: u64 = reply
                .headers
                .iter()
                .find(|(n, _)| *n == "retry-after")
                .unwrap()
                .1
                .parse()
                .unwrap();
            assert!((30..=32).contains(&retry), "retry-after {retry}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(at(T0 + 33_000_000), Step::Continue, "repaid");
    // Not a number: ignored.
    let mut request = PlainRequest::get("/llm").with_header("x-user", "bob");
    let (mut exchange, _, _) = Exchange::start(&l, &mut request, None, Moment::at(T0), &mut store);
    assert!(exchange
        .response_cost(&l, "x-tokens-used", "lots", T0, &mut store)
        .is_empty());
}

#[test]
fn monitor_warn_and_a_ramp_admit_what_they_do_not_enforce() {
    for (mode, outcome) in [
        ("monitor", Outcome::ShadowDenied),
        ("shadow", Outcome::ShadowDenied),
        ("warn", Outcome::Warned),
    ] {
        let l = limiter(&rule(&format!(
            r#""key": ["const:all"], "mode": "{mode}", "limits": [{{"requests": 1, "per": "minute"}}]"#
        )));
        let mut store = MemoryStore::default();
        let mut last = None;
        for _ in 0..3 {
            let mut r = PlainRequest::get("/");
            let (mut exchange, step, effects) =
                Exchange::start(&l, &mut r, None, Moment::at(T0), &mut store);
            assert_eq!(step, Step::Continue, "{mode}");
            last = Some((exchange.response_headers(&l), effects));
        }
        let (headers, effects) = last.unwrap();
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, Effect::Outcome { outcome: o, .. } if *o == outcome)),
            "{mode}: {effects:?}"
        );
        let warned = headers.iter().any(|(n, v)| *n == WARN_HEADER && v == "api");
        assert_eq!(warned, mode == "warn", "{mode}: {headers:?}");
        assert_eq!(
            effects.iter().any(|e| matches!(e, Effect::Warn { .. })),
            mode == "warn"
        );
    }
    // A ramp of 30%: about 30% of would-be denials are denied.
    let l = limiter(&rule(
        r#""key": ["const:all"], "ramp_percent": 30, "limits": [{"requests": 1, "per": "hour"}]"#,
    ));
    let mut store = MemoryStore::default();
    let denied = (0..2_000u64)
        .filter(|i| {
            let mut r = PlainRequest::get("/");
            let (_, step, _) =
                Exchange::start(&l, &mut r, None, Moment::at(T0 + i * 7), &mut store);
            step != Step::Continue
        })
        .count();
    assert!(
        (500..=700).contains(&denied),
        "{denied} of 2000 denied at 30%"
    );
}

#[test]
fn blocked_and_allowed_keys_override_the_rule() {
    let mut policy = sluice_core::parse(
        rule(r#""key": ["header:x-user"], "limits": [{"requests": 2, "per": "minute"}]"#)
            .as_bytes(),
    )
    .unwrap();
    policy.key_overrides.insert(
        "api".into(),
        [
            ("mallory".to_string(), KeyAction::Block),
            ("ops".to_string(), KeyAction::Allow),
        ]
        .into(),
    );
    let l = Limiter::new(policy);
    let mut store = MemoryStore::default();
    let user = |u: &'static str| move || PlainRequest::get("/").with_header("x-user", u);
    assert_eq!(admitted(&l, &mut store, 5, user("mallory")), 0);
    assert_eq!(admitted(&l, &mut store, 5, user("ops")), 5);
    assert_eq!(admitted(&l, &mut store, 5, user("alice")), 2);
}

#[test]
fn a_rule_that_fails_closed_without_the_service_answers_503_not_429() {
    let l = limiter(
        r#"{"service": {"cluster": "c"}, "rules": [{"name": "api", "key": ["const:all"], "consistency": "cached",
            "limits": [{"requests": 5, "per": "minute"}], "fallback": {"policy": "fail_closed"}}]}"#,
    );
    let mut store = MemoryStore::default();
    let down = Moment {
        service_up: false,
        ..Moment::at(T0)
    };
    let mut r = PlainRequest::get("/");
    let (_, step, effects) = Exchange::start(&l, &mut r, None, down, &mut store);
    let Step::Respond(reply) = step else {
        panic!("{step:?}")
    };
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.body.contains("limiter_unavailable"), "{}", reply.body);
    assert!(reply.headers.get("retry-after").is_some());
    assert!(effects.iter().any(|e| matches!(
        e,
        Effect::Outcome {
            outcome: Outcome::FailedClosed,
            ..
        }
    )));
    let evaluation = l.decide(
        &mut PlainRequest::get("/"),
        sluice_core::Conditions {
            now_us: T0,
            service_up: false,
            service_back_us: T0 + 7_000_000,
            load: Default::default(),
        },
        &mut store,
    );
    assert_eq!(
        evaluation.decision,
        Decision::Unavailable {
            rule: sluice_core::policy::RuleId::new(0),
            retry_after_us: 7_000_000
        }
    );
}

#[test]
fn configuration_errors_name_the_field() {
    let cases = [
        (rule(r#""key": ["jwt:"], "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].key[0]"),
        (rule(r#""key": ["client_ip/33/200"], "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].key[0]"),
        (rule(r#""key": ["jwt:sub|"], "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].key[0]"),
        (rule(r#""key": ["query:"], "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].key[0]"),
        (rule(r#""key": ["x"], "match": {"path_templates": ["/a/{b"]}, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].match.path_templates[0]"),
        (rule(r#""key": ["x"], "match": {"headers": {"x-a": 3}}, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].match.headers.x-a"),
        (rule(r#""key": ["x"], "match": {"client_cidrs": ["10.0.0.0/40"]}, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].match.client_cidrs[0]"),
        (rule(r#""key": ["client_ip"], "match": {"hosts": ["a b"]}, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].match.hosts[0]"),
        (rule(r#""key": ["client_ip"], "tiers": {"from": "jwt:plan", "default": "gold", "limits": {"free": [{"requests": 1, "per": "minute"}]}}"#), "rules[0].tiers.default"),
        (rule(r#""key": ["client_ip"], "limits": [{"requests": 1, "per": "minute"}], "tiers": {"from": "jwt:plan", "default": "free", "limits": {"free": [{"requests": 1, "per": "minute"}]}}"#), "rules[0].tiers"),
        (rule(r#""key": ["client_ip"], "tiers": {"from": "jwt:plan", "default": "free", "limits": {"free": [{"requests": 1, "per": "fortnight"}]}}"#), "rules[0].tiers.limits.free[0].per"),
        (rule(r#""key": ["client_ip"]"#), "rules[0].limits"),
        (rule(r#""key": ["client_ip"], "cost": 0, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].cost"),
        (rule(r#""key": ["client_ip"], "cost": 11, "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].cost"),
        (rule(r#""key": ["client_ip"], "cost_header": "x y", "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].cost_header"),
        (rule(r#""key": ["client_ip"], "mode": "loud", "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].mode"),
        (rule(r#""key": ["client_ip"], "mode": "warn", "ramp_percent": 10, "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].ramp_percent"),
        (rule(r#""key": ["client_ip"], "ramp_percent": 101, "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].ramp_percent"),
        (rule(r#""key": ["client_ip"], "when_missing": "ignore", "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].when_missing"),
        (rule(r#""key": ["client_ip"], "when_missing": null, "query_names": "CaseFold", "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].query_names"),
        (rule(r#""key": ["client_ip"], "when_missing": 1, "limits": [{"requests": 10, "per": "minute"}]"#), "rules[0].when_missing"),
        (rule(r#""key": ["client_ip"], "match": {"hosts": ["..."]}, "limits": [{"requests": 1, "per": "minute"}]"#), "rules[0].match.hosts[0]"),
        (
            r#"{"service": {"cluster": "c"}, "rules": [{"name": "api", "key": ["client_ip"], "consistency": "strict", "cost_header": "x-cost", "limits": [{"requests": 10, "per": "minute"}]}]}"#.to_string(),
            "rules[0].cost_header",
        ),
    ];
    for (json, field) in cases {
        let error = sluice_core::parse(json.as_bytes()).unwrap_err();
        assert_eq!(error.field, field, "{json}: {error}");
    }
}

#[test]
fn plain_requests_answer_hosts_queries_and_claims() {
    let mut r = PlainRequest::get("/x?a=1&b=%2F&a=2")
        .with_header(":authority", "example.com")
        .with_claim("org.id", "acme");
    let query = r.query_string().unwrap_or_default().to_string();
    assert_eq!(query_values(&query, "a", true), ["1", "2"]);
    assert_eq!(query_values(&query, "b", true), ["/"]);
    assert_eq!(r.host(), Some("example.com"));
    assert_eq!(r.claim("org.id").as_deref(), Some("acme"));
    assert_eq!(r.claim("sub"), None);
}

/// Requests of `make` admitted by rule 0 of `json` (5 a minute per key), of `n` at one moment.
fn admitted_of(json: &str, n: usize, make: impl Fn() -> PlainRequest) -> usize {
    let l = limiter(json);
    let mut store = MemoryStore::default();
    admitted(&l, &mut store, n, make)
}

#[test]
fn a_missing_part_is_counted_in_one_bucket_unless_the_rule_skips() {
    for key in [
        r#"["header:x-api-key"]"#,
        r#"["query:api_key"]"#,
        r#"["jwt:sub"]"#,
        r#"["client_ip"]"#,
        r#"["client_ip/24"]"#,
        r#"["jwt:sub|header:x-user"]"#,
    ] {
        let json = rule(&format!(
            r#""key": {key}, "limits": [{{"requests": 3, "per": "minute"}}]"#
        ));
        // None of them has the part: one bucket of 3 for all of them.
        assert_eq!(
            admitted_of(&json, 6, || PlainRequest::get("/x")),
            3,
            "{key}"
        );
        let l = limiter(&json);
        assert_eq!(
            keys(&l, &mut PlainRequest::get("/x")),
            [format!("api:{MISSING}")],
            "{key}"
        );
        let skip = rule(&format!(
            r#""key": {key}, "when_missing": "skip", "limits": [{{"requests": 3, "per": "minute"}}]"#
        ));
        assert_eq!(
            admitted_of(&skip, 6, || PlainRequest::get("/x")),
            6,
            "{key}: skip"
        );
    }
    // The other parts still key: per path, for requests without the header.
    let l = limiter(&rule(
        r#""key": ["header:x-user", "path"], "limits": [{"requests": 3, "per": "minute"}]"#,
    ));
    assert_eq!(
        keys(&l, &mut PlainRequest::get("/a")),
        [format!("api:{MISSING}:/a")]
    );
    // A client address that is not one keys as missing under a prefix, never escapes.
    let json = rule(r#""key": ["client_ip/24"], "limits": [{"requests": 3, "per": "minute"}]"#);
    assert_eq!(
        admitted_of(&json, 6, || PlainRequest::get("/")
            .from_ip("not-an-address")),
        3
    );
}

#[test]
fn no_value_a_client_sends_equals_the_missing_marker() {
    let l = limiter(&rule(
        r#""key": ["query:k", "header:x-k"], "limits": [{"requests": 1, "per": "minute"}]"#,
    ));
    let mut marked = PlainRequest::get("/?k=%1Emissing").with_header("x-k", "\u{1e}missing");
    let mut missing = PlainRequest::get("/");
    let marked_keys = keys(&l, &mut marked);
    assert_eq!(marked_keys, ["api:\u{1e}\u{1e}missing:\u{1e}\u{1e}missing"]);
    assert_ne!(marked_keys, keys(&l, &mut missing));
    // Nor the hex of a value that is not UTF-8.
    assert_eq!(
        sluice_core::limiter::key::header_value("\u{1e}hex:ff".as_bytes()),
        "\u{1e}\u{1e}hex:ff"
    );
    assert_ne!(
        sluice_core::limiter::key::header_value("\u{1e}hex:ff".as_bytes()),
        sluice_core::limiter::key::header_value(b"\xff")
    );
}

#[test]
fn query_parameters_split_on_semicolons_and_match_names_in_any_case() {
    let json = rule(r#""key": ["query:api_key"], "limits": [{"requests": 3, "per": "minute"}]"#);
    let l = limiter(&json);
    for path in [
        "/x?api_key=abc",
        "/x?x=1;api_key=abc",
        "/x?API_KEY=abc",
        "/x?Api_Key=abc&x=2",
        "/x?api%5Fkey=abc",
        "/x?API%5fKEY=abc",
        "/x?x=1;API_KEY=abc;y=2",
    ] {
        assert_eq!(
            keys(&l, &mut PlainRequest::get(path)),
            ["api:abc"],
            "{path}"
        );
    }
    // Every spelling of one key spends one bucket.
    let spellings = [
        "/x?api_key=abc",
        "/x?x=1;api_key=abc",
        "/x?API_KEY=abc",
        "/x?api%5Fkey=abc",
    ];
    let next = std::cell::Cell::new(0);
    let admitted = admitted_of(&json, 8, || {
        next.set(next.get() + 1);
        PlainRequest::get(spellings[next.get() % spellings.len()])
    });
    assert_eq!(admitted, 3);
    // Repeated names, any case: each distinct value, as for a repeated header.
    assert_eq!(
        keys(&l, &mut PlainRequest::get("/x?api_key=junk;API_KEY=abc")),
        ["api:junk", "api:abc"]
    );
    // Unicode case: the Kelvin sign is a k in lower case.
    assert_eq!(
        keys(&l, &mut PlainRequest::get("/x?api_%E2%84%AAey=abc")),
        ["api:abc"]
    );
    // Exact names: only as written; the others are missing the part, counted together.
    let exact = limiter(&rule(
        r#""key": ["query:api_key"], "query_names": "exact", "limits": [{"requests": 3, "per": "minute"}]"#,
    ));
    assert_eq!(
        keys(&exact, &mut PlainRequest::get("/x?x=1;api_key=abc")),
        ["api:abc"]
    );
    assert_eq!(
        keys(&exact, &mut PlainRequest::get("/x?API_KEY=abc")),
        [format!("api:{MISSING}")]
    );
}

#[test]
fn a_query_of_thousands_of_parameters_yields_at_most_four_values() {
    let l = limiter(&rule(
        r#""key": ["query:k"], "limits": [{"requests": 3, "per": "minute"}]"#,
    ));
    let mut path = String::from("/x?");
    for i in 0..20_000 {
        path.push_str(&format!("k={i}&K={i};junk{i}=x&"));
    }
    path.push_str("k=last");
    let built = keys(&l, &mut PlainRequest::get(&path));
    // More than four distinct values: the first three and the last, past eight keys in all one
    // shared bucket of the rule; at most four either way.
    assert!(built.len() <= 4, "{built:?}");
    assert_eq!(built, ["api:0", "api:1", "api:2", "api:last"]);
    let values = query_values(&path[3..], "k", false);
    assert_eq!(values, ["0", "1", "2", "last"]);
    assert_eq!(query_values("k=1&k=1;K=1", "k", false), ["1"]);
    assert_eq!(query_values("a=1;;&&b", "b", false), [""]);
    assert!(query_values("", "k", false).is_empty());
}

#[test]
fn claims_of_every_json_type_key_each_value_apart() {
    let l = limiter(&rule(
        r#""key": ["jwt:uid"], "limits": [{"requests": 3, "per": "minute"}]"#,
    ));
    let mut store = MemoryStore::default();
    // As the filter reads them: canonical text from the payload.
    let with = |uid: serde_json::Value| {
        let claims = serde_json::json!({ "uid": uid });
        let payload = sluice_core::request::claims::Payload::from_json(claims.as_object().unwrap());
        let text = payload.claim("uid");
        move || {
            let mut r = PlainRequest::get("/");
            if let Some(text) = &text {
                r = r.with_claim("uid", text);
            }
            r
        }
    };
    for uid in [
        serde_json::json!(12345),
        serde_json::json!(12346),
        serde_json::json!(1.5),
        serde_json::json!(null),
        serde_json::json!(true),
        serde_json::json!(0),
        serde_json::json!({"id": 1}),
        serde_json::json!({"id": 2}),
        serde_json::json!([1, 2]),
        serde_json::json!("alice"),
    ] {
        assert_eq!(admitted(&l, &mut store, 6, with(uid.clone())), 3, "{uid}");
    }
    // Without the claim: the missing bucket, also 3.
    assert_eq!(admitted(&l, &mut store, 6, with(serde_json::json!(""))), 3);
    assert_eq!(
        admitted(&l, &mut store, 6, || PlainRequest::get("/")),
        0,
        "the same bucket"
    );
}

#[test]
fn a_key_override_names_a_first_present_part_by_the_value_a_client_sent() {
    let policy = sluice_core::parse(
        rule(r#""key": ["header:x-user|client_ip"], "limits": [{"requests": 2, "per": "minute"}]"#)
            .as_bytes(),
    )
    .unwrap();
    let live = |keys: &[(&str, KeyAction)]| sluice_core::protocol::LiveOverrides {
        version: 1,
        keys: [(
            "api".to_string(),
            keys.iter().map(|(k, a)| (k.to_string(), *a)).collect(),
        )]
        .into(),
        ..Default::default()
    };
    let anonymous = |ip: &'static str| move || PlainRequest::get("/").from_ip(ip);
    let user = |u: &'static str| {
        move || {
            PlainRequest::get("/")
                .from_ip("10.0.0.9")
                .with_header("x-user", u)
        }
    };

    // The address as a client sees it: the client without x-user is blocked by it.
    let (blocked, problems) = sluice_core::overrides::apply(
        &policy,
        &live(&[
            ("127.0.0.1", KeyAction::Block),
            ("mallory", KeyAction::Block),
        ]),
    );
    assert!(problems.is_empty(), "{problems:?}");
    let l = Limiter::new(blocked);
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&l, &mut store, 5, anonymous("127.0.0.1")), 0);
    assert_eq!(admitted(&l, &mut store, 5, user("mallory")), 0);
    assert_eq!(admitted(&l, &mut store, 5, anonymous("127.0.0.2")), 2);
    assert_eq!(admitted(&l, &mut store, 5, user("alice")), 2);
    // A bare value matches it from whichever alternative supplied it: a user named so too.
    assert_eq!(admitted(&l, &mut store, 5, user("127.0.0.1")), 0);

    // Named as the filter writes it: that alternative only; it wins over a bare value.
    let (named, problems) = sluice_core::overrides::apply(
        &policy,
        &live(&[
            ("client_ip=127.0.0.1", KeyAction::Block),
            ("mallory", KeyAction::Block),
            ("header:x-user=mallory", KeyAction::Allow),
        ]),
    );
    assert!(problems.is_empty(), "{problems:?}");
    let l = Limiter::new(named);
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&l, &mut store, 5, anonymous("127.0.0.1")), 0);
    assert_eq!(admitted(&l, &mut store, 5, user("127.0.0.1")), 2);
    assert_eq!(admitted(&l, &mut store, 5, user("mallory")), 5);

    // Two first-present parts, one named and one bare.
    let policy = sluice_core::parse(
        rule(r#""key": ["header:x-user|client_ip", "header:x-org|const:none"], "limits": [{"requests": 2, "per": "minute"}]"#)
            .as_bytes(),
    )
    .unwrap();
    let sep = sluice_core::limiter::key::SEPARATOR;
    let key = format!("client_ip=127.0.0.1{sep}none");
    let (mixed, problems) =
        sluice_core::overrides::apply(&policy, &live(&[(&key, KeyAction::Block)]));
    assert!(problems.is_empty(), "{problems:?}");
    let l = Limiter::new(mixed);
    let mut store = MemoryStore::default();
    assert_eq!(admitted(&l, &mut store, 5, anonymous("127.0.0.1")), 0);
    let org = || {
        PlainRequest::get("/")
            .from_ip("127.0.0.1")
            .with_header("x-org", "none")
    };
    assert_eq!(admitted(&l, &mut store, 5, org), 0);
    let other = || {
        PlainRequest::get("/")
            .from_ip("127.0.0.1")
            .with_header("x-org", "acme")
    };
    assert_eq!(admitted(&l, &mut store, 5, other), 2);
}
