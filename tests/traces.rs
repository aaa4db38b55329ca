//! Every answered request leaves a trace, through the real binary: the heads refused at the
//! protocol level (by Pingora's parser or by the gateway's own head limits) are counted in
//! `tokengate_protocol_errors_total{reason}` with an access line; oversized heads get 431; a
//! stream cut after its first byte is `outcome="truncated"`, not a plain 200; throttling's
//! refusals carry the model, a client that leaves the queue is `outcome="left_queue"`, and
//! the queue timeout has its own error code and a `Retry-After`.

mod common;

use common::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends `raw` on a fresh connection (ignoring a write refused half-way: the gateway may
/// answer and close before a huge head is sent) and reads the answer to its end.
async fn raw(gw: &GatewayProc, raw: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let _ = s.write_all(raw).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}

fn status_of(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_refused_at_the_protocol_level_are_counted_and_logged() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("services:\n{}", service("m", &[("up-1", m.addr)])));
    let body = r#"{"model":"m","messages":[]}"#;
    let big = "a".repeat(1024 * 1024);
    let many: String = (0..10_000).map(|i| format!("x-h{i}: v\r\n")).collect();
    let few_too_many: String = (0..300).map(|i| format!("x{i}: v\r\n")).collect();
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "two content-lengths",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 27\r\ncontent-length: 5\r\n\r\n{body}"),
            400,
        ),
        (
            "xchunked",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n{body}"),
            400,
        ),
        ("garbage request line", "\x01\x02 nonsense\r\n\r\n".to_string(), 400),
        (
            "1 MB header",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n"),
            431,
        ),
        (
            "10,000 headers",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{many}\r\n"),
            431,
        ),
        (
            "300 small headers",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{few_too_many}\r\n"),
            431,
        ),
    ];
    for (what, req, want) in &cases {
        let answer = raw(&gw, req.as_bytes()).await;
        assert_eq!(status_of(&answer), *want, "{what}: {answer:?}");
    }
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    let metrics = gw.metrics().await;
    for (reason, n) in [
        ("bad_request", 3.0),
        ("head_too_large", 1.0),
        ("too_many_headers", 2.0),
    ] {
        assert_eq!(
            metric(
                &metrics,
                &format!("tokengate_protocol_errors_total{{reason=\"{reason}\"}}")
            ),
            Some(n),
            "{reason}: {metrics}"
        );
    }
    // One access line each.
    eventually("an access line per refused head", || async {
        let log = gw.log_text();
        let lines = |s: &str| log.lines().filter(|l| l.contains(s)).count();
        lines("status=400 reason=bad_request") == 3
            && lines("status=431 reason=head_too_large") == 1
            && lines("status=431 reason=too_many_headers") == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_after_its_first_byte_is_counted_and_logged_as_truncated() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("services:\n{}", service("m", &[("up-1", m.addr)])));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "close-mid")
        .body(chat_body("m", 200, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let _ = r.bytes().await;
    gw.wait_idle().await;
    eventually("the truncated stream's access line", || async {
        gw.log_text()
            .lines()
            .any(|l| l.contains(&id) && l.contains("status=200 outcome=truncated"))
    })
    .await;
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "tokengate_requests_total{code=\"200\",instance=\"up-1\",model=\"m\",outcome=\"truncated\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "tokengate_requests_total{code=\"200\",instance=\"up-1\",model=\"m\",outcome=\"complete\"}"
        ),
        None,
        "{metrics}"
    );
}

fn body(prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": 2,
        "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_refusals_carry_the_model_and_leaving_clients_their_own_outcome() {
    // A slow prefill: a 4000-word prompt holds the only slot for seconds.
    let e = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        prefill_tps: 400.0,
        time_scale: 1.0,
        decode_step_ms: 2.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    throttling: {{overflow: queue, prefill: 1, max_queue: 1, queue_timeout: 3s, retry_after: 7s}}\n{}",
        sim_instances(std::slice::from_ref(&e))
    ));
    let c = reqwest::Client::new();
    let held = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body(&words("h", 4000), true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    // The queue timeout: 503, its own code, Retry-After.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("late", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "7");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
    // A client that hangs up while queued. Its departure must be seen (the access line)
    // before the next client comes, or that one finds the queue still full.
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    assert!(short
        .post(gw.url("/v1/chat/completions"))
        .json(&body("impatient", false))
        .send()
        .await
        .is_err());
    eventually("the leaving client's access line", || async {
        gw.log_text()
            .lines()
            .any(|l| l.contains("model=m") && l.contains("status=0 outcome=left_queue"))
    })
    .await;
    // The queue full: 429 at once.
    let waiter = {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        tokio::spawn(async move { c.post(url).json(&body("w", false)).send().await })
    };
    eventually("a waiter in the queue", || async {
        gw.instances().await["throttles"][0]["queued"] == 1
    })
    .await;
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("third", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    assert_eq!(waiter.await.unwrap().unwrap().status(), 503);
    drop(held);
    gw.wait_idle().await;
    let metrics = gw.metrics().await;
    for (code, outcome, n) in [
        ("503", "complete", 2.0),
        ("429", "complete", 1.0),
        ("0", "left_queue", 1.0),
    ] {
        let key = format!(
            "tokengate_requests_total{{code=\"{code}\",instance=\"-\",model=\"m\",outcome=\"{outcome}\"}}"
        );
        assert_eq!(metric(&metrics, &key), Some(n), "{key}: {metrics}");
    }
    assert!(
        !metrics.contains("model=\"-\""),
        "a throttled request without its model: {metrics}"
    );
}

/// An HTTP/1.0 client has no chunked encoding: a stream reaches it close-delimited, even
/// when it asked to keep the connection alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_stream_is_close_delimited() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("services:\n{}", service("m", &[("up-1", m.addr)])));
    let body = String::from_utf8(chat_body("m", 200, true)).unwrap();
    for keep_alive in ["", "connection: keep-alive\r\n"] {
        let req = format!(
            "POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\nx-mock: sse\r\ncontent-type: application/json\r\n{keep_alive}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        // `raw` reads until the gateway closes the connection.
        let answer = raw(&gw, req.as_bytes()).await;
        assert_eq!(status_of(&answer), 200, "{answer}");
        let (head, rest) = answer.split_once("\r\n\r\n").unwrap();
        let head = head.to_ascii_lowercase();
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert!(!head.contains("content-length"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        // The events themselves, no chunk sizes between them.
        assert!(rest.starts_with("data: "), "{rest:?}");
        assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest:?}");
    }
    gw.wait_idle().await;
}

/// Requests pipelined on one connection (sent before the first answer) are all answered,
/// in order, not dropped with a closed connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("services:\n{}", service("m", &[("up-1", m.addr)])));
    let body = String::from_utf8(chat_body("m", 200, false)).unwrap();
    let req = |id: &str, last: bool| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: {id}\r\ncontent-type: application/json\r\n{}content-length: {}\r\n\r\n{body}",
            if last { "connection: close\r\n" } else { "" },
            body.len()
        )
    };
    let all = format!(
        "{}{}{}",
        req("pipe-1", false),
        req("pipe-2", false),
        req("pipe-3", true)
    );
    // `raw` reads until the gateway closes the connection (after the third answer).
    let answer = raw(&gw, all.as_bytes()).await;
    assert_eq!(answer.matches("HTTP/1.1 200 OK").count(), 3, "{answer}");
    let at = |id: &str| {
        answer
            .find(&format!("\"request_id\":\"{id}\""))
            .unwrap_or_else(|| panic!("no answer for {id}: {answer}"))
    };
    assert!(
        at("pipe-1") < at("pipe-2") && at("pipe-2") < at("pipe-3"),
        "{answer}"
    );
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 3);
    gw.wait_idle().await;
}
