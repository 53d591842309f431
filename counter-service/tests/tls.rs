//! `--tls-cert-file` and `--tls-key-file` as an attacker or a careless operator might set them: each
//! wrong file refuses the start with a reason naming its flag, and no reason quotes a key. (The
//! certificates are made here, `sluice_tests::certs`; serving and reloading them is shown in real
//! Envoy, `tests/tests/e2e_tls.rs`.)

use clap::Parser;
use sluice_counter_service::Settings;
use sluice_tests::certs::Authority;

fn tls_error(cert: &std::path::Path, key: &std::path::Path) -> String {
    let settings = Settings::try_parse_from([
        "sluice-counter-service".as_ref(),
        "--token".as_ref(),
        "t".as_ref(),
        "--tls-cert-file".as_ref(),
        cert.as_os_str(),
        "--tls-key-file".as_ref(),
        key.as_os_str(),
    ])
    .unwrap();
    match settings.tls() {
        Ok(_) => String::new(),
        Err(reason) => reason,
    }
}

#[test]
fn a_good_pair_loads() {
    let ca = Authority::new("ok").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    assert_eq!(tls_error(&issued.cert_file, &issued.key_file), "");
}

#[test]
fn one_flag_without_the_other_is_refused_naming_it() {
    for (flag, other) in [
        ("--tls-cert-file", "--tls-key-file"),
        ("--tls-key-file", "--tls-cert-file"),
    ] {
        let settings =
            Settings::try_parse_from(["sluice-counter-service", "--token", "t", flag, "x.pem"])
                .unwrap();
        let reason = settings.tls().err().unwrap_or_default();
        assert_eq!(reason, format!("{flag} needs {other}"));
    }
}

#[test]
fn each_wrong_file_is_refused_naming_its_flag_and_quoting_no_key() {
    let ca = Authority::new("wrong").unwrap();
    let issued = ca.issue("service", &["127.0.0.1"]).unwrap();
    let other = ca.issue("other", &["127.0.0.1"]).unwrap();
    let dir = ca.dir();
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let huge = dir.join("huge.pem");
    std::fs::write(&huge, vec![b'A'; 2 << 20]).unwrap();
    let missing = dir.join("missing.pem");
    let key_text = std::fs::read_to_string(&issued.key_file).unwrap();
    let cases = [
        (garbage.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (empty.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (huge.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (missing.clone(), issued.key_file.clone(), "--tls-cert-file"),
        (issued.cert_file.clone(), garbage.clone(), "--tls-key-file"),
        (issued.cert_file.clone(), missing.clone(), "--tls-key-file"),
        // A certificate's own file as its key: no key in it.
        (
            issued.cert_file.clone(),
            issued.cert_file.clone(),
            "--tls-key-file",
        ),
        // Another certificate's key.
        (
            issued.cert_file.clone(),
            other.key_file.clone(),
            "--tls-key-file",
        ),
        // The key where the certificate goes.
        (
            issued.key_file.clone(),
            issued.key_file.clone(),
            "--tls-cert-file",
        ),
    ];
    for (cert, key, flag) in cases {
        let reason = tls_error(&cert, &key);
        assert!(
            reason.starts_with(&format!("{flag} ")),
            "{} / {}: {reason:?} does not name {flag}",
            cert.display(),
            key.display()
        );
        assert!(
            !reason.contains("PRIVATE KEY")
                && !reason.contains(key_text.lines().nth(1).unwrap_or("-")),
            "{reason}"
        );
    }
}
