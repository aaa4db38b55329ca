//! Remote upstreams addressed by URL: another region's gateway (global scheduling) or an
//! external API (split proxy). An [`Endpoint`] is `scheme://host:port/base-path`; the host may
//! be a name, resolved when the endpoint is built and again by the background loop
//! ([`crate::background::health_checks`]), so an address that changes is followed and a name
//! that stops resolving makes the endpoint unavailable rather than the gateway fail.

use crate::health::Health;
use parking_lot::RwLock;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// A remote upstream. See the module documentation.
#[derive(Debug)]
pub struct Endpoint {
    /// The config's name (`global.members[].name`, `split.proxies[].name`).
    pub name: String,
    /// `name` as a header value (`x-tokengate-instance`).
    pub id_header: http::HeaderValue,
    pub tls: bool,
    /// Host for SNI, certificate checks and the `Host` header.
    pub host: String,
    pub port: u16,
    /// The URL's path without a trailing `/` (`/v1` for an OpenAI-style base URL, or empty).
    pub base_path: String,
    /// `https://`: SNI, verification and the CA of the Pingora peer.
    pub tls_peer: Option<crate::tls::TlsPeer>,
    /// The `tls:` settings the peer was built from (a reload that changes them builds anew).
    pub tls_settings: Option<crate::tls::TlsSettings>,
    addrs: RwLock<Vec<SocketAddr>>,
    turn: AtomicUsize,
    /// Active checks (and resolution failures) mark it down.
    pub health: Arc<Health>,
}

/// The parts of an `http://` or `https://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParts {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    pub path: String,
}

/// A URL from the config (`global.members[].url`, `split.proxies[].address`,
/// `mirror.target`), taken apart once when the config is read: the parts, or what is wrong
/// with it ([`crate::config::Config::validate`] reports that with the key's path, so a
/// validated config's URLs all have parts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointUrl {
    raw: String,
    parts: Result<UrlParts, String>,
}

impl EndpointUrl {
    pub fn new(raw: impl Into<String>) -> EndpointUrl {
        let raw = raw.into();
        let parts = parse_url(&raw);
        EndpointUrl { raw, parts }
    }

    /// The URL as written.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// Its parts, or what to fix.
    pub fn parts(&self) -> Result<&UrlParts, String> {
        self.parts.as_ref().map_err(Clone::clone)
    }
}

impl From<&str> for EndpointUrl {
    fn from(raw: &str) -> EndpointUrl {
        EndpointUrl::new(raw)
    }
}

impl<'de> serde::Deserialize<'de> for EndpointUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(EndpointUrl::new)
    }
}

impl serde::Serialize for EndpointUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.raw)
    }
}

/// Parses `http[s]://host[:port][/path]` (IPv6 hosts in brackets). The error says what to fix.
pub fn parse_url(url: &str) -> Result<UrlParts, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(format!("{url:?} must start with http:// or https://"));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(format!("{url:?}: credentials in the URL are not supported"));
    }
    let (host, port) = if let Some(h) = authority.strip_prefix('[') {
        let Some((h, p)) = h.split_once(']') else {
            return Err(format!("{url:?}: unterminated IPv6 address"));
        };
        (h.to_string(), p.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("{url:?}: no host"));
    }
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| format!("{url:?}: invalid port {p:?}"))?,
        None if tls => 443,
        None => 80,
    };
    if path.contains(['?', '#']) {
        return Err(format!("{url:?}: a query or fragment is not supported"));
    }
    Ok(UrlParts {
        tls,
        host,
        port,
        path: path.trim_end_matches('/').to_string(),
    })
}

impl Endpoint {
    /// An endpoint for `url`, resolved now (a name that does not resolve yet leaves it with
    /// no address: unavailable until a later resolution succeeds).
    pub fn new(name: &str, url: &str) -> Result<Endpoint, String> {
        Endpoint::with_tls(name, &parse_url(url)?, None)
    }

    /// [`Endpoint::new`] with `tls:` settings for an `https://` URL (the CA file is read here).
    pub fn with_tls(
        name: &str,
        u: &UrlParts,
        tls: Option<&crate::tls::TlsSettings>,
    ) -> Result<Endpoint, String> {
        let id_header = http::HeaderValue::from_str(name)
            .map_err(|_| format!("{name:?} cannot be a header value"))?;
        let tls_peer = if u.tls {
            Some(crate::tls::TlsPeer::new(&u.host, tls)?)
        } else {
            None
        };
        let e = Endpoint {
            tls_peer,
            tls_settings: tls.cloned(),
            name: name.to_string(),
            id_header,
            tls: u.tls,
            host: u.host.clone(),
            port: u.port,
            base_path: u.path.clone(),
            addrs: RwLock::new(Vec::new()),
            turn: AtomicUsize::new(0),
            health: Arc::new(Health::default()),
        };
        let _ = e.resolve();
        Ok(e)
    }

    /// Resolves the host again; keeps the previous addresses when resolution fails.
    pub fn resolve(&self) -> std::io::Result<usize> {
        let found: Vec<SocketAddr> = (self.host.as_str(), self.port).to_socket_addrs()?.collect();
        let n = found.len();
        if n > 0 {
            *self.addrs.write() = found;
        }
        Ok(n)
    }

    /// The next address (round-robin over what the host resolved to).
    pub fn addr(&self) -> Option<SocketAddr> {
        let a = self.addrs.read();
        if a.is_empty() {
            return None;
        }
        Some(a[self.turn.fetch_add(1, Relaxed) % a.len()])
    }

    /// `scheme://host:port`, for logs and health checks (no credentials are ever part of it).
    pub fn origin(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        if self.host.contains(':') {
            format!("{scheme}://[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}", self.host, self.port)
        }
    }

    /// Whether it may receive requests now.
    pub fn available(&self, now_ms: u64) -> bool {
        self.health.available(now_ms) && !self.addrs.read().is_empty()
    }
}

/// An `Arc`'d endpoint from the previous runtime with the same name and URL, else a new one
/// (its health and addresses survive a reload).
pub fn carried(
    prev: impl IntoIterator<Item = Arc<Endpoint>>,
    name: &str,
    url: &EndpointUrl,
    tls: Option<&crate::tls::TlsSettings>,
) -> Result<Arc<Endpoint>, String> {
    let u = url.parts()?;
    for e in prev {
        if e.name == name
            && e.tls == u.tls
            && e.host == u.host
            && e.port == u.port
            && e.base_path == u.path
            && e.tls_settings.as_ref() == tls
        {
            return Ok(e);
        }
    }
    Endpoint::with_tls(name, u, tls).map(Arc::new)
}

impl Endpoint {
    /// A Pingora peer to `addr` (TLS with the endpoint's settings for `https://`).
    pub fn peer(&self, addr: SocketAddr) -> pingora::upstreams::peer::HttpPeer {
        match &self.tls_peer {
            Some(t) => t.peer(addr),
            None => pingora::upstreams::peer::HttpPeer::new(addr, false, self.host.clone()),
        }
    }

    /// The `Host` header: `host[:port]` (the port when not the scheme's default).
    pub fn host_header(&self) -> String {
        let default_port = if self.tls { 443 } else { 80 };
        match (self.port == default_port, self.host.contains(':')) {
            (true, false) => self.host.clone(),
            (true, true) => format!("[{}]", self.host),
            (false, false) => format!("{}:{}", self.host, self.port),
            (false, true) => format!("[{}]:{}", self.host, self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("https://api.example.com/v1/").unwrap(),
            UrlParts {
                tls: true,
                host: "api.example.com".into(),
                port: 443,
                path: "/v1".into()
            }
        );
        assert_eq!(
            parse_url("http://127.0.0.1:19300").unwrap(),
            UrlParts {
                tls: false,
                host: "127.0.0.1".into(),
                port: 19300,
                path: String::new()
            }
        );
        assert_eq!(parse_url("http://[::1]:8000/x").unwrap().host, "::1");
        for bad in [
            "ftp://x",
            "http://",
            "http://h:99999",
            "http://u:p@h/",
            "https://h/v1?key=1",
            "127.0.0.1:80",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_resolve_and_unresolvable_ones_are_unavailable() {
        let e = Endpoint::new("local", "http://localhost:8000").unwrap();
        assert!(e.addr().is_some_and(|a| a.ip().is_loopback()));
        assert!(e.available(0));
        let bad = Endpoint::new("nowhere", "http://name.invalid:80").unwrap();
        assert!(bad.addr().is_none());
        assert!(!bad.available(0));
        assert_eq!(bad.origin(), "http://name.invalid:80");
    }
}

/// A remote upstream's attempts by outcome (`/admin/status`: a member gateway of global
/// scheduling, an entry of the split proxy).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Outcomes {
    pub ok: u64,
    pub refused: u64,
    pub error: u64,
    pub cancelled: u64,
}
