//! Who may call `/v1`: one shared token, or one credential per proxy (`--tokens-file`); and
//! who may call the admin API (`--admin-tokens-file`, read as a tokens file). A client
//! certificate may stand for a named credential too ([`crate::client_certs`], [`crate::auth`]).
//!
//! The scheme is matched case-insensitively (`Bearer`, `bearer`); the token must then follow
//! after exactly one space and is compared byte for byte, in constant time: no padding, no
//! trimming.

use std::sync::Arc;

use subtle::ConstantTimeEq;

/// Longest name of a per-proxy credential.
pub const MAX_NAME_BYTES: usize = 64;

/// Who may call `/v1`.
#[derive(Debug, Clone)]
pub enum Credentials {
    /// Anyone (`--insecure-no-auth` without a token).
    Open,
    /// Every proxy holds the same token (`--token`, `--token-file`).
    Shared(Vec<u8>),
    /// Each proxy holds a named token (`--tokens-file`); the name namespaces its proxy ids.
    PerProxy(Vec<(Arc<str>, Vec<u8>)>),
    /// No token is valid: callers are known by their client certificate alone
    /// (`--client-certs-file` or `--admin-client-certs-file` without a tokens file).
    NoToken,
}

/// The caller of a `/v1` request, as the token identified it (a request extension).
#[derive(Debug, Clone, Default)]
pub struct Caller {
    /// The credential's name with `--tokens-file`; `None` with a shared token or no token.
    pub name: Option<Arc<str>>,
}

impl Caller {
    /// The proxy id under which this caller's state is kept in Redis: `<name>/<proxy>` for a
    /// named credential, the proxy's own id otherwise.
    pub fn proxy_id(&self, proxy: &str) -> String {
        match &self.name {
            Some(name) => format!("{name}/{proxy}"),
            None => proxy.to_owned(),
        }
    }

    /// Whom the spend this caller reports beyond its leases is owed by (`lua/prelude.lua`'s
    /// `settle_debts`): the credential's name with `--tokens-file` (however many proxy ids it
    /// reports under), the proxy's own id otherwise. A penalty never starts from one debtor's
    /// unleased reports alone.
    pub fn debtor<'a>(&'a self, proxy: &'a str) -> &'a str {
        self.name.as_deref().unwrap_or(proxy)
    }
}

/// The lines of a file of `first second` lines (a tokens file, a certificate mapping): each one's
/// number (from 1) and its two fields. Blank lines and lines starting with `#` are skipped; a line
/// of another shape is refused naming it and `shape`, e.g. `name token`.
pub(crate) fn field_pairs<'a>(
    text: &'a str,
    shape: &'a str,
) -> impl Iterator<Item = Result<(usize, &'a str, &'a str), String>> + 'a {
    text.lines()
        .enumerate()
        .map(|(number, line)| (number + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(move |(number, line)| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields[..] {
                [first, second] => Ok((number, first, second)),
                _ => Err(format!("line {number}: expected `{shape}`")),
            }
        })
}

impl Credentials {
    /// One token for every proxy.
    pub fn shared(token: &str) -> Result<Credentials, String> {
        check_token(token)?;
        Ok(Credentials::Shared(token.as_bytes().to_vec()))
    }

    /// Named tokens from the text of a tokens file: one `name token` a line; blank lines and
    /// lines starting with `#` are skipped. A name may hold several tokens (for rotation).
    pub fn per_proxy(text: &str) -> Result<Credentials, String> {
        let mut credentials: Vec<(Arc<str>, Vec<u8>)> = Vec::new();
        for pair in field_pairs(text, "name token") {
            let (number, name, token) = pair?;
            let at = |reason: String| format!("line {number}: {reason}");
            check_name(name).map_err(at)?;
            check_token(token).map_err(at)?;
            if credentials.iter().any(|(_, t)| t == token.as_bytes()) {
                return Err(at("this token is already given to a name".into()));
            }
            credentials.push((name.into(), token.as_bytes().to_vec()));
        }
        if credentials.is_empty() {
            return Err("no credential in the file".into());
        }
        Ok(Credentials::PerProxy(credentials))
    }

    /// The tokens it holds (none for [`Credentials::Open`]).
    pub fn tokens(&self) -> Vec<&[u8]> {
        match self {
            Credentials::Open | Credentials::NoToken => Vec::new(),
            Credentials::Shared(token) => vec![token.as_slice()],
            Credentials::PerProxy(credentials) => {
                credentials.iter().map(|(_, t)| t.as_slice()).collect()
            }
        }
    }

    /// Who the `Authorization` header value authenticates, or `None` if it does not.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Option<Caller> {
        let given = authorization.and_then(bearer);
        match self {
            Credentials::Open => Some(Caller::default()),
            Credentials::NoToken => None,
            Credentials::Shared(token) => token_matches(token, given?).then(Caller::default),
            Credentials::PerProxy(credentials) => {
                let given = given?;
                // Every token is compared, so the time does not tell which one matched.
                let mut found = None;
                for (name, token) in credentials {
                    if token_matches(token, given) && found.is_none() {
                        found = Some(name.clone());
                    }
                }
                found.map(|name| Caller { name: Some(name) })
            }
        }
    }
}

/// The token of `Bearer <token>`: the scheme in any case, then exactly one space.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    rest.get(1..)
}

/// A token may hold visible ASCII only: what a proxy can send in a header without padding.
fn check_token(token: &str) -> Result<(), String> {
    if token.is_empty() {
        return Err("the token is empty".into());
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be visible ASCII, without spaces".into());
    }
    Ok(())
}

/// A credential's name: 1 to [`MAX_NAME_BYTES`] of `a-z A-Z 0-9 - _ .` (never a `/`, which
/// separates it from the proxy id).
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "the name {name:?} must be 1 to {MAX_NAME_BYTES} of a-z A-Z 0-9 - _ ."
        ))
    }
}

/// Whether `given` is `expected`, in a time that depends on `expected`'s length only.
pub fn token_matches(expected: &[u8], given: &[u8]) -> bool {
    let mut same = (expected.len() as u64).ct_eq(&(given.len() as u64));
    for (i, byte) in expected.iter().enumerate() {
        same &= byte.ct_eq(given.get(i).unwrap_or(&!*byte));
    }
    same.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        assert!(token_matches(b"secret", b"secret"));
        assert!(!token_matches(b"secret", b"secreT"));
        assert!(!token_matches(b"secret", b"secret2"));
        assert!(!token_matches(b"secret", b"secre"));
        assert!(!token_matches(b"secret", b""));
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_exact() {
        let shared = Credentials::shared("tok").unwrap();
        let ok = |value: &str| shared.authenticate(Some(value.as_bytes())).is_some();
        assert!(ok("Bearer tok"));
        assert!(ok("bearer tok"));
        assert!(ok("BEARER tok"));
        assert!(!ok("Bearer  tok"));
        assert!(!ok("Bearer tok "));
        assert!(!ok(" Bearer tok"));
        assert!(!ok("Bearer\ttok"));
        assert!(!ok("Basic tok"));
        assert!(!ok("Bearertok"));
        assert!(!ok("tok"));
        assert!(shared.authenticate(None).is_none());
        assert!(Credentials::Open.authenticate(None).is_some());
        assert!(Credentials::NoToken.authenticate(None).is_none());
        assert!(Credentials::NoToken
            .authenticate(Some(b"Bearer "))
            .is_none());
    }

    #[test]
    fn a_tokens_file_names_each_caller() {
        let text = "# proxies\nedge-a  tok-a\n\nedge-b tok-b\nedge-a tok-a2\n";
        let credentials = Credentials::per_proxy(text).unwrap();
        let name = |token: &str| {
            credentials
                .authenticate(Some(format!("Bearer {token}").as_bytes()))
                .and_then(|caller| caller.name)
                .map(|name| name.to_string())
        };
        assert_eq!(name("tok-a").as_deref(), Some("edge-a"));
        assert_eq!(name("tok-a2").as_deref(), Some("edge-a"));
        assert_eq!(name("tok-b").as_deref(), Some("edge-b"));
        assert_eq!(name("tok-c"), None);
        let caller = Caller {
            name: Some("edge-b".into()),
        };
        assert_eq!(caller.proxy_id("envoy-1"), "edge-b/envoy-1");
        assert_eq!(Caller::default().proxy_id("envoy-1"), "envoy-1");
    }

    #[test]
    fn a_bad_tokens_file_names_the_line() {
        let error = |text: &str| Credentials::per_proxy(text).unwrap_err();
        assert_eq!(error("a t1\nb\n"), "line 2: expected `name token`");
        assert_eq!(error("a t1 x\n"), "line 1: expected `name token`");
        assert_eq!(
            error("a t1\nb t1\n"),
            "line 2: this token is already given to a name"
        );
        assert_eq!(
            error("a/b t1\n"),
            "line 1: the name \"a/b\" must be 1 to 64 of a-z A-Z 0-9 - _ ."
        );
        assert_eq!(error("# nothing\n"), "no credential in the file");
        assert!(Credentials::shared("with space").is_err());
        assert!(Credentials::shared("").is_err());
    }
}
