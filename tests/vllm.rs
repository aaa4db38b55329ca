//! A real engine in the loop: two real vLLM servers (the CPU build serving the tiny model of
//! `scripts/vllm/setup.sh`) behind the real gateway binary. What engine-sim cannot show: a
//! real scheduler and prefix cache counting real tokens in 128-token blocks.
//!
//! Runs with `TOKENGATE_VLLM=1`, as CI sets it (the setup installs ~6 GB once per machine,
//! ~3 min here the first time; each vLLM takes ~2 GB and a core, ~60–80 s to start);
//! skipped with a message otherwise. `scripts/vllm/setup.sh` must have run (it prints its
//! directory at once when it has).

mod common;

use common::*;
use futures_util::StreamExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One vLLM server on a loopback port, killed (with its engine process) on drop.
struct Vllm {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Vllm {
    fn start(core: u32, dir: &std::path::Path) -> Vllm {
        // vLLM binds its own port: take a free one (a short race, for an opt-in test).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = dir.join(format!("vllm-{port}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/vllm/serve.sh"
        ))
        .args([port.to_string(), core.to_string()])
        .process_group(0)
        .stdout(Stdio::from(f.try_clone().unwrap()))
        .stderr(Stdio::from(f))
        .spawn()
        .expect("scripts/vllm/serve.sh");
        Vllm { child, port, log }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(600);
        let c = client();
        loop {
            if let Ok(r) = c.get(self.url("/health")).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            if let Ok(Some(s)) = self.child.try_wait() {
                panic!(
                    "vLLM exited ({s}):\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "vLLM did not start");
            tokio::time::sleep(Duration::from_millis(500)).await; // ok-sleep: poll interval under a deadline
        }
    }

    async fn reset_cache(&self) {
        let r = client()
            .post(self.url("/reset_prefix_cache"))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }

    async fn running(&self) -> f64 {
        let text = client()
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with("vllm:num_requests_running{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            // `--`: procps' kill reads a bare `-PID` as a signal name and kills nothing (the
            // test then waited for a vLLM that never exited).
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

/// Every request of the test gives up after this: a stuck engine fails the test, it does not
/// hang it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap()
}

fn system_prompt() -> String {
    "You are a helpful assistant for the gateway team. ".repeat(60)
}

/// One chat request: (instance, prompt tokens, cached tokens).
async fn chat(gw: &GatewayProc, user: &str) -> (String, u64, u64) {
    chat_with(gw, &system_prompt(), user).await
}

/// One chat request with a system prompt: (instance, prompt tokens, cached tokens).
async fn chat_with(gw: &GatewayProc, system: &str, user: &str) -> (String, u64, u64) {
    let r = client()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let who = r.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string();
    let v: serde_json::Value = r.json().await.unwrap();
    let u = &v["usage"];
    (
        who,
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// The service's index corrections and its engine token counters: (trims, engine prompt,
/// engine cached, predicted in the engines' units).
async fn index_figures(gw: &GatewayProc) -> (f64, f64, f64, f64) {
    gw.wait_idle().await;
    let trims = gw.instances().await["prefix_indexes"][0]["trims"]
        .as_f64()
        .unwrap();
    let m = gw.metrics().await;
    let e = |k: &str| {
        metric(
            &m,
            &format!("tokengate_prefix_engine_tokens_total{{kind=\"{k}\",service=\"tiny\"}}"),
        )
        .unwrap_or(0.0)
    };
    (trims, e("prompt"), e("cached"), e("predicted"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_behind_the_gateway() {
    if std::env::var("TOKENGATE_VLLM").as_deref() != Ok("1") {
        eprintln!(
            "skipped: set TOKENGATE_VLLM=1 (after scripts/vllm/setup.sh) to run against real vLLM"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut v1 = Vllm::start(0, dir.path());
    let mut v2 = Vllm::start(1, dir.path());
    v1.wait_ready().await;
    v2.wait_ready().await;
    let instances = format!(
        "    instances:\n      - {{id: v1, addr: \"127.0.0.1:{}\"}}\n      - {{id: v2, addr: \"127.0.0.1:{}\"}}\n",
        v1.port, v2.port
    );
    let layered = GatewayProc::start(&format!(
        "services:\n  - name: tiny\n    scheduler: {{mode: layered}}\n    engine_metrics: {{interval: 200ms, cache_size: true}}\n{instances}"
    ));
    let rr = GatewayProc::start(&format!(
        "services:\n  - name: tiny\n    load_balancing: round-robin\n{instances}"
    ));

    // Layered: a tenant's repeated system prompt stays on one instance, whose vLLM reports it
    // cached from the second request on.
    v1.reset_cache().await;
    v2.reset_cache().await;
    let mut seen = Vec::new();
    for i in 0..6 {
        seen.push(chat(&layered, &format!("question {i}")).await);
    }
    let home = &seen[0].0;
    assert!(seen.iter().all(|s| &s.0 == home), "{seen:?}");
    assert_eq!(seen[0].2, 0, "{seen:?}");
    assert!(seen[1..].iter().all(|s| s.2 > 0), "{seen:?}");
    let engine_cached: u64 = seen.iter().map(|s| s.2).sum();
    let prompt: u64 = seen.iter().map(|s| s.1).sum();
    eprintln!("layered: {seen:?}; engine cached {engine_cached}/{prompt} tokens");

    // The index in the engines' units: 100 requests of four tenants on engines that evict
    // nothing never correct it, and its prediction is within 5 points of what vLLM reports.
    let before = index_figures(&layered).await;
    let systems: Vec<String> = (0..4)
        .map(|t| {
            format!("Tenant {t} tools: ") + &"search the docs, read a file. ".repeat(20 + 12 * t)
        })
        .collect();
    for q in 0..25 {
        for system in &systems {
            chat_with(&layered, system, &format!("question {q}")).await;
        }
    }
    let after = index_figures(&layered).await;
    let (trims, prompt, cached, predicted) = (
        after.0 - before.0,
        after.1 - before.1,
        after.2 - before.2,
        after.3 - before.3,
    );
    eprintln!(
        "100 requests: index trims {trims}; engine hit ratio {:.3}, predicted {:.3}; block size {}",
        cached / prompt,
        predicted / prompt,
        layered.instances().await["instances"][0]["cache_block_tokens"]
    );
    assert_eq!(trims, 0.0);
    assert!((cached / prompt - predicted / prompt).abs() <= 0.05);
    // An engine that really evicted is corrected, and the tenant is cached again after.
    v1.reset_cache().await;
    v2.reset_cache().await;
    let (home, _, c0) = chat_with(&layered, &systems[0], "after the reset").await;
    assert_eq!(c0, 0);
    let trims_after_reset = index_figures(&layered).await.0 - after.0;
    let (again, _, c1) = chat_with(&layered, &systems[0], "and again").await;
    eprintln!("after /reset_prefix_cache: trims {trims_after_reset}, next request cached {c1} on {again} (home {home})");
    assert_eq!(trims_after_reset, 1.0);
    assert_eq!(again, home);
    assert!(c1 > 0);

    eprintln!("vllm test: round-robin");
    // Round-robin: the same prompt alternates, so each instance computes it once.
    v1.reset_cache().await;
    v2.reset_cache().await;
    let mut rrs = Vec::new();
    for i in 0..4 {
        rrs.push(chat(&rr, &format!("question {i}")).await);
    }
    assert_ne!(rrs[0].0, rrs[1].0, "{rrs:?}");
    assert_eq!((rrs[0].2, rrs[1].2), (0, 0), "{rrs:?}");
    assert!(rrs[2].2 > 0 && rrs[3].2 > 0, "{rrs:?}");

    eprintln!("vllm test: round-robin {rrs:?}; the APIs");
    // Every API through the gateway, streamed and not, with usage.
    let c = client();
    let r = c
        .post(layered.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "tiny", "max_tokens": 8, "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hello"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("\"usage\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    eprintln!("vllm test: stream ok");
    for (path, body) in [
        (
            "/v1/completions",
            serde_json::json!({"model": "tiny", "max_tokens": 8, "prompt": "hello"}),
        ),
        (
            "/v1/messages",
            serde_json::json!({"model": "tiny", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]}),
        ),
        (
            "/v1/responses",
            serde_json::json!({"model": "tiny", "max_output_tokens": 8, "input": "hello"}),
        ),
    ] {
        eprintln!("vllm test: {path}");
        let r = c.post(layered.url(path)).json(&body).send().await.unwrap();
        let status = r.status();
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{path}: {v}");
        assert!(v["usage"].is_object(), "{path}: {v}");
    }

    eprintln!("vllm test: engine metrics");
    // engine_metrics reads vLLM's own figures: its KV cache size from vllm:cache_config_info.
    eventually("the engines' cache size", || async {
        let v = layered.instances().await;
        v["instances"][0]["engine"]["cache_tokens"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;

    eprintln!("vllm test: a client hanging up");
    // A client that hangs up mid-stream: vLLM stops working on it.
    let r = c
        .post(layered.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "tiny", "max_tokens": 3000, "stream": true,
            "ignore_eos": true, "messages": [{"role": "user", "content": "go on"}]}),
        )
        .send()
        .await
        .unwrap();
    let mut s = r.bytes_stream();
    s.next().await.unwrap().unwrap();
    drop(s);
    eventually("vLLM to stop the abandoned request", || async {
        v1.running().await == 0.0 && v2.running().await == 0.0
    })
    .await;
}
