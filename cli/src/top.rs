//! `sluice top`: the keys a rule admits and denies most across the fleet, as the counter service
//! answers them (`GET /admin/v1/top`), refreshed in the terminal as `top` does (or once).

use std::time::Duration;

use serde_json::Value;

use crate::Failure;

/// Most characters of a key a row shows.
const KEY_CHARS: usize = 64;

#[derive(clap::Args)]
pub struct TopArgs {
    /// The counter service's base URL (plain HTTP), such as http://127.0.0.1:8080.
    #[arg(long)]
    pub service: String,
    /// A file holding an admin token (one of the service's --admin-tokens-file).
    #[arg(long)]
    pub token_file: std::path::PathBuf,
    /// The rule, or rule/tier.
    #[arg(long)]
    pub rule: String,
    /// Whole minutes, 1m to 15m.
    #[arg(long, default_value = "5m")]
    pub window: String,
    /// Keys shown of each kind, 1 to 64.
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2)]
    pub every: u64,
    /// Prints the table once and exits (for scripts and tests).
    #[arg(long)]
    pub once: bool,
}

/// Runs `sluice top`: one table with `--once`, else a table refreshed every `--every` seconds
/// until interrupted.
pub fn run(args: &TopArgs) -> Result<String, Failure> {
    let token = std::fs::read_to_string(&args.token_file)
        .map_err(|e| Failure::Unreadable(format!("{}: {e}", args.token_file.display())))?;
    let token = token.trim();
    if token.is_empty() {
        return Err(Failure::Unreadable(format!(
            "{}: holds no token",
            args.token_file.display()
        )));
    }
    let url = format!(
        "{}/admin/v1/top?rule={}&window={}&limit={}",
        args.service.trim_end_matches('/'),
        encoded(&args.rule),
        encoded(&args.window),
        args.limit
    );
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    if args.once {
        return fetch(&agent, &url, token).map(|answer| render(&answer));
    }
    loop {
        let screen = fetch(&agent, &url, token).map(|answer| render(&answer))?;
        // Home and clear, then the table: the terminal shows the latest one only.
        print!("\x1b[H\x1b[2J{screen}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
        std::thread::sleep(Duration::from_secs(args.every.max(1)));
    }
}

/// One answer of the service, or the reason it gave.
fn fetch(agent: &ureq::Agent, url: &str, token: &str) -> Result<Value, Failure> {
    let mut response = agent
        .get(url)
        .header("authorization", format!("Bearer {token}"))
        .call()
        .map_err(|e| Failure::Service(format!("{url}: {e}")))?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .map_err(|e| Failure::Service(format!("{url}: {e}")))?;
    let json: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    if status != 200 {
        let message = json["message"].as_str().unwrap_or(body.as_str());
        return Err(Failure::Service(format!(
            "the service answered {status}: {message}"
        )));
    }
    Ok(json)
}

/// The table of one answer.
pub fn render(answer: &Value) -> String {
    let mut out = format!(
        "sluice top: rule {}, the last {} minute(s), {} credential(s) reporting\n",
        answer["rule"].as_str().unwrap_or("?"),
        answer["window_minutes"],
        answer["credentials"]
    );
    for kind in ["denied", "admitted"] {
        let part = &answer[kind];
        let total = part["total"].as_u64().unwrap_or(0);
        out.push_str(&format!(
            "\n{} {total} request(s); each count at most {} below the true one\n",
            kind.to_uppercase(),
            part["error_bound"]
        ));
        out.push_str(&format!(
            "{:>4}  {:>12}  {:>12}  {:>6}  KEY\n",
            "#", "COUNT", "AT MOST", "SHARE"
        ));
        let keys = part["keys"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        for (i, entry) in keys.iter().enumerate() {
            let count = entry["count"].as_u64().unwrap_or(0);
            let share = match total {
                0 => 0.0,
                t => 100.0 * count as f64 / t as f64,
            };
            out.push_str(&format!(
                "{:>4}  {:>12}  {:>12}  {:>5.1}%  {}\n",
                i + 1,
                count,
                entry["at_most"].as_u64().unwrap_or(0),
                share,
                shown(entry["key"].as_str().unwrap_or(""))
            ));
        }
        if keys.is_empty() {
            out.push_str("         (none)\n");
        }
    }
    out
}

/// A key as a row shows it: its parts joined by `:`, without control characters (a terminal's
/// escapes), cut to [`KEY_CHARS`].
fn shown(key: &str) -> String {
    let mut out: String = key
        .chars()
        .map(|c| if c == '\u{1f}' { ':' } else { c })
        .filter(|c| !c.is_control())
        .take(KEY_CHARS + 1)
        .collect();
    if out.chars().count() > KEY_CHARS {
        out = out.chars().take(KEY_CHARS).collect();
        out.push('…');
    }
    out
}

/// A query value, percent-encoded.
fn encoded(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_shows_a_key_without_escapes_and_cut() {
        assert_eq!(shown("api\u{1f}10.0.0.1"), "api:10.0.0.1");
        assert_eq!(shown("api\u{1f}\u{1b}[2Jx"), "api:[2Jx");
        let long = shown(&"k".repeat(300));
        assert_eq!(long.chars().count(), KEY_CHARS + 1);
        assert!(long.ends_with('…'));
        assert_eq!(encoded("api/gold tier"), "api%2Fgold%20tier");
    }
}
