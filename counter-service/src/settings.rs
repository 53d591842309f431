//! Every setting of the service, from flags or the environment, in one struct.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

use crate::client_certs::CertNames;
use crate::credentials::Credentials;

/// The counter service's settings. Each flag also reads an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "sluice-counter-service",
    version,
    about,
    args_override_self = true
)]
pub struct Settings {
    /// Address to listen on.
    #[arg(long, env = "SLUICE_BIND", default_value = "127.0.0.1:8081")]
    pub bind: SocketAddr,

    /// Also serve Envoy's rate limit service (gRPC `envoy.service.ratelimit.v3.RateLimitService`,
    /// HTTP/2, over TLS too with `--tls-cert-file`) on this address, with the limits of
    /// `--rls-config`.
    #[arg(
        long,
        env = "SLUICE_GRPC_BIND",
        value_name = "ADDR",
        requires = "rls_config"
    )]
    pub grpc_bind: Option<SocketAddr>,

    /// The rate limit service's descriptors: YAML in envoyproxy/ratelimit's format, one domain per
    /// document (docs/envoy-ratelimit.md); read again within a second of a change.
    #[arg(
        long,
        env = "SLUICE_RLS_CONFIG",
        value_name = "PATH",
        requires = "grpc_bind"
    )]
    pub rls_config: Option<PathBuf>,

    /// Redis URL (`redis://host:port`), or a comma-separated list of Redis Cluster node URLs.
    #[arg(
        long,
        env = "SLUICE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,

    /// Treat `--redis-url` as a Redis Cluster (implied by a comma-separated list).
    #[arg(long, env = "SLUICE_REDIS_CLUSTER")]
    pub redis_cluster: bool,

    /// Find the primary through Redis Sentinel: the name the sentinels monitor it under;
    /// `--redis-url` then lists the sentinels (comma-separated).
    #[arg(long, env = "SLUICE_REDIS_SENTINEL", value_name = "NAME")]
    pub redis_sentinel: Option<String>,

    /// PEM file of the certificate authorities that sign Redis's certificate (`rediss://` URLs).
    /// Without it, the system's roots.
    #[arg(long, env = "SLUICE_REDIS_CA_FILE", value_name = "PATH")]
    pub redis_ca_file: Option<PathBuf>,

    /// PEM file of the client certificate (chain) the service shows Redis, for mutual TLS.
    #[arg(long, env = "SLUICE_REDIS_CLIENT_CERT_FILE", value_name = "PATH")]
    pub redis_client_cert_file: Option<PathBuf>,

    /// PEM file of the client certificate's private key.
    #[arg(long, env = "SLUICE_REDIS_CLIENT_KEY_FILE", value_name = "PATH")]
    pub redis_client_key_file: Option<PathBuf>,

    /// File holding the password of Redis's user (`redis://USER@host`, or the default user
    /// without one): its content, one trailing newline trimmed. Or SLUICE_REDIS_PASSWORD; never
    /// in the URL (a flag is visible in the process list).
    #[arg(long, env = "SLUICE_REDIS_PASSWORD_FILE", value_name = "PATH")]
    pub redis_password_file: Option<PathBuf>,

    /// Shared bearer token the proxies send (`Authorization: Bearer <token>`). Visible in the
    /// process list: prefer --token-file (or SLUICE_TOKEN).
    #[arg(long, env = "SLUICE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// File holding the shared bearer token (its content, trailing newline trimmed). The
    /// recommended way to pass the token.
    #[arg(long, env = "SLUICE_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// File of per-proxy credentials, one `name token` a line (`#` starts a comment). A proxy's
    /// id is then kept under its credential's name, so no holder can speak for another's proxies.
    #[arg(long, env = "SLUICE_TOKENS_FILE", value_name = "PATH")]
    pub tokens_file: Option<PathBuf>,

    /// File of the admin API's credentials (`/admin/v1`: live overrides, audit log), one
    /// `name token` a line (`#` starts a comment), like --tokens-file; the name is who the audit
    /// log records. Separate from the proxies' tokens: an admin token is refused on `/v1`, a
    /// proxy token on `/admin/v1`. Without it the admin API is disabled (it answers 404).
    #[arg(long, env = "SLUICE_ADMIN_TOKENS_FILE", value_name = "PATH")]
    pub admin_tokens_file: Option<PathBuf>,

    /// PEM certificate chain the service presents, with --tls-key-file: it then serves HTTPS
    /// only (TLS 1.2 and 1.3). Both files are read again on SIGHUP and when either changes; a
    /// reload that fails keeps the certificate in use.
    #[arg(long, env = "SLUICE_TLS_CERT_FILE", value_name = "PATH")]
    pub tls_cert_file: Option<PathBuf>,

    /// PEM private key of --tls-cert-file's certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "SLUICE_TLS_KEY_FILE", value_name = "PATH")]
    pub tls_key_file: Option<PathBuf>,

    /// PEM file of the certificate authorities that sign the clients' certificates (mutual TLS),
    /// with --tls-cert-file and a mapping (--client-certs-file, --admin-client-certs-file). A
    /// client may still connect without a certificate (and send a token); one whose certificate
    /// this does not verify is refused in the handshake. Read again with --tls-cert-file.
    #[arg(long, env = "SLUICE_TLS_CLIENT_CA_FILE", value_name = "PATH")]
    pub tls_client_ca_file: Option<PathBuf>,

    /// File mapping client certificates to the proxies' credentials, one `san name` a line (`#`
    /// starts a comment): a DNS or URI SAN (e.g. spiffe://example.org/edge-eu) and the name of a
    /// credential, as --tokens-file names them. A proxy showing a certificate with that SAN is
    /// that credential on `/v1`, without a token or with one of the same name. Read again on
    /// SIGHUP and when it changes.
    #[arg(long, env = "SLUICE_CLIENT_CERTS_FILE", value_name = "PATH")]
    pub client_certs_file: Option<PathBuf>,

    /// File mapping client certificates to admin names, like --client-certs-file: a certificate
    /// with one of its SANs is that admin on `/admin/v1` (only there), the name the audit log
    /// records. Enables the admin API, as --admin-tokens-file does.
    #[arg(long, env = "SLUICE_ADMIN_CLIENT_CERTS_FILE", value_name = "PATH")]
    pub admin_client_certs_file: Option<PathBuf>,

    /// The filter configuration the proxies run (the JSON of the plugin's `configuration`). With
    /// it, every admin PUT of limits or keys is checked as the proxies check it (an unknown rule
    /// or tier, limits a rule refuses, the memory their sliding logs take, a key that can match
    /// nothing) and refused with 400 naming the field. Without it the proxies are the check: they
    /// log what they do not apply and keep their configuration. A file that does not parse stops
    /// the service at start.
    #[arg(long, env = "SLUICE_POLICY", value_name = "PATH")]
    pub policy: Option<PathBuf>,

    /// Accept requests without a token (local experiments only).
    #[arg(long, env = "SLUICE_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,

    /// Deadline of every Redis call, in milliseconds.
    #[arg(long, env = "SLUICE_REDIS_TIMEOUT_MS", default_value_t = 50)]
    pub redis_timeout_ms: u64,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "SLUICE_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,

    /// Most entries in one sync batch.
    #[arg(long, env = "SLUICE_MAX_BATCH", default_value_t = 10_000)]
    pub max_batch: usize,

    /// Longest accepted key (and proxy id), in bytes.
    #[arg(long, env = "SLUICE_MAX_KEY_BYTES", default_value_t = 512)]
    pub max_key_bytes: usize,

    /// Most requests served at once; more are shed with 503.
    #[arg(long, env = "SLUICE_MAX_CONCURRENCY", default_value_t = 512)]
    pub max_concurrency: usize,

    /// Deadline of a whole request, in milliseconds.
    #[arg(long, env = "SLUICE_REQUEST_TIMEOUT_MS", default_value_t = 1000)]
    pub request_timeout_ms: u64,

    /// How many sync intervals a grant lives before it expires (1 to 100).
    #[arg(long, env = "SLUICE_GRANT_TTL_INTERVALS", default_value_t = 3)]
    pub grant_ttl_intervals: u64,

    /// Shortest sync interval the service accepts, in milliseconds: a proxy's `interval_ms` is
    /// raised to it.
    #[arg(long, env = "SLUICE_MIN_SYNC_INTERVAL_MS", default_value_t = 10)]
    pub min_sync_interval_ms: u64,

    /// Longest sync interval the service accepts, in milliseconds: a proxy's `interval_ms` is
    /// lowered to it. Leases are sized and timed by the clamped interval.
    #[arg(long, env = "SLUICE_MAX_SYNC_INTERVAL_MS", default_value_t = 60_000)]
    pub max_sync_interval_ms: u64,

    /// Deadline for a client to send a request's headers, in milliseconds; also how long a
    /// kept-alive connection may stay idle.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT_MS", default_value_t = 5_000)]
    pub header_read_timeout_ms: u64,

    /// How long the live overrides' version one read found answers the syncs that follow on this
    /// replica, in milliseconds, instead of a Redis call per sync; 0 reads at every sync. A change
    /// made through another replica reaches proxies at most this much later (one made through
    /// this replica, at the next sync).
    #[arg(long, env = "SLUICE_OVERRIDES_REFRESH_MS", default_value_t = 50)]
    pub overrides_refresh_ms: u64,

    /// Most bytes of live overrides kept, as proxies receive them (each entry's name and value
    /// JSON-escaped): a change that would take the set past it is refused. At most 4 MiB (the
    /// most a proxy keeps).
    #[arg(long, env = "SLUICE_OVERRIDES_MAX_BYTES", default_value_t = 1 << 20)]
    pub overrides_max_bytes: u64,

    /// Most keys given limits of their own at once (`PUT /admin/v1/overrides/keys/RULE` with
    /// `limits`), over every rule: one more is refused. 1 to 10000 (the most a proxy applies).
    #[arg(long, env = "SLUICE_KEY_LIMITS_MAX", default_value_t = 1_000)]
    pub key_limits_max: u64,

    /// Most connections open at once; more wait in the listen backlog until one closes.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = 4_096)]
    pub max_connections: usize,

    /// Longest a load report counts in the fleet level, in milliseconds (1 to 10800000): a report
    /// is fresh for three of the intervals the service answered its proxy, at least 1 s, and
    /// never longer than this, whatever interval the proxy names. Keep it at least three of the
    /// proxies' longest sync interval.
    #[arg(long, env = "SLUICE_FLEET_REPORT_MAX_AGE_MS", default_value_t = 5_000)]
    pub fleet_report_max_age_ms: u64,

    /// Most proxy ids one credential has load reports under (1 to 10000); past it, that
    /// credential's reports under new ids are not recorded. With a shared token every proxy is
    /// one credential: keep it at least the number of proxies.
    #[arg(
        long,
        env = "SLUICE_FLEET_MAX_PROXIES_PER_CREDENTIAL",
        default_value_t = 256
    )]
    pub fleet_max_proxies_per_credential: u64,

    /// Most calls a second of `GET /v1/status`, the endpoint without credentials, that may build a
    /// new status (1 to 10000); past it, a call gets the last status built, with its `Age` (429
    /// with `Retry-After` only before any was built). One status is built every 2 s at most.
    #[arg(long, env = "SLUICE_STATUS_RATE_PER_S", default_value_t = 20)]
    pub status_rate_per_s: u64,
}

/// Longest `--max-sync-interval-ms`: one hour.
pub const MAX_SYNC_INTERVAL_MS: u64 = 3_600_000;
/// Most `--grant-ttl-intervals`.
pub const MAX_GRANT_TTL_INTERVALS: u64 = 100;
/// Longest `--fleet-report-max-age-ms`: three of the longest sync intervals.
pub const MAX_FLEET_REPORT_AGE_MS: u64 = 3 * MAX_SYNC_INTERVAL_MS;
/// Most `--fleet-max-proxies-per-credential`: a credential's reports are read in one call.
pub const MAX_FLEET_PROXIES_PER_CREDENTIAL: u64 = 10_000;

/// Most `--status-rate-per-s`.
pub const MAX_STATUS_RATE_PER_S: u64 = 10_000;

/// Largest admin API body (`--max-body-bytes` bounds it too).
pub const ADMIN_MAX_BODY_BYTES: usize = 64 << 10;

impl Settings {
    /// The admin API's body limit: the smaller of [`ADMIN_MAX_BODY_BYTES`] and `--max-body-bytes`.
    pub fn admin_body_limit(&self) -> usize {
        self.max_body_bytes.min(ADMIN_MAX_BODY_BYTES)
    }

    /// The settings, or the reason (naming the flag) they cannot run a service.
    pub fn validate(&self) -> Result<(), String> {
        let sources = [
            self.shared_token().is_some(),
            self.token_file.is_some(),
            self.tokens_file.is_some(),
        ];
        match sources.iter().filter(|&&given| given).count() {
            0 if !self.insecure_no_auth && self.client_certs_file.is_none() => {
                return Err(NO_TOKEN.into())
            }
            0 | 1 => {}
            _ => return Err(ONE_TOKEN_SOURCE.into()),
        }
        if self.client_certs_file.is_some() && (sources[0] || sources[1]) {
            return Err(CERTS_NEED_NAMES.into());
        }
        let positive = [
            ("--redis-timeout-ms", self.redis_timeout_ms),
            ("--max-body-bytes", self.max_body_bytes as u64),
            ("--max-batch", self.max_batch as u64),
            ("--max-key-bytes", self.max_key_bytes as u64),
            ("--max-concurrency", self.max_concurrency as u64),
            ("--request-timeout-ms", self.request_timeout_ms),
            ("--grant-ttl-intervals", self.grant_ttl_intervals),
            ("--min-sync-interval-ms", self.min_sync_interval_ms),
            ("--max-sync-interval-ms", self.max_sync_interval_ms),
            ("--header-read-timeout-ms", self.header_read_timeout_ms),
            ("--max-connections", self.max_connections as u64),
            ("--overrides-max-bytes", self.overrides_max_bytes),
            ("--key-limits-max", self.key_limits_max),
            ("--fleet-report-max-age-ms", self.fleet_report_max_age_ms),
            (
                "--fleet-max-proxies-per-credential",
                self.fleet_max_proxies_per_credential,
            ),
            ("--status-rate-per-s", self.status_rate_per_s),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.grant_ttl_intervals > MAX_GRANT_TTL_INTERVALS {
            return Err(format!(
                "--grant-ttl-intervals must be at most {MAX_GRANT_TTL_INTERVALS}"
            ));
        }
        if self.max_sync_interval_ms > MAX_SYNC_INTERVAL_MS {
            return Err(format!(
                "--max-sync-interval-ms must be at most {MAX_SYNC_INTERVAL_MS}"
            ));
        }
        let most = sluice_protocol::MAX_OVERRIDES_BYTES as u64;
        if self.overrides_max_bytes > most {
            return Err(format!(
                "--overrides-max-bytes must be at most {most} (what a proxy keeps)"
            ));
        }
        let most = sluice_core::overrides::MAX_KEY_LIMITS as u64;
        if self.key_limits_max > most {
            return Err(format!(
                "--key-limits-max must be at most {most} (what a proxy applies)"
            ));
        }
        if self.fleet_report_max_age_ms > MAX_FLEET_REPORT_AGE_MS {
            return Err(format!(
                "--fleet-report-max-age-ms must be at most {MAX_FLEET_REPORT_AGE_MS}"
            ));
        }
        if self.fleet_max_proxies_per_credential > MAX_FLEET_PROXIES_PER_CREDENTIAL {
            return Err(format!(
                "--fleet-max-proxies-per-credential must be at most \
                 {MAX_FLEET_PROXIES_PER_CREDENTIAL}"
            ));
        }
        if self.status_rate_per_s > MAX_STATUS_RATE_PER_S {
            return Err(format!(
                "--status-rate-per-s must be at most {MAX_STATUS_RATE_PER_S}"
            ));
        }
        if self.min_sync_interval_ms > self.max_sync_interval_ms {
            return Err("--min-sync-interval-ms must not be above --max-sync-interval-ms".into());
        }
        if self.redis_nodes().is_empty() {
            return Err("--redis-url (SLUICE_REDIS_URL) is empty".into());
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => return Err("--tls-cert-file needs --tls-key-file".into()),
            (None, Some(_)) => return Err("--tls-key-file needs --tls-cert-file".into()),
            _ => {}
        }
        self.validate_client_certs()?;
        crate::redis_access::check_urls(&self.redis_nodes())?;
        if let Some(name) = &self.redis_sentinel {
            if self.redis_cluster {
                return Err("give only one of --redis-sentinel and --redis-cluster".into());
            }
            if name.is_empty()
                || name.len() > 256
                || name.chars().any(|c| c.is_control() || c == ' ')
            {
                return Err(
                    "--redis-sentinel (SLUICE_REDIS_SENTINEL): the primary's name, 1 to 256 \
                     characters without spaces"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// Mutual TLS: a CA needs the service's own certificate and something to map its clients'
    /// certificates to; each mapping needs the CA.
    fn validate_client_certs(&self) -> Result<(), String> {
        let mapped = self.client_certs_file.is_some() || self.admin_client_certs_file.is_some();
        match &self.tls_client_ca_file {
            Some(_) if self.tls_cert_file.is_none() => Err(
                "--tls-client-ca-file needs --tls-cert-file (client certificates are shown \
                     over TLS only)"
                    .into(),
            ),
            Some(_) if !mapped => Err("--tls-client-ca-file needs --client-certs-file or \
                 --admin-client-certs-file (what a certificate's SAN is a credential of)"
                .into()),
            None if self.client_certs_file.is_some() => Err(
                "--client-certs-file needs --tls-client-ca-file (who signs the certificates)"
                    .into(),
            ),
            None if self.admin_client_certs_file.is_some() => Err(
                "--admin-client-certs-file needs --tls-client-ca-file (who signs the certificates)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// The certificate to serve HTTPS with, read from --tls-cert-file and --tls-key-file, and
    /// the clients' CA (--tls-client-ca-file); `None` without them (plain HTTP). The reason names
    /// the flag whose file is wrong.
    pub fn tls(&self) -> Result<Option<crate::tls::Tls>, String> {
        self.validate()?;
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                crate::tls::Tls::load(cert, key, self.tls_client_ca_file.as_deref()).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The Redis URLs: one for a single Redis, the seed nodes for a cluster.
    pub fn redis_nodes(&self) -> Vec<String> {
        self.redis_url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Whether Redis is a cluster: the flag, or more than one node URL (not sentinels).
    pub fn is_cluster(&self) -> bool {
        self.redis_sentinel.is_none() && (self.redis_cluster || self.redis_nodes().len() > 1)
    }

    /// How to reach Redis: the URLs, TLS, the user and password, read and checked. The reason
    /// names the flag (or variable) and holds no secret.
    pub fn redis_access(&self) -> Result<crate::redis_access::RedisAccess, String> {
        let env = std::env::var(crate::redis_access::PASSWORD_ENV);
        let env = match env {
            Ok(value) => Some(value),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(format!("{}: not UTF-8", crate::redis_access::PASSWORD_ENV))
            }
        };
        let flags = crate::redis_access::Flags {
            urls: self.redis_nodes(),
            ca: self.redis_ca_file.as_deref(),
            cert: self.redis_client_cert_file.as_deref(),
            key: self.redis_client_key_file.as_deref(),
            password_file: self.redis_password_file.as_deref(),
        };
        crate::redis_access::read(flags, env)
    }

    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn overrides_refresh(&self) -> Duration {
        Duration::from_millis(self.overrides_refresh_ms)
    }

    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    /// A proxy's `interval_ms`, brought into `[--min-sync-interval-ms, --max-sync-interval-ms]`:
    /// the interval the service sizes and times its leases by, and answers in the hints.
    pub fn sync_interval_ms(&self, asked_ms: u64) -> u64 {
        let min = self.min_sync_interval_ms.max(1);
        asked_ms.clamp(min, self.max_sync_interval_ms.max(min))
    }

    /// How long a lease granted for a sync at `interval_ms` (already clamped) lives.
    pub fn grant_ttl_ms(&self, interval_ms: u64) -> u64 {
        interval_ms.saturating_mul(self.grant_ttl_intervals)
    }

    /// `--token`, unless empty.
    fn shared_token(&self) -> Option<&str> {
        self.token.as_deref().filter(|token| !token.is_empty())
    }

    /// Who may call `/v1`: reads the token files. The reason names the flag when it fails.
    pub fn credentials(&self) -> Result<Credentials, String> {
        self.validate()?;
        if let Some(token) = self.shared_token() {
            return Credentials::shared(token).map_err(|reason| format!("--token: {reason}"));
        }
        if let Some(path) = &self.token_file {
            let text = read("--token-file", path)?;
            let token = text.trim_end_matches(['\n', '\r']);
            return Credentials::shared(token)
                .map_err(|reason| format!("--token-file {}: {reason}", path.display()));
        }
        if let Some(path) = &self.tokens_file {
            let text = read("--tokens-file", path)?;
            return Credentials::per_proxy(&text)
                .map_err(|reason| format!("--tokens-file {}: {reason}", path.display()));
        }
        if self.insecure_no_auth {
            Ok(Credentials::Open)
        } else {
            Ok(Credentials::NoToken)
        }
    }

    /// Who may call the admin API: reads `--admin-tokens-file`; no token without it but with
    /// `--admin-client-certs-file`, `None` without either (the admin API is disabled). The reason
    /// names the flag when it fails.
    pub fn admin_credentials(&self) -> Result<Option<Credentials>, String> {
        let Some(path) = &self.admin_tokens_file else {
            let by_certificate = self.admin_client_certs_file.is_some();
            return Ok(by_certificate.then_some(Credentials::NoToken));
        };
        let text = read("--admin-tokens-file", path)?;
        Credentials::per_proxy(&text)
            .map(Some)
            .map_err(|reason| format!("--admin-tokens-file {}: {reason}", path.display()))
    }
}

impl Settings {
    /// Which client certificates are which proxy credential: reads `--client-certs-file`; `None`
    /// without it. The reason names the flag and the line when it fails.
    pub fn client_certs(&self) -> Result<Option<CertNames>, String> {
        read_cert_names("--client-certs-file", self.client_certs_file.as_deref())
    }

    /// Which client certificates are which admin: reads `--admin-client-certs-file`; `None`
    /// without it.
    pub fn admin_client_certs(&self) -> Result<Option<CertNames>, String> {
        read_cert_names(
            "--admin-client-certs-file",
            self.admin_client_certs_file.as_deref(),
        )
    }

    /// Whether the admin API is enabled: an admin tokens file or an admin certificates file.
    pub fn admin_api(&self) -> bool {
        self.admin_tokens_file.is_some() || self.admin_client_certs_file.is_some()
    }
}

fn read_cert_names(flag: &str, path: Option<&Path>) -> Result<Option<CertNames>, String> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text = read(flag, path)?;
    CertNames::parse(&text)
        .map(Some)
        .map_err(|reason| format!("{flag} {}: {reason}", path.display()))
}

impl Settings {
    /// The proxies' configuration (`--policy`), parsed by the filter's own parser; `None` without
    /// the flag. The reason names the flag and the configuration's field when it fails.
    pub fn policy(&self) -> Result<Option<sluice_core::policy::Policy>, String> {
        let Some(path) = &self.policy else {
            return Ok(None);
        };
        let bytes =
            std::fs::read(path).map_err(|error| format!("--policy {}: {error}", path.display()))?;
        sluice_core::parse(&bytes)
            .map(Some)
            .map_err(|error| format!("--policy {}: {error}", path.display()))
    }
}

const NO_TOKEN: &str = "a token is required unless --insecure-no-auth: --token-file \
    (SLUICE_TOKEN_FILE), --tokens-file (SLUICE_TOKENS_FILE) or --token (SLUICE_TOKEN); or client \
    certificates (--client-certs-file)";
const CERTS_NEED_NAMES: &str = "--client-certs-file names credentials as --tokens-file does: \
    give the tokens in --tokens-file, not as one shared token (--token, --token-file), whose \
    holders could pass for a certificate's proxies";
const ONE_TOKEN_SOURCE: &str =
    "give only one of --token (SLUICE_TOKEN), --token-file (SLUICE_TOKEN_FILE) and \
    --tokens-file (SLUICE_TOKENS_FILE)";

fn read(flag: &str, path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|error| format!("{flag} {}: {error}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Settings {
        let mut all = vec!["sluice-counter-service"];
        all.extend_from_slice(args);
        Settings::try_parse_from(all).unwrap()
    }

    #[test]
    fn a_token_is_required_unless_insecure() {
        let settings = parse(&["--token", ""]);
        assert_eq!(settings.validate().unwrap_err(), NO_TOKEN);
        assert!(parse(&["--token", "t"]).validate().is_ok());
        assert!(parse(&["--token", "", "--insecure-no-auth"])
            .validate()
            .is_ok());
    }

    #[test]
    fn a_list_of_urls_is_a_cluster() {
        let settings = parse(&["--token", "t", "--redis-url", "redis://a:1, redis://b:2"]);
        assert_eq!(settings.redis_nodes(), ["redis://a:1", "redis://b:2"]);
        assert!(settings.is_cluster());
        assert!(!parse(&["--token", "t"]).is_cluster());
    }

    #[test]
    fn the_sync_interval_is_clamped_to_the_bounds() {
        let settings = parse(&["--token", "t"]);
        assert_eq!(settings.sync_interval_ms(0), 10);
        assert_eq!(settings.sync_interval_ms(100), 100);
        assert_eq!(settings.sync_interval_ms(3_600_000), 60_000);
        assert_eq!(settings.grant_ttl_ms(60_000), 180_000);
        let bounds = |min: &str, max: &str| {
            parse(&[
                "--token",
                "t",
                "--min-sync-interval-ms",
                min,
                "--max-sync-interval-ms",
                max,
            ])
            .validate()
        };
        assert!(bounds("50", "50").is_ok());
        assert_eq!(
            bounds("51", "50").unwrap_err(),
            "--min-sync-interval-ms must not be above --max-sync-interval-ms"
        );
        assert_eq!(
            bounds("10", "3600001").unwrap_err(),
            "--max-sync-interval-ms must be at most 3600000"
        );
    }

    #[test]
    fn one_token_source_at_most() {
        let settings = parse(&["--token", "t", "--token-file", "f"]);
        assert_eq!(settings.validate().unwrap_err(), ONE_TOKEN_SOURCE);
        assert!(parse(&["--tokens-file", "f"]).validate().is_ok());
        let error = parse(&["--token-file", "/nonexistent/token"])
            .credentials()
            .unwrap_err();
        assert!(
            error.starts_with("--token-file /nonexistent/token: "),
            "{error}"
        );
        let error = parse(&["--token", "two words"]).credentials().unwrap_err();
        assert_eq!(
            error,
            "--token: the token must be visible ASCII, without spaces"
        );
    }

    #[test]
    fn admin_tokens_are_read_from_their_own_file() {
        assert!(parse(&["--token", "t"])
            .admin_credentials()
            .unwrap()
            .is_none());
        let error = parse(&["--token", "t", "--admin-tokens-file", "/nonexistent/admins"])
            .admin_credentials()
            .unwrap_err();
        assert!(
            error.starts_with("--admin-tokens-file /nonexistent/admins: "),
            "{error}"
        );
        let file = std::env::temp_dir().join(format!("sluice-{}-admins", std::process::id()));
        std::fs::write(&file, "# operators\nalice a-token\nbob\n").unwrap();
        let settings = parse(&[
            "--token",
            "t",
            "--admin-tokens-file",
            file.to_str().unwrap(),
        ]);
        let error = settings.admin_credentials().unwrap_err();
        std::fs::write(&file, "alice a-token\n").unwrap();
        let admins = settings.admin_credentials().unwrap().unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(
            error.ends_with(": line 3: expected `name token`"),
            "{error}"
        );
        let caller = admins.authenticate(Some(b"Bearer a-token")).unwrap();
        assert_eq!(caller.name.as_deref(), Some("alice"));
    }

    #[test]
    fn the_overrides_bound_is_at_most_what_a_proxy_keeps() {
        let bound = |bytes: &str| parse(&["--token", "t", "--overrides-max-bytes", bytes]);
        assert_eq!(parse(&["--token", "t"]).overrides_max_bytes, 1 << 20);
        assert!(bound("4194304").validate().is_ok());
        assert_eq!(
            bound("4194305").validate().unwrap_err(),
            "--overrides-max-bytes must be at most 4194304 (what a proxy keeps)"
        );
        assert_eq!(
            bound("0").validate().unwrap_err(),
            "--overrides-max-bytes must be at least 1"
        );
    }

    #[test]
    fn the_fleet_bounds_are_bounded() {
        let settings = parse(&["--token", "t"]);
        assert_eq!(settings.fleet_report_max_age_ms, 5_000);
        assert_eq!(settings.fleet_max_proxies_per_credential, 256);
        let fleet = |flag: &str, value: &str| parse(&["--token", "t", flag, value]).validate();
        assert!(fleet("--fleet-report-max-age-ms", "10800000").is_ok());
        assert_eq!(
            fleet("--fleet-report-max-age-ms", "10800001").unwrap_err(),
            "--fleet-report-max-age-ms must be at most 10800000"
        );
        assert_eq!(
            fleet("--fleet-report-max-age-ms", "0").unwrap_err(),
            "--fleet-report-max-age-ms must be at least 1"
        );
        assert!(fleet("--fleet-max-proxies-per-credential", "10000").is_ok());
        assert_eq!(
            fleet("--fleet-max-proxies-per-credential", "10001").unwrap_err(),
            "--fleet-max-proxies-per-credential must be at most 10000"
        );
        assert_eq!(
            fleet("--fleet-max-proxies-per-credential", "0").unwrap_err(),
            "--fleet-max-proxies-per-credential must be at least 1"
        );
    }

    #[test]
    fn a_sentinel_name_is_checked_and_is_not_a_cluster() {
        let sentinel = |name: &str, more: &[&str]| {
            let mut args = vec![
                "--token",
                "t",
                "--redis-url",
                "redis://a:26379,redis://b:26379",
                "--redis-sentinel",
                name,
            ];
            args.extend_from_slice(more);
            parse(&args)
        };
        assert!(sentinel("mymaster", &[]).validate().is_ok());
        assert!(!sentinel("mymaster", &[]).is_cluster());
        for bad in ["", "two words", "line\nbreak", &"n".repeat(257)] {
            let error = sentinel(bad, &[]).validate().unwrap_err();
            assert!(
                error.starts_with("--redis-sentinel (SLUICE_REDIS_SENTINEL): "),
                "{error}"
            );
        }
        assert_eq!(
            sentinel("mymaster", &["--redis-cluster"])
                .validate()
                .unwrap_err(),
            "give only one of --redis-sentinel and --redis-cluster"
        );
    }

    #[test]
    fn zero_limits_name_their_flag() {
        let settings = parse(&["--token", "t", "--max-batch", "0"]);
        assert_eq!(
            settings.validate().unwrap_err(),
            "--max-batch must be at least 1"
        );
    }
}
