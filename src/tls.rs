//! TLS towards HTTPS upstreams: engines addressed by `https://` URLs and external APIs.
//! Certificates are verified against the system's roots, or against a private CA
//! (`tls.ca_file`), with SNI and host-name checks; `tls.insecure_skip_verify` turns every
//! check off (tests only — warned at every config load). The same settings build the
//! Pingora peer of a request ([`TlsPeer::apply`]) and the HTTP client of the background
//! loops and side requests ([`client`]).

use pingora::protocols::tls::CaType;
use pingora::upstreams::peer::HttpPeer;
use pingora::utils::tls::{parse_x509, WrappedX509};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// TLS towards HTTPS upstreams (`tls:` of a service or a split-proxy entry).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file of the CA certificates to trust instead of the system's (a private CA).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Accept any certificate (tests only: logged as a warning at every load).
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

/// Checks the settings (the CA file is read); the error starts with the key's name.
pub fn check(t: &TlsSettings) -> Result<(), String> {
    if let Some(p) = &t.ca_file {
        read_ca(p).map_err(|e| format!("ca_file: {e}"))?;
    }
    Ok(())
}

/// The DER certificates of a PEM file (at least one, each one parsable).
fn read_ca(path: &Path) -> Result<(Vec<Vec<u8>>, Vec<u8>), String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut ders = Vec::new();
    for c in rustls_pemfile::certs(&mut pem.as_slice()) {
        let c = c.map_err(|e| format!("{}: not a PEM certificate file ({e})", path.display()))?;
        x509_parser::parse_x509_certificate(c.as_ref())
            .map_err(|e| format!("{}: a certificate does not parse ({e})", path.display()))?;
        ders.push(c.as_ref().to_vec());
    }
    if ders.is_empty() {
        return Err(format!(
            "{}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
            path.display()
        ));
    }
    Ok((ders, pem))
}

/// What a Pingora peer needs for one HTTPS upstream.
#[derive(Debug)]
pub struct TlsPeer {
    /// The host name sent as SNI and checked against the certificate.
    pub sni: String,
    pub verify: bool,
    /// The private CA, when `ca_file` is set (else the system's roots).
    pub ca: Option<Arc<CaType>>,
}

impl TlsPeer {
    /// The peer settings for `host` under `t` (`None`: defaults). The CA file is read here.
    pub fn new(host: &str, t: Option<&TlsSettings>) -> Result<TlsPeer, String> {
        let t = t.cloned().unwrap_or_default();
        let ca = match &t.ca_file {
            None => None,
            Some(p) => {
                let (ders, _) = read_ca(p).map_err(|e| format!("ca_file: {e}"))?;
                let certs: Vec<WrappedX509> = ders
                    .into_iter()
                    .map(|d| WrappedX509::new(d, parse_x509))
                    .collect();
                Some(Arc::from(certs.into_boxed_slice()))
            }
        };
        Ok(TlsPeer {
            sni: host.to_string(),
            verify: !t.insecure_skip_verify,
            ca,
        })
    }

    /// The same settings for another host.
    pub fn with_sni(&self, host: &str) -> TlsPeer {
        TlsPeer {
            sni: host.to_string(),
            verify: self.verify,
            ca: self.ca.clone(),
        }
    }

    /// A Pingora peer to `addr` over TLS with these settings.
    pub fn peer(&self, addr: std::net::SocketAddr) -> HttpPeer {
        let mut p = HttpPeer::new(addr, true, self.sni.clone());
        p.options.verify_cert = self.verify;
        p.options.verify_hostname = self.verify;
        p.options.ca = self.ca.clone();
        p
    }
}

/// An HTTP client for health checks, metric scrapes and side requests to upstreams under
/// `t` (plain HTTP upstreams need nothing from it).
pub fn client(t: Option<&TlsSettings>) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_idle_timeout(std::time::Duration::from_secs(60));
    if let Some(t) = t {
        if let Some(p) = &t.ca_file {
            let (_, pem) = read_ca(p).map_err(|e| format!("ca_file: {e}"))?;
            b = b.tls_built_in_root_certs(false);
            for c in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("ca_file: {}: {e}", p.display()))?
            {
                b = b.add_root_certificate(c);
            }
        }
        if t.insecure_skip_verify {
            b = b.danger_accept_invalid_certs(true);
        }
    }
    b.build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))
}
