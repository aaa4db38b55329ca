//! Instance addresses: `ip:port`, or `host:port` for engines addressed by name (a Docker
//! Compose service, a Kubernetes headless Service: `engine-0.engines.default.svc:8000`), or
//! either as a URL, `http://host:port` or `https://host:port` (HTTPS: TLS with SNI and
//! certificate verification, see [`crate::tls`]; the port defaults to 80 / 443).
//! A name is resolved when the config is loaded (at start and on every reload); a name with
//! several addresses gives its lowest IPv4 address (else its lowest address), so the choice
//! does not depend on the resolver's order: one instance is one engine, list each pod's own
//! name to spread over several. The reloader re-resolves names every [`RERESOLVE_EVERY`] and
//! reloads when the running address is no longer among a name's addresses (a restarted
//! pod's new IP).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// How often the reloader re-resolves the names of a running config.
pub const RERESOLVE_EVERY: Duration = Duration::from_secs(10);

/// An instance address taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `https://`.
    pub tls: bool,
    /// The host as written (a name or an IP; IPv6 without brackets): SNI and certificate
    /// checks.
    pub host: String,
    /// `host:port` to resolve (IPv6 in brackets), also the `Host` header.
    pub authority: String,
}

/// An instance address from the config (`services[].instances[].addr`), taken apart once
/// when the config is read: its [`Target`], or what is wrong with it (reported by the config's
/// validation with the key's path, so a validated config's addresses all have a target). It
/// reads as the address as written (`&str`).
#[derive(Clone, PartialEq, Eq)]
pub struct InstanceAddr {
    raw: String,
    target: Result<Target, String>,
}

impl InstanceAddr {
    pub fn new(raw: impl Into<String>) -> InstanceAddr {
        let raw = raw.into();
        let target = target(&raw);
        InstanceAddr { raw, target }
    }

    /// The address as written.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// Its parts, or what to fix.
    pub fn target(&self) -> Result<&Target, String> {
        self.target.as_ref().map_err(Clone::clone)
    }
}

impl std::ops::Deref for InstanceAddr {
    type Target = str;
    fn deref(&self) -> &str {
        &self.raw
    }
}

impl std::fmt::Display for InstanceAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.raw)
    }
}

impl std::fmt::Debug for InstanceAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.raw, f)
    }
}

impl From<String> for InstanceAddr {
    fn from(raw: String) -> InstanceAddr {
        InstanceAddr::new(raw)
    }
}

impl From<&str> for InstanceAddr {
    fn from(raw: &str) -> InstanceAddr {
        InstanceAddr::new(raw)
    }
}

impl<'de> serde::Deserialize<'de> for InstanceAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <String as serde::Deserialize>::deserialize(d).map(InstanceAddr::new)
    }
}

impl serde::Serialize for InstanceAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.raw)
    }
}

/// Takes an address apart: `ip:port`, `host:port`, or `http[s]://host[:port][/]`.
pub fn target(addr: &str) -> Result<Target, String> {
    let (tls, rest) = match (addr.strip_prefix("https://"), addr.strip_prefix("http://")) {
        (Some(r), _) => (true, r),
        (_, Some(r)) => (false, r),
        _ => {
            check(addr)?;
            let host = host_of(addr);
            return Ok(Target {
                tls: false,
                host,
                authority: addr.to_string(),
            });
        }
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#', '@']) {
        return Err(format!(
            "invalid address {addr:?}: an engine's URL is scheme://host[:port] (no path, query or credentials)"
        ));
    }
    // The default port when the URL has none.
    let has_port = match rest.rsplit_once(':') {
        Some((h, p)) => {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (!h.starts_with('[') || h.ends_with(']'))
        }
        None => false,
    };
    let authority = if has_port {
        rest.to_string()
    } else {
        format!("{rest}:{}", if tls { 443 } else { 80 })
    };
    check(&authority).map_err(|e| format!("invalid address {addr:?}: {e}"))?;
    Ok(Target {
        tls,
        host: host_of(&authority),
        authority,
    })
}

/// The host of a checked `host:port` (IPv6 without brackets).
fn host_of(authority: &str) -> String {
    let h = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    h.trim_start_matches('[').trim_end_matches(']').to_string()
}

/// `host:port` of an address (the URL's scheme and trailing slash removed).
fn authority(addr: &str) -> String {
    target(addr).map_or_else(|_| addr.to_string(), |t| t.authority)
}

/// Whether `addr` names a host (not an `ip:port`).
pub fn is_name(addr: &str) -> bool {
    authority(addr).parse::<SocketAddr>().is_err()
}

/// Checks the form of an address without resolving it: `ip:port`, `[v6]:port`, or
/// `host:port` with a DNS name (letters, digits, `-`, `.`) and a port.
pub fn check(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let bad = || {
        format!(
            "invalid socket address {addr:?} (expected ip:port or host:port, e.g. 10.0.0.5:8000 or engine-0.engines:8000)"
        )
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let valid_host = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        // all-digit dotted strings are malformed IPs, not names
        && !host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    match port.parse::<u16>() {
        Ok(p) if p > 0 && valid_host => Ok(()),
        _ => Err(bad()),
    }
}

/// The environment variable naming a hosts file consulted before the system's resolver
/// (`name ip [ip…]` per line, `#` comments): lets tests change what a name resolves to.
pub const TEST_HOSTS_ENV: &str = "TOKENGATE_TEST_HOSTS";

/// The addresses `TOKENGATE_TEST_HOSTS` gives `host:port`, when it names the host.
fn test_hosts(authority: &str) -> Option<Vec<SocketAddr>> {
    let file = std::env::var_os(TEST_HOSTS_ENV)?;
    let (host, port) = authority.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == host).then(|| {
                w.filter_map(|ip| ip.parse::<std::net::IpAddr>().ok())
                    .map(|ip| SocketAddr::new(ip, port))
                    .collect()
            })
        })
}

/// Every address of `addr` (blocking), sorted, without duplicates.
pub fn resolve_every(addr: &str) -> Result<Vec<SocketAddr>, String> {
    let addr = &authority(addr);
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    check(addr)?;
    let mut all: Vec<SocketAddr> = match test_hosts(addr) {
        Some(v) => v,
        None => addr
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {addr:?}: {e}"))?
            .collect(),
    };
    all.sort();
    all.dedup();
    Ok(all)
}

/// The socket address of `addr`: parsed, or looked up (blocking) when it is a name.
pub fn resolve(addr: &str) -> Result<SocketAddr, String> {
    let all = resolve_every(addr)?;
    pick(&all).ok_or_else(|| format!("cannot resolve {:?}: no address", authority(addr)))
}

/// The address a name stands for among all of its addresses: the lowest IPv4 one, else the
/// lowest.
fn pick(all: &[SocketAddr]) -> Option<SocketAddr> {
    all.iter()
        .filter(|a| a.is_ipv4())
        .min()
        .or_else(|| all.iter().min())
        .copied()
}

/// Every address of `addr` now, without blocking the runtime's thread.
pub async fn resolve_all(addr: &str) -> Result<Vec<SocketAddr>, String> {
    let owned = authority(addr);
    let addr = owned.as_str();
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    check(addr)?;
    let mut all: Vec<SocketAddr> = match test_hosts(addr) {
        Some(v) => v,
        None => tokio::net::lookup_host(addr)
            .await
            .map_err(|e| format!("cannot resolve {addr:?}: {e}"))?
            .collect(),
    };
    all.sort();
    all.dedup();
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let t = target("https://engine.example:8443").unwrap();
        assert_eq!(
            (t.tls, t.host.as_str(), t.authority.as_str()),
            (true, "engine.example", "engine.example:8443")
        );
        let t = target("https://localhost/").unwrap();
        assert_eq!(t.authority, "localhost:443");
        let t = target("http://[::1]:8000").unwrap();
        assert_eq!((t.tls, t.host.as_str()), (false, "::1"));
        let t = target("10.0.0.5:8000").unwrap();
        assert_eq!((t.tls, t.host.as_str()), (false, "10.0.0.5"));
        assert!(is_name("http://vllm-0.vllm:8000"));
        assert!(!is_name("http://127.0.0.1:8000"));
        assert_eq!(resolve("http://127.0.0.1:9").unwrap().port(), 9);
        for bad in [
            "http://h:1/v1",
            "https://u:p@h:1",
            "ftp://h:1",
            "http://",
            "https://h:x",
        ] {
            assert!(target(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn forms() {
        for ok in [
            "10.0.0.5:8000",
            "[::1]:8000",
            "engine-0.engines.default.svc.cluster.local:8000",
            "localhost:1",
            "e1:80",
        ] {
            assert!(check(ok).is_ok(), "{ok}");
        }
        for bad in [
            "localhost",
            "x",
            "host:0",
            "host:99999",
            ":80",
            "-a:80",
            "a_b:80",
            "300.1.1.1:80",
            "a..b:80",
            "http://a:80",
        ] {
            let e = check(bad).unwrap_err();
            assert!(e.starts_with("invalid socket address"), "{bad}: {e}");
        }
    }

    #[test]
    fn resolves_ips_and_names() {
        assert_eq!(
            resolve("127.0.0.1:9").unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert_eq!(resolve("localhost:9").unwrap().port(), 9);
        assert!(is_name("localhost:9") && !is_name("127.0.0.1:9"));
        assert!(resolve("no-such-host.invalid:80")
            .unwrap_err()
            .starts_with("cannot resolve"));
    }

    #[test]
    fn a_name_with_several_addresses_stands_for_its_lowest_ipv4() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let all = [a("[::1]:80"), a("10.0.0.9:80"), a("10.0.0.2:80")];
        assert_eq!(pick(&all), Some(a("10.0.0.2:80")));
        assert_eq!(pick(&all[..1]), Some(a("[::1]:80")));
        assert_eq!(pick(&[]), None);
    }
}
