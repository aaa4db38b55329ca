//! The prefix index calibrated to the engines (issue 33), through the real binary: engines
//! that cache 128-token blocks and count tokens ±15 % differently from the gateway's
//! estimate. On engines that evict nothing the index is never corrected and its prediction,
//! in the engines' units, is within 5 points of what they report; an engine that really
//! evicted (`/reset_prefix_cache`) is corrected, and the next request is cached again.

mod common;

use common::*;

/// `(instance, prompt tokens, cached tokens)` of one answered request.
async fn send(
    c: &reqwest::Client,
    gw: &GatewayProc,
    body: &serde_json::Value,
) -> (String, u64, u64) {
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let inst = r.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string();
    let v: serde_json::Value = r.json().await.unwrap();
    let u = &v["usage"];
    (
        inst,
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

fn engine_tokens(metrics: &str, kind: &str) -> f64 {
    metric(
        metrics,
        &format!("tokengate_prefix_engine_tokens_total{{kind=\"{kind}\",service=\"m\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_is_corrected_only_when_an_engine_really_evicted() {
    // Two engines with 128-token blocks; one counts 15 % more tokens than the gateway's
    // estimate, the other 15 % fewer.
    let mut fleet = Vec::new();
    for (i, bytes_per_token) in [(1, 3.4), (2, 4.6)] {
        fleet.push(
            engine_sim::spawn_local(engine_sim::SimConfig {
                id: format!("e{i}"),
                model: "m".into(),
                block_size: 128,
                bytes_per_token,
                time_scale: 20.0,
                ..Default::default()
            })
            .await
            .unwrap(),
        );
    }
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    scheduler: {{mode: layered}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    // Four tenants with system prompts of ~600 to ~1,500 tokens, 25 questions each,
    // interleaved.
    let systems: Vec<String> = (0..4)
        .map(|t| words(&format!("t{t}x"), 150 + 120 * t))
        .collect();
    let mut homes = vec![String::new(); 4];
    for q in 0..25 {
        for (t, system) in systems.iter().enumerate() {
            let (inst, prompt, cached) =
                send(&c, &gw, &chat(system, &format!("question {q}"), 2, false)).await;
            assert!(prompt > 0);
            if q == 0 {
                homes[t] = inst;
            } else {
                assert_eq!(
                    inst, homes[t],
                    "tenant {t} left its instance at question {q}"
                );
                assert!(cached > 0, "tenant {t} question {q}: nothing cached");
            }
        }
    }
    gw.wait_idle().await;
    let v = gw.instances().await;
    let index = &v["prefix_indexes"][0];
    assert_eq!(
        index["trims"], 0,
        "a healthy engine's reports trimmed the index: {v:#}"
    );
    // The block size was learned from the engines' cached-token counts, and how each
    // engine's tokenizer counts against the gateway's estimate from their prompt tokens.
    for i in v["instances"].as_array().unwrap() {
        assert_eq!(i["cache_block_tokens"], 128, "{i}");
        let r = i["tokens_per_estimate"].as_f64().unwrap();
        match i["id"].as_str().unwrap() {
            "e1" => assert!((1.1..1.3).contains(&r), "4 / 3.4 bytes per token: {i}"),
            _ => assert!((0.8..0.95).contains(&r), "4 / 4.6 bytes per token: {i}"),
        }
    }
    let m = gw.metrics().await;
    let (prompt, cached, predicted) = (
        engine_tokens(&m, "prompt"),
        engine_tokens(&m, "cached"),
        engine_tokens(&m, "predicted"),
    );
    let (engine_ratio, predicted_ratio) = (cached / prompt, predicted / prompt);
    eprintln!("engine hit ratio {engine_ratio:.3}, predicted {predicted_ratio:.3}");
    assert!(
        (engine_ratio - predicted_ratio).abs() <= 0.05,
        "engine {engine_ratio:.3} vs predicted {predicted_ratio:.3}"
    );

    // The largest tenant's engine drops its cache: the index is corrected once, then the
    // next question is routed there again and cached.
    let home = fleet.iter().find(|s| s.id() == homes[3]).unwrap();
    let r = c
        .post(format!("http://{}/reset_prefix_cache", home.addr))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let (_, _, cached) = send(&c, &gw, &chat(&systems[3], "after the reset", 2, false)).await;
    assert_eq!(cached, 0);
    gw.wait_idle().await;
    let v = gw.instances().await;
    assert_eq!(v["prefix_indexes"][0]["trims"], 1, "{v:#}");
    let (inst, _, cached) = send(&c, &gw, &chat(&systems[3], "and again", 2, false)).await;
    assert_eq!(inst, homes[3]);
    assert!(cached > 0);
    gw.wait_idle().await;
    assert_eq!(gw.instances().await["prefix_indexes"][0]["trims"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_size_counts_in_the_engines_tokens() {
    // An engine whose tokenizer counts twice the gateway's estimate (2 bytes per token) and
    // a KV cache of 2,048 of its tokens: the index holds 64 of its 16-token blocks there,
    // not 128, once the engine's prompt counts have said so.
    let sim = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        bytes_per_token: 2.0,
        time_scale: 20.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    scheduler: {{mode: layered}}\n    instances:\n      - {{id: e1, addr: \"{}\", cache_tokens: 2048}}\n",
        sim.addr
    ));
    let inst = || async { gw.instances().await["instances"][0].clone() };
    assert_eq!(inst().await["cache_blocks"], 128);
    let c = reqwest::Client::new();
    send(&c, &gw, &chat(&words("a", 100), "q", 2, false)).await;
    gw.wait_idle().await;
    let i = inst().await;
    let r = i["tokens_per_estimate"].as_f64().unwrap();
    assert!((1.9..2.2).contains(&r), "{i}");
    let blocks = i["cache_blocks"].as_u64().unwrap();
    assert!((58..=68).contains(&blocks), "{i}");
    assert_eq!(i["engine_cache_tokens"], 2048, "{i}");
}
