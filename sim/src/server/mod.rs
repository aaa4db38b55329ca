//! HTTP/1.1 front end (hyper) with fault injection, the HTTP side of the
//! prefill/decode disaggregation protocols ([`crate::pd`]) and SGLang's
//! `POST /abort_request` ([`crate::abort`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::task::AbortOnDrop;

mod body;
mod inference;
mod routes;
mod state;

use body::BoxError;
use routes::handle;
pub(crate) use state::Shared;

/// While refusing, only connections whose request line targets /admin/ are
/// served. Peeks (without consuming) up to 200 ms for the request line.
async fn is_admin_conn(stream: &TcpStream) -> bool {
    const PREFIXES: [&[u8]; 3] = [b"GET /admin/", b"POST /admin/", b"PUT /admin/"];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut buf = [0u8; 16];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return false,
        };
        let got = &buf[..n];
        if PREFIXES.iter().any(|p| got.starts_with(p)) {
            return true;
        }
        if !PREFIXES.iter().any(|p| p.starts_with(got)) || n == buf.len() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
    }
}

async fn serve_conn(shared: Arc<Shared>, stream: TcpStream, bootstrap_only: bool) {
    if shared.faults.read().refuse && !is_admin_conn(&stream).await {
        // reset the connection
        let _ = stream.set_zero_linger();
        drop(stream);
        return;
    }
    let _ = stream.set_nodelay(true);
    let local = stream
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)));
    let svc_shared = shared.clone();
    let svc = hyper::service::service_fn(move |req| {
        let shared = svc_shared.clone();
        async move {
            let id = shared.id_header.clone();
            let mut r = handle(shared, req, local, bootstrap_only).await?;
            r.headers_mut().insert("x-engine-id", id);
            Ok::<_, BoxError>(r)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive(true)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        log::debug!("engine-sim {}: connection ended: {e}", shared.cfg.id);
    }
}

async fn accept_opt(l: &Option<TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

pub(crate) async fn accept_loop(
    listener: TcpListener,
    bootstrap: Option<TcpListener>,
    shared: Arc<Shared>,
    mut shutdown: oneshot::Receiver<()>,
    scheduler: AbortOnDrop,
) {
    let mut conns: JoinSet<()> = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(shared.clone(), stream, false));
                }
                Err(e) => {
                    log::warn!("engine-sim {}: accept failed: {e}", shared.cfg.id);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            r = accept_opt(&bootstrap) => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(shared.clone(), stream, true));
                }
                Err(e) => {
                    log::warn!("engine-sim {}: bootstrap accept failed: {e}", shared.cfg.id);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    drop(listener);
    drop(bootstrap);
    conns.shutdown().await;
    drop(scheduler);
}
