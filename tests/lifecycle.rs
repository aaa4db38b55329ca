//! Process lifecycle: SIGTERM stops accepting, lets in-flight streams finish, exits 0.

mod common;

use common::*;
use futures_util::StreamExt;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_streams_then_exits_zero() {
    // Real-time engine: 200 tokens take ~1.3 s, long enough to signal mid-stream.
    let fleet = sims(1, "m", "e", 1.0).await;
    let mut gw = GatewayProc::start(&format!(
        "shutdown_grace: 20s\nservices:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 200,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    let pid = gw.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    // New connections are refused once the listener is closed.
    let proxy = gw.proxy;
    eventually("the listener to close", || async move {
        tokio::net::TcpStream::connect(proxy).await.is_err()
    })
    .await;
    // The stream in flight runs to its end.
    let mut text = String::from_utf8_lossy(&first).to_string();
    while let Some(c) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Then the process exits 0, well before the grace period.
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "gateway did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await; // ok-sleep: poll interval under a deadline
    };
    assert!(status.success(), "{status:?}");
    assert!(gw.log_text().contains("all connections finished"));
}
