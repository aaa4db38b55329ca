//! Fault injection: in-process, over /admin/faults, and their effects.

mod common;

use std::time::{Duration, Instant};

use common::*;
use engine_sim::Faults;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Raw HTTP/1.1 GET on a fresh connection; Ok(bytes read) or the IO error.
async fn raw_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<Vec<u8>> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    Ok(out)
}

#[tokio::test]
async fn refuse() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    assert!(raw_get(sim.addr, "/health")
        .await
        .unwrap()
        .starts_with(b"HTTP/1.1 200"));
    // a pooled keep-alive connection exists now
    assert_eq!(
        c.get(format!("{}/health", sim.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    sim.update_faults(|f| f.refuse = true);
    match raw_get(sim.addr, "/health").await {
        Ok(b) => assert!(b.is_empty(), "got a response while refusing: {b:?}"),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused
            ),
            "{e}"
        ),
    }
    let r = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&chat("x", 2, false))
        .send()
        .await;
    assert!(r.is_err(), "inference while refusing: {r:?}");
    // the admin API stays reachable and clears the fault
    let r = c
        .get(format!("{}/admin/faults", sim.url()))
        .send()
        .await
        .unwrap();
    let f: Value = r.json().await.unwrap();
    assert_eq!(f["refuse"], true);
    let r = c
        .post(format!("{}/admin/faults", sim.url()))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(sim.faults(), Faults::default());
    assert!(raw_get(sim.addr, "/health")
        .await
        .unwrap()
        .starts_with(b"HTTP/1.1 200"));
    sim.stop().await;
}

#[tokio::test]
async fn stall_and_first_byte_delay() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    sim.update_faults(|f| f.stall_ms = 300);
    // a client with a short timeout gives up
    let r = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .timeout(Duration::from_millis(100))
        .json(&chat("x", 2, false))
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
    let t0 = Instant::now();
    let r = post(&c, &sim, "/v1/chat/completions", &chat("x", 2, true)).await;
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(r.status(), 200);
    read_sse(r).await.unwrap();
    // /health is not stalled: it answers while an inference request is still stalled.
    sim.update_faults(|f| f.stall_ms = 60_000);
    let stalled = tokio::spawn(
        c.post(format!("{}/v1/chat/completions", sim.url()))
            .json(&chat("x", 2, false))
            .send(),
    );
    let h = c.get(format!("{}/health", sim.url())).send().await.unwrap();
    assert_eq!(h.status(), 200);
    assert!(!stalled.is_finished());
    stalled.abort();

    sim.set_faults(Faults {
        first_byte_delay_ms: 300,
        ..Faults::default()
    });
    let finished_before = sim.stats().requests_finished;
    let t0 = Instant::now();
    let r = post(&c, &sim, "/v1/chat/completions", &chat("x", 4, true)).await;
    let headers_at = t0.elapsed();
    assert!(headers_at >= Duration::from_millis(300), "{headers_at:?}");
    // The engine worked meanwhile: the generation had finished when the headers left (the
    // engine's own counter, read before a byte of the body).
    assert_eq!(sim.stats().requests_finished, finished_before + 1);
    let evs = read_sse(r).await.unwrap();
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    let t0 = Instant::now();
    let r = post(
        &c,
        &sim,
        "/v1/messages",
        &json!({"max_tokens": 2, "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(t0.elapsed() >= Duration::from_millis(300));
    sim.stop().await;
}

#[tokio::test]
async fn close_after_chunks() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    sim.update_faults(|f| f.close_after_chunks = Some(3));
    for (path, body) in [
        ("/v1/chat/completions", chat("x", 10, true)),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 10, "stream": true}),
        ),
        (
            "/v1/messages",
            json!({"messages": [], "max_tokens": 10, "stream": true}),
        ),
        (
            "/v1/responses",
            json!({"input": "x", "max_output_tokens": 10, "stream": true}),
        ),
    ] {
        let r = post(&c, &sim, path, &body).await;
        assert_eq!(r.status(), 200);
        // read what arrives before the cut
        let mut got = String::new();
        let mut r = r;
        let err = loop {
            match r.chunk().await {
                Ok(Some(b)) => got.push_str(std::str::from_utf8(&b).unwrap()),
                Ok(None) => panic!("{path}: stream ended cleanly: {got}"),
                Err(e) => break e,
            }
        };
        assert!(
            err.is_body() || err.is_decode() || err.is_request(),
            "{err:?}"
        );
        let marker = match path {
            "/v1/chat/completions" => "\"delta\":{\"content\":\"",
            "/v1/completions" => "\"text\":\"",
            "/v1/messages" => "event: content_block_delta",
            _ => "event: response.output_text.delta",
        };
        let content = got.matches(marker).count();
        assert_eq!(content, 3, "{path}: {got}");
        assert!(!got.contains("[DONE]"));
    }
    // non-stream: connection closed without a response
    let r = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&chat("x", 3, false))
        .send()
        .await;
    assert!(r.is_err(), "{r:?}");
    sim.set_faults(Faults::default());
    assert_eq!(
        post(&c, &sim, "/v1/chat/completions", &chat("x", 3, false))
            .await
            .status(),
        200
    );
    // aborted streams released their KV blocks
    eventually(|| async { sim.stats().running == 0 }).await;
    assert_eq!(sim.stats().kv_usage, 0.0);
    sim.stop().await;
}

#[tokio::test]
async fn error_status_and_rate_limit() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    sim.update_faults(|f| f.error_rate = 1.0);
    let r = post(&c, &sim, "/v1/chat/completions", &chat("x", 2, false)).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], 503);
    let r = post(
        &c,
        &sim,
        "/v1/messages",
        &json!({"max_tokens": 1, "messages": []}),
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["type"], "error");
    // health and metrics are not affected
    assert_eq!(
        c.get(format!("{}/health", sim.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    sim.update_faults(|f| f.error_status = 500);
    assert_eq!(
        post(&c, &sim, "/v1/completions", &json!({"prompt": "x"}))
            .await
            .status(),
        500
    );

    // over the admin API
    let r = c
        .post(format!("{}/admin/faults", sim.url()))
        .json(&json!({"rate_limit": true, "retry_after_s": 7}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = post(&c, &sim, "/v1/chat/completions", &chat("x", 2, false)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    let r = c
        .post(format!("{}/admin/faults", sim.url()))
        .json(&json!({"bogus": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    c.post(format!("{}/admin/faults", sim.url()))
        .body("")
        .send()
        .await
        .unwrap();
    assert_eq!(
        post(&c, &sim, "/v1/chat/completions", &chat("x", 2, false))
            .await
            .status(),
        200
    );
    // nothing reached the engine while failing
    assert_eq!(
        metric(
            &c,
            &sim,
            "vllm:request_success_total{model_name=\"sim-model\",finished_reason=\"length\"}"
        )
        .await,
        1.0
    );
    sim.stop().await;
}

#[tokio::test]
async fn error_rate_is_deterministic() {
    let faults = Faults {
        error_rate: 0.5,
        fault_seed: 42,
        ..Faults::default()
    };
    let mut patterns = Vec::new();
    for _ in 0..2 {
        let sim = sim(engine_sim::SimConfig {
            faults: faults.clone(),
            ..fast_cfg()
        })
        .await;
        let c = client();
        let mut p = Vec::new();
        for _ in 0..40 {
            p.push(
                post(
                    &c,
                    &sim,
                    "/v1/completions",
                    &json!({"prompt": "x", "max_tokens": 1}),
                )
                .await
                .status()
                .as_u16(),
            );
        }
        patterns.push(p);
        sim.stop().await;
    }
    assert_eq!(patterns[0], patterns[1]);
    let fails = patterns[0].iter().filter(|s| **s == 503).count();
    assert!((8..=32).contains(&fails), "{fails} of 40 failed");
    assert!(patterns[0].iter().all(|s| *s == 503 || *s == 200));
}
