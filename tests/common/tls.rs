//! HTTPS upstreams for tests: a private CA and a server certificate made here (rcgen), and a
//! TLS terminator on 127.0.0.1:0 that forwards the decrypted bytes to a plain upstream (an
//! engine-sim or the mock), so that it plays an HTTPS engine or external API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

/// A CA and a certificate it signed for `localhost` and 127.0.0.1.
pub(crate) struct TestPki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestPki {
    pub(crate) fn new() -> TestPki {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "tokengate test CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf =
            rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .unwrap();
        let cert = leaf.signed_by(&key, &ca_cert, &ca_key).unwrap();
        TestPki {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Writes the CA certificate to `dir/name` and returns its path.
    pub(crate) fn write_ca(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, &self.ca_pem).unwrap();
        p
    }
}

/// Serves TLS with `pki`'s certificate on 127.0.0.1:0 and forwards every connection to
/// `upstream` in plain TCP. Runs until the test's runtime ends.
pub(crate) async fn tls_front(pki: &TestPki, upstream: SocketAddr) -> SocketAddr {
    let certs: Vec<_> = rustls_pemfile::certs(&mut pki.cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = rustls_pemfile::private_key(&mut pki.key_pem.as_bytes())
        .unwrap()
        .unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { break };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else {
                    return; // a client that rejected our certificate
                };
                let Ok(mut up) = TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    addr
}
