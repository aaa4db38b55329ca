//! The four inference APIs through the gateway to real engine-sim instances: shapes pass
//! through untouched, usage (with cached tokens) is read from JSON and from every SSE dialect.

mod common;

use common::*;

async fn fleet() -> (Vec<engine_sim::SimHandle>, GatewayProc) {
    let mut sims = Vec::new();
    for id in ["e1", "e2"] {
        sims.push(
            engine_sim::spawn_local(engine_sim::SimConfig {
                id: id.into(),
                model: "qwen3-0.6b".into(),
                time_scale: 100.0,
                ..Default::default()
            })
            .await
            .unwrap(),
        );
    }
    // The engines' ids pass (response_headers.engine) so that they can be compared with
    // the gateway's x-tokengate-instance.
    let yaml = format!(
        "response_headers: {{engine: [x-engine-id]}}\nservices:\n{}",
        service("qwen3-0.6b", &[("e1", sims[0].addr), ("e2", sims[1].addr)])
    );
    (sims, GatewayProc::start(&yaml))
}

fn counter(metrics: &str, kind: &str) -> u64 {
    let needle = format!("tokengate_tokens_total{{kind=\"{kind}\",model=\"qwen3-0.6b\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_streams_and_reports_usage() {
    let (_sims, gw) = fleet().await;
    let c = reqwest::Client::new();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let cases = [
        (
            "/v1/chat/completions",
            serde_json::json!({"model":"qwen3-0.6b","max_tokens":5,
                "messages":[{"role":"system","content":long},{"role":"user","content":"hi"}]}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model":"qwen3-0.6b","max_tokens":5,"prompt":long}),
        ),
        (
            "/v1/responses",
            serde_json::json!({"model":"qwen3-0.6b","max_output_tokens":5,"instructions":long,"input":"hi"}),
        ),
        (
            "/v1/messages",
            serde_json::json!({"model":"qwen3-0.6b","max_tokens":5,"system":long,
                "messages":[{"role":"user","content":"hi"}]}),
        ),
    ];
    let mut expected_completion = 0;
    for (path, body) in &cases {
        for stream in [false, true] {
            let mut b = body.clone();
            b["stream"] = serde_json::Value::Bool(stream);
            let r = c
                .post(gw.url(path))
                .header("x-session-id", "s1")
                .json(&b)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{path} stream={stream}");
            let engine = r.headers()["x-engine-id"].to_str().unwrap().to_string();
            assert_eq!(r.headers()["x-tokengate-instance"], engine.as_str());
            let text = r.text().await.unwrap();
            expected_completion += 5;
            if !stream {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                match *path {
                    "/v1/messages" => {
                        assert_eq!(v["type"], "message");
                        assert_eq!(v["usage"]["output_tokens"], 5);
                    }
                    "/v1/responses" => assert_eq!(v["usage"]["output_tokens"], 5),
                    _ => assert_eq!(v["usage"]["completion_tokens"], 5),
                }
                continue;
            }
            match *path {
                "/v1/messages" => {
                    assert!(text.contains("event: message_start"), "{text}");
                    assert!(text.contains("event: message_stop"), "{text}");
                }
                "/v1/responses" => {
                    // Ends with `response.incomplete` when max_output_tokens cut it, as OpenAI does.
                    assert!(
                        text.contains("event: response.completed")
                            || text.contains("event: response.incomplete"),
                        "{text}"
                    )
                }
                _ => {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                    // Usage was injected for the gateway and removed for this client.
                    assert!(!text.contains("\"usage\":{"), "{text}");
                }
            }
        }
    }
    gw.wait_idle().await;
    let m = gw.metrics().await;
    assert_eq!(counter(&m, "completion"), expected_completion, "{m}");
    assert!(counter(&m, "prompt") > 8 * 400, "{m}");
    // The same long prefix was sent 8 times over 2 engines: most of it came from their caches.
    assert!(counter(&m, "cached") > 4 * 400, "{m}");
}
