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
