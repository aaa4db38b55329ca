//! The decision-service plugin end to end: a route over a small and a large model whose
//! policy asks a decision model (engine-sim in `--decision-mode`) which target fits.

mod common;

use common::*;

const SMALL: &str = "short factual questions, greetings, small talk, simple one-line writing";
const LARGE: &str =
    "reasoning, math, proofs, prove, code, programming, python, implement, algorithms";

async fn setup(
    provider: &engine_sim::SimHandle,
    timeout: &str,
) -> (Vec<engine_sim::SimHandle>, GatewayProc) {
    let small = sims(2, "qwen3-0.6b", "small", 200.0).await;
    let large = sims(2, "qwen3-32b", "large", 200.0).await;
    let yaml = format!(
        "services:\n  - name: qwen3-0.6b\n{}  - name: qwen3-32b\n{}providers:\n  - {{name: jev, base_url: \"{}/v1\", model: jev-latest}}\nroutes:\n  - name: qwen3\n    targets:\n      - {{service: qwen3-0.6b, criteria: \"{SMALL}\"}}\n      - {{service: qwen3-32b, criteria: \"{LARGE}\"}}\n    policy:\n      plugins:\n        - {{kind: decision-service}}\n        - {{kind: session-affinity}}\n        - {{kind: least-inflight}}\n    decision: {{provider: jev, timeout: {timeout}}}\n",
        sim_instances(&small),
        sim_instances(&large),
        provider.url(),
    );
    let mut all = small;
    all.extend(large);
    (all, GatewayProc::start(&yaml))
}

async fn ask(gw: &GatewayProc, text: &str) -> (String, String) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "qwen3", "max_tokens": 4,
            "messages": [{"role": "user", "content": text}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let inst = r.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string();
    let reason = r.headers()["x-tokengate-reason"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(reason.starts_with("decision("), "{reason}");
    let v: serde_json::Value = r.json().await.unwrap();
    (inst, v["model"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_model_picks_the_smallest_fit() {
    let jev = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "jev".into(),
        model: "jev-latest".into(),
        time_scale: 200.0,
        decision_mode: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let (_fleet, gw) = setup(&jev, "2s").await;
    for _ in 0..3 {
        let (inst, model) = ask(&gw, "Write a one-line greeting card.").await;
        assert!(inst.starts_with("small"), "{inst}");
        assert_eq!(model, "qwen3-0.6b");
        let (inst, model) = ask(
            &gw,
            "Prove that there are infinitely many primes, then implement the proof sketch in Python.",
        )
        .await;
        assert!(inst.starts_with("large"), "{inst}");
        assert_eq!(model, "qwen3-32b");
    }
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_decision_total{outcome=\"target\",route=\"qwen3\"}"
        ),
        Some(6.0),
        "{m}"
    );
    assert!(
        m.contains("tokengate_decision_latency_seconds_count{route=\"qwen3\"} 6"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_garbage_answers_abstain_without_failing_the_request() {
    // A decision model that stalls: every call times out after 200 ms.
    let stalled = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "stalled".into(),
        model: "jev-latest".into(),
        decision_mode: true,
        faults: engine_sim::Faults {
            stall_ms: 60_000,
            ..Default::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    let (_fleet, gw) = setup(&stalled, "200ms").await;
    let (_, model) = ask(&gw, "Write a one-line greeting card.").await;
    assert!(model == "qwen3-0.6b" || model == "qwen3-32b");
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_decision_total{outcome=\"timeout\",route=\"qwen3\"}"
        ),
        Some(1.0),
        "{m}"
    );
    // A model that answers filler text (engine-sim in normal mode): no target named.
    let chatty = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "chatty".into(),
        model: "jev-latest".into(),
        time_scale: 200.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let (_fleet2, gw2) = setup(&chatty, "2s").await;
    ask(&gw2, "Prove it.").await;
    let m = gw2.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_decision_total{outcome=\"no_target\",route=\"qwen3\"}"
        ),
        Some(1.0),
        "{m}"
    );
}
