//! Global scheduling through the real binary: what one gateway cannot take goes to another
//! region's gateway (with that gateway's key), members are tried in order, and a request that
//! already crossed a region is never forwarded again.

mod common;

use common::*;

fn body(prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": 2,
        "messages": [{"role": "user", "content": prompt}]})
}

async fn sim(id: &str, prefill_tps: f64) -> engine_sim::SimHandle {
    engine_sim::spawn_local(engine_sim::SimConfig {
        id: id.into(),
        model: "m".into(),
        prefill_tps,
        time_scale: 1.0,
        ..Default::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_would_be_rejected_overflows_to_another_region() {
    // Region B: one engine, keys required.
    let b_sim = sim("b1", 50_000.0).await;
    let b = GatewayProc::start(&format!(
        "api_keys: [sk-region-b]\nservices:\n  - name: m\n{}",
        sim_instances(std::slice::from_ref(&b_sim))
    ));
    // Region A: one slow engine, 1 prefill slot, reject mode; B as a member (listed after a
    // member that refuses connections: members are tried in order).
    let a_sim = sim("a1", 400.0).await;
    let a = GatewayProc::start(&format!(
        "global:\n  name: region-a\n  members:\n    - {{name: gone, url: \"http://{}\", token: sk-x}}\n    - {{name: region-b, url: \"http://{}\", token: sk-region-b}}\nservices:\n  - name: m\n    throttling: {{overflow: reject, prefill: 1}}\n{}",
        dead_addr(),
        b.proxy,
        sim_instances(std::slice::from_ref(&a_sim))
    ));
    let c = reqwest::Client::new();
    // Fill A's only slot.
    let held = c
        .post(a.url("/v1/chat/completions"))
        .json(&body(&words("h", 4000), true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    assert_eq!(held.headers()["x-tokengate-instance"], "a1");
    // The next one is served by region B, streamed back unchanged.
    let r = c
        .post(a.url("/v1/chat/completions"))
        .json(&body("overflow me", true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-reason"], "global(region-b)");
    assert_eq!(r.headers()["x-tokengate-instance"], "region-b");
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        !text.contains("\"usage\""),
        "the client did not ask for usage: {text}"
    );
    assert_eq!(b_sim.stats().requests_finished, 1);
    // B checked the token: without it, B refuses.
    let direct = c
        .post(b.url("/v1/chat/completions"))
        .json(&body("no key", false))
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 401);
    // Counted when each request completes (its logging phase), maybe just after the answer.
    eventually("A to count both overflow requests", || async {
        let m = a.metrics().await;
        ["region-b\",outcome=\"ok", "gone\",outcome=\"error"]
            .iter()
            .all(|k| {
                metric(
                    &m,
                    &format!("tokengate_global_requests_total{{member=\"{k}\"}}"),
                )
                .is_some()
            })
    })
    .await;
    let m = a.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_global_requests_total{member=\"region-b\",outcome=\"ok\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "tokengate_global_requests_total{member=\"gone\",outcome=\"error\"}"
        ),
        Some(1.0),
        "{m}"
    );
    // The token never reaches a log.
    for log in [a.log_text(), b.log_text()] {
        assert!(!log.contains("sk-region-b"), "{log}");
    }
    drop(held);
    a.wait_idle().await;
    b.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_that_list_each_other_do_not_loop() {
    // Neither has an instance that answers (health checks mark them down, so neither can take
    // a request): each would forward to the other.
    let dead = dead_addr();
    let placeholder = dead_addr();
    let mk = |name: &str, peer: std::net::SocketAddr| {
        format!(
            "global:\n  name: {name}\n  members:\n    - {{name: peer, url: \"http://{peer}\"}}\nhealth_check: {{interval: 100ms, timeout: 100ms, fall: 1}}\nservices:\n  - name: m\n    instances:\n      - {{id: {name}-1, addr: \"{dead}\"}}\n"
        )
    };
    let b = GatewayProc::start(&mk("b", placeholder));
    let a = GatewayProc::start(&mk("a", b.proxy));
    // Point B at A (a reload).
    let cfg = std::fs::read_to_string(b.config_path()).unwrap();
    std::fs::write(
        b.config_path(),
        cfg.replace(&placeholder.to_string(), &a.proxy.to_string()),
    )
    .unwrap();
    std::process::Command::new("kill")
        .args(["-HUP", &b.child.id().to_string()])
        .status()
        .unwrap();
    eventually("B to reload", || async {
        b.metrics()
            .await
            .contains("tokengate_config_reloads_total{result=\"ok\"} 1")
    })
    .await;
    for g in [&a, &b] {
        eventually("the dead instance to be marked down", || async {
            g.instances().await["instances"][0]["health"]["healthy"] == false
        })
        .await;
    }
    let r = reqwest::Client::new()
        .post(a.url("/v1/chat/completions"))
        .json(&body("nobody can", false))
        .send()
        .await
        .unwrap();
    // A: no instance → B; B: no instance either, and the request already crossed a region
    // → B answers 503 itself; A has no other member and passes it on.
    assert_eq!(r.status(), 503);
    // A counts the forward when the request completes (its logging phase), which may come
    // just after the client has the answer.
    let forwarded = |m: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("tokengate_global_requests_total{member=\"peer\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    eventually("A to count its forward to B", || async {
        forwarded(&a.metrics().await) > 0.0
    })
    .await;
    let (ma, mb) = (a.metrics().await, b.metrics().await);
    assert_eq!(forwarded(&ma), 1.0, "{ma}");
    assert!(
        !mb.contains("tokengate_global_requests_total{"),
        "B forwarded a request that came from A:\n{mb}"
    );
    a.wait_idle().await;
    b.wait_idle().await;
}
