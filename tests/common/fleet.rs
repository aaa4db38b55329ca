//! A whole fleet for the operations tests: `tokengate demo` (engine-sims + the gateway in one
//! process) with a config that exercises every metric family the dashboard and the status
//! page show, and bounded bursts of traffic through it.

use super::{eventually, DEADLINE};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where [`Fleet::start`] writes the address of the member gateway it starts first
/// ([`MEMBER_YAML`]).
const MEMBER_ADDR: &str = "MEMBER_ADDR";

/// Two services (one layered with session affinity and prefix layers, one least-token), a
/// decision route over both with its decision model, engine metrics scraped; a throttled
/// service (one instance, one prefill slot, a queue of two); a prefill/decode-disaggregated
/// service (vLLM's protocol: one prefill, two decode engine-sims, throttled per phase); and
/// another region's gateway as a global member, which takes what the throttled service
/// cannot; and a traffic mirror copying every other planned request to that member gateway
/// (as the throttled service's model, with its API key); a split proxy sending `gpt*` models
/// to that member gateway as an external API. Every port is 0: the demo starts
/// an engine-sim on a free port for each instance and provider; the member is a second
/// `tokengate demo` ([`MEMBER_YAML`]).
pub(crate) const FLEET_YAML: &str = r#"
listen: ["127.0.0.1:0"]
admin_listen: "127.0.0.1:0"
threads: 2
health_check: { interval: 1s }
global:
  name: us-east
  members:
    - { name: eu-west, url: "http://MEMBER_ADDR", token: sk-eu-west }
mirror:
  target: "http://MEMBER_ADDR"
  target_model: qwen3-8b
  ratio: 50
  auth_token: sk-eu-west
  timeout_ms: 10000
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
  - name: qwen3-8b
    throttling: { overflow: queue, prefill: 1, max_queue: 2, queue_timeout: 2s }
    instances:
      - { id: mid-1, addr: "127.0.0.1:0" }
  - name: qwen3-235b
    pd: { mode: vllm-nixl, decode_policy: least-token }
    throttling: { overflow: queue, prefill: 4, decode: 8 }
    instances:
      - { id: pf-1, addr: "127.0.0.1:0", role: prefill }
      - { id: dc-1, addr: "127.0.0.1:0", role: decode }
      - { id: dc-2, addr: "127.0.0.1:0", role: decode }
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
split:
  strategy: prefix
  proxies:
    - { local: true, prefix: "qwen*" }
    - { name: partner, address: "http://MEMBER_ADDR/v1", model: qwen3-8b, api_key: sk-eu-west, prefix: "gpt*" }
"#;

/// The member gateway of [`FLEET_YAML`] (region `eu-west`, also its mirror target): the
/// throttled service's model on one engine-sim, behind an API key (the fleet's member token).
pub(crate) const MEMBER_YAML: &str = r#"
listen: ["127.0.0.1:0"]
admin_listen: "127.0.0.1:0"
threads: 1
api_keys: [sk-eu-west]
services:
  - name: qwen3-8b
    instances:
      - { id: eu-mid-1, addr: "127.0.0.1:0" }
"#;

/// The throttled service of [`FLEET_YAML`], its only instance, and the member gateway.
pub(crate) const THROTTLED: &str = "qwen3-8b";
pub(crate) const THROTTLED_INSTANCE: &str = "mid-1";
pub(crate) const MEMBER: &str = "eu-west";

/// A running `tokengate demo`; killed on drop.
pub(crate) struct Fleet {
    child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    /// Every engine-sim of the demo by instance id.
    pub engines: BTreeMap<String, SocketAddr>,
    _dir: tempfile::TempDir,
    /// The member gateway, when the config has one (stopped after this one).
    pub member: Option<Box<Fleet>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Fleet {
    /// Starts `tokengate demo -c` with `yaml` (every address on port 0) and waits for its
    /// listeners. A config that names `MEMBER_ADDR` gets a member gateway ([`MEMBER_YAML`])
    /// started first, at that address.
    pub(crate) fn start(yaml: &str) -> Fleet {
        let (member, yaml) = if yaml.contains(MEMBER_ADDR) {
            let m = Fleet::start(MEMBER_YAML);
            let y = yaml.replace(MEMBER_ADDR, &m.proxy.to_string());
            (Some(Box::new(m)), y)
        } else {
            (None, yaml.to_string())
        };
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
        let mut engines = BTreeMap::new();
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
            } else if let Some(rest) = l.trim_start().strip_prefix("engine-sim ") {
                // `engine-sim ID model NAME http://ADDR[ (role)]`
                let w: Vec<&str> = rest.split_whitespace().collect();
                let a = w.iter().find_map(|x| x.strip_prefix("http://")).unwrap();
                engines.insert(w[0].to_string(), a.parse().unwrap());
            }
        }
        Fleet {
            child,
            proxy: proxy.unwrap(),
            admin: admin.unwrap(),
            engines,
            _dir: dir,
            member,
        }
    }

    pub(crate) fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// `n` rounds of traffic, one request at a time: per round a streamed and a unary chat
    /// to the first two services and the disaggregated one (a shared system prompt, so
    /// prefixes repeat; a session header for affinity), a unary chat to the throttled one
    /// (one at a time: it never queues), one request through the decision route, and every
    /// fourth round an unknown model (404). Returns the number of requests sent.
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
                ("qwen3-235b", true),
                ("qwen3-235b", false),
                (THROTTLED, false),
                ("qwen3", true),
                // The split proxy's external entry (the member gateway as an external API).
                ("gpt-4o-mini", false),
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

    /// Overloads the throttled service ([`THROTTLED`]: one instance, one prefill slot, a
    /// queue of two, `queue_timeout` 2 s) step by step, every step confirmed on the admin API
    /// before the next (no timing assumptions but the queue timeout itself):
    /// 1. its engine stalls every request (engine-sim's `stall_ms` fault), so a first
    ///    streamed request holds the only slot;
    /// 2. two more join the queue;
    /// 3. a fourth finds the queue full (`queue_full`) and overflows to the member gateway
    ///    ([`MEMBER`]), which serves it: 200, `x-tokengate-reason: global(eu-west)`;
    /// 4. the two queued ones time out: 503 (`queue_timeout`);
    /// 5. a fifth queues; the fault is cleared and the first request's client leaves, so the
    ///    fifth gets the slot after its wait and is served: 200.
    ///
    /// Ends with the fleet idle. Takes the queue timeout plus a little.
    pub(crate) async fn overload(&self) {
        let engine = self.engines[THROTTLED_INSTANCE];
        let faults = format!("http://{engine}/admin/faults");
        let url = format!("http://{}/v1/chat/completions", self.proxy);
        let body = |stream: bool, n: usize| {
            serde_json::json!({
                "model": THROTTLED,
                "stream": stream,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": format!("Overload request {n}.")}],
            })
        };
        let c = reqwest::Client::new();
        let set_faults = |v: serde_json::Value| {
            let c = c.clone();
            let faults = faults.clone();
            async move {
                let r = c.post(&faults).json(&v).send().await.unwrap();
                assert!(r.status().is_success(), "{faults}: {}", r.status());
            }
        };
        // A request on its own connection, sent in the background: (status, reason header).
        let spawn = |b: serde_json::Value| {
            let url = url.clone();
            tokio::spawn(async move {
                let c = reqwest::Client::new();
                let r = c.post(url).json(&b).send().await.unwrap();
                let reason = r
                    .headers()
                    .get("x-tokengate-reason")
                    .map(|v| v.to_str().unwrap().to_string());
                let status = r.status().as_u16();
                let _ = r.bytes().await;
                (status, reason)
            })
        };
        let within = |h: tokio::task::JoinHandle<(u16, Option<String>)>| async move {
            tokio::time::timeout(DEADLINE, h)
                .await
                .expect("request within the deadline")
                .unwrap()
        };
        let before = self.throttle().await;
        set_faults(serde_json::json!({"stall_ms": 60_000})).await;
        let holder = spawn(body(true, 0));
        eventually("the first request to hold the throttled slot", || async {
            self.instance(THROTTLED_INSTANCE).await["inflight_requests"] == 1
        })
        .await;
        let mut queued = Vec::new();
        for n in 1..=2 {
            queued.push(spawn(body(false, n)));
            eventually("a request to join the queue", || async {
                self.throttle().await["queued"] == n as u64
            })
            .await;
        }
        let (status, reason) = within(spawn(body(false, 3))).await;
        assert_eq!(status, 200, "the queue is full: the member serves it");
        assert_eq!(reason.as_deref(), Some("global(eu-west)"));
        for q in queued {
            let (status, _) = within(q).await;
            assert_eq!(status, 503, "a queued request times out");
        }
        let last = spawn(body(false, 4));
        eventually("the fifth request to queue", || async {
            self.throttle().await["queued"] == 1
        })
        .await;
        set_faults(serde_json::json!({})).await;
        holder.abort();
        let (status, _) = within(last).await;
        assert_eq!(status, 200, "the queued request got the slot");
        let t = self.throttle().await;
        let grew = |p: &str| {
            t.pointer(p).unwrap().as_u64().unwrap() - before.pointer(p).unwrap().as_u64().unwrap()
        };
        assert_eq!(grew("/rejections/queue_full"), 1, "{t}");
        assert_eq!(grew("/rejections/queue_timeout"), 2, "{t}");
        assert_eq!(grew("/queue_wait/count"), 3, "{t}");
    }

    /// `/admin/status` of one instance.
    pub(crate) async fn instance(&self, id: &str) -> serde_json::Value {
        let v = self.admin_json("/admin/status").await;
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no instance {id}: {v:#}"))
    }

    /// `/admin/status` of the throttled service's throttle.
    pub(crate) async fn throttle(&self) -> serde_json::Value {
        let v = self.admin_json("/admin/status").await;
        v["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == THROTTLED)
            .map(|s| s["throttle"].clone())
            .unwrap_or_else(|| panic!("no service {THROTTLED}: {v:#}"))
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

    /// Waits until the load table is idle, every mirror copy has ended (none queued or in
    /// flight) and the status history has a point that counted requests (the sampler closes
    /// an interval every 5 s); returns `/admin/status`.
    pub(crate) async fn settled_status(&self) -> serde_json::Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let v = self.admin_json("/admin/status").await;
            let idle = v["instances"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["inflight_requests"] == 0 && i["waiting"] == 0)
                && v["mirror"]["queued"] == 0
                && v["mirror"]["inflight"] == 0;
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
