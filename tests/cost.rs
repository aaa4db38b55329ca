//! Predicted-TTFT scheduling through the real binary (issue 12): the layered scheduler with
//! predicted-TTFT eligibility and balancing weighs an instance's queued prefill work against
//! the prefix it holds.

mod common;

use common::*;

/// Two engines `e1`, `e2` serving model `m` in real time, otherwise as `cfg`.
async fn pair(cfg: engine_sim::SimConfig) -> Vec<engine_sim::SimHandle> {
    sim_fleet(
        2,
        engine_sim::SimConfig {
            time_scale: 1.0,
            ..cfg
        },
    )
    .await
}

/// Two engines prefilling 400 tokens/s (real time): a 16 KB prompt takes ~10 s.
async fn slow_pair() -> Vec<engine_sim::SimHandle> {
    pair(engine_sim::SimConfig {
        prefill_tps: 400.0,
        ..Default::default()
    })
    .await
}

/// The value of response header `k`.
fn header(r: &reqwest::Response, k: &str) -> String {
    r.headers()[k].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_queued_prefill_steers_a_request_away_from_the_prefix_holder() {
    let fleet = slow_pair().await;
    // The layered scheduler with predicted TTFT: prefix layer comparing predicted TTFTs,
    // balancing by predicted TTFT (no least-cached layer: this tests the balancer).
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: predicted-ttft\n    scheduler: {{mode: layered, prefix: {{ttft_tolerance: 0.5}}, least_cached: {{enabled: false}}}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let post = |body: serde_json::Value| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move { c.post(url).json(&body).send().await.unwrap() }
    };
    let system = words("sys", 40); // ~60 tokens: a short system prompt
                                   // A: lands somewhere and completes; that instance holds the system prompt.
    let a = post(chat(&system, "hello", 2, false)).await;
    assert_eq!(a.status(), 200);
    let holder = header(&a, "x-tokengate-instance");
    a.bytes().await.unwrap();
    // B: the same system prompt and a 16 KB user message: the holder has the prefix and the
    // same (empty) queue, so B goes there and prefills for ~10 s.
    let b = post(chat(&system, &words("long", 3000), 2, true)).await;
    assert_eq!(b.status(), 200);
    assert_eq!(header(&b, "x-tokengate-instance"), holder);
    let v = gw.instances().await;
    let q = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == holder.as_str())
        .unwrap()["queued_prefill_tokens"]
        .as_u64()
        .unwrap();
    assert!(q > 3000, "B's prefill is queued on {holder}: {v:#}");
    // C: the same system prompt again. The holder matches it, but its predicted TTFT
    // (thousands of queued tokens) is far above the other engine's (a cold ~60-token
    // prefill): C goes to the other engine.
    let cr = post(chat(&system, "short question", 2, false)).await;
    assert_eq!(cr.status(), 200);
    let reason = header(&cr, "x-tokengate-reason");
    assert_ne!(header(&cr, "x-tokengate-instance"), holder, "{reason}");
    assert_eq!(reason, "predicted-ttft");
    cr.bytes().await.unwrap();
    drop(b); // the client gives up on B
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_in_an_engine_by_someone_else_count() {
    // Engines that run one request at a time (the rest queue in the engine) and decode
    // slowly (50 ms per token).
    let fleet = sim_fleet(
        2,
        engine_sim::SimConfig {
            max_running: 1,
            decode_step_ms: 50.0,
            decode_per_req_ms: 0.0,
            time_scale: 1.0,
            ..Default::default()
        },
    )
    .await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: predicted-ttft\n    scheduler: {{mode: layered, prefix: {{ttft_tolerance: 0.5}}, least_cached: {{enabled: false}}}}\n    engine_metrics: {{interval: 50ms}}\n{}",
        sim_instances(&fleet)
    ));
    // Another client (not this gateway) keeps e1 busy: 1 running + 2 queued in the engine.
    let direct = reqwest::Client::new();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            direct
                .post(format!("{}/v1/chat/completions", fleet[0].url()))
                .json(
                    &serde_json::json!({"model": "m", "stream": true, "max_tokens": 400,
                    "messages": [{"role": "user", "content": "busy"}]}),
                )
                .send()
                .await
                .unwrap(),
        );
    }
    eventually("the gateway to see e1's queue", || async {
        let v = gw.instances().await;
        v["instances"][0]["engine"]["waiting"] == 2 && v["instances"][0]["engine"]["running"] == 1
    })
    .await;
    // e1 looks idle to the gateway's own table, but its engine has 2 queued: e2 is cheaper.
    let c = reqwest::Client::new();
    for _ in 0..3 {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&chat(&words("s", 30), "hi", 2, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-tokengate-instance"], "e2");
        r.bytes().await.unwrap();
    }
    let v = gw.instances().await;
    assert_eq!(v["instances"][1]["engine"]["waiting"], 0, "{v:#}");
    drop(held);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_max_tokens_counts_as_a_few_average_answers_in_flight() {
    // An engine that decodes slowly (50 ms per token): the streams stay in flight.
    let sim = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        decode_step_ms: 50.0,
        time_scale: 1.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        sim.addr
    ));
    let c = reqwest::Client::new();
    let stream = |max_tokens: u64| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .json(
                    &serde_json::json!({"model": "m", "stream": true, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": "hi"}]}),
                )
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r
        }
    };
    let inflight = || async { gw.instances().await["instances"][0]["inflight_tokens"].clone() };
    // A coding agent's max_tokens: before any answer the service's average is 256, so it
    // counts 4 × 256 = 1,024 output tokens, not 32,000.
    let big = stream(32_000).await;
    let t = inflight().await.as_u64().unwrap();
    assert!((1_024..1_100).contains(&t), "{t}");
    // A small max_tokens counts as given.
    let small = stream(100).await;
    let t2 = inflight().await.as_u64().unwrap();
    assert!((t + 100..t + 176).contains(&t2), "{t} {t2}");
    drop((big, small));
    gw.wait_idle().await;
    assert_eq!(inflight().await, 0);
    // Cancelled streams teach nothing; a completed answer of 4 tokens moves the service's
    // average a 64th of the way from 256: 252.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    gw.wait_idle().await;
    let v = gw.instances().await;
    assert_eq!(v["services"][0]["mean_output_tokens"], 252, "{v:#}");
}

/// `n` streams of `max_tokens` sent straight to the engine (not through the gateway), open
/// until dropped.
async fn busy_directly(
    sim: &engine_sim::SimHandle,
    n: usize,
    max_tokens: u32,
) -> Vec<reqwest::Response> {
    let direct = reqwest::Client::new();
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(
            direct
                .post(format!("{}/v1/chat/completions", sim.url()))
                .json(
                    &serde_json::json!({"model": "m", "stream": true, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": "busy"}]}),
                )
                .send()
                .await
                .unwrap(),
        );
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_metrics_in_sglang_names_are_read_too() {
    let sim = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "sg1".into(),
        model: "m".into(),
        max_running: 1,
        decode_step_ms: 50.0,
        time_scale: 1.0,
        metrics_flavor: engine_sim::MetricsFlavor::Sglang,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    engine_metrics: {{interval: 50ms}}\n{}",
        sim_instances(std::slice::from_ref(&sim))
    ));
    let held = busy_directly(&sim, 2, 400).await;
    eventually(
        "sglang:num_running_reqs / num_queue_reqs in /admin",
        || async {
            let v = gw.instances().await;
            let e = &v["instances"][0]["engine"];
            e["running"] == 1 && e["waiting"] == 1 && e["kv_usage"].as_f64().unwrap() > 0.0
        },
    )
    .await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_cached_sends_cold_prompts_to_the_emptiest_cache() {
    // The layered default: no session affinity (no session headers), the prefix layer, then
    // least-cached.
    cold_prompts_fill_the_emptiest_caches(
        "{mode: layered}",
        |r| r == "least-cached",
        |r| r.starts_with("prefix("),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_mode_with_a_ttft_room_and_least_cached_does_the_same() {
    // Policy mode: near-best predicted TTFTs tie, the prefix plugin outweighs least-cached
    // where a prompt is cached, least-cached decides where it is not.
    cold_prompts_fill_the_emptiest_caches(
        "{mode: policy, plugins: [{kind: predicted-ttft, weight: 2, tolerance: 0.5, slack: 50ms, temperature: 50ms}, {kind: session-affinity, weight: 0.5}, {kind: prefix-cache, weight: 0.5, min_hit_ratio: 0.1}, {kind: least-cached, weight: 0.25}]}",
        |r| r.starts_with("policy(") && r.contains("prefix=0.5*0.00") && r.contains("least-cached="),
        |r| r.contains("prefix=0.5*1.00"),
    )
    .await;
}

/// Three engine-sims behind `scheduler`: three unrelated cold prompts land on three
/// different instances, `cached_blocks` in `/admin/instances` orders them by prompt size, a
/// fourth cold prompt goes to the emptiest cache, and an extension of the biggest prompt
/// still follows its cache. `cold` / `cached` check the reason headers of the two kinds.
async fn cold_prompts_fill_the_emptiest_caches(
    scheduler: &str,
    cold: impl Fn(&str) -> bool,
    cached: impl Fn(&str) -> bool,
) {
    let fleet = sim_fleet(
        3,
        engine_sim::SimConfig {
            ..Default::default()
        },
    )
    .await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    scheduler: {scheduler}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let send = |system: String| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .json(&chat(&system, "go", 2, false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let h = |k: &str| r.headers()[k].to_str().unwrap().to_string();
            let out = (h("x-tokengate-instance"), h("x-tokengate-reason"));
            r.bytes().await.unwrap();
            out
        }
    };
    // Three unrelated prompts of different sizes on an idle fleet: each lands on an instance
    // holding nothing yet (a load balancer alone could reuse one: all loads are 0).
    let (big, r1) = send(words("a", 600)).await;
    let (small, r2) = send(words("b", 150)).await;
    let (mid, r3) = send(words("c", 350)).await;
    for r in [&r1, &r2, &r3] {
        assert!(cold(r), "{r}");
    }
    let mut used = vec![big.clone(), small.clone(), mid.clone()];
    used.sort();
    used.dedup();
    assert_eq!(used.len(), 3, "one per instance: {big} {small} {mid}");
    // The index's view of each cache, in /admin/instances.
    let v = gw.instances().await;
    let held = |id: &str| {
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == id)
            .unwrap()["cached_blocks"]
            .as_u64()
            .unwrap()
    };
    assert!(
        held(&small) < held(&mid) && held(&mid) < held(&big),
        "{v:#}"
    );
    // A fourth cold prompt: the emptiest cache, the small prompt's instance.
    let (fourth, r4) = send(words("d", 100)).await;
    assert_eq!(fourth, small, "{r4}");
    assert!(cold(&r4), "{r4}");
    // A prompt that extends the big one still follows its cache.
    let (again, r5) = send(words("a", 600) + "and more").await;
    assert_eq!(again, big, "{r5}");
    assert!(cached(&r5), "{r5}");
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttft_filter_in_policy_mode_moves_a_session_off_a_long_queue_whatever_the_weights() {
    let fleet = slow_pair().await;
    // Session affinity 100 times heavier than the TTFT score: only the filter can move the
    // session.
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    scheduler: {{mode: policy, session_keys: [\"header:x-session-id\"], plugins: [{{kind: predicted-ttft, weight: 0.1, filter: true, tolerance: 0.5, slack: 50ms}}, {{kind: session-affinity, weight: 10, unbound: abstain}}, {{kind: prefix-cache, weight: 1, min_hit_ratio: 0.1}}]}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let post = |body: serde_json::Value| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            c.post(url)
                .header("x-session-id", "agent-1")
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    let system = words("sys", 40);
    // A binds the session to an instance.
    let a = post(chat(&system, "hello", 2, false)).await;
    assert_eq!(a.status(), 200);
    let home = header(&a, "x-tokengate-instance");
    a.bytes().await.unwrap();
    // B (same session): stays home and prefills a 16 KB message there for ~10 s.
    let b = post(chat(&system, &words("long", 3000), 2, true)).await;
    assert_eq!(b.status(), 200);
    assert_eq!(header(&b, "x-tokengate-instance"), home);
    let reason_b = header(&b, "x-tokengate-reason");
    assert!(!reason_b.contains("filtered"), "{reason_b}");
    // C (same session): home's predicted TTFT is seconds, the other engine's a short cold
    // prefill: the filter takes home out, and the reason says so.
    let cr = post(chat(&system, "short question", 2, false)).await;
    assert_eq!(cr.status(), 200);
    let reason = header(&cr, "x-tokengate-reason");
    assert_ne!(header(&cr, "x-tokengate-instance"), home, "{reason}");
    assert!(
        reason.starts_with("policy(") && reason.ends_with(" filtered(ttft:1)"),
        "{reason}"
    );
    cr.bytes().await.unwrap();
    drop(b); // the client gives up on B
    gw.wait_idle().await;
}

/// The engine's cached prompt tokens for one (non-stream) answer.
async fn engine_cached(r: reqwest::Response) -> u64 {
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_cache_size_keeps_the_index_in_step_with_what_the_engine_evicted() {
    // An engine whose KV cache holds 64 blocks of 16 tokens; prompts A and B of ~17 blocks,
    // then C of ~50: the engine evicts A (least recently used) to make room for C.
    let run = |service: &'static str, cache: &'static str| async move {
        let sim = engine_sim::spawn_local(engine_sim::SimConfig {
            id: "e1".into(),
            model: "m".into(),
            block_size: 16,
            kv_blocks: 64,
            time_scale: 1.0,
            ..Default::default()
        })
        .await
        .unwrap();
        let addr = sim.addr;
        let gw = GatewayProc::start(&format!(
            "prefix_index: {{block_size: 16}}\nservices:\n  - name: m\n{service}    instances:\n      - {{id: e1, addr: \"{addr}\"{cache}}}\n"
        ));
        // With engine_metrics: the first scrape has told the engine's cache size.
        if !service.is_empty() {
            eventually("the engine's cache size", || async {
                gw.instances().await["instances"][0]["cache_blocks"] == 64
            })
            .await;
        }
        let c = reqwest::Client::new();
        let post = |body: serde_json::Value| {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            async move { c.post(url).json(&body).send().await.unwrap() }
        };
        let a = chat(&words("a", 250), "q", 2, false);
        for body in [
            a.clone(),
            chat(&words("b", 250), "q", 2, false),
            chat(&words("c", 650), "q", 2, false),
        ] {
            engine_cached(post(body).await).await;
            // The index orders entries by their last use in 100 ms ticks: a new tick.
            gw.advance_clock(250).await;
        }
        gw.wait_idle().await;
        let predicted = || async {
            metric(
                &gw.metrics().await,
                "tokengate_prefix_tokens_total{kind=\"predicted\",service=\"m\"}",
            )
            .unwrap()
        };
        let before = predicted().await;
        let inst = gw.instances().await["instances"][0].clone();
        let cached = engine_cached(post(a).await).await;
        gw.wait_idle().await;
        let evicted = metric(
            &gw.metrics().await,
            "tokengate_prefix_index_capacity_evicted_blocks{service=\"m\"}",
        );
        (inst, predicted().await - before, cached, evicted)
    };
    // Without the cache size the index still lists A on e1: it predicts a hit of A's whole
    // prompt that the engine no longer has.
    let (inst, predicted, cached, _) = run("", "").await;
    assert!(predicted > 200.0, "{predicted} {inst}");
    assert_eq!(cached, 0, "the engine evicted A");
    assert!(inst["cache_blocks"].is_null(), "{inst}");
    assert!(inst["cached_blocks"].as_u64().unwrap() > 64, "{inst}");
    // With it (64 blocks) the index forgets A as the engine did, and never holds more; the
    // same when the size comes from the engine's metrics (vllm:cache_config_info).
    for (service, cache) in [
        ("", ", cache_tokens: 1024"),
        (
            "    engine_metrics: {interval: 50ms, cache_size: true}\n",
            "",
        ),
    ] {
        let (inst, predicted, cached, evicted) = run(service, cache).await;
        assert_eq!((predicted, cached), (0.0, 0), "{inst}");
        assert_eq!(inst["cache_blocks"], 64, "{inst}");
        let held = inst["cached_blocks"].as_u64().unwrap();
        assert!(held > 0 && held <= 64, "{inst}");
        // What it forgot still counts as placed there (least-cached compares that).
        assert!(inst["placed_blocks"].as_u64().unwrap() > 64, "{inst}");
        assert!(evicted.unwrap() > 0.0, "{evicted:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_cached_counts_what_a_cache_size_bound_forgot() {
    // Two engines of 64 blocks (1,024 tokens), the gateway told so. Session s1 sends three
    // prompts (~18, ~18, ~36 blocks) to one instance, X: the index's bound forgets the first
    // there (X then holds ~54 blocks by the index, ~72 placed). Session s2's ~58-block
    // prompt goes to the other, Y. A cold prompt then goes to Y, where fewer blocks were
    // placed (58 < 72), though the index believes X holds fewer (54 < 58): X's engine has
    // been given more distinct work, and its cache turned over for it.
    let fleet = pair(engine_sim::SimConfig {
        block_size: 16,
        kv_blocks: 64,
        ..Default::default()
    })
    .await;
    let instances = sim_instances(&fleet).replace("\"}", "\", cache_tokens: 1024}");
    assert_eq!(instances.matches("cache_tokens").count(), 2, "{instances}");
    let gw = GatewayProc::start(&format!(
        "prefix_index: {{block_size: 16}}\nservices:\n  - name: m\n    scheduler: {{mode: layered}}\n{instances}"
    ));
    let c = reqwest::Client::new();
    let post = |body: serde_json::Value, session: Option<&'static str>| {
        let mut rq = c.post(gw.url("/v1/chat/completions")).json(&body);
        if let Some(s) = session {
            rq = rq.header("x-session-id", s);
        }
        async move {
            let r = rq.send().await.unwrap();
            assert_eq!(r.status(), 200);
            let got = (
                header(&r, "x-tokengate-instance"),
                header(&r, "x-tokengate-reason"),
            );
            r.bytes().await.unwrap();
            got
        }
    };
    let (x, _) = post(chat(&words("a", 250), "q", 2, false), Some("s1")).await;
    for body in [
        chat(&words("b", 250), "q", 2, false),
        chat(&words("c", 470), "q", 2, false),
    ] {
        // The index orders entries by their last use in 100 ms ticks: a new tick.
        gw.advance_clock(250).await;
        let (to, reason) = post(body, Some("s1")).await;
        assert_eq!(to, x, "{reason}");
    }
    let (y, reason) = post(chat(&words("d", 760), "q", 2, false), Some("s2")).await;
    assert_ne!(y, x, "{reason}");
    gw.wait_idle().await;
    let v = gw.instances().await;
    let blocks = |id: &str, k: &str| {
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == id)
            .unwrap()[k]
            .as_u64()
            .unwrap()
    };
    let (x_held, x_placed) = (blocks(&x, "cached_blocks"), blocks(&x, "placed_blocks"));
    let (y_held, y_placed) = (blocks(&y, "cached_blocks"), blocks(&y, "placed_blocks"));
    assert!(
        x_held < y_held && y_held == y_placed && y_placed < x_placed,
        "{v:#}"
    );
    assert!(x_placed > 64, "the bound forgot A on {x}: {v:#}");
    let (to, reason) = post(chat(&words("e", 10), "q", 2, false), None).await;
    assert_eq!(
        (to.as_str(), reason.as_str()),
        (y.as_str(), "least-cached"),
        "{v:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_follows_its_prefix_to_a_holder_whose_cache_its_in_flight_requests_fill() {
    // Two engine-sims decoding slowly (a 100-token answer takes ~5 s). A long request on one
    // holds ~1,100 tokens of its KV cache; a second prompt with the same ~1,000-token system
    // prompt goes to the holder of that prefix (the prefix layer), also when the gateway knows
    // the caches hold 1,500 tokens: the engine holds the shared prefix once, and only the
    // second prompt's own few tokens need room there. (Until matrix run 23 a KV-room check
    // added both prompts whole and sent it to the other instance; with real vLLM caches of a
    // few prompts that cost 4-16 points of prefix hits.)
    let run = |cache: &'static str| async move {
        let fleet = pair(engine_sim::SimConfig {
            decode_step_ms: 50.0,
            ..Default::default()
        })
        .await;
        let instances: String = fleet
            .iter()
            .enumerate()
            .map(|(i, s)| format!("      - {{id: e{}, addr: \"{}\"{cache}}}\n", i + 1, s.addr))
            .collect();
        let gw = GatewayProc::start(&format!(
            "services:\n  - name: m\n    scheduler: {{mode: layered}}\n    instances:\n{instances}"
        ));
        let c = reqwest::Client::new();
        let system = words("sys", 650); // ~1,000 tokens
        let mut long = chat(&system, "tell me everything", 2, true);
        long["max_tokens"] = serde_json::json!(100);
        let a = c
            .post(gw.url("/v1/chat/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(a.status(), 200);
        let holder = header(&a, "x-tokengate-instance");
        // A's response is streaming: it stays in flight while B is placed.
        let b = c
            .post(gw.url("/v1/chat/completions"))
            .json(&chat(&system, "a short question", 2, false))
            .send()
            .await
            .unwrap();
        assert_eq!(b.status(), 200);
        let placed = (
            header(&b, "x-tokengate-instance"),
            header(&b, "x-tokengate-reason"),
        );
        let inst = gw.instances().await["instances"][0].clone();
        let want = if cache.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::json!(1500)
        };
        assert_eq!(inst["cache_tokens"], want, "{inst}");
        drop(a);
        (holder, placed)
    };
    // Cache size unknown, then known (1,500 tokens): B follows the prefix to A's instance.
    for cache in ["", ", cache_tokens: 1500"] {
        let (holder, (inst, reason)) = run(cache).await;
        assert_eq!(inst, holder, "{cache}: {reason}");
        assert!(reason.starts_with("prefix("), "{cache}: {reason}");
    }
}

/// `kind: least-waiting` (a policy plugin that is only its file and one registry line): the
/// engine's own queue counts, so requests go around an engine whose queue other clients
/// filled, though this gateway has sent it nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_waiting_goes_around_an_engine_queue_other_clients_filled() {
    let fleet = sim_fleet(
        2,
        engine_sim::SimConfig {
            max_running: 1,
            decode_step_ms: 50.0,
            time_scale: 1.0,
            ..Default::default()
        },
    )
    .await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    scheduler: {{mode: policy, plugins: [{{kind: least-waiting}}]}}\n    engine_metrics: {{interval: 50ms}}\n{}",
        sim_instances(&fleet)
    ));
    // Two streams straight to e1: one runs (its batch holds one), one waits in its queue.
    let held = busy_directly(&fleet[0], 2, 4000).await;
    eventually("e1's queue in /admin", || async {
        let v = gw.instances().await;
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["id"] == "e1" && i["engine"]["waiting"] == 1)
    })
    .await;
    let c = reqwest::Client::new();
    for k in 0..6 {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&chat("sys", &format!("q{k}"), 1, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (inst, reason) = routed(&r);
        r.bytes().await.unwrap();
        assert_eq!(inst, "e2", "request {k}: {reason}");
        assert!(reason.starts_with("policy(waiting="), "{reason}");
    }
    drop(held);
}

/// One engine prefilling 2,000 tokens/s (real time) behind a layered service with `extra`
/// service keys and a prefill prior of 1,000 tokens/s.
async fn one_slow_engine(extra: &str) -> (Vec<engine_sim::SimHandle>, GatewayProc) {
    slow_engines(1, extra).await
}

/// [`one_slow_engine`] with `n` engines.
async fn slow_engines(n: usize, extra: &str) -> (Vec<engine_sim::SimHandle>, GatewayProc) {
    let fleet = sim_fleet(
        n,
        engine_sim::SimConfig {
            time_scale: 1.0,
            prefill_tps: 2000.0,
            ..Default::default()
        },
    )
    .await;
    let gw = GatewayProc::start(&format!(
        "cost_model: {{prior_prefill_tokens_per_second: 1000}}\nservices:\n  - name: m\n    scheduler: {{mode: layered}}\n{extra}{}",
        sim_instances(&fleet)
    ));
    (fleet, gw)
}

/// Waits until the engine has received `n` requests (running, waiting or finished): the
/// next one sent cannot overtake them on the way.
async fn reached_engine(sim: &engine_sim::SimHandle, n: usize) {
    eventually(&format!("{n} requests at the engine"), || async {
        let s = sim.stats();
        s.running + s.waiting + s.requests_finished as usize >= n
    })
    .await;
}

/// Through [`one_slow_engine`] with `extra`: sends three long cold streamed prompts (the
/// first is sent, the others held — or sent, with `hold: false`), then a short one, and
/// returns the order the four answered in, the short one's `x-tokengate-held-ms`, and the
/// requests held at e1 (`tokengate_held_requests`) just after the fourth was counted there.
async fn long_long_long_short(extra: &str) -> (Vec<&'static str>, Option<String>, f64) {
    // Held requests go by arrival + predicted prefill. With a prior of 1,000 tokens/s a long
    // prompt's prediction is ~3.4 s, so the short one overtakes long2 and long3 unless it
    // arrives more than ~3.4 s after long2.
    let (fleet, gw) = one_slow_engine(extra).await;
    let c = reqwest::Client::new();
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let held = std::sync::Arc::new(parking_lot::Mutex::new(None));
    let mut tasks = Vec::new();
    let inflight = |n: u64| {
        let gw = &gw;
        async move {
            eventually(&format!("{n} requests in flight at e1"), || async {
                gw.instances().await["instances"][0]["inflight_requests"] == n
            })
            .await
        }
    };
    for (n, (label, size)) in [
        ("long1", 1500),
        ("long2", 1500),
        ("long3", 1500),
        ("short", 10),
    ]
    .into_iter()
    .enumerate()
    {
        let (c, url) = (c.clone(), gw.url("/v1/chat/completions"));
        let (done, held) = (done.clone(), held.clone());
        let body = chat(&words(label, size), "go", 1, true);
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            if label == "short" {
                *held.lock() = r
                    .headers()
                    .get("x-tokengate-held-ms")
                    .map(|v| v.to_str().unwrap().to_string());
            }
            r.bytes().await.unwrap();
            done.lock().push(label);
        }));
        // Each arrives after the one before is counted at the instance — and, where nothing
        // is held, has reached the engine (else the next may overtake it on the way).
        inflight(n as u64 + 1).await;
        if extra.contains("hold: false") {
            reached_engine(&fleet[0], n + 1).await;
        }
    }
    // Held: long2, long3 and short while long1 prefills (~0.8 s), then at least long3 until
    // long2's first token: at least one for more than a second after the fourth arrived.
    let held_now = metric(
        &gw.metrics().await,
        "tokengate_held_requests{instance=\"e1\"}",
    )
    .expect("the held family has a series per instance");
    for t in tasks {
        tokio::time::timeout(DEADLINE, t).await.unwrap().unwrap();
    }
    let order = done.lock().clone();
    let h = held.lock().clone();
    (order, h, held_now)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_engine_gets_a_short_request_before_the_long_ones_held_with_it() {
    // Held: the engine prefills the first long prompt; the next two wait at
    // the gateway, each with the key arrival + its predicted prefill; the short one (a few
    // ms) arrives just after them and is sent first, as soon as the first long one has its
    // first token.
    // `min_queued: 0s`: the short request's prediction (~24 ms) is below the default 250 ms,
    // so at long1's first token the queue would send long2 with it (a batching engine's
    // worth) and the two would race to this serialized engine; a debug build under
    // parallel tests lost that race about one run in four.
    let (order, held, held_now) =
        long_long_long_short("    engine_queue: {hold: true, min_queued: 0s}\n").await;
    assert_eq!(order, ["long1", "short", "long2", "long3"], "held");
    assert!(held_now >= 1.0, "tokengate_held_requests {held_now}");
    let ms: u64 = held
        .expect("the short request says it was held")
        .parse()
        .unwrap();
    assert!(ms > 0);
    // Not held (`hold: false`): the engine serves its queue in arrival order, the short one
    // last.
    let (order, held, held_now) = long_long_long_short("    engine_queue: {hold: false}\n").await;
    assert_eq!(order.last(), Some(&"short"), "not held: {order:?}");
    assert_eq!(held, None);
    assert_eq!(held_now, 0.0);
}

/// A warm turn that would be next in line goes to its saturated engine at once instead of
/// being held (`engine_queue: {hold: true}`): the engine keeps its cached history while it
/// waits there. One engine prefills a long cold prompt, a second is held; a session's next
/// turn, most of it cached, is sent at once (no `x-tokengate-held-ms`) and answered before
/// the held prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_turn_next_in_line_is_sent_to_its_saturated_engine_at_once() {
    let (fleet, gw) = one_slow_engine("    engine_queue: {hold: true, min_queued: 0s}\n").await;
    let c = reqwest::Client::new();
    let url = gw.url("/v1/chat/completions");
    let history = words("w", 600);
    let r = c
        .post(&url)
        .json(&chat(&history, "first turn", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (n, label) in ["long1", "long2"].into_iter().enumerate() {
        let (c, url, done) = (c.clone(), url.clone(), done.clone());
        let body = chat(&words(label, 1500), "go", 1, true);
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            done.lock().push(label);
        }));
        eventually(&format!("{} requests at e1", n + 1), || async {
            gw.instances().await["instances"][0]["inflight_requests"] == n as u64 + 1
        })
        .await;
    }
    assert_eq!(gw.instances().await["instances"][0]["held"], 1);
    // The first turn and long1 have reached the engine (the warm turn must not overtake
    // long1 on the way).
    reached_engine(&fleet[0], 2).await;
    let r = c
        .post(&url)
        .json(&chat(&history, "second turn", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let held = r.headers().get("x-tokengate-held-ms").cloned();
    r.bytes().await.unwrap();
    done.lock().push("warm");
    assert_eq!(held, None, "the warm turn was sent at once");
    for t in tasks {
        tokio::time::timeout(DEADLINE, t).await.unwrap().unwrap();
    }
    let order = done.lock().clone();
    assert_eq!(order, ["long1", "warm", "long2"]);
}

/// With no `engine_queue` key a request is held only once every instance of the service is
/// saturated (`scope: service`): two engines each prefilling a long cold prompt; the first
/// two prompts go at once (each finds an instance with room), the third waits at the
/// gateway and says so (`x-tokengate-held-ms`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_request_is_held_only_once_every_instance_is_saturated() {
    let (_fleet, gw) = slow_engines(2, "").await;
    let c = reqwest::Client::new();
    let url = gw.url("/v1/chat/completions");
    let mut tasks = Vec::new();
    // (in flight, held) per instance, the busiest first.
    let instances = || async {
        let v = gw.instances().await;
        let mut v: Vec<(u64, u64)> = v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["inflight_requests"].as_u64().unwrap(),
                    i["held"].as_u64().unwrap(),
                )
            })
            .collect();
        v.sort_by(|a, b| b.cmp(a));
        v
    };
    for (n, label) in ["long1", "long2", "long3"].into_iter().enumerate() {
        let (c, url) = (c.clone(), url.clone());
        let body = chat(&words(label, 1500), "go", 1, true);
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let held = r.headers().get("x-tokengate-held-ms").cloned();
            r.bytes().await.unwrap();
            (label, held)
        }));
        // long1 and long2 each on an instance of their own (a cold prompt goes where it
        // starts first), long3 held at one of them.
        let want: &[(u64, u64)] = match n {
            0 => &[(1, 0), (0, 0)],
            1 => &[(1, 0), (1, 0)],
            _ => &[(2, 1), (1, 0)],
        };
        eventually(&format!("{label} placed: {want:?}"), || async {
            instances().await == want
        })
        .await;
    }
    for t in tasks {
        let (label, held) = tokio::time::timeout(DEADLINE, t).await.unwrap().unwrap();
        assert_eq!(held.is_some(), label == "long3", "{label}: held {held:?}");
    }
}

/// The debug line names whose prefill rate each estimate uses: the prior before anything is
/// learned, and never the prior again once an instance has answered a few prefills with
/// nothing queued ahead (an instance still short of samples then borrows the fleet's mean;
/// which one that is depends on the split, so the unit test in `plugins/src/cost/tests.rs`
/// checks the `fleet` suffix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debug_line_says_whose_prefill_rate_each_estimate_uses() {
    let fleet = pair(engine_sim::SimConfig {
        prefill_tps: 20_000.0,
        ..Default::default()
    })
    .await;
    let gw = GatewayProc::start_with_env(
        &format!("services:\n  - name: m\n{}", sim_instances(&fleet)),
        &[("RUST_LOG", "info,tokengate=debug")],
    );
    let c = reqwest::Client::new();
    let url = gw.url("/v1/chat/completions");
    // One at a time, each a cold prompt of a few hundred tokens (real prefill work, nothing
    // queued ahead): after seven, one of the two instances has answered at least four.
    for i in 0..8 {
        let body = chat(&words(&format!("t{i}x"), 200), "hello", 2, true);
        let r = c.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let log = gw.log_text();
    let routes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("dispatch] route "))
        .collect();
    assert_eq!(routes.len(), 8, "{log}");
    // The first decision: nothing learned, every estimate on the prior (8k tokens/s).
    assert!(routes[0].contains("@8.0k/s prior"), "{}", routes[0]);
    // The last: at least one instance has its own rate, so nobody runs on the prior.
    let last = routes[7];
    assert!(
        last.contains("k/s") && !last.contains("k/s prior"),
        "{last}"
    );
}
