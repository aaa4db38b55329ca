//! Starting the gateway: bind the listeners (so `127.0.0.1:0` works and the real addresses
//! can be printed), then run the Pingora proxy app and the admin app on them inside a
//! Pingora `Server` (which owns the runtime, signals and graceful shutdown).

use crate::admin::Admin;
use crate::config::Config;
use crate::proxy::Gateway;
use crate::shared::Shared;
use anyhow::Context;
use async_trait::async_trait;
use log::{error, info};
use parking_lot::Mutex;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::server::configuration::ServerConf;
use pingora::server::{Server, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

/// Listeners bound before the server starts.
pub struct Listeners {
    pub proxy: Vec<TcpListener>,
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds every address of the config.
    pub fn bind(cfg: &Config) -> anyhow::Result<Listeners> {
        let mut proxy = Vec::new();
        for (i, a) in cfg.listen.iter().enumerate() {
            let l =
                TcpListener::bind(a).with_context(|| format!("listen[{i}]: cannot bind {a}"))?;
            proxy.push(l);
        }
        let admin = TcpListener::bind(&cfg.admin_listen)
            .with_context(|| format!("admin_listen: cannot bind {}", cfg.admin_listen))?;
        Ok(Listeners { proxy, admin })
    }

    pub fn proxy_addrs(&self) -> Vec<SocketAddr> {
        self.proxy
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.local_addr().ok()
    }
}

/// Open client connections, so that shutdown can wait for them to finish.
#[derive(Default)]
struct Active {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

struct ActiveGuard(Arc<Active>);

impl ActiveGuard {
    fn new(a: &Arc<Active>) -> Self {
        a.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ActiveGuard(a.clone())
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if self
            .0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.idle.notify_waiters();
        }
    }
}

impl Active {
    /// Waits until no connection is open, at most `limit`. Returns the number still open.
    async fn drain(&self, limit: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let idle = self.idle.notified();
            let n = self.count.load(std::sync::atomic::Ordering::SeqCst);
            if n == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.count.load(std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
}

/// How long a client connection may sit idle before its first request or between two
/// (Pingora's own default for both, which it applies once a request has begun).
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// Serves one client connection on an HTTP/1 app, one request at a time, **waiting for each
/// request's first byte before handing the connection to Pingora**: Pingora allocates its
/// per-request state (two boxed futures, ~20 KiB in a release build, written whole when
/// made) as soon as it starts reading a request, so a connection waiting in Pingora costs
/// that much for as long as it is idle. Waiting here first, an idle connection (fresh, or
/// kept alive between requests) holds only its socket, its buffers and this task
/// (bench/results/reliability.md: ~30 KiB → ~5 KiB per idle connection). Otherwise this is
/// Pingora's own HTTP/1 loop (`HttpServerApp::process_new`): the keep-alive settings of one
/// request carried to the next, 60 s keep-alive, none once shutting down. An idle kept-alive
/// connection closes at shutdown; one that has not sent its first request yet is left to
/// the drain's grace period, as Pingora does. Apps that speak h2c or a custom protocol
/// go through Pingora's loop unchanged.
async fn serve<A>(app: Arc<A>, stream: pingora::protocols::Stream, shutdown: ShutdownWatch)
where
    A: HttpServerApp + Send + Sync + 'static,
{
    use pingora::protocols::http::ServerSession;
    if app
        .server_options()
        .is_some_and(|o| o.h2c || o.force_custom)
    {
        let mut next = ServerApp::process_new(&app, stream, &shutdown).await;
        while let Some(s) = next {
            next = ServerApp::process_new(&app, s, &shutdown).await;
        }
        return;
    }
    let mut stream = stream;
    // The settings the previous request of the connection left (`None` with `first`: none
    // yet, as for Pingora's first request; `None` after one: Pingora carried none).
    let mut first = true;
    let mut carried: Option<pingora::apps::HttpPersistentSettings> = None;
    loop {
        // Bytes of the next request may already have been read with the previous one (a
        // pipelined request, kept in the settings): then it is not waited for.
        let pipelined = carried.as_ref().is_some_and(has_pipelined_prefix);
        if !pipelined && !request_begins(&mut stream, &shutdown, first).await {
            return;
        }
        let mut session = ServerSession::new_http1(stream);
        if first {
            if *shutdown.borrow() {
                session.set_keepalive(None);
            } else {
                session.set_keepalive(Some(IDLE.as_secs()));
            }
            session.set_keepalive_reuses_remaining(
                app.server_options().and_then(|o| o.keepalive_request_limit),
            );
        } else if let Some(c) = carried.take() {
            c.apply_to_session(&mut session);
        }
        match app.process_new_http(session, &shutdown).await {
            Some(reused) => {
                (stream, carried) = reused.consume();
                first = false;
            }
            None => return,
        }
    }
}

/// Whether the settings carry bytes of a pipelined request. Pingora 0.9 has no getter for
/// them: read from their `Debug` output, stopping at that field (no allocation; its earlier
/// fields are a few numbers). Should the field not be found (another Pingora), the answer is
/// yes: the request is then never waited for, which costs memory, never a stalled request.
fn has_pipelined_prefix(c: &pingora::apps::HttpPersistentSettings) -> bool {
    use std::fmt::Write;
    #[derive(Default)]
    struct Probe {
        at_field: bool,
        found: Option<bool>,
    }
    impl Write for Probe {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            if self.at_field {
                let v = s.trim_start_matches(':').trim_start();
                if v.is_empty() {
                    return Ok(());
                }
                self.found = Some(v.starts_with("Some"));
                return Err(std::fmt::Error); // enough read
            }
            self.at_field = s == "pipelined_prefix";
            Ok(())
        }
    }
    let mut p = Probe::default();
    let _ = write!(p, "{c:?}");
    p.found.unwrap_or(true)
}

/// Waits until the client sends the first byte of a request (left in the stream for
/// Pingora to read); `false`: the client closed, stayed idle for [`IDLE`], or (between
/// requests) the gateway is shutting down.
async fn request_begins(
    stream: &mut pingora::protocols::Stream,
    shutdown: &ShutdownWatch,
    first: bool,
) -> bool {
    let mut byte = [0u8; 1];
    let mut stop = shutdown.clone();
    tokio::select! {
        r = pingora::prelude::fast_timeout::fast_timeout(IDLE, stream.try_peek(&mut byte)) => {
            matches!(r, Ok(Ok(_)))
        }
        _ = async {
            if first || stop.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        } => false,
    }
}

/// Accepts connections and hands each to `serve` (a Pingora app's loop), until shutdown.
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    serve: F,
    mut shutdown: ShutdownWatch,
    active: Arc<Active>,
    shared: Arc<Shared>,
) where
    F: Fn(pingora::protocols::Stream, ShutdownWatch) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    if let Err(e) = listener.set_nonblocking(true) {
        error!("cannot set listener non-blocking: {e}");
        return;
    }
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            error!("cannot register listener: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((sock, _)) => {
                    let _ = sock.set_nodelay(true);
                    let shutdown = shutdown.clone();
                    let guard = ActiveGuard::new(&active);
                    let head_limit = shared.runtime.load().timeouts.client_head;
                    let expired = shared.metrics.protocol_errors.clone();
                    let stream: pingora::protocols::Stream = Box::new(
                        crate::transport::Gathered::with_head_deadline(
                            pingora::protocols::l4::stream::Stream::from(sock),
                            head_limit,
                            expired,
                        ),
                    );
                    let served = serve(stream, shutdown);
                    tokio::spawn(async move {
                        let _guard = guard;
                        served.await;
                    });
                }
                Err(e) => {
                    error!("accept failed: {e}");
                    if e.raw_os_error() == Some(24) {
                        // Out of file descriptors: let in-flight requests release some.
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    }
                }
            },
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() {
                    break;
                }
            }
        }
    }
}

struct Acceptor {
    listeners: Mutex<Option<Listeners>>,
    reloader: Mutex<Option<crate::reload::Reloader>>,
    /// Longest wait for in-flight requests at shutdown.
    grace: std::time::Duration,
    shared: Arc<Shared>,
    proxy: Arc<pingora::proxy::HttpProxy<Gateway>>,
    admin: Arc<Admin>,
}

#[async_trait]
impl BackgroundService for Acceptor {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(l) = self.listeners.lock().take() else {
            return;
        };
        let mut tasks = Vec::new();
        let active = Arc::new(Active::default());
        for pl in l.proxy {
            let proxy = self.proxy.clone();
            tasks.push(tokio::spawn(accept_loop(
                pl,
                move |stream, shutdown| serve(proxy.clone(), stream, shutdown),
                shutdown.clone(),
                active.clone(),
                self.shared.clone(),
            )));
        }
        let admin = self.admin.clone();
        tasks.push(tokio::spawn(accept_loop(
            l.admin,
            move |stream, shutdown| {
                let admin = admin.clone();
                async move {
                    let mut next = admin.process_new(stream, &shutdown).await;
                    while let Some(s) = next {
                        next = admin.process_new(s, &shutdown).await;
                    }
                }
            },
            shutdown.clone(),
            Arc::new(Active::default()),
            self.shared.clone(),
        )));
        tasks.push(tokio::spawn(crate::background::health_checks::run_checks(
            self.shared.clone(),
            shutdown.clone(),
        )));
        if let Some(r) = self.reloader.lock().take() {
            tasks.push(tokio::spawn(r.run(shutdown.clone())));
        }
        tasks.push(tokio::spawn(crate::background::maintenance::run(
            self.shared.clone(),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(crate::background::engine_metrics::run(
            self.shared.clone(),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(crate::status::run(
            self.shared.clone(),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(self.shared.mirror.clone().run()));
        if let Some(c) = self.shared.cluster.clone() {
            info!(
                "cluster: replica {} sharing its routing state on Redis",
                c.replica
            );
            tasks.push(tokio::spawn(crate::background::cluster::run(
                self.shared.clone(),
                c,
                shutdown.clone(),
            )));
        }
        if let Some(o) = self.shared.otel.load_full() {
            info!("tracing: spans exported to {} (OTLP/{})", o.url, o.protocol);
            tasks.push(tokio::spawn(o.run()));
        }
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        info!(
            "shutting down: no longer accepting connections; waiting up to {:?} for {} open connections",
            self.grace,
            active.count.load(std::sync::atomic::Ordering::SeqCst)
        );
        // No keep-alive from now on: connections close after their current request.
        self.proxy.cleanup().await;
        let left = active.drain(self.grace).await;
        for t in tasks {
            t.abort();
        }
        if left > 0 {
            log::warn!("shutdown grace period over: closing {left} connections");
        } else {
            // Pingora would sit out the rest of its grace period; there is nothing left to
            // wait for.
            info!("all connections finished; exiting");
            std::process::exit(0);
        }
    }
}

/// Runs the gateway on bound listeners; returns only on a startup error (the Pingora server
/// exits the process when it shuts down). With `reloads`, the config file is reloaded on
/// SIGHUP and when it changes.
pub fn run(
    cfg: Config,
    listeners: Listeners,
    reloads: Option<crate::reload::ReloadSource>,
) -> anyhow::Result<()> {
    let threads = cfg
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let conf = ServerConf {
        threads,
        // Pingora keeps the runtimes alive for this long after SIGTERM; the acceptor drains
        // in-flight requests meanwhile and exits as soon as they are done.
        grace_period_seconds: Some(cfg.shutdown_grace.as_secs().max(1)),
        graceful_shutdown_timeout_seconds: Some(5),
        ..ServerConf::default()
    };
    let shared = Shared::new(&cfg)
        .map_err(|e| anyhow::anyhow!("invalid config:\n  {}", e.0.join("\n  ")))?;
    for w in cfg.warnings() {
        log::warn!("config: {w}");
    }
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let proxy = pingora::proxy::http_proxy(
        &server.configuration,
        Gateway {
            shared: shared.clone(),
        },
    );
    let reloader = reloads.map(|source| crate::reload::Reloader {
        source,
        shared: shared.clone(),
        listen: cfg.listen.clone(),
        admin_listen: cfg.admin_listen.clone(),
    });
    let acceptor = Acceptor {
        listeners: Mutex::new(Some(listeners)),
        reloader: Mutex::new(reloader),
        grace: cfg.shutdown_grace,
        shared: shared.clone(),
        proxy: Arc::new(proxy),
        admin: Arc::new(Admin { shared }),
    };
    let mut svc = background_service("tokengate", acceptor);
    svc.threads = Some(threads);
    server.add_service(svc);
    server.run_forever();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pipelined_prefix_is_seen_in_the_carried_settings() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (c, _) = tokio::join!(
            tokio::net::TcpStream::connect(l.local_addr().unwrap()),
            l.accept()
        );
        let stream: pingora::protocols::Stream = Box::new(crate::transport::Gathered::new(
            pingora::protocols::l4::stream::Stream::from(c.unwrap()),
        ));
        let mut session = pingora::protocols::http::ServerSession::new_http1(stream);
        session.set_keepalive(Some(60));
        let mut c = pingora::apps::HttpPersistentSettings::for_session(&session);
        assert!(!has_pipelined_prefix(&c), "{c:?}");
        c.set_pipelined_prefix(bytes::BytesMut::from(&b"POST /v1/chat"[..]));
        assert!(has_pipelined_prefix(&c), "{c:?}");
    }
}
