//! Credentials that rotate: the proxies' token file (`--tokens-file`, or `--token-file`) and the
//! admin tokens file (`--admin-tokens-file`) are read again on SIGHUP and within
//! [`WATCH_INTERVAL`] of a change. A name may hold several tokens at once, so a fleet moves to a
//! new token without a moment where either is refused: add it beside the old one, move the
//! proxies, remove the old one. A file that fails its check (a malformed line, a token given to
//! two names, no credential) keeps the set in use, and the reason, naming the line, is logged. A
//! set that changed is in force for every request from then on (a removed token is refused at
//! once) and is recorded in the audit log (`GET /admin/v1/audit`): who (`sluice-counter-service`),
//! which flag, how many names and tokens, never a token.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use serde_json::json;

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
    set: Arc<RwLock<Arc<Credentials>>>,
    stamp: Option<SystemTime>,
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
            set: state.credentials.clone(),
            stamp: modified(&path),
        });
    }
    if let (Some(path), Some(set)) = (&settings.admin_tokens_file, &state.admin) {
        watched.push(Watched {
            flag: "--admin-tokens-file",
            path: path.clone(),
            set: set.clone(),
            stamp: modified(path),
        });
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
    let read = match file.flag {
        "--admin-tokens-file" => settings
            .admin_credentials()
            .and_then(|admins| admins.ok_or_else(|| "--admin-tokens-file: not given".to_owned())),
        _ => settings.credentials(),
    };
    let credentials = match read {
        Ok(credentials) => credentials,
        Err(reason) => {
            tracing::error!("credentials: reload refused, the set in use is kept: {reason}");
            return;
        }
    };
    let current = match file.set.read() {
        Ok(current) => current.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    if same(&current, &credentials) {
        return;
    }
    let (names, tokens) = counts(&credentials);
    match file.set.write() {
        Ok(mut set) => *set = Arc::new(credentials),
        Err(poisoned) => *poisoned.into_inner() = Arc::new(credentials),
    }
    tracing::info!(
        flag = file.flag,
        names,
        tokens,
        "credentials: reloaded, in force for every request from now on"
    );
    audit(state, file.flag, names, tokens).await;
}

/// Whether two sets let in the same tokens under the same names.
fn same(a: &Credentials, b: &Credentials) -> bool {
    match (a, b) {
        (Credentials::Open, Credentials::Open) => true,
        (Credentials::Shared(x), Credentials::Shared(y)) => x == y,
        (Credentials::PerProxy(x), Credentials::PerProxy(y)) => x == y,
        _ => false,
    }
}

/// How many names and tokens a set holds (a shared token is one name).
fn counts(credentials: &Credentials) -> (usize, usize) {
    match credentials {
        Credentials::Open => (0, 0),
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
async fn audit(state: &AppState, flag: &str, names: usize, tokens: usize) {
    let at_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let entry = json!({
        "at_ms": at_ms,
        "who": RELOADER,
        "action": "reload credentials",
        "target": flag,
        "value": {"names": names, "tokens": tokens},
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
