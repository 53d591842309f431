//! The gates: `/v1` lets a request go on only with a proxy credential the service knows, the
//! admin API only with an admin credential (see [`crate::credentials`]); the handlers learn who
//! sent it.
//!
//! A credential is a bearer token, or a client certificate whose SAN is mapped to the
//! credential's name ([`crate::client_certs`]; the proxies' mapping on `/v1`, the admins' on the
//! admin API, never the other's). The rules, in order:
//!
//! 1. A certificate whose names map to two credentials is refused: 403 `certificate_ambiguous`.
//! 2. A token that is given (an `Authorization` header, unless it is the scheme `Bearer` with
//!    nothing after it but spaces, what a filter without `service.token` sends) must be valid:
//!    401 otherwise, whatever the certificate.
//! 3. With both, they must name the same credential: 403 `credentials_disagree` otherwise (a
//!    shared token names no credential, so it never agrees with a certificate).
//! 4. Either alone is enough; with neither, 401.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

use crate::client_certs::{CertNames, PeerCertificate};
use crate::credentials::{Caller, Credentials};
use crate::error::AppError;
use crate::state::AppState;

/// Who sent a request: its `authorization` header checked against `tokens`, its connection's
/// verified client certificate (`peer`) looked up in `certs` (see the module's rules).
pub fn identify(
    tokens: &Credentials,
    certs: Option<&CertNames>,
    peer: Option<&PeerCertificate>,
    authorization: Option<&[u8]>,
) -> Result<Caller, AppError> {
    let by_certificate = match (certs, peer) {
        (Some(certs), Some(peer)) => certs
            .name_of(peer)
            .map_err(|_| AppError::CertificateAmbiguous)?,
        _ => None,
    };
    // `Bearer ` and nothing more is no token (never a valid one: a token is never empty). HTTP
    // trims the header's trailing space, so it arrives as `Bearer`.
    let authorization =
        authorization.filter(|value| !value.trim_ascii_end().eq_ignore_ascii_case(b"bearer"));
    let Some(name) = by_certificate else {
        return tokens
            .authenticate(authorization)
            .ok_or(AppError::Unauthorized);
    };
    if authorization.is_none() || matches!(tokens, Credentials::Open) {
        return Ok(Caller { name: Some(name) });
    }
    let by_token = tokens
        .authenticate(authorization)
        .ok_or(AppError::Unauthorized)?;
    if by_token.name.as_deref() == Some(&*name) {
        Ok(by_token)
    } else {
        Err(AppError::CredentialsDisagree)
    }
}

/// Lets the request through only with a proxy credential the service knows, and tells the
/// handlers who sent it (a [`Caller`] extension).
pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let certs = state.proxy_certs();
    let caller = identify(
        &state.proxies(),
        certs.as_deref(),
        request.extensions().get::<PeerCertificate>(),
        request
            .headers()
            .get(AUTHORIZATION)
            .map(|value| value.as_bytes()),
    )?;
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}

/// The caller of an admin request: its credential's name (a request extension), who the audit
/// log records.
#[derive(Debug, Clone)]
pub struct Admin {
    pub name: Arc<str>,
}

/// Lets an admin request through only with an admin credential (`--admin-tokens-file`,
/// `--admin-client-certs-file`), and tells the handlers whose ([`Admin`]). Without either the
/// admin API is disabled: 404 `admin_disabled`, whatever the credential.
pub async fn require_admin(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let admins = state.admins().ok_or(AppError::AdminDisabled)?;
    let certs = state.admin_certs();
    let caller = identify(
        &admins,
        certs.as_deref(),
        request.extensions().get::<PeerCertificate>(),
        request
            .headers()
            .get(AUTHORIZATION)
            .map(|value| value.as_bytes()),
    )?;
    let name = caller.name.unwrap_or_else(|| "admin".into());
    request.extensions_mut().insert(Admin { name });
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client_certs::San;

    fn certs() -> CertNames {
        CertNames::parse("edge-a.internal edge-a\nspiffe://sluice/edge-b edge-b\n").unwrap()
    }

    fn peer(dns: &str) -> PeerCertificate {
        PeerCertificate::with_sans(vec![San::Dns(dns.to_owned())])
    }

    fn who(
        tokens: &Credentials,
        peer: Option<&PeerCertificate>,
        header: Option<&str>,
    ) -> Result<Option<String>, &'static str> {
        identify(tokens, Some(&certs()), peer, header.map(str::as_bytes))
            .map(|caller| caller.name.map(|name| name.to_string()))
            .map_err(|error| error.kind())
    }

    #[test]
    fn a_mapped_certificate_is_its_credential_and_a_token_must_agree() {
        let tokens = Credentials::per_proxy("edge-a tok-a\nedge-b tok-b\n").unwrap();
        let a = peer("edge-a.internal");
        let name = |n: &str| Ok(Some(n.to_owned()));
        assert_eq!(who(&tokens, Some(&a), None), name("edge-a"));
        assert_eq!(who(&tokens, Some(&a), Some("Bearer ")), name("edge-a"));
        assert_eq!(who(&tokens, Some(&a), Some("bearer")), name("edge-a"));
        assert_eq!(who(&tokens, Some(&a), Some("Bearerx")), Err("unauthorized"));
        assert_eq!(who(&tokens, Some(&a), Some("Bearer tok-a")), name("edge-a"));
        assert_eq!(
            who(&tokens, Some(&a), Some("Bearer tok-b")),
            Err("credentials_disagree")
        );
        assert_eq!(
            who(&tokens, Some(&a), Some("Bearer wrong")),
            Err("unauthorized")
        );
        assert_eq!(who(&tokens, Some(&a), Some("Basic x")), Err("unauthorized"));
        // Unmapped: the token decides alone.
        let unmapped = peer("edge-z.internal");
        assert_eq!(who(&tokens, Some(&unmapped), None), Err("unauthorized"));
        assert_eq!(
            who(&tokens, Some(&unmapped), Some("Bearer tok-b")),
            name("edge-b")
        );
        assert_eq!(who(&tokens, None, Some("Bearer tok-b")), name("edge-b"));
        assert_eq!(who(&tokens, None, None), Err("unauthorized"));
        assert_eq!(who(&tokens, None, Some("Bearer ")), Err("unauthorized"));
        // Names of two credentials in one certificate.
        let both = PeerCertificate::with_sans(vec![
            San::Dns("edge-a.internal".into()),
            San::Uri("spiffe://sluice/edge-b".into()),
        ]);
        assert_eq!(
            who(&tokens, Some(&both), Some("Bearer tok-a")),
            Err("certificate_ambiguous")
        );
    }

    #[test]
    fn without_tokens_only_a_certificate_lets_in() {
        let a = peer("edge-a.internal");
        let tokens = Credentials::NoToken;
        assert_eq!(who(&tokens, Some(&a), None), Ok(Some("edge-a".to_owned())));
        assert_eq!(
            who(&tokens, Some(&a), Some("Bearer anything")),
            Err("unauthorized")
        );
        assert_eq!(who(&tokens, None, None), Err("unauthorized"));
        // A shared token names no credential: it never agrees with a certificate.
        let shared = Credentials::shared("tok").unwrap();
        assert_eq!(
            who(&shared, Some(&a), Some("Bearer tok")),
            Err("credentials_disagree")
        );
        assert_eq!(who(&shared, None, Some("Bearer tok")), Ok(None));
        // Without a mapping a certificate is nobody.
        let alone = identify(&Credentials::NoToken, None, Some(&a), None);
        assert_eq!(alone.map(|_| ()).map_err(|e| e.kind()), Err("unauthorized"));
    }
}
