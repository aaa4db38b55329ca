//! The gateway core, end to end: the real `tokengate` binary in front of real HTTP upstreams
//! on loopback.

mod common;

use common::*;
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn one_service(m: &Mock) -> String {
    format!("services:\n{}", service("m", &[("up-1", m.addr)]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_forwarded_byte_exact_with_content_length_and_chunked() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let c = reqwest::Client::new();
    for size in [
        100usize,
        1024,
        64 * 1024 - 1,
        64 * 1024 + 1,
        100 * 1024,
        1024 * 1024,
    ] {
        let body = chat_body("m", size, false);
        let want_hash = xxhash_rust::xxh3::xxh3_64(&body);
        for chunked in [false, true] {
            let req = c.post(gw.url("/v1/chat/completions"));
            let req = if chunked {
                req.body(common::chunked(&body, 7919))
            } else {
                req.body(body.clone())
            };
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200, "size {size} chunked {chunked}");
            assert_eq!(r.headers()["x-tokengate-instance"], "up-1");
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["len"], body.len(), "size {size} chunked {chunked}");
            assert_eq!(v["hash"], want_hash, "size {size} chunked {chunked}");
            // The engine always gets a Content-Length, never chunked framing.
            assert_eq!(v["content_length"], body.len().to_string());
            assert!(v["transfer_encoding"].is_null());
        }
    }
    gw.wait_idle().await;
}

/// Responses larger than the client connection's write gathering (16 KiB) go through byte-exact,
/// to a reader that takes them whole and to one that reads 1 KiB at a time off a raw socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_responses_reach_the_client_byte_exact() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let c = reqwest::Client::new();
    for size in [10 * 1024usize, 16 * 1024, 100 * 1024, 1024 * 1024] {
        let body = chat_body("m", size, false);
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-mock", "mirror")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "size {size}");
        let got = tokio::time::timeout(DEADLINE, r.bytes())
            .await
            .expect("the whole response arrives")
            .unwrap();
        assert!(got[..] == body[..], "size {size}: response differs");

        let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-mock: mirror\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body).await.unwrap();
        let mut all = Vec::new();
        let mut piece = [0u8; 1024];
        loop {
            let n = tokio::time::timeout(DEADLINE, s.read(&mut piece))
                .await
                .expect("the gateway keeps sending")
                .unwrap();
            if n == 0 {
                break;
            }
            all.extend_from_slice(&piece[..n]);
        }
        let split = all
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head")
            + 4;
        assert!(
            all[split..] == body[..],
            "size {size}: raw response differs"
        );
    }
    gw.wait_idle().await;
}

/// A long stream arrives whole and in order: every chunk is gathered with its framing and
/// flushed before the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_streams_arrive_complete_and_in_order() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "sse")
        .header("x-mock-chunks", "3000")
        .body(chat_body("m", 300, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let all = tokio::time::timeout(DEADLINE, r.bytes())
        .await
        .expect("the whole stream arrives")
        .unwrap();
    let text = String::from_utf8(all.to_vec()).unwrap();
    let tokens: Vec<&str> = text
        .split("\n\n")
        .filter_map(|ev| ev.split("\"content\":\"").nth(1))
        .filter_map(|rest| rest.split(' ').next())
        .collect();
    let want: Vec<String> = (0..3000).map(|i| format!("t{i}")).collect();
    assert_eq!(tokens, want);
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "{}",
        &text[text.len() - 40..]
    );
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_body_is_a_clear_400() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("empty"));
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let body = chat_body("m", 2000, false);
    let mut s = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 64];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut got))
        .await
        .expect("100 Continue in time")
        .unwrap();
    let first = String::from_utf8_lossy(&got[..n]).to_string();
    assert!(first.starts_with("HTTP/1.1 100"), "{first}");
    s.write_all(&body).await.unwrap();
    let mut resp = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&resp).contains("\"hash\"") {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&resp)
        );
        resp.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&resp);
    assert!(text.contains("200 OK"), "{text}");
    assert!(
        text.contains(&xxhash_rust::xxh3::xxh3_64(&body).to_string()),
        "{text}"
    );
}

/// Reads an SSE response to the end, returning its text.
async fn read_all(r: reqwest::Response) -> String {
    String::from_utf8(r.bytes().await.unwrap().to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_reach_the_client_before_the_upstream_finishes() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let c = reqwest::Client::new();
    // Small body (plain path) and a 200 KiB body (subrequest path).
    for size in [500usize, 200 * 1024] {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-mock", "sse")
            .header("x-mock-gate", "1")
            .body(chat_body("m", size, true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "text/event-stream");
        let mut stream = r.bytes_stream();
        let first = tokio::time::timeout(DEADLINE, stream.next())
            .await
            .expect("first chunk while the upstream is still holding the stream")
            .unwrap()
            .unwrap();
        assert!(String::from_utf8_lossy(&first).contains("t0"), "{first:?}");
        m.release();
        let mut rest = String::from_utf8_lossy(&first).to_string();
        while let Some(c) = stream.next().await {
            rest.push_str(&String::from_utf8_lossy(&c.unwrap()));
        }
        assert!(rest.contains("t4"), "{rest}");
        assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
        // The gateway asked for usage on the client's behalf and removed the usage chunk.
        assert!(!rest.contains("usage"), "{rest}");
    }
    gw.wait_idle().await;
    let metrics = gw.metrics().await;
    // 2 streams × the mock's usage (7 prompt, 5 completion, 4 cached).
    assert!(
        metrics.contains("tokengate_tokens_total{kind=\"prompt\",model=\"m\"} 14"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tokengate_tokens_total{kind=\"completion\",model=\"m\"} 10"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tokengate_tokens_total{kind=\"cached\",model=\"m\"} 8"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tokengate_ttft_seconds_count{model=\"m\"} 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_asked_for_usage_keeps_its_usage_chunk() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&one_service(&m));
    let body = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "sse")
        .body(&body[..])
        .send()
        .await
        .unwrap();
    let text = read_all(r).await;
    assert!(text.contains("\"usage\":{\"prompt_tokens\":7"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_return_to_zero_on_every_path() {
    let m = Mock::start().await;
    let dead = dead_addr();
    // No active checks: one would take the dead instance out before any request (a check
    // that cannot connect marks it unhealthy at once); this test is about requests.
    let yaml = format!(
        "health_check: {{enabled: false}}\nservices:\n{}{}",
        service("m", &[("up-1", m.addr)]),
        service("dead", &[("gone-1", dead)])
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let post = |model: &str, mode: &str| {
        c.post(gw.url("/v1/chat/completions"))
            .header("x-mock", mode)
            .body(chat_body(model, 300, mode != "echo"))
    };
    // Success.
    let r = post("m", "echo").send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    // Upstream 5xx: passed through as is.
    let r = post("m", "status").send().await.unwrap();
    assert_eq!(r.status(), 503);
    r.bytes().await.unwrap();
    // Upstream closing mid-stream: the client sees a truncated stream (no [DONE]).
    let r = post("m", "close-mid").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await;
    if let Ok(b) = body {
        assert!(!String::from_utf8_lossy(&b).contains("[DONE]"));
    }
    // Connect refused.
    let r = post("dead", "echo").send().await.unwrap();
    assert_eq!(r.status(), 502);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot connect to instance gone-1"),
        "{v}"
    );
    // Client disconnecting mid-stream, on the plain and the subrequest path.
    for size in [300usize, 300 * 1024] {
        let before = m.peer_closed.load(std::sync::atomic::Ordering::SeqCst);
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-mock", "hang")
            .body(chat_body("m", size, true))
            .send()
            .await
            .unwrap();
        let mut s = r.bytes_stream();
        let first = s.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("t0"));
        drop(s);
        // The gateway notices and closes the upstream connection.
        eventually("the upstream connection to be closed", || async {
            m.peer_closed.load(std::sync::atomic::Ordering::SeqCst) > before
        })
        .await;
    }
    let v = gw.wait_idle().await;
    let up = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == "up-1")
        .unwrap()
        .clone();
    assert_eq!(up["completed"], 1, "{v:#}");
    // The engine's 503 and its dying mid-stream count against it; clients leaving do not.
    assert_eq!(up["errors"], 2, "{v:#}");
    assert_eq!(up["cancelled"], 2, "{v:#}");
    let gone = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == "gone-1")
        .unwrap()
        .clone();
    assert_eq!(gone["errors"], 1, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_retry_on_another_instance() {
    let m = Mock::start().await;
    let dead = dead_addr();
    // No active checks: one would take dead-1 out before any request; this test is about
    // what requests do.
    let yaml = format!(
        "health_check: {{enabled: false}}\nservices:\n  - name: m\n    load_balancing: round-robin\n    instances:\n      - {{id: dead-1, addr: \"{dead}\"}}\n      - {{id: up-1, addr: \"{}\"}}\n",
        m.addr
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    // Small bodies (plain path) and large ones (subrequest path) alike.
    for size in [200usize, 200, 150 * 1024, 150 * 1024] {
        let body = chat_body("m", size, false);
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-tokengate-instance"], "up-1");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["hash"], xxhash_rust::xxh3::xxh3_64(&body));
    }
    let v = gw.wait_idle().await;
    // Round-robin put the first three requests on dead-1 first: three failed connects and
    // retries; the third consecutive failure ejected dead-1 (passive health), so the fourth
    // request went straight to up-1.
    assert_eq!(v["instances"][0]["id"], "dead-1");
    assert_eq!(v["instances"][0]["errors"], 3, "{v:#}");
    assert_eq!(v["instances"][0]["health"]["ejected"], true, "{v:#}");
    assert_eq!(v["instances"][0]["health"]["ejections"], 1, "{v:#}");
    assert_eq!(v["instances"][1]["completed"], 4, "{v:#}");
    let m = gw.metrics().await;
    assert!(
        m.contains("tokengate_instance_available{instance=\"dead-1\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("tokengate_instance_available{instance=\"up-1\"} 1"),
        "{m}"
    );
}

async fn error_of(r: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(r.status(), status);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_are_api_shaped() {
    let m = Mock::start().await;
    let yaml = format!(
        "api_keys: [sk-good]\nmax_body_bytes: 100000\n{}",
        one_service(&m)
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let chat = gw.url("/v1/chat/completions");
    let auth = |r: reqwest::RequestBuilder| r.header("authorization", "Bearer sk-good");

    let v = error_of(c.post(&chat).body("{}").send().await.unwrap(), 401).await;
    assert_eq!(v["error"]["type"], "authentication_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("missing API key"));
    let v = error_of(
        c.post(&chat)
            .header("authorization", "Bearer sk-bad")
            .body("{}")
            .send()
            .await
            .unwrap(),
        401,
    )
    .await;
    assert_eq!(v["error"]["message"], "invalid API key");
    // Anthropic SDKs send x-api-key and get Anthropic-shaped errors.
    let v = error_of(
        c.post(gw.url("/v1/messages"))
            .header("x-api-key", "sk-bad")
            .body("{}")
            .send()
            .await
            .unwrap(),
        401,
    )
    .await;
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "authentication_error");

    let v = error_of(auth(c.post(&chat)).body("{nope").send().await.unwrap(), 400).await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid JSON"),
        "{v}"
    );
    assert_eq!(v["error"]["code"], "invalid_request");
    let v = error_of(
        auth(c.post(&chat))
            .body(r#"{"messages":[]}"#)
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(v["error"]["message"].as_str().unwrap().contains("`model`"));
    let v = error_of(
        auth(c.post(&chat))
            .body(r#"{"model":"nope","messages":[]}"#)
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("\"nope\""));
    let v = error_of(
        auth(c.post(gw.url("/v1/messages")))
            .body(r#"{"model":"nope","max_tokens":1,"messages":[]}"#)
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert_eq!(v["error"]["type"], "not_found_error");
    let v = error_of(
        auth(c.post(gw.url("/v2/whatever"))).send().await.unwrap(),
        404,
    )
    .await;
    assert_eq!(v["error"]["code"], "unknown_url");
    let v = error_of(auth(c.get(&chat)).send().await.unwrap(), 405).await;
    assert_eq!(v["error"]["code"], "method_not_allowed");
    // Too large: announced by Content-Length, and discovered while reading a chunked body.
    let v = error_of(
        auth(c.post(&chat))
            .body(chat_body("m", 200_000, false))
            .send()
            .await
            .unwrap(),
        413,
    )
    .await;
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_body_bytes"));
    let r = auth(c.post(&chat))
        .body(chunked(&chat_body("m", 200_000, false), 10_000))
        .send()
        .await;
    // The gateway answers 413 as soon as the limit is crossed; the client may still be
    // uploading and see the connection close instead.
    if let Ok(r) = r {
        error_of(r, 413).await;
    }
    // None of this reached the upstream.
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    // A good key works, and is not forwarded to the engine.
    let r = auth(c.post(&chat))
        .body(chat_body("m", 100, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["auth"], "");
    // Keys never reach the logs.
    assert!(!gw.log_text().contains("sk-good"));
    assert!(!gw.log_text().contains("sk-bad"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeouts_are_504() {
    let m = Mock::start().await;
    let yaml = format!(
        "timeouts: {{first_byte: 300ms, idle: 300ms}}\n{}",
        one_service(&m)
    );
    let gw = GatewayProc::start(&yaml);
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "stall")
        .body(chat_body("m", 100, false))
        .send()
        .await
        .unwrap();
    let v = error_of(r, 504).await;
    assert_eq!(v["error"]["code"], "upstream_timeout");
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_fallback_rewrites_the_model() {
    let m = Mock::start().await;
    let yaml = format!(
        "routing: {{strict: false, default_model: m}}\n{}",
        one_service(&m)
    );
    let gw = GatewayProc::start(&yaml);
    let body = chat_body("something-else", 100, false);
    let expected = tokengate::api::rewrite_model(&body, "m").unwrap();
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["hash"], xxhash_rust::xxh3::xxh3_64(&expected));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_headers_request_id_and_metrics() {
    let m = Mock::start().await;
    let yaml = format!(
        "services:\n{}{}",
        service("m", &[("up-1", m.addr)]),
        service("other", &[("up-2", m.addr)])
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let v: serde_json::Value = c
        .get(gw.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["m", "other"]);
    assert_eq!(v["data"][0]["object"], "model");

    // A client's request id goes upstream and back; one is generated when absent.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "req-42")
        .body(chat_body("m", 100, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "req-42");
    assert_eq!(r.headers()["x-tokengate-reason"], "least-token");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["request_id"], "req-42");
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("other", 100, false))
        .send()
        .await
        .unwrap();
    let generated = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(generated.len(), 32);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["request_id"], generated.as_str());

    gw.wait_idle().await;
    let metrics = gw.metrics().await;
    for needle in [
        "tokengate_requests_total{code=\"200\",instance=\"up-1\",model=\"m\",outcome=\"complete\"} 1",
        "tokengate_requests_total{code=\"200\",instance=\"up-2\",model=\"other\",outcome=\"complete\"} 1",
        "tokengate_request_duration_seconds_count{model=\"m\"} 1",
        // Tokens per model (the service that served the request).
        "tokengate_tokens_total{kind=\"prompt\",model=\"m\"} 11",
        "tokengate_tokens_total{kind=\"completion\",model=\"m\"} 3",
        "tokengate_tokens_total{kind=\"cached\",model=\"m\"} 5",
        "tokengate_tokens_total{kind=\"prompt\",model=\"other\"} 11",
        "tokengate_tokens_total{kind=\"cached\",model=\"other\"} 5",
        "tokengate_inflight_requests{instance=\"up-1\"} 0",
        "tokengate_inflight_tokens{instance=\"up-2\"} 0",
        "tokengate_routing_decisions_total{reason=\"least-token\"} 2",
    ] {
        assert!(metrics.contains(needle), "missing {needle}:\n{metrics}");
    }
    let h = c.get(gw.admin_url("/health")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    // The access log has one line per request with the decision (written in the logging hook,
    // after the client has its answer: poll for it).
    eventually("the access log line", || async {
        gw.log_text().contains("id=req-42")
    })
    .await;
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("id=req-42"))
        .expect("access log line");
    for part in [
        "POST /v1/chat/completions",
        "model=m",
        "instance=up-1",
        "status=200",
        "reason=least-token",
        "prompt_tokens=11",
    ] {
        assert!(line.contains(part), "{part} not in {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_spreads_concurrent_streams() {
    let m = Mock::start().await;
    let yaml = format!(
        "services:\n  - name: m\n    load_balancing: least-request\n    instances:\n      - {{id: a, addr: \"{0}\"}}\n      - {{id: b, addr: \"{0}\"}}\n",
        m.addr
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    // Hold 4 streams open at once: least-request puts 2 on each instance.
    let mut held = Vec::new();
    for _ in 0..4 {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-mock", "hang")
            .body(chat_body("m", 100, true))
            .send()
            .await
            .unwrap();
        let inst = r.headers()["x-tokengate-instance"]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(r.headers()["x-tokengate-reason"], "least-request");
        held.push((inst, r));
    }
    let a = held.iter().filter(|(i, _)| i == "a").count();
    assert_eq!(
        a,
        2,
        "{:?}",
        held.iter().map(|(i, _)| i).collect::<Vec<_>>()
    );
    let v = gw.instances().await;
    for i in v["instances"].as_array().unwrap() {
        assert_eq!(i["inflight_requests"], 2, "{v:#}");
    }
    drop(held);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_metrics_and_instances_but_not_health() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("admin_token: adm-secret\n{}", one_service(&m)));
    let c = reqwest::Client::new();
    for path in ["/metrics", "/admin/instances"] {
        let r = c.get(gw.admin_url(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = c
            .get(gw.admin_url(path))
            .header("authorization", "Bearer wrong")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = c
            .get(gw.admin_url(path))
            .header("authorization", "Bearer adm-secret")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    assert_eq!(
        c.get(gw.admin_url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(!gw.log_text().contains("adm-secret"));
}
