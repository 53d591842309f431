//! Every configuration on `docs/recipes.md` passes the filter's own check: a recipe that no longer
//! parses (a field renamed, a bound tightened) fails here, not in a user's proxy.

fn recipes() -> Vec<(usize, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/recipes.md");
    let text = std::fs::read_to_string(path).unwrap();
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match (&mut current, line.trim_end()) {
            (None, "```json") => current = Some((n + 2, String::new())),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some((_, block)), line) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn every_recipe_is_a_configuration_the_filter_accepts() {
    let blocks = recipes();
    assert!(blocks.len() >= 5, "{} recipes", blocks.len());
    for (line, block) in blocks {
        if let Err(error) = sluice_core::parse(block.as_bytes()) {
            panic!("docs/recipes.md, the block at line {line}: {error}\n{block}");
        }
    }
}

/// The login recipe does what the page says: the sixth failure of an account is not forwarded, and
/// the account stays out for ten minutes though its limit would have room after a minute.
#[test]
fn the_login_recipe_keeps_an_account_out_for_ten_minutes() {
    use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};
    let (_, block) = recipes().into_iter().next().unwrap();
    // Local here: the recipe's cached rule needs the service, and the penalty's arithmetic is the
    // same.
    let block = block.replace(r#""consistency": "cached","#, "");
    let limiter = Limiter::new(sluice_core::parse(block.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    const SECOND: u64 = 1_000_000;
    let t0 = 1_700_000_000 * SECOND;
    let mut attempt = |at: u64, status: u32| {
        let mut request = PlainRequest::get("/login")
            .with_header("x-account", "alice")
            .with_header("cookie", "session=s1");
        request.method = "POST".into();
        let (mut exchange, step, _) =
            Exchange::start(&limiter, &mut request, None, Moment::at(at), &mut store);
        if step == Step::Continue {
            let _ = exchange.response_status(&limiter, status, at, &mut store);
            let _ = exchange.finish(&limiter, &mut store);
        }
        step
    };
    for i in 0..5 {
        assert_eq!(attempt(t0 + i * SECOND, 401), Step::Continue, "failure {i}");
    }
    let Step::Respond(reply) = attempt(t0 + 5 * SECOND, 401) else {
        panic!("the sixth failure was forwarded")
    };
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("600"));
    assert!(matches!(attempt(t0 + 120 * SECOND, 200), Step::Respond(_)));
    assert_eq!(attempt(t0 + 606 * SECOND, 200), Step::Continue);
}

/// Attacker's test, on the login recipe as shipped: a client without the session cookie fails
/// logins (a new account each time, so that the account rule never stops it) until it is denied.
/// Another client without the cookie, at another address, is not locked out; the attacker is, for
/// the limit's wait. A session in its penalty sent as `a=1, session=…` is still denied, and
/// `Alice` and `ALICE` are two accounts.
#[test]
fn the_login_recipe_counts_clients_without_a_session_apart() {
    use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};
    let (_, block) = recipes().into_iter().next().unwrap();
    let limiter = Limiter::new(sluice_core::parse(block.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    const SECOND: u64 = 1_000_000;
    let t0 = 1_700_000_000 * SECOND;
    let mut attempt = |at: u64, ip: &str, account: &str, cookie: &str, status: u32| {
        let mut request = PlainRequest::get("/login")
            .from_ip(ip)
            .with_header("x-account", account);
        if !cookie.is_empty() {
            request = request.with_header("cookie", cookie);
        }
        request.method = "POST".into();
        let (mut exchange, step, _) =
            Exchange::start(&limiter, &mut request, None, Moment::at(at), &mut store);
        if step == Step::Continue {
            let _ = exchange.response_status(&limiter, status, at, &mut store);
            let _ = exchange.finish(&limiter, &mut store);
        }
        step
    };
    let (mallory, newcomer) = ("203.0.113.66", "198.51.100.7");
    let mut failed = 0;
    for i in 0..40u64 {
        match attempt(t0 + i, mallory, &format!("user{i}"), "", 401) {
            Step::Continue => failed += 1,
            Step::Respond(reply) => {
                assert_eq!(reply.status, 429);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(failed, 20, "twenty failures a minute");
    for cookie in ["", "theme=dark", "session="] {
        assert_eq!(
            attempt(t0 + 50, newcomer, "alice", cookie, 200),
            Step::Continue,
            "a newcomer with {cookie:?}, locked out by another client's failures"
        );
    }
    assert!(matches!(
        attempt(t0 + 51, mallory, "bob", "", 200),
        Step::Respond(_)
    ));

    // A session that failed twenty times is in its penalty, however its cookie is spelled.
    for i in 0..20u64 {
        let step = attempt(
            t0 + 100 + i,
            mallory,
            &format!("v{i}"),
            "session=victim",
            401,
        );
        assert_eq!(step, Step::Continue);
    }
    // The next attempt is denied: the penalty starts.
    assert!(matches!(
        attempt(t0 + 130, mallory, "v20", "session=victim", 401),
        Step::Respond(_)
    ));
    for cookie in [
        "session=victim",
        "a=1, session=victim",
        "a=1 session=victim",
        "theme=dark; a=1, session=victim",
    ] {
        assert!(
            matches!(
                attempt(t0 + 300 * SECOND, newcomer, "carol", cookie, 200),
                Step::Respond(_)
            ),
            "{cookie:?} escaped the penalty of session=victim"
        );
    }

    // Five failures for `Alice` put `Alice` into its penalty, not `ALICE`.
    for i in 0..5u64 {
        let ip = format!("192.0.2.{i}");
        assert_eq!(attempt(t0 + 400 + i, &ip, "Alice", "", 401), Step::Continue);
    }
    assert!(matches!(
        attempt(t0 + 410, "192.0.2.9", "Alice", "", 200),
        Step::Respond(_)
    ));
    assert_eq!(
        attempt(t0 + 411, "192.0.2.9", "ALICE", "", 200),
        Step::Continue
    );
}

/// The night recipe does what the page says: by night a key gets the night's burst, and its
/// denial says the night's limit; by day the day's burst.
#[test]
fn the_night_recipe_follows_the_clock() {
    use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};
    let (_, block) = recipes()
        .into_iter()
        .find(|(_, b)| b.contains("\"schedule\""))
        .unwrap();
    let limiter = Limiter::new(sluice_core::parse(block.as_bytes()).unwrap());
    // 2026-01-01 00:00 UTC.
    let midnight = 1_767_225_600_000_000u64;
    for (hour, burst, policy) in [(23, 10, "q=60"), (12, 100, "q=600")] {
        let mut store = MemoryStore::default();
        let moment = Moment::at(midnight + hour * 3_600_000_000);
        let mut admitted = 0;
        let denial = loop {
            let mut request = PlainRequest::get("/api/items").with_header("x-api-key", "k1");
            match Exchange::start(&limiter, &mut request, None, moment, &mut store).1 {
                Step::Continue => admitted += 1,
                Step::Respond(reply) => break reply,
                other => panic!("{other:?}"),
            }
            assert!(admitted <= 1_000);
        };
        assert_eq!(admitted, burst, "at {hour}:00");
        let header = denial.headers.get("ratelimit-policy").unwrap_or("");
        assert!(header.contains(policy), "at {hour}:00: {header}");
    }
}

/// The night recipe's quota reads are limited per address, whichever API key they name: 30 a
/// minute are answered (each the key's own, unspent), the next is denied by `quota-reads`.
#[test]
fn the_night_recipe_limits_quota_reads_per_address() {
    use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};
    let (_, block) = recipes()
        .into_iter()
        .find(|(_, b)| b.contains("\"schedule\""))
        .unwrap();
    let limiter = Limiter::new(sluice_core::parse(block.as_bytes()).unwrap());
    let mut store = MemoryStore::default();
    // 2026-01-01 12:00 UTC.
    let moment = Moment::at(1_767_268_800_000_000);
    let mut answered = 0;
    let denial = loop {
        let key = format!("k{answered}");
        let mut request = PlainRequest::get("/rate_limit")
            .from_ip("203.0.113.7")
            .with_header("x-api-key", &key);
        match Exchange::start(&limiter, &mut request, None, moment, &mut store).1 {
            Step::Respond(reply) if reply.status == 200 => {
                assert!(reply.body.contains(r#""remaining":100"#), "{}", reply.body);
                answered += 1;
            }
            Step::Respond(reply) => break reply,
            other => panic!("{other:?}"),
        }
        assert!(answered <= 100);
    };
    assert_eq!(answered, 30);
    assert_eq!(denial.status, 429);
    assert!(
        denial.body.contains(r#""rule":"quota-reads""#),
        "{}",
        denial.body
    );
}

/// The per-customer recipe does what the page says: the token's limit up to 5,000 (100 without
/// one), and customer 42's own limits, set through the counter service, past the 1,000 every
/// other customer shares.
#[test]
fn the_per_customer_recipe_gives_each_customer_its_contract() {
    use sluice_core::protocol::LiveOverrides;
    use sluice_core::{Exchange, Limiter, MemoryStore, Moment, PlainRequest, Step};
    let (_, block) = recipes()
        .into_iter()
        .find(|(_, block)| block.contains("limits_from"))
        .expect("the per-customer recipe");
    // Local here: the counts are the same arithmetic, and the key's own limits arrive the same way.
    let block = block.replace(r#""consistency": "cached""#, r#""consistency": "local""#);
    let configured = sluice_core::parse(block.as_bytes()).unwrap();
    let live = LiveOverrides {
        version: 1,
        limits: [(
            "key:fleet\u{1f}42".to_string(),
            vec![serde_json::json!({"requests": 20000, "per": "minute"})],
        )]
        .into(),
        ..Default::default()
    };
    let (applied, problems) = sluice_core::overrides::apply(&configured, &live);
    assert!(problems.is_empty(), "{problems:?}");
    let limiter = Limiter::with_overrides(applied, &configured, [1, 2]);
    let mut store = MemoryStore::default();
    let mut admitted = |sub: &str, rate: &str, customer: &str, n: usize| {
        (0..n)
            .filter(|_| {
                let mut request = PlainRequest::get("/api/x")
                    .with_claim("sub", sub)
                    .with_claim("rate_per_minute", rate)
                    .with_header("x-customer", customer);
                let at = Moment::at(1_700_000_000_000_000);
                Exchange::start(&limiter, &mut request, None, at, &mut store).1 == Step::Continue
            })
            .count()
    };
    assert_eq!(admitted("alice", "150", "42", 200), 150);
    assert_eq!(admitted("bob", "lots", "43", 200), 100);
    assert_eq!(
        admitted("dave", "5000", "44", 1100),
        1000,
        "the fleet's 1,000"
    );
    assert_eq!(
        admitted("erin", "5000", "42", 1100),
        1100,
        "42's own 20,000"
    );
}
