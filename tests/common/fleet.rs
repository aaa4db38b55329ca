//! A whole fleet for the operations tests: `tokengate demo` (engine-sims + the gateway in one
//! process) with a config that exercises every metric family the dashboard and the status
//! page show, and a bounded burst of traffic through it.

use super::DEADLINE;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Two services (one layered with session affinity and prefix layers, one least-token), a
/// decision route over both with its decision model, engine metrics scraped. Every port is
/// 0: the demo starts an engine-sim on a free port for each instance and provider.
pub(crate) const FLEET_YAML: &str = r#"
listen: ["127.0.0.1:0"]
admin_listen: "127.0.0.1:0"
threads: 2
health_check: { interval: 1s }
services:
  - name: qwen3-0.6b
    scheduler:
      mode: layered
      affinity: { mode: soft }
    engine_metrics: { interval: 1s }
    instances:
      - { id: small-1, addr: "127.0.0.1:0" }
      - { id: small-2, addr: "127.0.0.1:0" }
  - name: qwen3-32b
    load_balancing: least-token
    instances:
      - { id: large-1, addr: "127.0.0.1:0" }
      - { id: large-2, addr: "127.0.0.1:0" }
providers:
  - { name: jev, base_url: "http://127.0.0.1:0/v1", model: jev-latest }
routes:
  - name: qwen3
    route_by: policy
    targets:
      - { service: qwen3-0.6b, criteria: "greetings, small talk" }
      - { service: qwen3-32b, criteria: "code, math, proofs" }
    policy:
      plugins:
        - { kind: decision-service }
        - { kind: session-affinity }
        - { kind: least-inflight }
    decision: { provider: jev, timeout: 2s }
"#;

/// A running `tokengate demo`; killed on drop.
pub(crate) struct Fleet {
    child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Fleet {
    /// Starts `tokengate demo -c` with `yaml` (every address on port 0) and waits for its
    /// listeners.
    pub(crate) fn start(yaml: &str) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("fleet.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["demo", "--time-scale", "20", "-c"])
            .arg(&cfg)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tokengate demo");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let (mut proxy, mut admin) = (None, None);
        let deadline = Instant::now() + DEADLINE;
        while proxy.is_none() || admin.is_none() {
            let Ok(l) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
                let _ = child.kill();
                panic!("tokengate demo did not report its listeners");
            };
            let addr = |l: &str| -> SocketAddr {
                l.rsplit("http://").next().unwrap().trim().parse().unwrap()
            };
            if l.starts_with("tokengate: proxy listening on") {
                proxy = Some(addr(&l));
            } else if l.starts_with("tokengate: admin listening on") {
                admin = Some(addr(&l));
            }
        }
        Fleet {
            child,
            proxy: proxy.unwrap(),
            admin: admin.unwrap(),
            _dir: dir,
        }
    }

    pub(crate) fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// `n` rounds of traffic: per round a streamed and a unary chat to each service (a
    /// shared system prompt, so prefixes repeat; a session header for affinity), one request
    /// through the decision route, and every fourth round an unknown model (404). Returns
    /// the number of requests sent.
    pub(crate) async fn drive(&self, rounds: usize) -> usize {
        let c = reqwest::Client::new();
        let url = format!("http://{}/v1/chat/completions", self.proxy);
        let system = "You are a helpful assistant for the operations team. ".repeat(20);
        let mut sent = 0;
        for r in 0..rounds {
            let mut reqs = Vec::new();
            for (model, stream) in [
                ("qwen3-0.6b", true),
                ("qwen3-0.6b", false),
                ("qwen3-32b", true),
                ("qwen3-32b", false),
                ("qwen3", true),
            ] {
                let body = serde_json::json!({
                    "model": model,
                    "stream": stream,
                    "max_tokens": 8,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": format!("Say hello to user {} please.", r % 3)},
                    ],
                });
                reqs.push(
                    c.post(&url)
                        .header("x-session-id", format!("session-{}", r % 3))
                        .json(&body)
                        .send(),
                );
            }
            if r % 4 == 3 {
                reqs.push(
                    c.post(&url)
                        .json(&serde_json::json!({"model": "no-such-model", "messages": []}))
                        .send(),
                );
            }
            for f in reqs {
                let resp = tokio::time::timeout(DEADLINE, f)
                    .await
                    .expect("request within the deadline")
                    .expect("request sent");
                let _ = resp.bytes().await;
                sent += 1;
            }
        }
        sent
    }

    /// `GET path` on the admin listener as JSON.
    pub(crate) async fn admin_json(&self, path: &str) -> serde_json::Value {
        reqwest::get(self.admin_url(path))
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

    /// Waits until the load table is idle and the status history has a point that counted
    /// requests (the sampler closes an interval every 5 s); returns `/admin/status`.
    pub(crate) async fn settled_status(&self) -> serde_json::Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let v = self.admin_json("/admin/status").await;
            let idle = v["instances"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["inflight_requests"] == 0 && i["waiting"] == 0);
            let sampled = v["history"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["requests"].as_u64() > Some(0));
            if idle && sampled {
                return v;
            }
            assert!(Instant::now() < deadline, "status never settled: {v:#}");
            tokio::time::sleep(Duration::from_millis(100)).await; // ok-sleep: poll interval under a deadline
        }
    }
}
