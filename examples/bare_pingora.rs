//! The floor under tokengate: a Pingora 0.9 proxy that does nothing but forward every request
//! to one upstream over a kept-alive connection (no body peek, no routing, no metrics, no
//! usage parsing). `bench/overhead.sh` runs it beside tokengate so the overhead table can tell
//! what Pingora itself costs on the machine from what tokengate adds on top.
//!
//! Usage: `cargo run --release --example bare_pingora -- LISTEN_ADDR UPSTREAM_ADDR [THREADS]`

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;

struct Bare {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();
    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: bare_pingora LISTEN_ADDR UPSTREAM_ADDR [THREADS]");
        std::process::exit(2);
    }
    let threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(2);
    let conf = ServerConf {
        threads,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut svc = http_proxy_service(
        &server.configuration,
        Bare {
            upstream: args[2].clone(),
        },
    );
    svc.add_tcp(&args[1]);
    server.add_service(svc);
    server.run_forever();
}
