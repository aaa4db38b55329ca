//! The phases of an upstream request through the real binary: *prefill* (waiting) lasts from
//! dispatch until the first token — not the response header, which engines send before they
//! prefill — and *decode* from the first token to completion. Also: the hit-rate ceiling is
//! tracked for every service, whatever its scheduler.

mod common;

use common::*;
use futures_util::StreamExt;

fn inst<'a>(v: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .unwrap()
}

/// A stream request whose prompt is `prompt_bytes` long.
fn stream_body(prompt_bytes: usize, max_tokens: u64) -> serde_json::Value {
    let content: String = (0..prompt_bytes)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    serde_json::json!({"model": "m", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_waiting_until_its_first_token_not_its_header() {
    // Prefill at 50 tokens/s: a 4,000-byte prompt (1,000 tokens) takes 20 s; engine-sim
    // sends the stream's header at once (as vLLM and SGLang do).
    let slow = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        prefill_tps: 50.0,
        time_scale: 1.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(std::slice::from_ref(&slow))
    ));
    let c = reqwest::Client::new();
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&stream_body(4000, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The header is here; the first token is ~20 s away: the request is in its prefill phase.
    let v = gw.instances().await;
    let e1 = inst(&v, "e1");
    assert_eq!(e1["inflight_requests"], 1, "{v:#}");
    assert_eq!(
        e1["waiting"], 1,
        "prefill lasts until the first token: {v:#}"
    );
    assert_eq!(e1["decoding"], 0, "{v:#}");
    let m = gw.metrics().await;
    assert_eq!(
        metric(&m, "tokengate_waiting_requests{instance=\"e1\"}"),
        Some(1.0)
    );
    drop(r); // the client leaves during the prefill
    gw.wait_idle().await;
    slow.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_first_token_a_stream_is_decoding() {
    // Fast prefill, slow decode: 400 tokens at one 50 ms step each.
    let sim = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        decode_step_ms: 50.0,
        decode_per_req_ms: 0.0,
        time_scale: 1.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(std::slice::from_ref(&sim))
    ));
    let c = reqwest::Client::new();
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&stream_body(200, 400))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Read until a chunk with content (engine-sim's role-only first chunk, `"content":""`,
    // is not a token): the gateway saw it, and left the prefill phase, before forwarding it.
    let mut body = r.bytes_stream();
    let mut seen = Vec::new();
    let has_token = |b: &[u8]| {
        let s = String::from_utf8_lossy(b);
        s.split("\"content\":\"")
            .skip(1)
            .any(|rest| !rest.starts_with('"'))
    };
    while !has_token(&seen) {
        let chunk = body.next().await.expect("stream ended early").unwrap();
        seen.extend_from_slice(&chunk);
    }
    let v = gw.instances().await;
    let e1 = inst(&v, "e1");
    assert_eq!(e1["inflight_requests"], 1, "{v:#}");
    assert_eq!(e1["waiting"], 0, "{v:#}");
    assert_eq!(e1["decoding"], 1, "{v:#}");
    drop(body);
    gw.wait_idle().await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hit_rate_ceiling_is_tracked_without_prefix_scheduling() {
    // Plain round-robin over 2 engines: the index still learns where every prompt went.
    let fleet = sims(2, "m", "e", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: round-robin\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let body = serde_json::json!({"model": "m", "max_tokens": 2,
        "messages": [{"role": "user", "content": "x ".repeat(2000)}]});
    for _ in 0..4 {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-tokengate-reason"], "round-robin");
        r.bytes().await.unwrap();
    }
    gw.wait_idle().await;
    let m = gw.metrics().await;
    let get = |kind: &str| {
        metric(
            &m,
            &format!("tokengate_prefix_hit_ratio{{kind=\"{kind}\",service=\"m\"}}"),
        )
        .unwrap_or_else(|| panic!("no {kind} ratio for service m:\n{m}"))
    };
    // 4 identical prompts: the first is cold, the other 3 could be all hits (ceiling 0.75);
    // round-robin sends the second to the other engine (predicted 0.5: requests 3 and 4).
    let (ceiling, predicted, engine) = (get("ceiling"), get("predicted"), get("engine"));
    assert!((ceiling - 0.75).abs() < 0.02, "ceiling {ceiling}\n{m}");
    assert!((predicted - 0.5).abs() < 0.02, "predicted {predicted}\n{m}");
    assert!(
        (engine - predicted).abs() < 0.05,
        "engine {engine} vs {predicted}"
    );
    let v = gw.instances().await;
    assert!(
        v["prefix_indexes"][0]["nodes"].as_u64().unwrap() > 0,
        "{v:#}"
    );
}
