//! Hot reload: SIGHUP and file changes swap the config atomically; a bad file is rejected
//! with its YAML path and the running config kept; streams in flight are not dropped and
//! the load counters of instances that stay survive.

mod common;

use common::*;
use futures_util::StreamExt;

fn instances_of(v: &serde_json::Value) -> Vec<String> {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_config_without_dropping_streams() {
    let fleet = sims(2, "m", "e", 1.0).await;
    let one = format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        fleet[0].addr
    );
    let gw = GatewayProc::start(&one);
    let cfg_path = gw.config_path();
    let header = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .split("services:")
        .next()
        .unwrap()
        .to_string();
    // A stream in flight on e1 across the reloads.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 600,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-tokengate-instance"], "e1");
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();

    // A bad file is rejected; the old config keeps serving.
    std::fs::write(
        &cfg_path,
        format!(
            "{header}services:\n  - name: m\n    instances:\n      - {{id: e1, addr: nowhere}}\n"
        ),
    )
    .unwrap();
    let pid = gw.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    eventually("the rejection to be counted", || async {
        gw.metrics()
            .await
            .contains("tokengate_config_reloads_total{result=\"error\"} 1")
    })
    .await;
    // The counter is bumped just before the error is logged.
    eventually("the rejection to be logged", || async {
        gw.log_text()
            .contains("services[0].instances[0].addr: invalid socket address")
    })
    .await;
    assert!(gw
        .metrics()
        .await
        .contains("tokengate_config_last_reload_success 0"));
    assert_eq!(instances_of(&gw.instances().await), vec!["e1"]);

    // A good file adds e2 (picked up from the file change alone, no signal).
    std::fs::write(
        &cfg_path,
        format!(
            "{header}services:\n  - name: m\n    load_balancing: least-request\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n      - {{id: e2, addr: \"{}\"}}\n",
            fleet[0].addr, fleet[1].addr
        ),
    )
    .unwrap();
    eventually("e2 to appear", || async {
        instances_of(&gw.instances().await) == vec!["e1", "e2"]
    })
    .await;
    // e1 kept its counter: the stream in flight is still counted there.
    let v = gw.instances().await;
    assert_eq!(v["instances"][0]["inflight_requests"], 1, "{v:#}");
    // least-request now sends new work to the idle e2.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-tokengate-instance"], "e2");
    r.bytes().await.unwrap();
    // The stream that started before both reloads completes.
    let mut text = String::new();
    while let Some(c) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    gw.wait_idle().await;
}
