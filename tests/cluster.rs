//! Several replicas that route as one (`cluster.redis`), through the real binary: three
//! gateways on 127.0.0.1:0, one engine-sim fleet, a real `redis-server` started here on a
//! free port. Without `redis-server` on the PATH the tests skip with a message, unless
//! `TOKENGATE_REQUIRE_REDIS=1` (CI: `.ci/run`), where they fail.

mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` of the test's own, without persistence; killed on drop.
struct Redis {
    child: Option<Child>,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// `None` (the test skips) when `redis-server` is not installed and not required.
    fn start() -> Option<Redis> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(
                std::env::var("TOKENGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "redis-server is required (TOKENGATE_REQUIRE_REDIS=1): install it with scripts/setup.sh (apt-get install redis-server)"
            );
            eprintln!("skipped: redis-server is not installed (scripts/setup.sh installs it)");
            return None;
        }
        let mut r = Redis {
            child: None,
            port: 0,
            _dir: tempfile::tempdir().unwrap(),
        };
        // A free port: bound by the OS, released, then taken by Redis (another port if some
        // other process took it meanwhile).
        for _ in 0..5 {
            r.port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if r.spawn() {
                return Some(r);
            }
            r.kill();
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// Starts the server on its port; whether it answers PING within the deadline.
    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(self._dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + DEADLINE;
        while Instant::now() < deadline {
            if self.ping() {
                return true;
            }
            // Exited (its port taken): not up.
            if self
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some())
            {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20)); // ok-sleep: poll interval under a deadline
        }
        false
    }

    fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// The number of members of a sorted set (`ZCARD`); `None` when Redis does not answer.
    fn zcard(&self, key: &str) -> Option<u64> {
        self.command(&["ZCARD", key])?.parse().ok()
    }

    /// A field of a hash as a number (`HGET`); `None`: absent, or Redis does not answer.
    fn hget(&self, key: &str, field: &str) -> Option<f64> {
        self.command(&["HGET", key, field])?.parse().ok()
    }

    /// Sends a command; the answer's integer or bulk string (`None`: nil, or no answer).
    fn command(&self, args: &[&str]) -> Option<String> {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        let mut cmd = format!("*{}\r\n", args.len());
        for a in args {
            cmd.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(cmd.as_bytes()).ok()?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).ok()?;
        if let Some(n) = line.strip_prefix(':') {
            return Some(n.trim().to_string());
        }
        line.strip_prefix('$')?.trim().parse::<usize>().ok()?;
        let mut value = String::new();
        r.read_line(&mut value).ok()?;
        Some(value.trim_end().to_string())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the server and starts a new, empty one on the same port.
    fn restart_empty(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not restart on {}",
            self.port
        );
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `cluster:` block of a replica: a Redis timeout of 1 s, far above a loopback round trip,
/// so that a busy CI machine does not make a replica degraded (and the tests' fleet-wide
/// guarantees local only) by accident.
fn cluster_yaml(redis: &Redis, name: &str, extra: &str) -> String {
    format!(
        "cluster:\n  replica: {name}\n  heartbeat: 200ms\n  lease: 2s\n  redis: {{url: \"{}\", key_prefix: t, timeout: 1s}}\n{extra}",
        redis.url()
    )
}

/// Three replicas of one config (their `cluster.replica` r1, r2, r3), each joined.
async fn replicas(redis: &Redis, services: &str) -> Vec<GatewayProc> {
    replicas_n(redis, 3, services).await
}

/// `n` replicas of one config (their `cluster.replica` r1 … rn), each joined.
async fn replicas_n(redis: &Redis, n: usize, services: &str) -> Vec<GatewayProc> {
    let gws: Vec<GatewayProc> = (1..=n)
        .map(|i| {
            GatewayProc::start(&format!(
                "{}{services}",
                cluster_yaml(redis, &format!("r{i}"), "")
            ))
        })
        .collect();
    for g in &gws {
        eventually("every replica sees the others", || async {
            let v = admin(g, "/admin/cluster").await;
            v["state"] == "ok"
                && v["replicas"]
                    .as_array()
                    .is_some_and(|a| a.iter().filter(|r| r["health"] == "healthy").count() == n)
        })
        .await;
    }
    gws
}

async fn admin(g: &GatewayProc, path: &str) -> serde_json::Value {
    reqwest::get(g.admin_url(path))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Sends a chat request; (status, instance header, cached tokens).
async fn send(
    c: &reqwest::Client,
    g: &GatewayProc,
    body: &serde_json::Value,
    session: Option<&str>,
) -> (u16, String, u64) {
    let mut r = c.post(g.url("/v1/chat/completions")).json(body);
    if let Some(s) = session {
        r = r.header("x-session-id", s);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let inst = r
        .headers()
        .get("x-tokengate-instance")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let v: serde_json::Value = r.json().await.unwrap_or_default();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (status, inst, cached)
}

fn service(fleet: &[engine_sim::SimHandle], extra: &str) -> String {
    format!("services:\n  - name: m\n{extra}{}", sim_instances(fleet))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_prefixes_are_shared_by_the_replicas() {
    let Some(redis) = Redis::start() else { return };
    let fleet = sims(3, "m", "e", 100.0).await;
    let gws = replicas(&redis, &service(&fleet, "")).await;
    let c = reqwest::Client::new();
    // Twelve sessions of four turns, each turn through another replica and with a prompt
    // that shares nothing with the previous turn's: only the shared binding keeps a session
    // on its instance (a replica that did not see the first turn would balance it).
    let mut homes = std::collections::BTreeSet::new();
    for s in 0..12 {
        let sid = format!("sess-{s}");
        let mut first = None;
        for turn in 0..4 {
            let g = &gws[(s + turn) % 3];
            let (st, inst, _) = send(
                &c,
                g,
                &chat("", &words(&format!("s{s}t{turn}w"), 40), 2, false),
                Some(&sid),
            )
            .await;
            assert_eq!(st, 200);
            match &first {
                None => first = Some(inst),
                Some(f) => assert_eq!(&inst, f, "session {sid} turn {turn} left its instance"),
            }
        }
        homes.extend(first);
    }
    // The sessions were spread, not all on one engine.
    assert!(homes.len() >= 2, "every session on one instance: {homes:?}");

    // A prefix routed through r1 is a hit through r2 once r2's index has it.
    let long = words("shared-prefix-", 600);
    let (st, holder, _) = send(&c, &gws[0], &chat("", &long, 2, false), None).await;
    assert_eq!(st, 200);
    eventually("r2's index knows the placement made by r1", || async {
        let v = gws[1].instances().await;
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["id"] == holder.as_str() && i["cached_blocks"].as_u64().unwrap_or(0) >= 20)
    })
    .await;
    let (st, inst, cached) = send(
        &c,
        &gws[1],
        &chat("", &format!("{long} and a new question"), 2, false),
        None,
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(
        inst, holder,
        "the prefix's next request through r2 went elsewhere"
    );
    assert!(
        cached > 0,
        "the engine found nothing of the prefix in its cache"
    );
    let m = gws[1].metrics().await;
    assert!(
        metric(
            &m,
            "tokengate_cluster_events_applied_total{kind=\"placed\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "r2 applied no placement: {m}"
    );
}

async fn slow_sim(id: &str) -> engine_sim::SimHandle {
    engine_sim::spawn_local(engine_sim::SimConfig {
        id: id.into(),
        model: "m".into(),
        prefill_tps: 20_000.0,
        time_scale: 1.0,
        decode_step_ms: 5.0,
        decode_per_req_ms: 0.0,
        ..Default::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_limit_holds_for_the_fleet() {
    let Some(redis) = Redis::start() else { return };
    let fleet = vec![slow_sim("e1").await, slow_sim("e2").await];
    let gws = replicas(
        &redis,
        &service(
            &fleet,
            "    throttling: {overflow: queue, total: 2, max_queue: 100, queue_timeout: 30s}\n",
        ),
    )
    .await;
    // 36 requests at once, 12 through each replica: each replica alone would let 2 run per
    // engine, so 6 per engine without the fleet's leases.
    let c = reqwest::Client::new();
    let reqs: Vec<_> = (0..36)
        .map(|i| {
            let c = c.clone();
            let url = gws[i % 3].url("/v1/chat/completions");
            let b = chat("", &words(&format!("r{i}x"), 200), 8, false);
            tokio::spawn(async move { c.post(url).json(&b).send().await.unwrap().status() })
        })
        .collect();
    for r in reqs {
        assert_eq!(r.await.unwrap(), 200);
    }
    for e in &fleet {
        let st = e.stats();
        assert!(st.requests_finished > 0, "{} served nothing", e.id());
        assert!(
            st.max_running <= 2,
            "{} ran {} requests at once; the fleet's limit is 2",
            e.id(),
            st.max_running
        );
    }
}

/// Sends a chat request with a tenant's key: (status, `Retry-After` in seconds,
/// `x-ratelimit-remaining-requests`).
async fn send_as(
    c: &reqwest::Client,
    g: &GatewayProc,
    key: &str,
    body: &serde_json::Value,
) -> (u16, Option<u64>, Option<u64>) {
    let r = c
        .post(g.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let remaining = r
        .headers()
        .get("x-ratelimit-remaining-requests")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    (status, retry, remaining)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_requests_per_minute_hold_for_the_fleet() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let fleet = sims(1, "m", "e", 100.0).await;
    // 5 a minute: one more every 12 s, far longer than the 12 requests below take.
    let tenants = "tenants:\n  - {name: team, keys: [sk-team], limits: {requests_per_minute: 5}}\n";
    let gws = replicas_n(&redis, 2, &format!("{tenants}{}", service(&fleet, ""))).await;
    let c = reqwest::Client::new();
    let (mut ok, mut refused) = (0, 0);
    let mut remaining = Vec::new();
    for i in 0..12 {
        let (st, retry, left) = send_as(
            &c,
            &gws[i % 2],
            "sk-team",
            &chat("", &format!("q{i}"), 2, false),
        )
        .await;
        match st {
            200 => {
                ok += 1;
                remaining.push(left);
            }
            429 => {
                assert!(
                    retry.is_some_and(|s| s >= 1),
                    "a refusal without Retry-After"
                );
                refused += 1;
            }
            s => panic!("request {i}: status {s}"),
        }
    }
    // Each replica alone would admit 5 (10 in all).
    assert_eq!((ok, refused), (5, 7), "admitted, refused");
    // The headers count down the fleet's requests, whichever replica answered.
    assert_eq!(remaining, [Some(4), Some(3), Some(2), Some(1), Some(0)]);
    let m = gws[1].metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_cluster_local_fallbacks_total{what=\"tenant\"}"
        ),
        Some(0.0),
        "the fleet's count was not used: {m}"
    );
    // Redis gone: each replica's own limit (r2 admitted 2 of its 6, the fleet's refusals
    // given back to its own bucket: 3 left there).
    redis.kill();
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(
            send_as(
                &c,
                &gws[1],
                "sk-team",
                &chat("", &format!("d{i}"), 2, false),
            )
            .await
            .0,
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let m = gws[1].metrics().await;
    assert!(
        metric(
            &m,
            "tokengate_cluster_local_fallbacks_total{what=\"tenant\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "no local fallback counted: {m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_admission_reads_the_session_in_the_same_round_trip() {
    let Some(redis) = Redis::start() else { return };
    let fleet = sims(3, "m", "e", 100.0).await;
    let tenants = "tenants:\n  - {name: team, keys: [sk-team], limits: {requests_per_minute: 1000, concurrency: 50}}\n";
    let gws = replicas_n(&redis, 2, &format!("{tenants}{}", service(&fleet, ""))).await;
    let c = reqwest::Client::new();
    // Six sessions of three turns, each turn through the other replica with a prompt that
    // shares nothing with the last: only the fleet's binding keeps a session in place.
    for s in 0..6 {
        let mut home = None;
        for turn in 0..3 {
            let r = c
                .post(gws[(s + turn) % 2].url("/v1/chat/completions"))
                .bearer_auth("sk-team")
                .header("x-session-id", format!("sess-{s}"))
                .json(&chat("", &words(&format!("s{s}t{turn}w"), 40), 2, false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let inst = r.headers()["x-tokengate-instance"]
                .to_str()
                .unwrap()
                .to_string();
            match &home {
                None => home = Some(inst),
                Some(h) => assert_eq!(&inst, h, "session {s} turn {turn} left its instance"),
            }
        }
    }
    // One Redis call per request before routing: the tenant's script, no session read.
    let mut calls = [0.0; 2];
    for g in &gws {
        let m = g.metrics().await;
        let get = |op: &str| {
            metric(
                &m,
                &format!("tokengate_cluster_redis_calls_total{{op=\"{op}\",result=\"ok\"}}"),
            )
            .unwrap_or(0.0)
        };
        calls[0] += get("tenant");
        calls[1] += get("session_get");
    }
    assert_eq!(calls, [18.0, 0.0], "tenant scripts, session reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_is_charged_to_the_fleets_tokens() {
    let Some(redis) = Redis::start() else { return };
    let fleet = sims(1, "m", "e", 100.0).await;
    // 300 output tokens a minute: 5 a second come back.
    let tenants =
        "tenants:\n  - {name: team, keys: [sk-team], limits: {output_tokens_per_minute: 300}}\n";
    let gws = replicas_n(&redis, 2, &format!("{tenants}{}", service(&fleet, ""))).await;
    let c = reqwest::Client::new();
    // Through r1: 10 reserved (max_tokens), 250 used (the engine ignores max_tokens here).
    let r = c
        .post(gws[0].url("/v1/chat/completions"))
        .bearer_auth("sk-team")
        .header("x-sim-output-tokens", "250")
        .json(&chat("", "a long one", 10, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 250);
    // Settled on Redis off the request's path: 300 - 250, plus what came back since.
    eventually("the fleet's bucket charged with the 250 used", || async {
        redis.hget("t:tenant:team", "o").is_some_and(|l| l < 100.0)
    })
    .await;
    // So r2, whose own bucket is full, refuses 100 more until about 10 s have refilled it.
    let (st, retry, _) = send_as(&c, &gws[1], "sk-team", &chat("", "next", 100, false)).await;
    assert_eq!(st, 429, "r2 admitted 100 tokens the fleet does not have");
    assert!(retry.is_some_and(|s| s >= 2), "Retry-After {retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_concurrency_holds_for_the_fleet() {
    let Some(redis) = Redis::start() else { return };
    let fleet = vec![slow_sim("e1").await];
    let tenants = "tenants:\n  - {name: team, keys: [sk-team], limits: {concurrency: 2}}\n";
    let gws = replicas_n(&redis, 2, &format!("{tenants}{}", service(&fleet, ""))).await;
    let c = reqwest::Client::new();
    // Eight requests at once, four through each replica, each holding its engine for 5 s
    // (1,000 decode steps of 5 ms): each replica alone would let 2 run, 4 in all.
    let reqs: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            let url = gws[i % 2].url("/v1/chat/completions");
            let b = chat("", &format!("long {i}"), 1000, false);
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .bearer_auth("sk-team")
                    .json(&b)
                    .send()
                    .await
                    .unwrap();
                let st = r.status().as_u16();
                let _ = r.bytes().await;
                st
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for r in reqs {
        statuses.push(r.await.unwrap());
    }
    statuses.sort();
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429, 429, 429]);
    assert!(fleet[0].stats().max_running <= 2, "{:?}", fleet[0].stats());
    // Both slots come back: requests through either replica are admitted again.
    for g in &gws {
        eventually("the tenant's fleet slots are free again", || async {
            send_as(&c, g, "sk-team", &chat("", "short", 1, false))
                .await
                .0
                == 200
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_balances_on_the_fleets_load() {
    let Some(redis) = Redis::start() else { return };
    let fleet = vec![slow_sim("e1").await, slow_sim("e2").await];
    let gws = replicas(
        &redis,
        &service(&fleet, "    load_balancing: least-request\n"),
    )
    .await;
    // r1 holds one long stream on one engine...
    let c = reqwest::Client::new();
    let held = c
        .post(gws[0].url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "m", "max_tokens": 100000, "stream": true,
            "messages": [{"role": "user", "content": "hold"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let busy = held.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string();
    // ...which r2 learns...
    eventually("r2 sees r1's request in flight", || async {
        gws[1].instances().await["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["id"] == busy.as_str() && i["other_replicas"]["inflight_requests"] == 1)
    })
    .await;
    // ...so its least-request balancing sends its own requests to the other engine (alone,
    // r2 would see two idle engines and alternate).
    for n in 0..4 {
        let (st, inst, _) = send(
            &c,
            &gws[1],
            &chat("", &format!("short {n}"), 1, false),
            None,
        )
        .await;
        assert_eq!(st, 200);
        assert_ne!(
            inst, busy,
            "r2 sent request {n} to the engine r1 keeps busy"
        );
    }
    drop(held);
    eventually("r1's request leaves r2's view", || async {
        gws[1].instances().await["instances"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["other_replicas"]["inflight_requests"] == 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_gives_its_slots_back_within_the_lease() {
    let Some(redis) = Redis::start() else { return };
    let fleet = vec![slow_sim("e1").await];
    let mut gws = replicas(
        &redis,
        &service(
            &fleet,
            "    throttling: {overflow: queue, total: 1, max_queue: 10, queue_timeout: 20s}\n",
        ),
    )
    .await;
    // r3 holds the fleet's one slot with a long answer (in its decode phase)...
    let c = reqwest::Client::new();
    let hold = {
        let c = c.clone();
        let url = gws[2].url("/v1/chat/completions");
        let b = serde_json::json!({"model": "m", "max_tokens": 100000, "stream": true,
            "messages": [{"role": "user", "content": "hold"}]});
        tokio::spawn(async move {
            let r = c.post(url).json(&b).send().await;
            // The stream ends when r3 dies; what it got does not matter.
            if let Ok(r) = r {
                let _ = r.bytes().await;
            }
        })
    };
    eventually("r3 holds the slot", || async {
        admin(&gws[2], "/admin/cluster").await["leases_held"] == 1
    })
    .await;
    // ...so r1's request queues behind the fleet's limit.
    let waiting = {
        let c = c.clone();
        let url = gws[0].url("/v1/chat/completions");
        tokio::spawn(async move {
            let t = Instant::now();
            let r = c
                .post(url)
                .json(&chat("", "after", 2, false))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), t.elapsed())
        })
    };
    eventually("r1's request queued", || async {
        gws[0].instances().await["throttles"][0]["queued"] == 1
    })
    .await;
    // r3 dies without giving anything back: its lease expires (2 s), r1's request runs.
    let killed_at = Instant::now();
    let mut r3 = gws.pop().unwrap();
    let _ = r3.child.kill();
    let _ = r3.child.wait();
    let (status, _) = waiting.await.unwrap();
    assert_eq!(status, 200);
    let took = killed_at.elapsed();
    // Not before the lease could expire: the slot was the dead replica's until then.
    assert!(
        took >= Duration::from_millis(1000),
        "r1's request ran {took:?} after r3 died: the slot was not held for the lease"
    );
    assert!(
        took < Duration::from_secs(5),
        "the dead replica's slot came back after {took:?} (lease 2s)"
    );
    hold.abort();
    // r1 lists r3 as missing (3 heartbeats without one), then not at all (10).
    eventually("r1 no longer lists r3 as healthy", || async {
        let v = admin(&gws[0], "/admin/cluster").await;
        !v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["replica"] == "r3" && r["health"] == "healthy")
    })
    .await;
    eventually("r1 forgets r3", || async {
        let v = admin(&gws[0], "/admin/cluster").await;
        let list = v["replicas"].as_array().unwrap();
        list.len() == 2 && !list.iter().any(|r| r["replica"] == "r3")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load_fails_no_request() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let fleet = sims(2, "m", "e", 100.0).await;
    let gws = replicas(
        &redis,
        &service(
            &fleet,
            "    throttling: {overflow: queue, total: 4, max_queue: 100, queue_timeout: 30s}\n",
        ),
    )
    .await;
    let c = reqwest::Client::new();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Six clients, 40 requests each, round-robin over the replicas, sessions included.
    let load: Vec<_> = (0..6)
        .map(|w| {
            let c = c.clone();
            let urls: Vec<String> = gws.iter().map(|g| g.url("/v1/chat/completions")).collect();
            let sent = sent.clone();
            tokio::spawn(async move {
                let mut bad = Vec::new();
                for i in 0..40 {
                    let r = c
                        .post(&urls[(w + i) % 3])
                        .header("x-session-id", format!("w{w}-{}", i / 5))
                        .json(&chat("", &words(&format!("w{w}i{i}"), 60), 2, false))
                        .send()
                        .await;
                    match r {
                        Ok(r) if r.status() == 200 => {}
                        Ok(r) => bad.push(format!(
                            "{}: {}",
                            r.status(),
                            r.text().await.unwrap_or_default()
                        )),
                        Err(e) => bad.push(e.to_string()),
                    }
                    sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                bad
            })
        })
        .collect();
    let at = |n: usize| {
        let sent = sent.clone();
        async move {
            eventually(&format!("{n} requests sent"), || async {
                sent.load(std::sync::atomic::Ordering::Relaxed) >= n
            })
            .await
        }
    };
    at(40).await;
    redis.kill();
    for g in &gws {
        eventually("the replica says cluster: degraded", || async {
            g.instances().await["cluster"]["summary"] == "cluster: degraded"
        })
        .await;
    }
    at(120).await;
    redis.restart_empty();
    for g in &gws {
        eventually("the replica is back on Redis", || async {
            admin(g, "/admin/cluster").await["state"] == "ok"
        })
        .await;
    }
    let mut bad = Vec::new();
    for l in load {
        bad.extend(l.await.unwrap());
    }
    assert!(bad.is_empty(), "{} requests failed: {bad:?}", bad.len());
    for g in &gws {
        let m = g.metrics().await;
        assert!(metric(&m, "tokengate_cluster_degraded").is_some_and(|v| v == 0.0));
        let warned = g
            .log_text()
            .matches("routing on this replica's local state")
            .count();
        assert_eq!(warned, 1, "one warning per outage, got {warned}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_come_back_after_redis_restarts_empty() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let fleet = vec![slow_sim("e1").await];
    let gws = replicas_n(
        &redis,
        2,
        &service(&fleet, "    throttling: {overflow: reject, total: 2}\n"),
    )
    .await;
    let c = reqwest::Client::new();
    // Two long requests through r1 take the fleet's two slots of e1 (5 s each).
    let holds: Vec<_> = (0..2)
        .map(|i| {
            let (c, url) = (c.clone(), gws[0].url("/v1/chat/completions"));
            let b = chat("", &format!("long {i}"), 1000, false);
            tokio::spawn(async move { c.post(url).json(&b).send().await.unwrap().status() })
        })
        .collect();
    let key = "t:lease:m:e1:total";
    eventually("both slots leased", || async {
        redis.zcard(key) == Some(2)
    })
    .await;
    // Redis loses everything; r1's next heartbeat adds its two live leases back.
    redis.restart_empty();
    eventually("the live leases are back in the new Redis", || async {
        redis.zcard(key) == Some(2)
    })
    .await;
    eventually("r2 uses Redis again", || async {
        admin(&gws[1], "/admin/cluster").await["state"] == "ok"
    })
    .await;
    // So r2 finds e1 full while they run (without them it would take a third slot).
    let (st, _, _) = send(&c, &gws[1], &chat("", "third", 1, false), None).await;
    assert_eq!(st, 429, "r2 took a slot the fleet does not have");
    for h in holds {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert!(fleet[0].stats().max_running <= 2, "{:?}", fleet[0].stats());
}

/// Fleet-wide fairness: under a fleet-wide limit of 2 slots with a backlog, tenant `heavy`
/// sends 10× tenant `light`, `heavy` mostly through r1 and `light` mostly through r2. Each
/// replica's queue alone is mostly one tenant (fair per replica, r1 would take most freed
/// slots for `heavy`); with the fleet's figures r1 leaves the freed slots to `light` while it
/// was served less fleet-wide, and each gets at least 40 % of the engine's tokens while both
/// are backlogged (every request the same size: shares of answers are shares of tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_the_fleet_fairly_whichever_replica_they_use() {
    let Some(redis) = Redis::start() else { return };
    let fleet = vec![slow_sim("e1").await];
    let tenants = "tenants:\n  - {name: heavy, keys: [sk-h]}\n  - {name: light, keys: [sk-l]}\n";
    let throttling =
        "    throttling: {overflow: queue, total: 2, max_queue: 1000, queue_timeout: 60s}\n";
    let gws = replicas_n(
        &redis,
        2,
        &format!("{tenants}{}", service(&fleet, throttling)),
    )
    .await;
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<&'static str>::new()));
    let c = reqwest::Client::new();
    let send = |g: &GatewayProc, key: &'static str, label: &'static str, i: usize| {
        let (c, url, done) = (c.clone(), g.url("/v1/chat/completions"), done.clone());
        let body = chat("", &words(&format!("{label}{i}w"), 40), 16, false);
        tokio::spawn(async move {
            let r = c
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            done.lock().push(label);
        })
    };
    // 100 of `heavy`: 90 through r1, 10 through r2.
    let mut tasks: Vec<_> = (0..100)
        .map(|i| send(&gws[usize::from(i % 10 == 9)], "sk-h", "h", i))
        .collect();
    eventually("r1's queue to fill", || async {
        metric(
            &gws[0].metrics().await,
            "tokengate_throttle_queue_length{service=\"m\"}",
        )
        .is_some_and(|q| q >= 60.0)
    })
    .await;
    let before = done.lock().len();
    // 10 of `light`: 9 through r2, 1 through r1.
    tasks.extend((0..10).map(|i| send(&gws[usize::from(i != 0)], "sk-l", "l", i)));
    for t in tasks {
        t.await.unwrap();
    }
    let order = done.lock().clone();
    // From the light tenant's arrival to its last answer, both were backlogged.
    let share = share_while_backlogged(&order, before, "l");
    assert!(share >= 0.4, "light tenant got {share:.2}: {order:?}");
    assert!(fleet[0].stats().max_running <= 2, "{:?}", fleet[0].stats());
    for g in &gws {
        let m = g.metrics().await;
        let fallbacks = metric(
            &m,
            "tokengate_cluster_local_fallbacks_total{what=\"fairness\"}",
        );
        assert_eq!(fallbacks, Some(0.0), "fair on local figures only:\n{m}");
    }
    // Redis away: each replica's queue is fair on its own figures, counted as fallbacks.
    drop(redis);
    eventually("r1 says cluster: degraded", || async {
        gws[0].instances().await["cluster"]["summary"] == "cluster: degraded"
    })
    .await;
    done.lock().clear();
    let queued: Vec<_> = (0..6)
        .map(|i| send(&gws[0], "sk-l", "l", 100 + i))
        .collect();
    for t in queued {
        t.await.unwrap();
    }
    eventually("queued requests counted as local fallbacks", || async {
        metric(
            &gws[0].metrics().await,
            "tokengate_cluster_local_fallbacks_total{what=\"fairness\"}",
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
}

/// A Redis restarted empty does not give a tenant a fresh minute: each replica, seeing the
/// store's epoch change, writes back its share of the minute's charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_keeps_the_tenants_minute() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let fleet = sims(1, "m", "e", 100.0).await;
    // 6 a minute: one more every 10 s, longer than the test takes.
    let tenants = "tenants:\n  - {name: team, keys: [sk-team], limits: {requests_per_minute: 6}}\n";
    let gws = replicas_n(&redis, 2, &format!("{tenants}{}", service(&fleet, ""))).await;
    let c = reqwest::Client::new();
    for i in 0..6 {
        let body = chat("", &format!("q{i}"), 2, false);
        let (st, _, _) = send_as(&c, &gws[i % 2], "sk-team", &body).await;
        assert_eq!(st, 200, "request {i}");
    }
    redis.restart_empty();
    // Each replica writes back its 3: the new bucket holds none of the 6.
    eventually(
        "both replicas' shares of the minute written back",
        || async { redis.hget("t:tenant:team", "r").is_some_and(|l| l < 1.0) },
    )
    .await;
    for (i, g) in gws.iter().enumerate() {
        eventually("the replica uses Redis again", || async {
            admin(g, "/admin/cluster").await["state"] == "ok"
        })
        .await;
        let body = chat("", &format!("after {i}"), 2, false);
        let (st, retry, _) = send_as(&c, g, "sk-team", &body).await;
        assert_eq!(st, 429, "r{} admitted a request of a spent minute", i + 1);
        assert!(retry.is_some_and(|s| s >= 1), "Retry-After {retry:?}");
    }
}

#[test]
fn config_errors_name_the_yaml_path() {
    let (ok, err) = check_yaml(
        "cluster:\n  redis: {url: \"http://x\", timeout: 0s}\n  heartbeat: 1s\n  lease: 1s\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
    );
    assert!(!ok);
    assert!(err.contains("cluster.redis.url"), "{err}");
    assert!(err.contains("cluster.redis.timeout"), "{err}");
    assert!(err.contains("cluster.lease"), "{err}");
    let (ok, err) = check_yaml(
        "cluster:\n  redis: {url: \"redis://:secret@127.0.0.1:6379\"}\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
    );
    assert!(ok, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cluster_nothing_is_shared() {
    let fleet = sims(1, "m", "e", 100.0).await;
    let g = GatewayProc::start(&service(&fleet, ""));
    let v = admin(&g, "/admin/cluster").await;
    assert_eq!(v["enabled"], false);
    assert_eq!(g.instances().await["cluster"]["state"], "off");
    let (st, _, _) = send(
        &reqwest::Client::new(),
        &g,
        &chat("", "hello", 2, false),
        Some("s"),
    )
    .await;
    assert_eq!(st, 200);
    // The families are there (dashboards), all zero: no Redis call was made.
    let m = g.metrics().await;
    let calls: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("tokengate_cluster_redis_calls_total{"))
        .collect();
    assert!(!calls.is_empty());
    assert!(calls.iter().all(|l| l.ends_with(" 0")), "{calls:?}");
    assert_eq!(metric(&m, "tokengate_cluster_degraded"), Some(0.0));
    assert_eq!(admin(&g, "/admin/status").await["cluster"]["state"], "off");
    // `cluster:` is read at start: a reload that adds it says so and changes nothing.
    let cfg = std::fs::read_to_string(g.config_path()).unwrap();
    std::fs::write(
        g.config_path(),
        format!("{cfg}cluster:\n  redis: {{url: \"redis://127.0.0.1:9\"}}\n"),
    )
    .unwrap();
    let status = std::process::Command::new("kill")
        .args(["-HUP", &g.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    eventually("the reload warns that cluster needs a restart", || async {
        g.log_text()
            .contains("cluster changes take effect only after a restart")
    })
    .await;
    assert_eq!(admin(&g, "/admin/cluster").await["enabled"], false);
}

/// Sends a chat request to `g`; (instance, reason). Asserts a 200.
async fn place(
    c: &reqwest::Client,
    g: &GatewayProc,
    body: &serde_json::Value,
    session: Option<&str>,
) -> (String, String) {
    let mut r = c.post(g.url("/v1/chat/completions")).json(body);
    if let Some(s) = session {
        r = r.header("x-session-id", s);
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let h = |k: &str| {
        r.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let out = (h("x-tokengate-instance"), h("x-tokengate-reason"));
    r.bytes().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_rendezvous_placement_makes_replicas_agree() {
    // Two replicas that never talk (no Redis), one fleet whose load both scrape.
    let fleet = sims(4, "m", "e", 100.0).await;
    let yaml = format!(
        "cluster: {{placement: rendezvous}}\n{}",
        service(&fleet, "    engine_metrics: {interval: 100ms}\n")
    );
    let gws = [GatewayProc::start(&yaml), GatewayProc::start(&yaml)];
    for g in &gws {
        // Nothing shared, nothing to connect to.
        assert_eq!(admin(g, "/admin/cluster").await["enabled"], false);
        eventually("every engine scraped by both replicas", || async {
            g.instances().await["instances"]
                .as_array()
                .is_some_and(|a| a.len() == 4 && a.iter().all(|i| i["engine"]["age_ms"].is_u64()))
        })
        .await;
    }
    let c = reqwest::Client::new();
    // A fixed pseudo-random replica per session (an L4 balancer's choice, as far as the
    // replicas can tell).
    let mut lcg = 0x2545_f491_4f6c_dd1du64;
    let mut pick = || {
        lcg = lcg
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (lcg >> 33) as usize % 2
    };
    let mut homes = std::collections::BTreeSet::new();
    for s in 0..16 {
        let sid = format!("rv-sess-{s}");
        let a = pick();
        // Its first turn through one replica, its second (sharing nothing with the first, so
        // no prefix match either) through the other, which has never seen the session.
        let (first, why) = place(
            &c,
            &gws[a],
            &chat("", &words(&format!("s{s}a"), 40), 2, false),
            Some(&sid),
        )
        .await;
        assert_eq!(why, "rendezvous(session)", "session {sid}");
        let (second, why) = place(
            &c,
            &gws[1 - a],
            &chat("", &words(&format!("s{s}b"), 40), 2, false),
            Some(&sid),
        )
        .await;
        assert_eq!(
            why, "rendezvous(session)",
            "session {sid} through the other replica"
        );
        assert_eq!(second, first, "session {sid}: the replicas placed it apart");
        // The first replica keeps its binding.
        let (third, why) = place(
            &c,
            &gws[a],
            &chat("", &words(&format!("s{s}c"), 40), 2, false),
            Some(&sid),
        )
        .await;
        assert_eq!(
            (third.as_str(), why.as_str()),
            (first.as_str(), "affinity"),
            "{sid}"
        );
        homes.insert(first);
    }
    assert!(homes.len() >= 3, "sessions not spread: {homes:?}");
    // A new prefix without a session: its home from its first block, whichever replica.
    let mut prefix_homes = std::collections::BTreeSet::new();
    for p in 0..8 {
        let long = words(&format!("rv-prefix-{p}-"), 300);
        let a = pick();
        let (first, why) = place(
            &c,
            &gws[a],
            &chat("", &format!("{long} first question"), 2, false),
            None,
        )
        .await;
        assert_eq!(why, "rendezvous(prefix)", "prefix {p}");
        let (second, why) = place(
            &c,
            &gws[1 - a],
            &chat("", &format!("{long} second question"), 2, false),
            None,
        )
        .await;
        assert_eq!(
            why, "rendezvous(prefix)",
            "prefix {p} through the other replica"
        );
        assert_eq!(second, first, "prefix {p}: the replicas placed it apart");
        // Through the first replica again: its own index has the prefix there.
        let (third, why) = place(
            &c,
            &gws[a],
            &chat("", &format!("{long} third question"), 2, false),
            None,
        )
        .await;
        assert_eq!(third, first, "prefix {p}");
        assert!(why.starts_with("prefix("), "prefix {p}: {why}");
        prefix_homes.insert(first);
    }
    assert!(
        prefix_homes.len() >= 2,
        "prefixes not spread: {prefix_homes:?}"
    );
}

#[test]
fn rendezvous_placement_needs_no_redis_and_is_checked() {
    let svc = "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n      - {id: b, addr: 127.0.0.1:8001}\n";
    let (ok, err) = check_yaml(&format!("cluster: {{placement: rendezvous}}\n{svc}"));
    assert!(ok, "{err}");
    // Without engine_metrics it warns: the hash alone, blind to load.
    assert!(err.contains("services[0].engine_metrics"), "{err}");
    // Without Redis, nothing else makes sense.
    let (ok, err) = check_yaml(&format!("cluster: {{}}\n{svc}"));
    assert!(!ok);
    assert!(
        err.contains("cluster.placement: without cluster.redis"),
        "{err}"
    );
    let (ok, err) = check_yaml(&format!("cluster: {{placement: load}}\n{svc}"));
    assert!(!ok);
    assert!(err.contains("cluster.placement"), "{err}");
    let (ok, err) = check_yaml(&format!("cluster: {{placement: hashed}}\n{svc}"));
    assert!(!ok);
    assert!(err.contains("cluster.placement"), "{err}");
    // With Redis it may be chosen too.
    let (ok, err) = check_yaml(&format!(
        "cluster: {{placement: rendezvous, redis: {{url: \"redis://127.0.0.1:6379\"}}}}\n{svc}"
    ));
    assert!(ok, "{err}");
}
