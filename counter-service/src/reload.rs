//! Credentials that rotate: the proxies' token file (`--tokens-file`, or `--token-file`), the
//! admin tokens file (`--admin-tokens-file`) and the client certificates' mappings
//! (`--client-certs-file`, `--admin-client-certs-file`) are read again on SIGHUP and within
//! [`WATCH_INTERVAL`] of a change. A name may hold several tokens at once, so a fleet moves to a
//! new token without a moment where either is refused: add it beside the old one, move the
//! proxies, remove the old one. A file that fails its check (a malformed line, a token given to
//! two names, no credential) keeps the set in use, and the reason, naming the line, is logged. A
//! set that changed is in force for every request from then on (a removed token is refused at
//! once, and a SAN removed from a mapping on every connection, open or not) and is recorded in the
//! audit log (`GET /admin/v1/audit`): who (`sluice-counter-service`), which flag, how many names
//! and tokens (or SANs), never a token.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use serde_json::json;

use crate::client_certs::CertNames;
use crate::credentials::Credentials;
use crate::overrides::{AUDIT_CAP, AUDIT_KEY};
use crate::settings::Settings;
use crate::state::AppState;

/// How often the files' modification times are compared with the last read ones.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Who the audit log says reloaded a credentials file.
pub const RELOADER: &str = "sluice-counter-service";

/// One file of credentials and the set read from it last.
struct Watched {
    flag: &'static str,
    path: PathBuf,
    set: Set,
    stamp: Option<SystemTime>,
}

/// What a file holds: tokens, or which client certificates are which credential.
enum Set {
    Tokens(Arc<RwLock<Arc<Credentials>>>),
    Certificates(Arc<RwLock<Arc<CertNames>>>),
}

/// Watches the credentials files `state` was started with, for as long as the process runs.
/// Nothing to watch with `--token` (a command-line value cannot change).
pub fn watch_credentials(state: AppState) {
    let mut watched = Vec::new();
    let settings = state.settings.clone();
    if let Some((flag, path)) = proxies_file(&settings) {
        watched.push(Watched {
            flag,
            path: path.clone(),
            set: Set::Tokens(state.credentials.clone()),
            stamp: modified(&path),
        });
    }
    if let (Some(path), Some(set)) = (&settings.admin_tokens_file, &state.admin) {
        watched.push(Watched {
            flag: "--admin-tokens-file",
            path: path.clone(),
            set: Set::Tokens(set.clone()),
            stamp: modified(path),
        });
    }
    let mappings = [
        (
            "--client-certs-file",
            &settings.client_certs_file,
            &state.client_certs,
        ),
        (
            "--admin-client-certs-file",
            &settings.admin_client_certs_file,
            &state.admin_client_certs,
        ),
    ];
    for (flag, path, set) in mappings {
        if let (Some(path), Some(set)) = (path, set) {
            watched.push(Watched {
                flag,
                path: path.clone(),
                set: Set::Certificates(set.clone()),
                stamp: modified(path),
            });
        }
    }
    if watched.is_empty() {
        return;
    }
    tokio::spawn(async move {
        let mut hangup = crate::hangup::Hangup::new();
        loop {
            let signalled = hangup.or_sleep(WATCH_INTERVAL).await;
            for file in &mut watched {
                let stamp = modified(&file.path);
                if !signalled && stamp == file.stamp {
                    continue;
                }
                file.stamp = stamp;
                reload(&state, &settings, file).await;
            }
        }
    });
}

/// The file the proxies' credentials come from, and its flag: none with `--token`.
fn proxies_file(settings: &Settings) -> Option<(&'static str, PathBuf)> {
    if settings.token.as_deref().is_some_and(|t| !t.is_empty()) {
        return None;
    }
    match (&settings.token_file, &settings.tokens_file) {
        (Some(path), _) => Some(("--token-file", path.clone())),
        (None, Some(path)) => Some(("--tokens-file", path.clone())),
        (None, None) => None,
    }
}

async fn reload(state: &AppState, settings: &Settings, file: &mut Watched) {
    let swapped = match &file.set {
        Set::Tokens(set) => {
            let read = match file.flag {
                "--admin-tokens-file" => settings.admin_credentials().and_then(|admins| {
                    admins.ok_or_else(|| "--admin-tokens-file: not given".to_owned())
                }),
                _ => settings.credentials(),
            };
            read.map(|credentials| {
                let counts = counts(&credentials);
                swap(set, credentials, same).then_some(counts)
            })
        }
        Set::Certificates(set) => {
            let read = match file.flag {
                "--admin-client-certs-file" => settings.admin_client_certs(),
                _ => settings.client_certs(),
            };
            read.and_then(|names| names.ok_or_else(|| format!("{}: not given", file.flag)))
                .map(|names| {
                    let counts = names.counts();
                    swap(set, names, |a, b| a == b).then_some(counts)
                })
        }
    };
    let (names, count) = match swapped {
        Ok(Some(counts)) => counts,
        Ok(None) => return,
        Err(reason) => {
            tracing::error!("credentials: reload refused, the set in use is kept: {reason}");
            return;
        }
    };
    let what = match file.set {
        Set::Tokens(_) => "tokens",
        Set::Certificates(_) => "sans",
    };
    tracing::info!(
        flag = file.flag,
        names,
        count,
        what,
        "credentials: reloaded, in force for every request from now on"
    );
    audit(state, file.flag, json!({"names": names, what: count})).await;
}

/// Puts `new` in `lock`'s place unless it is the same: whether it did.
fn swap<T>(lock: &RwLock<Arc<T>>, new: T, same: impl Fn(&T, &T) -> bool) -> bool {
    let current = match lock.read() {
        Ok(current) => current.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    if same(&current, &new) {
        return false;
    }
    match lock.write() {
        Ok(mut set) => *set = Arc::new(new),
        Err(poisoned) => *poisoned.into_inner() = Arc::new(new),
    }
    true
}

/// Whether two sets let in the same tokens under the same names.
fn same(a: &Credentials, b: &Credentials) -> bool {
    match (a, b) {
        (Credentials::Open, Credentials::Open) => true,
        (Credentials::Shared(x), Credentials::Shared(y)) => x == y,
        (Credentials::PerProxy(x), Credentials::PerProxy(y)) => x == y,
        (Credentials::NoToken, Credentials::NoToken) => true,
        _ => false,
    }
}

/// How many names and tokens a set holds (a shared token is one name).
fn counts(credentials: &Credentials) -> (usize, usize) {
    match credentials {
        Credentials::Open | Credentials::NoToken => (0, 0),
        Credentials::Shared(_) => (1, 1),
        Credentials::PerProxy(all) => {
            let mut names: Vec<&str> = all.iter().map(|(name, _)| &**name).collect();
            names.sort_unstable();
            names.dedup();
            (names.len(), all.len())
        }
    }
}

/// Records the reload in the audit log, best effort: a Redis that does not answer leaves a
/// warning in the log instead.
async fn audit(state: &AppState, flag: &str, value: serde_json::Value) {
    let at_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let entry = json!({
        "at_ms": at_ms,
        "who": RELOADER,
        "action": "reload credentials",
        "target": flag,
        "value": value,
    })
    .to_string();
    let mut push = redis::cmd("LPUSH");
    push.arg(AUDIT_KEY).arg(entry);
    let mut trim = redis::cmd("LTRIM");
    trim.arg(AUDIT_KEY).arg(0).arg(AUDIT_CAP - 1);
    let written = match state.backend.query::<()>("audit", &push).await {
        Ok(()) => state.backend.query::<()>("audit", &trim).await,
        Err(error) => Err(error),
    };
    if let Err(error) = written {
        tracing::warn!("credentials: the reload is not in the audit log: {error}");
    }
}

fn modified(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
