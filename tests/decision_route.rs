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
    let (inst, reason) = routed(&r);
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

/// The decision service's answer restricts the choice to the target it names, however
/// strongly the other plugins pull elsewhere. (Before, it was a scorer whose weight was
/// split over the target's instances: here a session bound to `large` with affinity
/// weight 20 outscored the decision's 10 / 2 per small instance.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_restricts_the_choice_to_the_target_it_names() {
    let jev = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "jev".into(),
        model: "judge-7".into(),
        time_scale: 200.0,
        decision_mode: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let small = sims(2, "qwen3-0.6b", "small", 200.0).await;
    let large = sims(1, "qwen3-32b", "large", 200.0).await;
    // The provider names no model: the route names its own decision model.
    let yaml = format!(
        "services:\n  - name: qwen3-0.6b\n{}  - name: qwen3-32b\n{}providers:\n  - {{name: jev, base_url: \"{}/v1\"}}\nroutes:\n  - name: qwen3\n    targets:\n      - {{service: qwen3-0.6b, criteria: \"{SMALL}\"}}\n      - {{service: qwen3-32b, criteria: \"{LARGE}\"}}\n    policy:\n      plugins:\n        - {{kind: decision-service}}\n        - {{kind: session-affinity, weight: 20}}\n        - {{kind: least-inflight}}\n    decision: {{provider: jev, model: judge-7}}\n",
        sim_instances(&small),
        sim_instances(&large),
        jev.url(),
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let send = |text: &'static str| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .header("session-id", "conv-1")
                .json(&serde_json::json!({"model": "qwen3", "max_tokens": 4,
                    "messages": [{"role": "user", "content": text}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let h = |k: &str| r.headers()[k].to_str().unwrap().to_string();
            let (inst, reason) = (h("x-tokengate-instance"), h("x-tokengate-reason"));
            r.bytes().await.unwrap();
            (inst, reason)
        }
    };
    // A proof binds the session to the large model's instance.
    let (inst, reason) = send("Prove that there are infinitely many primes.").await;
    assert_eq!(inst, "large1");
    assert!(
        reason.starts_with("decision(qwen3-32b)+policy("),
        "{reason}"
    );
    // Greetings in the same session: the decision names the small model, and the bound
    // large instance (affinity 20) is not a candidate.
    for _ in 0..4 {
        let (inst, reason) = send("Write a one-line greeting card.").await;
        assert!(inst.starts_with("small"), "{inst} {reason}");
        assert!(
            reason.starts_with("decision(qwen3-0.6b)+policy("),
            "{reason}"
        );
    }
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_decision_total{outcome=\"target\",route=\"qwen3\"}"
        ),
        Some(5.0),
        "{m}"
    );
}

/// A route whose policy has no decision-service plugin never calls the decision model, even
/// with a `decision` block (the config check warns about it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_without_the_decision_plugin_never_asks() {
    let jev = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "jev".into(),
        model: "jev-latest".into(),
        time_scale: 200.0,
        decision_mode: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let small = sims(1, "qwen3-0.6b", "small", 200.0).await;
    let large = sims(1, "qwen3-32b", "large", 200.0).await;
    let yaml = format!(
        "services:\n  - name: qwen3-0.6b\n{}  - name: qwen3-32b\n{}providers:\n  - {{name: jev, base_url: \"{}/v1\", model: jev-latest}}\nroutes:\n  - name: qwen3\n    targets:\n      - {{service: qwen3-0.6b}}\n      - {{service: qwen3-32b}}\n    policy:\n      plugins:\n        - {{kind: least-inflight}}\n    decision: {{provider: jev}}\n  - name: qwen3-rr\n    targets:\n      - {{service: qwen3-0.6b}}\n      - {{service: qwen3-32b}}\n    decision: {{provider: jev}}\n",
        sim_instances(&small),
        sim_instances(&large),
        jev.url(),
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    for model in ["qwen3", "qwen3-rr", "qwen3", "qwen3-rr"] {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&serde_json::json!({"model": model, "max_tokens": 2,
                "messages": [{"role": "user", "content": "Prove it."}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    // The decision engine saw no request at all.
    assert_eq!(jev.stats().prompt_tokens, 0);
    let m = gw.metrics().await;
    assert!(!m.contains("tokengate_decision_total{"), "{m}");
    eventually("the unused decision block to be warned about", || async {
        gw.log_text()
            .contains("routes[1].decision: set, but no decision-service plugin")
    })
    .await;
}
