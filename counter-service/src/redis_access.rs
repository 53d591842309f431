//! How the service reaches Redis: the URLs, TLS (`rediss://`: a CA file, a client certificate for
//! mutual TLS), an ACL user and its password, Sentinel. Read once at start; every reason it
//! cannot be used names the flag (or variable) and never holds a secret: no password, no key,
//! and no URL (one could hold a password).

use std::path::Path;

use redis::{ClientTlsConfig, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The environment variable that may hold the Redis password (there is no flag: a flag's value
/// is in the process list).
pub const PASSWORD_ENV: &str = "SLUICE_REDIS_PASSWORD";

/// Longest password accepted from a file or the environment, in bytes.
pub const MAX_PASSWORD_BYTES: usize = 4096;

/// Largest CA, certificate or key file read, in bytes.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// Everything needed to connect, checked.
#[derive(Clone, Default)]
pub struct RedisAccess {
    /// The URLs: Redis, the cluster's seed nodes, or the sentinels. None holds a password.
    pub urls: Vec<String>,
    /// Whether the URLs are `rediss://`.
    pub tls: bool,
    /// The CA and client certificate to use over TLS (`None`: the system's roots, no client
    /// certificate).
    pub certificates: Option<TlsCertificates>,
    /// The ACL user, from the URL (`redis://USER@host`).
    pub username: Option<String>,
    /// The password, from `--redis-password-file` or `SLUICE_REDIS_PASSWORD`.
    pub password: Option<Password>,
}

/// A password: never printed (its `Debug` is `<redacted>`).
#[derive(Clone)]
pub struct Password(String);

impl Password {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Debug for RedisAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAccess")
            .field("urls", &self.urls)
            .field("tls", &self.tls)
            .field("certificates", &self.certificates.is_some())
            .field("username", &self.username)
            .field("password", &self.password)
            .finish()
    }
}

/// Checks the URLs without reading anything: the scheme, one scheme for all, no password, no
/// `#insecure`. The reasons name `--redis-url` and never quote it.
pub fn check_urls(urls: &[String]) -> Result<(), String> {
    let mut schemes = Vec::new();
    for (index, text) in urls.iter().enumerate() {
        let which = if urls.len() > 1 {
            format!("--redis-url (SLUICE_REDIS_URL), URL {}", index + 1)
        } else {
            "--redis-url (SLUICE_REDIS_URL)".to_owned()
        };
        let url = url::Url::parse(text).map_err(|error| format!("{which}: {error}"))?;
        if url.password().is_some() || has_password_separator(text) {
            return Err(format!(
                "{which} holds a password, which would be visible in the process list and the \
                 environment of every child: give it in --redis-password-file \
                 (SLUICE_REDIS_PASSWORD_FILE) or {PASSWORD_ENV}, and only the user in the URL \
                 (redis://USER@host)"
            ));
        }
        match url.scheme() {
            "redis" | "rediss" => {}
            _ => {
                return Err(format!(
                    "{which}: the scheme must be redis:// or rediss:// (TLS)"
                ))
            }
        }
        if url.fragment().is_some() {
            return Err(format!(
                "{which}: a URL fragment (such as #insecure, which would skip checking Redis's \
                 certificate) is refused"
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("{which}: no host"));
        }
        schemes.push(url.scheme().to_owned());
    }
    schemes.dedup();
    if schemes.len() > 1 {
        return Err(
            "--redis-url (SLUICE_REDIS_URL): mixes redis:// and rediss:// URLs; use one scheme"
                .into(),
        );
    }
    Ok(())
}

/// Whether the URL's user part holds a `:` (`redis://user:@host`: a password, even empty).
fn has_password_separator(text: &str) -> bool {
    let rest = text.split_once("://").map_or(text, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .is_some_and(|(user, _)| user.contains(':'))
}

/// The Redis flags as given (`--redis-url`'s nodes, the TLS files, the password file).
pub struct Flags<'a> {
    pub urls: Vec<String>,
    pub ca: Option<&'a Path>,
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
    pub password_file: Option<&'a Path>,
}

/// Reads and checks what the settings name, given the value of `SLUICE_REDIS_PASSWORD` (`None`:
/// not set).
pub fn read(flags: Flags<'_>, password_env: Option<String>) -> Result<RedisAccess, String> {
    let urls = flags.urls;
    check_urls(&urls)?;
    let tls = urls.first().is_some_and(|url| url.starts_with("rediss://"));
    let username = match urls.first().map(|url| url::Url::parse(url)) {
        Some(Ok(url)) if !url.username().is_empty() => Some(
            percent_encoding::percent_decode_str(url.username())
                .decode_utf8()
                .map_err(|_| "--redis-url (SLUICE_REDIS_URL): the user is not UTF-8".to_owned())?
                .into_owned(),
        ),
        _ => None,
    };
    if urls.len() > 1 {
        let users: Vec<String> = urls
            .iter()
            .filter_map(|url| url::Url::parse(url).ok())
            .map(|url| url.username().to_owned())
            .collect();
        if users.windows(2).any(|pair| pair[0] != pair[1]) {
            return Err("--redis-url (SLUICE_REDIS_URL): every URL must name the same user".into());
        }
    }

    let (ca, cert, key) = (flags.ca, flags.cert, flags.key);
    if !tls {
        for (flag, given) in [
            ("--redis-ca-file", ca.is_some()),
            ("--redis-client-cert-file", cert.is_some()),
            ("--redis-client-key-file", key.is_some()),
        ] {
            if given {
                return Err(format!(
                    "{flag} is for TLS: give rediss:// URLs in --redis-url (SLUICE_REDIS_URL)"
                ));
            }
        }
    }
    let root_cert = ca.map(read_ca).transpose()?;
    let client_tls = match (cert, key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err("--redis-client-cert-file needs --redis-client-key-file".into())
        }
        (None, Some(_)) => {
            return Err("--redis-client-key-file needs --redis-client-cert-file".into())
        }
        (Some(cert), Some(key)) => Some(read_client(cert, key)?),
    };
    let certificates = (root_cert.is_some() || client_tls.is_some()).then_some(TlsCertificates {
        client_tls,
        root_cert,
    });

    let password = match (flags.password_file, password_env) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "give only one of --redis-password-file (SLUICE_REDIS_PASSWORD_FILE) and \
                 {PASSWORD_ENV}"
            ))
        }
        (Some(path), None) => {
            let flag = format!("--redis-password-file {}", path.display());
            let text = read_bounded(path, MAX_PASSWORD_BYTES as u64 + 2)
                .map_err(|error| format!("{flag}: {error}"))?;
            let text = String::from_utf8(text).map_err(|_| format!("{flag}: not UTF-8"))?;
            Some(password(&text, &flag)?)
        }
        (None, Some(value)) => Some(password(&value, PASSWORD_ENV)?),
        (None, None) => None,
    };
    if username.is_some() && password.is_none() {
        return Err(format!(
            "--redis-url (SLUICE_REDIS_URL) names a user but no password is given: \
             --redis-password-file (SLUICE_REDIS_PASSWORD_FILE) or {PASSWORD_ENV}"
        ));
    }
    Ok(RedisAccess {
        urls,
        tls,
        certificates,
        username,
        password,
    })
}

/// A password from a file's text or the variable: one trailing newline (`\n` or `\r\n`)
/// trimmed; empty, several lines or control characters refused.
fn password(text: &str, source: &str) -> Result<Password, String> {
    let line = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text);
    if line.is_empty() {
        return Err(format!("{source}: the password is empty"));
    }
    if line.len() > MAX_PASSWORD_BYTES {
        return Err(format!(
            "{source}: the password is longer than {MAX_PASSWORD_BYTES} bytes"
        ));
    }
    if line.chars().any(char::is_control) {
        return Err(format!(
            "{source}: the password holds a line break or another control character (one \
             trailing newline is trimmed, nothing else)"
        ));
    }
    Ok(Password(line.to_owned()))
}

fn read_bounded(path: &Path, most: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|error| error.to_string())?;
    let mut bytes = Vec::new();
    file.take(most + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| error.to_string())?;
    if bytes.len() as u64 > most {
        return Err(format!("larger than {most} bytes"));
    }
    Ok(bytes)
}

/// The CA file: PEM, at least one certificate, each one a trust anchor rustls accepts.
fn read_ca(path: &Path) -> Result<Vec<u8>, String> {
    let flag = format!("--redis-ca-file {}", path.display());
    let pem = read_bounded(path, MAX_PEM_BYTES).map_err(|error| format!("{flag}: {error}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|error| format!("{flag}: not PEM certificates: {error}"))?;
        roots
            .add(cert)
            .map_err(|error| format!("{flag}: a certificate is not usable as a CA: {error}"))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "{flag}: no certificate in it (expected PEM, `-----BEGIN CERTIFICATE-----`)"
        ));
    }
    Ok(pem)
}

/// The client certificate chain and its key, for mutual TLS.
fn read_client(cert: &Path, key: &Path) -> Result<ClientTlsConfig, String> {
    let cert_flag = format!("--redis-client-cert-file {}", cert.display());
    let key_flag = format!("--redis-client-key-file {}", key.display());
    let client_cert =
        read_bounded(cert, MAX_PEM_BYTES).map_err(|error| format!("{cert_flag}: {error}"))?;
    let mut count = 0;
    for one in CertificateDer::pem_slice_iter(&client_cert) {
        one.map_err(|error| format!("{cert_flag}: not PEM certificates: {error}"))?;
        count += 1;
    }
    if count == 0 {
        return Err(format!(
            "{cert_flag}: no certificate in it (expected PEM, `-----BEGIN CERTIFICATE-----`)"
        ));
    }
    let client_key =
        read_bounded(key, MAX_PEM_BYTES).map_err(|error| format!("{key_flag}: {error}"))?;
    // The parser's error names what it did not find, never the key's bytes.
    PrivateKeyDer::from_pem_slice(&client_key)
        .map_err(|error| format!("{key_flag}: no PEM private key in it: {error}"))?;
    Ok(ClientTlsConfig {
        client_cert,
        client_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_loses_one_trailing_newline_only() {
        assert_eq!(password("s3cret\n", "f").unwrap().expose(), "s3cret");
        assert_eq!(password("s3cret\r\n", "f").unwrap().expose(), "s3cret");
        assert_eq!(password("s3cret", "f").unwrap().expose(), "s3cret");
        assert_eq!(password("\n", "f").unwrap_err(), "f: the password is empty");
        assert_eq!(password("", "f").unwrap_err(), "f: the password is empty");
        let two = password("s3cret\n\n", "f").unwrap_err();
        assert!(
            two.starts_with("f: the password holds a line break"),
            "{two}"
        );
        assert!(!two.contains("s3cret"));
        assert!(password("a\nb", "f").is_err());
        assert!(password(&"x".repeat(MAX_PASSWORD_BYTES + 1), "f").is_err());
        assert_eq!(
            format!("{:?}", password("s3cret", "f").unwrap()),
            "<redacted>"
        );
    }

    #[test]
    fn a_url_with_a_password_is_refused_without_being_quoted() {
        for url in [
            "redis://alice:hunter2@127.0.0.1:6379",
            "rediss://:hunter2@127.0.0.1:6379",
            "redis://alice:@127.0.0.1:6379",
        ] {
            let error = check_urls(&[url.to_owned()]).unwrap_err();
            assert!(error.contains("holds a password"), "{error}");
            assert!(
                !error.contains("hunter2") && !error.contains(url),
                "{error}"
            );
        }
        let error = check_urls(&[
            "redis://a:1".to_owned(),
            "redis://bob:hunter2@b:2".to_owned(),
        ])
        .unwrap_err();
        assert!(error.starts_with("--redis-url (SLUICE_REDIS_URL), URL 2 holds a password"));
        assert!(!error.contains("hunter2"));
    }

    #[test]
    fn urls_are_redis_or_rediss_without_a_fragment() {
        assert!(check_urls(&["redis://alice@h:1".to_owned()]).is_ok());
        assert!(check_urls(&["rediss://h:1".to_owned()]).is_ok());
        let error = check_urls(&["rediss://h:1/#insecure".to_owned()]).unwrap_err();
        assert!(error.contains("#insecure"), "{error}");
        let error = check_urls(&["http://h:1".to_owned()]).unwrap_err();
        assert_eq!(
            error,
            "--redis-url (SLUICE_REDIS_URL): the scheme must be redis:// or rediss:// (TLS)"
        );
        let error = check_urls(&["redis://a:1".to_owned(), "rediss://b:2".to_owned()]);
        assert!(error.unwrap_err().contains("mixes redis:// and rediss://"));
        assert!(check_urls(&["not a url".to_owned()]).is_err());
    }
}
