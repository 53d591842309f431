//! Certificates the tests make for themselves (rcgen): a certificate authority, and certificates it
//! signs for a name (valid, expired, or for another name), written as PEM files in a temp dir. No
//! key material is committed anywhere.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};
use tempfile::TempDir;

/// A certificate authority, and the directory its files and those of what it signs are in.
pub struct Authority {
    dir: TempDir,
    name: String,
    params: CertificateParams,
    key: KeyPair,
    /// The authority's certificate (what a client trusts), PEM.
    pub ca_pem: String,
}

/// A certificate an [`Authority`] signed, and its key, as files.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub cert_pem: String,
}

impl Authority {
    /// A new authority named `name` (its common name, and the files' prefix).
    pub fn new(name: &str) -> Result<Authority> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut subject = DistinguishedName::new();
        subject.push(DnType::CommonName, format!("sluice test CA {name}"));
        params.distinguished_name = subject;
        let key = KeyPair::generate()?;
        let ca_pem = params.self_signed(&key)?.pem();
        let dir = tempfile::Builder::new().prefix("sluice-certs-").tempdir()?;
        std::fs::write(dir.path().join(format!("{name}-ca.pem")), &ca_pem)?;
        Ok(Authority {
            dir,
            name: name.to_owned(),
            params,
            key,
            ca_pem,
        })
    }

    /// The authority's certificate as a file (what a client is told to trust).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca.pem", self.name))
    }

    /// A certificate for `names` (DNS names or IP addresses), valid from a day ago for a year, in
    /// files named after `file`.
    pub fn issue(&self, file: &str, names: &[&str]) -> Result<Issued> {
        self.issue_with(file, names, false)
    }

    /// As [`Authority::issue`], but it expired: valid from 2020-01-01 to 2020-02-01.
    pub fn issue_expired(&self, file: &str, names: &[&str]) -> Result<Issued> {
        self.issue_with(file, names, true)
    }

    fn issue_with(&self, file: &str, names: &[&str], expired: bool) -> Result<Issued> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names)?;
        if expired {
            params.not_before = date_time_ymd(2020, 1, 1);
            params.not_after = date_time_ymd(2020, 2, 1);
        }
        let key = KeyPair::generate()?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert_pem = params.signed_by(&key, &issuer)?.pem();
        let cert_file = self.dir.path().join(format!("{file}.pem"));
        let key_file = self.dir.path().join(format!("{file}-key.pem"));
        std::fs::write(&cert_file, &cert_pem)
            .with_context(|| format!("writing {}", cert_file.display()))?;
        std::fs::write(&key_file, key.serialize_pem())
            .with_context(|| format!("writing {}", key_file.display()))?;
        Ok(Issued {
            cert_file,
            key_file,
            cert_pem,
        })
    }

    /// The directory the files are in (removed when the authority is dropped).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// A client that trusts only `ca_pem` (and checks the name in the URL against the certificate).
pub fn agent_trusting(ca_pem: &str) -> Result<ureq::Agent> {
    use std::sync::Arc;
    use ureq::tls::{Certificate, RootCerts, TlsConfig};
    let ca = Certificate::from_pem(ca_pem.as_bytes())
        .context("the CA's PEM")?
        .to_owned();
    let tls = TlsConfig::builder()
        .root_certs(RootCerts::Specific(Arc::new(vec![ca])))
        .build();
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(std::time::Duration::from_secs(10)))
        .tls_config(tls)
        .build();
    Ok(ureq::Agent::new_with_config(config))
}
