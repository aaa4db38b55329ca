//! Test support: the real `tokengate` binary as a child process, and a scriptable HTTP/1.1
//! upstream on 127.0.0.1:0. No fixed ports, no sleeps: readiness is read from the gateway's
//! stdout, waits poll with a deadline.
#![allow(dead_code)]

pub(crate) mod fleet;
pub(crate) mod requests;
pub(crate) mod tls;

// In every test's `use common::*` (not every test uses them).
#[allow(unused_imports)]
pub(crate) use requests::{chat, routed, share_while_backlogged, words};

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

/// A running gateway process; killed on drop.
pub(crate) struct GatewayProc {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl GatewayProc {
    /// Writes `yaml` (which must not set `listen` / `admin_listen`) to a temp file, adds
    /// loopback listeners on port 0, starts `tokengate serve` and waits for its listeners.
    pub(crate) fn start(yaml: &str) -> GatewayProc {
        GatewayProc::start_with_env(yaml, &[])
    }

    /// [`GatewayProc::start`] with extra environment variables for the gateway process.
    pub(crate) fn start_with_env(yaml: &str, env: &[(&str, &str)]) -> GatewayProc {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = dir.path().join("tokengate.yaml");
        let full =
            format!("listen: [\"127.0.0.1:0\"]\nadmin_listen: 127.0.0.1:0\nthreads: 2\n{yaml}");
        std::fs::write(&cfg, full).expect("write config");
        let log = dir.path().join("tokengate.log");
        let logf = std::fs::File::create(&log).expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["serve", "-c"])
            .arg(&cfg)
            // TG_TEST_LOG (e.g. "info,tokengate=debug") for every decision's explanation in the log.
            .env(
                "RUST_LOG",
                std::env::var("TG_TEST_LOG").unwrap_or("info".into()),
            )
            // Lets a test move the gateway's clock forward (`advance_clock`).
            .env("TOKENGATE_TEST_CLOCK", "1")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(logf))
            .spawn()
            .expect("spawn tokengate");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let (mut proxy, mut admin) = (None, None);
        let deadline = Instant::now() + DEADLINE;
        while proxy.is_none() || admin.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match rx.recv_timeout(left) {
                Ok(l) => l,
                Err(_) => {
                    let _ = child.kill();
                    panic!(
                        "gateway did not report its listeners; log:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
            };
            let addr = |l: &str| -> SocketAddr {
                l.rsplit("http://").next().unwrap().trim().parse().unwrap()
            };
            if line.starts_with("tokengate: proxy listening on") {
                proxy = Some(addr(&line));
            } else if line.starts_with("tokengate: admin listening on") {
                admin = Some(addr(&line));
            }
        }
        GatewayProc {
            child,
            proxy: proxy.unwrap(),
            admin: admin.unwrap(),
            log,
            _dir: dir,
        }
    }

    /// The config file the gateway was started with (tests rewrite it to test reloads).
    pub(crate) fn config_path(&self) -> PathBuf {
        self._dir.path().join("tokengate.yaml")
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.proxy, path)
    }

    pub(crate) fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Moves the gateway's clock forward by `ms` (`POST /admin/clock`): time passes for the
    /// prefix index, health and the scheduler's clocks without sleeping.
    pub(crate) async fn advance_clock(&self, ms: u64) {
        let r = reqwest::Client::new()
            .post(self.admin_url(&format!("/admin/clock?advance_ms={ms}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `/admin/instances` until every instance has zero in-flight requests, tokens and
    /// waiting requests, or panics at the deadline with the last snapshot.
    pub(crate) async fn wait_idle(&self) -> serde_json::Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let v = self.instances().await;
            let idle = v["instances"].as_array().unwrap().iter().all(|i| {
                i["inflight_requests"] == 0 && i["inflight_tokens"] == 0 && i["waiting"] == 0
            });
            if idle {
                return v;
            }
            if Instant::now() > deadline {
                panic!("load table never returned to zero: {v:#}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await; // ok-sleep: poll interval under a deadline
        }
    }

    /// `GET /admin/instances` as JSON.
    pub(crate) async fn instances(&self) -> serde_json::Value {
        reqwest::get(self.admin_url("/admin/instances"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub(crate) async fn metrics(&self) -> String {
        reqwest::get(self.admin_url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tokengate check` on `yaml` (written to a temp file): whether it passed, and its stderr.
#[allow(dead_code)]
pub(crate) fn check_yaml(yaml: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("c.yaml");
    std::fs::write(&f, yaml).expect("write config");
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "-c"])
        .arg(&f)
        .output()
        .expect("run tokengate check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Polls `f` until it returns true or the deadline passes.
pub(crate) async fn eventually<F: FnMut() -> Fut, Fut: std::future::Future<Output = bool>>(
    what: &str,
    mut f: F,
) {
    let deadline = Instant::now() + DEADLINE;
    while !f().await {
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // ok-sleep: poll interval under a deadline
    }
}

/// A scriptable upstream. `GET /health` answers 200 (not counted in `requests`). The
/// behaviour of every other request is chosen by its `x-mock` header:
/// - absent or `echo`: 200 JSON `{len, hash, content_length, transfer_encoding, request_id,
///   auth, usage}` describing the request as received;
/// - `sse`: an SSE stream of `x-mock-chunks` (default 5) chat chunks; after the first it waits
///   for [`Mock::release`] when `x-mock-gate: 1`; a usage chunk at the end when the body asks
///   for `include_usage`; then `data: [DONE]`;
/// - `mirror`: 200 `application/json` whose body is the request body, byte for byte;
/// - `status`: answers `x-mock-status` with a JSON error;
/// - `close-mid`: starts an SSE stream, sends 2 chunks, closes the connection;
/// - `hang`: starts an SSE stream, sends 1 chunk, then sends nothing until the peer closes
///   (counted in `peer_closed`);
/// - `stall`: sends nothing at all until the peer closes.
///
/// A mock started with [`Mock::recording`] also keeps every request it answers ([`Seen`]).
#[derive(Clone)]
pub(crate) struct Mock {
    pub addr: SocketAddr,
    pub gate: Arc<Notify>,
    pub requests: Arc<AtomicU64>,
    pub peer_closed: Arc<AtomicU64>,
    pub seen: Option<Arc<std::sync::Mutex<Vec<Seen>>>>,
    /// `x-mock*` headers applied to every request, over the client's ([`Mock::force`]).
    pub forced: Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

/// A request a recording [`Mock`] received (health checks excepted).
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub path: String,
    /// Lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Seen {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

impl Mock {
    pub(crate) async fn start() -> Mock {
        Mock::start_with("127.0.0.1:0", false).await
    }

    /// A mock on `addr` (e.g. another loopback address, `127.0.0.2:0`).
    pub(crate) async fn start_on(addr: &str) -> Mock {
        Mock::start_with(addr, false).await
    }

    /// A mock that keeps every request it answers in `seen`.
    pub(crate) async fn recording() -> Mock {
        Mock::start_with("127.0.0.1:0", true).await
    }

    /// What a recording mock received so far.
    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen
            .as_ref()
            .map(|s| s.lock().unwrap().clone())
            .unwrap_or_default()
    }

    async fn start_with(addr: &str, record: bool) -> Mock {
        let l = TcpListener::bind(addr).await.unwrap();
        let m = Mock {
            addr: l.local_addr().unwrap(),
            gate: Arc::new(Notify::new()),
            requests: Arc::new(AtomicU64::new(0)),
            peer_closed: Arc::new(AtomicU64::new(0)),
            seen: record.then(|| Arc::new(std::sync::Mutex::new(Vec::new()))),
            forced: Arc::new(std::sync::Mutex::new(Vec::new())),
        };
        let mm = m.clone();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else { break };
                let mm = mm.clone();
                tokio::spawn(async move {
                    let _ = Box::pin(mm.serve(s)).await;
                });
            }
        });
        m
    }

    /// Behaves as if every request carried `name: value` (e.g. `x-mock: status`), whatever
    /// the client sent: a mock that plays one failing upstream among several.
    #[allow(dead_code)]
    pub(crate) fn force(&self, name: &str, value: &str) {
        self.forced
            .lock()
            .unwrap()
            .push((name.to_string(), value.to_string()));
    }

    pub(crate) fn release(&self) {
        self.gate.notify_one();
    }

    async fn serve(&self, mut s: TcpStream) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(8192);
        loop {
            // Read a request head.
            let head_end = loop {
                if let Some(p) = find(&buf, b"\r\n\r\n") {
                    break p + 4;
                }
                let mut tmp = [0u8; 65536];
                let n = s.read(&mut tmp).await?;
                if n == 0 {
                    return Ok(());
                }
                buf.extend_from_slice(&tmp[..n]);
            };
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            req.parse(&buf[..head_end]).expect("valid request head");
            let forced = self.forced.lock().unwrap().clone();
            let h = |name: &str| -> Option<String> {
                if let Some((_, v)) = forced.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
                    return Some(v.clone());
                }
                req.headers
                    .iter()
                    .find(|x| x.name.eq_ignore_ascii_case(name))
                    .map(|x| String::from_utf8_lossy(x.value).to_string())
            };
            let is_health = req.path == Some("/health");
            let cl = h("content-length");
            let te = h("transfer-encoding");
            let mode = h("x-mock").unwrap_or_else(|| "echo".into());
            let chunks: usize = h("x-mock-chunks").and_then(|v| v.parse().ok()).unwrap_or(5);
            let gated = h("x-mock-gate").is_some();
            let status = h("x-mock-status").unwrap_or_else(|| "503".into());
            let rid = h("x-request-id").unwrap_or_default();
            let auth = h("authorization").unwrap_or_default();
            let head = self.seen.as_ref().map(|_| {
                let headers: Vec<(String, String)> = req
                    .headers
                    .iter()
                    .map(|x| {
                        (
                            x.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(x.value).to_string(),
                        )
                    })
                    .collect();
                (req.path.unwrap_or_default().to_string(), headers)
            });
            let mut rest = buf.split_off(head_end);
            buf.clear();
            // Read the body.
            let body = if te.as_deref().is_some_and(|t| t.contains("chunked")) {
                Box::pin(read_chunked(&mut s, &mut rest)).await?
            } else {
                let n: usize = cl.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
                while rest.len() < n {
                    let mut tmp = [0u8; 65536];
                    let k = s.read(&mut tmp).await?;
                    if k == 0 {
                        return Ok(());
                    }
                    rest.extend_from_slice(&tmp[..k]);
                }
                let b = rest[..n].to_vec();
                buf = rest.split_off(n);
                b
            };
            if is_health {
                // The gateway's active health checks: not counted as requests.
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
                    .await?;
                continue;
            }
            if let (Some(seen), Some((path, headers))) = (&self.seen, head) {
                seen.lock().unwrap().push(Seen {
                    path,
                    headers,
                    body: body.clone(),
                });
            }
            self.requests.fetch_add(1, Ordering::SeqCst);
            let wants_usage = find(&body, b"\"include_usage\":true").is_some();
            match mode.as_str() {
                "echo" => {
                    let v = serde_json::json!({
                        "len": body.len(),
                        "hash": xxhash_rust::xxh3::xxh3_64(&body),
                        "content_length": cl,
                        "transfer_encoding": te,
                        "request_id": rid,
                        "auth": auth,
                        "choices": [{"message": {"role": "assistant", "content": "ok"}}],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 5}},
                    });
                    let b = serde_json::to_vec(&v).unwrap();
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        b.len()
                    );
                    s.write_all(head.as_bytes()).await?;
                    s.write_all(&b).await?;
                }
                "mirror" => {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    s.write_all(head.as_bytes()).await?;
                    s.write_all(&body).await?;
                }
                "status" => {
                    let b = br#"{"error":{"message":"mock failure","type":"server_error"}}"#;
                    let head = format!(
                        "HTTP/1.1 {status} Mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        b.len()
                    );
                    s.write_all(head.as_bytes()).await?;
                    s.write_all(b).await?;
                }
                "sse" | "close-mid" | "hang" => {
                    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await?;
                    let n = match mode.as_str() {
                        "sse" => chunks,
                        "close-mid" => 2,
                        _ => 1,
                    };
                    for i in 0..n {
                        let ev = format!(
                            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}]}}\n\n"
                        );
                        write_chunk(&mut s, ev.as_bytes()).await?;
                        if i == 0 && gated {
                            self.gate.notified().await;
                        }
                    }
                    match mode.as_str() {
                        "close-mid" => return Ok(()),
                        "hang" => {
                            let mut tmp = [0u8; 1024];
                            while s.read(&mut tmp).await.unwrap_or(0) > 0 {}
                            self.peer_closed.fetch_add(1, Ordering::SeqCst);
                            return Ok(());
                        }
                        _ => {}
                    }
                    if wants_usage {
                        write_chunk(&mut s, b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n").await?;
                    }
                    write_chunk(&mut s, b"data: [DONE]\n\n").await?;
                    s.write_all(b"0\r\n\r\n").await?;
                }
                "stall" => {
                    let mut tmp = [0u8; 1024];
                    while s.read(&mut tmp).await.unwrap_or(0) > 0 {}
                    self.peer_closed.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
                other => panic!("unknown mock mode {other}"),
            }
        }
    }
}

async fn write_chunk(s: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(format!("{:x}\r\n", data.len()).as_bytes())
        .await?;
    s.write_all(data).await?;
    s.write_all(b"\r\n").await?;
    s.flush().await
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

async fn read_chunked(s: &mut TcpStream, rest: &mut Vec<u8>) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        while find(rest, b"\r\n").is_none() {
            let mut tmp = [0u8; 65536];
            let k = s.read(&mut tmp).await?;
            if k == 0 {
                return Ok(body);
            }
            rest.extend_from_slice(&tmp[..k]);
        }
        let p = find(rest, b"\r\n").unwrap();
        let size = usize::from_str_radix(
            std::str::from_utf8(&rest[..p])
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap();
        let need = p + 2 + size + 2;
        while rest.len() < need {
            let mut tmp = [0u8; 65536];
            let k = s.read(&mut tmp).await?;
            if k == 0 {
                return Ok(body);
            }
            rest.extend_from_slice(&tmp[..k]);
        }
        body.extend_from_slice(&rest[p + 2..p + 2 + size]);
        rest.drain(..need);
        if size == 0 {
            return Ok(body);
        }
    }
}

/// A chat request body of at least `size` bytes.
pub(crate) fn chat_body(model: &str, size: usize, stream: bool) -> Vec<u8> {
    let base = format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":8,"messages":[{{"role":"user","content":""}}]}}"#
    );
    let pad = size.saturating_sub(base.len());
    let content: String = (0..pad).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":8,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    )
    .into_bytes()
}

/// `body` sent chunked (`Transfer-Encoding: chunked`, pieces of `piece` bytes).
pub(crate) fn chunked(body: &[u8], piece: usize) -> reqwest::Body {
    let parts: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(piece).map(|p| Ok(p.to_vec())).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(parts))
}

/// A service block for the YAML config.
pub(crate) fn service(name: &str, instances: &[(&str, SocketAddr)]) -> String {
    let mut s = format!("  - name: {name}\n    instances:\n");
    for (id, a) in instances {
        s.push_str(&format!("      - {{id: {id}, addr: \"{a}\"}}\n"));
    }
    s
}

/// A loopback address nobody listens on, whose connections are refused.
pub(crate) fn dead_addr() -> SocketAddr {
    // A port bound but never listening: connections to it are refused, and since the socket
    // lives until the test process ends, the port is never handed to another listener (a
    // closed listener's port can be — the gateway's own, say — and then "dead" answers).
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = s.local_addr().unwrap();
    Box::leak(Box::new(s));
    addr
}

/// `n` engine-sims serving `model`, ids `{prefix}1..n`.
pub(crate) async fn sims(
    n: usize,
    model: &str,
    prefix: &str,
    time_scale: f64,
) -> Vec<engine_sim::SimHandle> {
    let mut v = Vec::new();
    for i in 1..=n {
        v.push(
            engine_sim::spawn_local(engine_sim::SimConfig {
                id: format!("{prefix}{i}"),
                model: model.into(),
                time_scale,
                ..Default::default()
            })
            .await
            .unwrap(),
        );
    }
    v
}

/// `n` engines `e1`…`en` serving model `m`, otherwise as `cfg`.
pub(crate) async fn sim_fleet(n: usize, cfg: engine_sim::SimConfig) -> Vec<engine_sim::SimHandle> {
    let mut v = Vec::new();
    for i in 1..=n {
        v.push(
            engine_sim::spawn_local(engine_sim::SimConfig {
                id: format!("e{i}"),
                model: "m".into(),
                ..cfg.clone()
            })
            .await
            .unwrap(),
        );
    }
    v
}

/// The instance list of a service block for `sims`.
pub(crate) fn sim_instances(sims: &[engine_sim::SimHandle]) -> String {
    let mut s = String::from("    instances:\n");
    for h in sims {
        s.push_str(&format!(
            "      - {{id: {}, addr: \"{}\"}}\n",
            h.id(),
            h.addr
        ));
    }
    s
}

/// A metric's value from Prometheus text (first line starting with `name_and_labels `).
pub(crate) fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}
