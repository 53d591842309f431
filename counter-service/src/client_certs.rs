//! Client certificates as credentials (mutual TLS): the names a verified client certificate
//! carries (its DNS and URI subject alternative names), and the files that map them to the name of
//! a credential: `--client-certs-file` for `/v1` (the names of `--tokens-file`), and
//! `--admin-client-certs-file` for the admin API (the names of `--admin-tokens-file`), one
//! `san name` a line.
//!
//! The handshake verifies the certificate against `--tls-client-ca-file` ([`crate::tls`]); here
//! its names are only read and looked up. A SAN is a DNS name (compared without case) or a URI
//! (anything with a `:`, such as a SPIFFE ID `spiffe://example.org/edge-eu`, compared byte for
//! byte). A certificate none of whose names is mapped has no identity; one whose names map to two
//! credentials is refused ([`Ambiguous`]).

use std::collections::HashMap;
use std::sync::Arc;

use crate::credentials::{check_name, field_pairs};

/// Longest SAN a mapping file may name.
pub const MAX_SAN_BYTES: usize = 2048;

/// A subject alternative name, as a certificate carries it and a mapping file names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum San {
    /// A DNS name, in lower case.
    Dns(String),
    /// A URI, as written.
    Uri(String),
}

/// The names of the client certificate a connection's handshake verified: a request extension
/// of every request on that connection.
#[derive(Debug, Clone, Default)]
pub struct PeerCertificate {
    sans: Arc<[San]>,
}

impl PeerCertificate {
    /// The DNS and URI SANs of `der`, an end-entity certificate the handshake verified. A
    /// certificate that does not parse here carries no name (so it has no identity).
    pub fn from_der(der: &[u8]) -> PeerCertificate {
        PeerCertificate {
            sans: sans_of(der).into(),
        }
    }

    /// A certificate with these names (tests).
    pub fn with_sans(sans: Vec<San>) -> PeerCertificate {
        PeerCertificate { sans: sans.into() }
    }

    pub fn sans(&self) -> &[San] {
        &self.sans
    }
}

fn sans_of(der: &[u8]) -> Vec<San> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(extension)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    extension
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some(San::Dns(dns.to_ascii_lowercase())),
            GeneralName::URI(uri) => Some(San::Uri((*uri).to_owned())),
            _ => None,
        })
        .collect()
}

/// A certificate whose names map to more than one credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ambiguous;

/// A mapping file: each SAN, and the name of the credential a certificate carrying it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertNames {
    names: HashMap<San, Arc<str>>,
}

impl CertNames {
    /// The text of a mapping file: one `san name` a line; blank lines and lines starting with `#`
    /// are skipped. A name may have several SANs (a fleet moving to new certificates); a SAN
    /// belongs to one name. The reason names the line.
    pub fn parse(text: &str) -> Result<CertNames, String> {
        let mut names = HashMap::new();
        for pair in field_pairs(text, "san name") {
            let (number, san, name) = pair?;
            let at = |reason: String| format!("line {number}: {reason}");
            let san = parse_san(san).map_err(at)?;
            check_name(name).map_err(at)?;
            if names.insert(san, Arc::<str>::from(name)).is_some() {
                return Err(at("this SAN is already given to a name".into()));
            }
        }
        if names.is_empty() {
            return Err("no certificate name in the file".into());
        }
        Ok(CertNames { names })
    }

    /// The credential `peer` is: the one name its mapped SANs share, `None` if none is mapped.
    pub fn name_of(&self, peer: &PeerCertificate) -> Result<Option<Arc<str>>, Ambiguous> {
        let mut found: Option<&Arc<str>> = None;
        for san in peer.sans() {
            let Some(name) = self.names.get(san) else {
                continue;
            };
            match found {
                Some(other) if other != name => return Err(Ambiguous),
                _ => found = Some(name),
            }
        }
        Ok(found.cloned())
    }

    /// How many names and SANs it holds.
    pub fn counts(&self) -> (usize, usize) {
        let mut names: Vec<&str> = self.names.values().map(|name| &**name).collect();
        names.sort_unstable();
        names.dedup();
        (names.len(), self.names.len())
    }

    /// The SANs it maps.
    pub fn sans(&self) -> impl Iterator<Item = &San> {
        self.names.keys()
    }
}

/// A SAN as a mapping file writes it: a URI if it holds a `:` (`scheme:rest`), otherwise a DNS
/// name (letters, digits and hyphens in dot-separated labels; no wildcard).
fn parse_san(text: &str) -> Result<San, String> {
    if text.len() > MAX_SAN_BYTES {
        return Err(format!("the SAN is longer than {MAX_SAN_BYTES} bytes"));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the SAN must be visible ASCII".into());
    }
    if let Some((scheme, rest)) = text.split_once(':') {
        let scheme_ok = scheme
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic())
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
        if !scheme_ok || rest.is_empty() {
            return Err(format!(
                "the SAN {text:?} is neither a DNS name nor a URI (`scheme:...`, e.g. spiffe://...)"
            ));
        }
        return Ok(San::Uri(text.to_owned()));
    }
    if text.contains('*') {
        return Err(format!(
            "the SAN {text:?} is a wildcard: map each certificate's own name"
        ));
    }
    let labels_ok = text.len() <= 253
        && text.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !labels_ok {
        return Err(format!(
            "the SAN {text:?} is not a DNS name (labels of a-z 0-9 -) nor a URI"
        ));
    }
    Ok(San::Dns(text.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(sans: &[San]) -> PeerCertificate {
        PeerCertificate::with_sans(sans.to_vec())
    }

    #[test]
    fn a_mapping_names_each_san_dns_without_case_uri_exactly() {
        let text = "# proxies\nEdge-A.proxies.internal edge-a\n\nspiffe://sluice/edge-b edge-b\n\
                    urn:example:edge-a2 edge-a\n";
        let map = CertNames::parse(text).unwrap();
        let name = |sans: &[San]| map.name_of(&peer(sans)).unwrap().map(|n| n.to_string());
        let dns = |s: &str| San::Dns(s.to_owned());
        let uri = |s: &str| San::Uri(s.to_owned());
        assert_eq!(
            name(&[dns("edge-a.proxies.internal")]).as_deref(),
            Some("edge-a")
        );
        assert_eq!(
            name(&[uri("spiffe://sluice/edge-b")]).as_deref(),
            Some("edge-b")
        );
        assert_eq!(name(&[uri("spiffe://sluice/EDGE-B")]), None);
        // A DNS name with the text of a URI is not the URI.
        assert_eq!(name(&[dns("spiffe://sluice/edge-b")]), None);
        assert_eq!(name(&[dns("edge-c.proxies.internal")]), None);
        assert_eq!(name(&[]), None);
        // Two SANs of one name are that name; of two names, refused.
        assert_eq!(
            name(&[dns("edge-a.proxies.internal"), uri("urn:example:edge-a2")]).as_deref(),
            Some("edge-a")
        );
        assert_eq!(
            map.name_of(&peer(&[
                dns("edge-a.proxies.internal"),
                uri("spiffe://sluice/edge-b")
            ])),
            Err(Ambiguous)
        );
        assert_eq!(map.counts(), (2, 3));
    }

    #[test]
    fn a_bad_mapping_names_the_line() {
        let error = |text: &str| CertNames::parse(text).unwrap_err();
        assert_eq!(
            error("a.internal a\nb.internal\n"),
            "line 2: expected `san name`"
        );
        assert_eq!(error("a.internal a x\n"), "line 1: expected `san name`");
        assert_eq!(
            error("a.internal a\nA.internal b\n"),
            "line 2: this SAN is already given to a name"
        );
        assert_eq!(
            error("*.proxies.internal a\n"),
            "line 1: the SAN \"*.proxies.internal\" is a wildcard: map each certificate's own name"
        );
        assert_eq!(
            error("a..internal a\n"),
            "line 1: the SAN \"a..internal\" is not a DNS name (labels of a-z 0-9 -) nor a URI"
        );
        assert_eq!(
            error("1spiffe://x a\n"),
            "line 1: the SAN \"1spiffe://x\" is neither a DNS name nor a URI (`scheme:...`, e.g. \
             spiffe://...)"
        );
        assert_eq!(
            error("spiffe: a\n"),
            "line 1: the SAN \"spiffe:\" is neither a DNS name nor a URI (`scheme:...`, e.g. \
             spiffe://...)"
        );
        assert_eq!(
            error("a.internal a/b\n"),
            "line 1: the name \"a/b\" must be 1 to 64 of a-z A-Z 0-9 - _ ."
        );
        let long = format!("spiffe://{} a\n", "x".repeat(MAX_SAN_BYTES));
        assert_eq!(error(&long), "line 1: the SAN is longer than 2048 bytes");
        assert_eq!(error("# nothing\n"), "no certificate name in the file");
    }

    #[test]
    fn a_certificate_that_does_not_parse_has_no_name() {
        assert!(PeerCertificate::from_der(b"not a certificate")
            .sans()
            .is_empty());
        assert!(PeerCertificate::from_der(&[]).sans().is_empty());
    }
}
