//! Routes (one model name over several services): round-robin, target weights and policy
//! scoring, through the real gateway binary.

mod common;

use common::*;

fn completed(v: &serde_json::Value, id: &str) -> f64 {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .unwrap()["completed"]
        .as_f64()
        .unwrap()
}

/// Sends `n` small requests for `model`, 32 at a time.
async fn send_many(gw: &GatewayProc, model: &str, n: usize) {
    let c = reqwest::Client::new();
    let body = chat_body(model, 100, false);
    let url = gw.url("/v1/chat/completions");
    let mut left = n;
    while left > 0 {
        let k = left.min(32);
        let futs: Vec<_> = (0..k)
            .map(|_| {
                let c = c.clone();
                let url = url.clone();
                let body = body.clone();
                async move {
                    let r = c.post(&url).body(body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                }
            })
            .collect();
        futures_util::future::join_all(futs).await;
        left -= k;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_weights_are_shares_whatever_the_instance_count() {
    let m = Mock::start().await;
    let a = m.addr;
    let yaml = format!(
        "services:\n{}{}{}routes:\n  - name: even\n    targets:\n      - {{service: a, weight: 100}}\n      - {{service: b, weight: 100}}\n  - name: skewed\n    targets:\n      - {{service: c, weight: 100}}\n      - {{service: b, weight: 300}}\n",
        service("a", &[("a1", a)]),
        service("b", &[("b1", a), ("b2", a)]),
        service("c", &[("c1", a)]),
    );
    let gw = GatewayProc::start(&yaml);
    let n = 10_000;
    send_many(&gw, "even", n).await;
    let v = gw.wait_idle().await;
    let share = |id: &str| completed(&v, id) / n as f64;
    // A (1 instance) and B (2 instances) split 50/50; each B instance gets 25 %.
    assert!((share("a1") - 0.5).abs() <= 0.03, "{v:#}");
    assert!((share("b1") - 0.25).abs() <= 0.03, "{v:#}");
    assert!((share("b2") - 0.25).abs() <= 0.03, "{v:#}");
    send_many(&gw, "skewed", n).await;
    let v2 = gw.wait_idle().await;
    let c1 = completed(&v2, "c1") / n as f64;
    let b =
        (completed(&v2, "b1") + completed(&v2, "b2") - completed(&v, "b1") - completed(&v, "b2"))
            / n as f64;
    assert!((c1 - 0.25).abs() <= 0.03, "c {c1} {v2:#}");
    assert!((b - 0.75).abs() <= 0.03, "b {b} {v2:#}");
    let m = gw.metrics().await;
    assert!(
        m.contains("tokengate_routing_decisions_total{reason=\"weight\"} 20000"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_rewrites_the_model_to_the_chosen_service() {
    let small = sims(1, "qwen3-0.6b", "small", 200.0).await;
    let large = sims(1, "qwen3-32b", "large", 200.0).await;
    let yaml = format!(
        "services:\n  - name: qwen3-0.6b\n{}  - name: qwen3-32b\n{}routes:\n  - name: qwen3\n    targets:\n      - {{service: qwen3-0.6b}}\n      - {{service: qwen3-32b}}\n",
        sim_instances(&small),
        sim_instances(&large)
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        // engine-sim answers 404 for a model it does not serve: 200 proves the rewrite.
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .body(chat_body("qwen3", 100, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let reason = r.headers()["x-tokengate-reason"].to_str().unwrap();
        assert!(reason.starts_with("round-robin(qwen3-"), "{reason}");
        let inst = r.headers()["x-tokengate-instance"]
            .to_str()
            .unwrap()
            .to_string();
        let v: serde_json::Value = r.json().await.unwrap();
        let want = if inst == "small1" {
            "qwen3-0.6b"
        } else {
            "qwen3-32b"
        };
        assert_eq!(v["model"], want);
        seen.insert(inst);
    }
    assert_eq!(seen.len(), 2, "round-robin over both targets");
    let models: serde_json::Value = c
        .get(gw.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["qwen3-0.6b", "qwen3-32b", "qwen3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_sessions_follow_the_key_chain_rules() {
    let m = Mock::start().await;
    let a = m.addr;
    let yaml = format!(
        "services:\n{}{}routes:\n  - name: r\n    targets:\n      - {{service: x}}\n      - {{service: y}}\n    policy:\n      plugins:\n        - {{kind: session-affinity, weight: 4}}\n        - {{kind: least-inflight, weight: 1}}\n",
        service("x", &[("x1", a), ("x2", a)]),
        service("y", &[("y1", a), ("y2", a)]),
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let run = |path: &'static str, header: Option<&'static str>| {
        let c = c.clone();
        let url = gw.url(path);
        async move {
            let mut seen = std::collections::HashSet::new();
            for _ in 0..24 {
                let body = serde_json::json!({"model": "r", "max_tokens": 1,
                    "prompt_cache_key": "pk-1", "input": "hi",
                    "messages": [{"role": "user", "content": "hi"}]});
                let mut req = c.post(&url).json(&body);
                if let Some(h) = header {
                    req = req.header(h, "sess-9");
                }
                let r = req.send().await.unwrap();
                assert_eq!(r.status(), 200);
                let reason = r.headers()["x-tokengate-reason"]
                    .to_str()
                    .unwrap()
                    .to_string();
                assert!(reason.starts_with("policy(affinity="), "{reason}");
                seen.insert(
                    r.headers()["x-tokengate-instance"]
                        .to_str()
                        .unwrap()
                        .to_string(),
                );
                r.bytes().await.unwrap();
            }
            seen.len()
        }
    };
    // The session-id header is a session on every API.
    assert_eq!(run("/v1/chat/completions", Some("session-id")).await, 1);
    // prompt_cache_key counts on the Responses API…
    assert_eq!(run("/v1/responses", None).await, 1);
    // …but never on chat/completions: no session, ties are broken at random.
    assert!(run("/v1/chat/completions", None).await > 1);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_alternates_between_targets_whatever_their_sizes() {
    let m = Mock::start().await;
    let a = m.addr;
    // Target `big` has 3 instances, `small` 1: each target gets half of the route's traffic,
    // and inside `big` its own scheduler spreads the half over the 3.
    let yaml = format!(
        "services:\n{}{}routes:\n  - name: r\n    route_by: round-robin\n    targets:\n      - {{service: big}}\n      - {{service: small}}\n",
        service("big", &[("b1", a), ("b2", a), ("b3", a)]),
        service("small", &[("s1", a)]),
    );
    let gw = GatewayProc::start(&yaml);
    let n = 600;
    send_many(&gw, "r", n).await;
    let v = gw.wait_idle().await;
    let big = completed(&v, "b1") + completed(&v, "b2") + completed(&v, "b3");
    let small = completed(&v, "s1");
    assert_eq!(big + small, n as f64);
    assert!((small / n as f64 - 0.5).abs() <= 0.03, "{v:#}");
    for b in ["b1", "b2", "b3"] {
        assert!(
            (completed(&v, b) / n as f64 - 1.0 / 6.0).abs() <= 0.03,
            "{b}: {v:#}"
        );
    }
    let m = gw.metrics().await;
    assert!(
        m.contains(&format!(
            "tokengate_routing_decisions_total{{reason=\"round-robin\"}} {n}"
        )),
        "{m}"
    );
}
