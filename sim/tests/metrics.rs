//! /metrics reflects what happened.

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test]
async fn metrics_match_usage() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let (mut prompt, mut hits, mut gen) = (0u64, 0u64, 0u64);
    let base = text(5, 900);
    let mut add = |v: &Value| {
        prompt += v["usage"]["prompt_tokens"].as_u64().unwrap();
        hits += cached(v);
        gen += v["usage"]["completion_tokens"].as_u64().unwrap();
    };
    for i in 0..6 {
        let v = chat_json(&c, &sim, &format!("{base}{}", i % 2), 3 + i).await;
        add(&v);
    }
    // streamed requests count too
    let evs = read_sse(post(&c, &sim, "/v1/chat/completions", &chat(&base, 5, true)).await)
        .await
        .unwrap();
    add(&evs[evs.len() - 2].json());
    assert!(hits > 0);
    let m = |name: &'static str| {
        let c = c.clone();
        let sim = &sim;
        async move { metric(&c, sim, name).await as u64 }
    };
    assert_eq!(m("vllm:prefix_cache_queries_total{").await, prompt);
    assert_eq!(m("vllm:prefix_cache_hits_total{").await, hits);
    assert_eq!(m("vllm:prompt_tokens_total{").await, prompt);
    assert_eq!(m("vllm:generation_tokens_total{").await, gen);
    assert_eq!(
        m("vllm:request_success_total{model_name=\"sim-model\",finished_reason=\"length\"}").await,
        7
    );
    assert_eq!(m("vllm:time_to_first_token_seconds_count{").await, 7);
    assert_eq!(
        m("vllm:time_to_first_token_seconds_bucket{model_name=\"sim-model\",le=\"+Inf\"}").await,
        7
    );
    assert_eq!(m("vllm:num_requests_running{").await, 0);
    assert_eq!(m("vllm:num_requests_waiting{").await, 0);
    assert_eq!(metric(&c, &sim, "vllm:kv_cache_usage_perc{").await, 0.0);
    // a request without max_tokens finishes with reason "stop"
    post(&c, &sim, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(
        m("vllm:request_success_total{model_name=\"sim-model\",finished_reason=\"stop\"}").await,
        1
    );
    // the admin stats agree
    let st: Value = c
        .get(format!("{}/admin/stats", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st["requests_finished"], 8);
    sim.stop().await;
}

#[tokio::test]
async fn kv_usage_while_running() {
    let sim = sim(engine_sim::SimConfig {
        time_scale: 1.0,
        kv_blocks: 1000,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let cc = c.clone();
    let url = sim.url();
    let t = tokio::spawn(async move {
        cc.post(format!("{url}/v1/chat/completions"))
            .json(&chat(&text(1, 6400), 100, false))
            .send()
            .await
            .unwrap()
            .status()
    });
    // 1600 prompt + 100 output tokens = 107 blocks of 1000
    eventually(|| {
        let c = c.clone();
        let sim = &sim;
        async move { metric(&c, sim, "vllm:kv_cache_usage_perc{").await > 0.1 }
    })
    .await;
    assert_eq!(metric(&c, &sim, "vllm:num_requests_running{").await, 1.0);
    assert_eq!(t.await.unwrap(), 200);
    assert_eq!(metric(&c, &sim, "vllm:kv_cache_usage_perc{").await, 0.0);
    sim.stop().await;
}

/// Full /metrics text.
async fn scrape(c: &reqwest::Client, sim: &engine_sim::SimHandle) -> String {
    c.get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn sglang_flavor_names_and_values_move() {
    // One running slot and a slow decode: a queue forms behind the running request.
    let sim = sim(engine_sim::SimConfig {
        metrics_flavor: engine_sim::MetricsFlavor::Sglang,
        max_running: 1,
        time_scale: 1.0,
        decode_step_ms: 5.0,
        decode_per_req_ms: 0.0,
        kv_blocks: 1000,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let body = scrape(&c, &sim).await;
    // SGLang's scheduler label set; no vLLM names in this flavour.
    let labels = "{model_name=\"sim-model\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\"}";
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
    ] {
        assert!(
            body.contains(&format!("{name}{labels} ")),
            "{name} in\n{body}"
        );
        assert!(
            body.contains(&format!("# TYPE {name} gauge")),
            "{name} type"
        );
    }
    assert!(body.contains("sglang:prompt_tokens_total{model_name=\"sim-model\"} 0"));
    assert!(!body.contains("vllm:"), "no vLLM names:\n{body}");
    for name in [
        "engine_sim:prefill_phase{",
        "engine_sim:max_prefill_phase{",
        "engine_sim:max_running{",
    ] {
        assert!(body.contains(name), "{name} in\n{body}");
    }
    assert!(body.contains(
        "engine_sim:info{model_name=\"sim-model\",engine_id=\"sim-test\",role=\"integrated\",pd_mode=\"sglang\"} 1"
    ));

    let base = text(9, 2000);
    let tasks: Vec<_> = (0..3)
        .map(|i| {
            let (c, url, base) = (c.clone(), sim.url(), base.clone());
            tokio::spawn(async move {
                c.post(format!("{url}/v1/chat/completions"))
                    .json(&chat(&format!("{base}{i}"), 40, false))
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            })
        })
        .collect();
    // Under load: one running, the others queued, KV in use, tokens flowing.
    eventually(|| {
        let c = c.clone();
        let sim = &sim;
        async move {
            metric(&c, sim, "sglang:num_queue_reqs{").await >= 1.0
                && metric(&c, sim, "sglang:num_running_reqs{").await == 1.0
        }
    })
    .await;
    assert!(metric(&c, &sim, "sglang:token_usage{").await > 0.0);
    assert!(metric(&c, &sim, "engine_sim:prefill_phase{").await >= 1.0);
    eventually(|| {
        let c = c.clone();
        let sim = &sim;
        async move { metric(&c, sim, "sglang:gen_throughput{").await > 0.0 }
    })
    .await;
    let mut hits = 0;
    for t in tasks {
        hits += cached(&t.await.unwrap());
    }
    // The shared 500-token prefix hits the cache for the second and third request.
    assert!(hits > 0);
    let st = sim.stats();
    assert_eq!(metric(&c, &sim, "sglang:num_running_reqs{").await, 0.0);
    assert_eq!(metric(&c, &sim, "sglang:num_queue_reqs{").await, 0.0);
    assert_eq!(metric(&c, &sim, "sglang:token_usage{").await, 0.0);
    let rate = metric(&c, &sim, "sglang:cache_hit_rate{").await;
    let want = st.prefix_cache_hits as f64 / st.prefix_cache_queries as f64;
    assert!(rate > 0.0 && (rate - want).abs() < 1e-9, "{rate} vs {want}");
    assert_eq!(
        metric(&c, &sim, "sglang:generation_tokens_total{").await as u64,
        st.generation_tokens
    );
    assert_eq!(metric(&c, &sim, "engine_sim:max_running{").await, 1.0);
    assert_eq!(
        metric(&c, &sim, "engine_sim:max_prefill_phase{").await,
        st.max_prefill_phase as f64
    );
    assert!(st.max_prefill_phase >= 2, "{st:?}");
    assert_eq!(metric(&c, &sim, "engine_sim:prefill_phase{").await, 0.0);
    sim.stop().await;
}

#[tokio::test]
async fn engine_sim_gauges_in_vllm_flavor() {
    // Slow prefills (serialized): several requests sit in their prefill phase at once.
    let sim = sim(engine_sim::SimConfig {
        prefill_tps: 2000.0,
        time_scale: 1.0,
        ..fast_cfg()
    })
    .await;
    let c = client();
    assert!(scrape(&c, &sim)
        .await
        .contains("vllm:num_requests_running{"));
    assert_eq!(metric(&c, &sim, "engine_sim:max_prefill_phase{").await, 0.0);
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (c, url) = (c.clone(), sim.url());
            tokio::spawn(async move {
                // 400 tokens each: 200 ms of prefill, one after the other
                c.post(format!("{url}/v1/chat/completions"))
                    .json(&chat(&text(100 + i, 1600), 2, false))
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    eventually(|| {
        let c = c.clone();
        let sim = &sim;
        async move { metric(&c, sim, "engine_sim:prefill_phase{").await >= 2.0 }
    })
    .await;
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let st = sim.stats();
    assert_eq!(metric(&c, &sim, "engine_sim:prefill_phase{").await, 0.0);
    assert_eq!(
        metric(&c, &sim, "engine_sim:max_prefill_phase{").await,
        st.max_prefill_phase as f64
    );
    assert!(st.max_prefill_phase >= 2, "{st:?}");
    assert_eq!(
        metric(&c, &sim, "engine_sim:max_running{").await,
        st.max_running as f64
    );
    assert!(st.max_running >= 2, "{st:?}");
    assert_eq!(
        metric(&c, &sim, "engine_sim:prefill_computed_tokens_total{").await as u64,
        st.prefill_computed_tokens
    );
    // "<|user|>\n" + 1600 bytes + "\n" = 1610 bytes = 403 tokens each, nothing cached
    assert_eq!(st.prefill_computed_tokens, 4 * 403);
    sim.stop().await;
}
