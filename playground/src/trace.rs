//! A trace: the requests to play, one CSV line each.
//!
//! ```text
//! # seconds,client,path,method,extras,duration
//! 0.000,alice,/api/items
//! 0.250,10.0.0.7,/api/items,POST
//! 1.5,bob,/api/export,GET,x-tier=pro;jwt:plan=pro
//! 2.0,bob,/api/report,GET,,30
//! ```
//!
//! `seconds` is the arrival after the start of the trace; `client` is who sends it: its address
//! when it is one, else an address in 10.0.0.0/8 drawn from its name, and always its
//! `x-api-key` header and its JWT `sub` claim, so rules keyed on `client_ip`,
//! `header:x-api-key` or `jwt:sub` see one key per client. `path` defaults to `/`, `method` to
//! `GET`. `extras` are `name=value` pairs separated by `;`: a request header, or a verified JWT
//! claim when the name starts with `jwt:`, or `status=NNN`: the status the upstream answers it
//! (default 200), which rules that count by the answer (`count_when`) read. `duration` is how
//! long, in seconds, an admitted request stays in flight (its response ends then): what a
//! concurrent limit counts; 0 (the default) ends it at once. Blank lines, `#` comments and a
//! first line of column names are skipped; lines are played in time order.

use std::net::IpAddr;

use sluice_core::PlainRequest;

/// Most requests one trace may hold: enough for minutes of heavy traffic, and a page that
/// stays quick.
pub const MAX_REQUESTS: usize = 50_000;
/// Latest arrival: 31 days, so a month window can be watched.
pub const MAX_SECONDS: f64 = 31.0 * 86_400.0;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    /// Microseconds after the start of the trace.
    pub at_us: u64,
    pub client: String,
    pub path: String,
    pub method: String,
    /// Request headers besides the client's `x-api-key`, lower-case names.
    pub headers: Vec<(String, String)>,
    /// Verified JWT claims besides the client's `sub`.
    pub claims: Vec<(String, String)>,
    /// The status the upstream answers it (`status=NNN`), if the trace says.
    pub status: Option<u32>,
    /// Microseconds it stays in flight once admitted (the trace's `duration`; 0: it ends at
    /// once).
    pub duration_us: u64,
    /// Its line in the CSV (1-based), for messages.
    pub line: usize,
}

impl Arrival {
    /// The client's address: itself when it is one, else one in 10.0.0.0/8 from its name.
    pub fn client_ip(&self) -> IpAddr {
        if let Ok(ip) = self.client.parse::<IpAddr>() {
            return ip;
        }
        // FNV-1a: the same name always gets the same address.
        let mut hash: u32 = 0x811c_9dc5;
        for byte in self.client.bytes() {
            hash = (hash ^ byte as u32).wrapping_mul(0x0100_0193);
        }
        let [_, b, c, d] = hash.to_be_bytes();
        IpAddr::from([10, b, c, d])
    }

    /// The request as core sees it.
    pub fn request(&self) -> PlainRequest {
        let mut request = PlainRequest::get(&self.path).from_ip(&self.client_ip().to_string());
        request.method.clone_from(&self.method);
        if !self.headers.iter().any(|(n, _)| n == "x-api-key") {
            request = request.with_header("x-api-key", &self.client);
        }
        for (name, value) in &self.headers {
            request = request.with_header(name, value);
        }
        if !self.claims.iter().any(|(n, _)| n == "sub") {
            request = request.with_claim("sub", &self.client);
        }
        for (name, value) in &self.claims {
            request = request.with_claim(name, value);
        }
        request
    }
}

/// Reads a trace; the error names the line and the column.
pub fn parse_trace(csv: &str) -> Result<Vec<Arrival>, String> {
    let mut arrivals = Vec::new();
    let mut first = true;
    for (index, raw) in csv.lines().enumerate() {
        let line = index + 1;
        let text = raw.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let seconds = fields.first().copied().unwrap_or("");
        let Ok(at) = seconds.parse::<f64>() else {
            if first {
                // Column names.
                first = false;
                continue;
            }
            return Err(format!(
                "line {line}: seconds: expected a number of seconds, got \"{seconds}\""
            ));
        };
        first = false;
        if !(0.0..=MAX_SECONDS).contains(&at) {
            return Err(format!(
                "line {line}: seconds: expected 0 to {MAX_SECONDS} (31 days), got {seconds}"
            ));
        }
        if fields.len() > 6 {
            return Err(format!(
                "line {line}: expected at most 6 columns (seconds,client,path,method,extras,duration), got {}",
                fields.len()
            ));
        }
        let field = |i: usize, default: &str| -> String {
            fields
                .get(i)
                .filter(|f| !f.is_empty())
                .map_or(default.to_string(), |f| f.to_string())
        };
        let path = field(2, "/");
        if !path.starts_with('/') {
            return Err(format!(
                "line {line}: path: expected a path starting with /, got \"{path}\""
            ));
        }
        let method = field(3, "GET").to_ascii_uppercase();
        let mut headers = Vec::new();
        let mut claims = Vec::new();
        let mut status = None;
        for pair in field(4, "")
            .split(';')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let Some((name, value)) = pair.split_once('=') else {
                return Err(format!(
                    "line {line}: extras: expected name=value, got \"{pair}\""
                ));
            };
            let (name, value) = (name.trim(), value.trim());
            if name == "status" {
                match value.parse::<u32>() {
                    Ok(s) if (100..=599).contains(&s) => status = Some(s),
                    _ => {
                        return Err(format!(
                            "line {line}: extras: status: expected an HTTP status, 100 to 599, got \"{value}\""
                        ))
                    }
                }
                continue;
            }
            match name.strip_prefix("jwt:") {
                Some(claim) => claims.push((claim.to_string(), value.to_string())),
                None => headers.push((name.to_ascii_lowercase(), value.to_string())),
            }
        }
        let duration = field(5, "0");
        let duration_s = match duration.parse::<f64>() {
            Ok(d) if (0.0..=MAX_SECONDS).contains(&d) => d,
            _ => {
                return Err(format!(
                    "line {line}: duration: expected 0 to {MAX_SECONDS} seconds, got \"{duration}\""
                ))
            }
        };
        if arrivals.len() == MAX_REQUESTS {
            return Err(format!(
                "line {line}: at most {MAX_REQUESTS} requests in a trace"
            ));
        }
        arrivals.push(Arrival {
            at_us: (at * 1e6).round() as u64,
            client: field(1, "client"),
            path,
            method,
            headers,
            claims,
            status,
            duration_us: (duration_s * 1e6).round() as u64,
            line,
        });
    }
    arrivals.sort_by_key(|a| a.at_us);
    Ok(arrivals)
}
