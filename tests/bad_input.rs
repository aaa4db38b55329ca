//! Bad input through the real binary: every malformed request gets a clear 4xx or a clean
//! close, never a panic, never a hang, and the gateway keeps serving afterwards. (Empty body,
//! `{nope`, missing `model`, unknown model, bad keys, wrong method / path and bodies over
//! `max_body_bytes` are in `tests/gateway.rs::client_errors_are_api_shaped`.)

mod common;

use common::*;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn gateway(extra: &str) -> (Mock, GatewayProc) {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "{extra}services:\n{}",
        service("m", &[("up-1", m.addr)])
    ));
    (m, gw)
}

/// The gateway answers a good request after whatever came before.
async fn still_serves(gw: &GatewayProc) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("m", 200, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
}

/// Writes `req` on a fresh connection and reads until the gateway closes it (bounded).
async fn raw_exchange(gw: &GatewayProc, req: &[u8]) -> String {
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    // The gateway may answer (and close) before it has read everything: ignore write errors.
    let _ = s.write_all(req).await;
    read_to_close(&mut s).await
}

async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "connection neither answered nor closed: {}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}

fn status_of(resp: &str) -> Option<u16> {
    resp.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_400_in_the_clients_api_shape() {
    let (m, gw) = gateway("").await;
    let c = reqwest::Client::new();
    // 100,000 levels of nesting, unbalanced: no stack overflow, a 400.
    let deep = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":{}}}]}}"#,
        "[".repeat(100_000)
    );
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "/v1/chat/completions",
            br#"{"model":"m","messages":"hi"}"#.to_vec(),
        ),
        (
            "/v1/chat/completions",
            br#"{"model":"m","stream":"yes"}"#.to_vec(),
        ),
        (
            "/v1/chat/completions",
            br#"{"model":"m","max_tokens":-1}"#.to_vec(),
        ),
        ("/v1/chat/completions", br#"{"model":["m"]}"#.to_vec()),
        ("/v1/chat/completions", br#"{"model":""}"#.to_vec()),
        ("/v1/chat/completions", br#"[{"model":"m"}]"#.to_vec()),
        (
            "/v1/chat/completions",
            br#"{"model":"m"} trailing"#.to_vec(),
        ),
        ("/v1/chat/completions", br#"null"#.to_vec()),
        ("/v1/chat/completions", deep.into_bytes()),
        // Invalid UTF-8 inside a string and outside one.
        (
            "/v1/chat/completions",
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"
                .to_vec(),
        ),
        ("/v1/completions", b"\xef\xbb\xbf{\"model\":\"m\"}".to_vec()),
        (
            "/v1/completions",
            br#"{"model":"m","prompt":"\ud800"#.to_vec(),
        ),
        ("/v1/responses", br#"{"model":"m","input":[1,2"#.to_vec()),
        ("/v1/messages", br#"{"model":"m","system":}"#.to_vec()),
        (
            "/v1/messages",
            br#"{"model":"m","metadata":{"user_id":5}}"#.to_vec(),
        ),
    ];
    for (path, body) in cases {
        let r = c
            .post(gw.url(path))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).to_string();
        assert_eq!(r.status(), 400, "{path} {shown}");
        let v: serde_json::Value = r.json().await.unwrap();
        if path == "/v1/messages" {
            assert_eq!(v["type"], "error", "{shown}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{shown}");
        } else {
            assert_eq!(v["error"]["code"], "invalid_request", "{shown}");
        }
    }
    assert_eq!(m.requests.load(SeqCst), 0);
    // Balanced deep nesting is valid JSON: forwarded as it is, no stack overflow.
    let deep = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":{}{}}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    still_serves(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_headers_are_431_or_refused_and_the_gateway_survives() {
    let (m, gw) = gateway("").await;
    let c = reqwest::Client::new();
    // 100 KiB in one header: above the gateway's 64 KiB head limit.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header("x-big", "a".repeat(100 * 1024))
        .body(chat_body("m", 200, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("request headers too large"),
        "{v}"
    );
    // Many small headers adding up.
    let mut req = c.post(gw.url("/v1/chat/completions"));
    for i in 0..200 {
        req = req.header(format!("x-h{i}"), "b".repeat(400));
    }
    let r = req.body(chat_body("m", 200, false)).send().await.unwrap();
    assert_eq!(r.status(), 431);
    // 2 MiB: beyond what Pingora parses at all (1 MiB); a 4xx or a closed connection.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: {}\r\ncontent-length: 2\r\n\r\n{{}}",
        "c".repeat(2 * 1024 * 1024)
    );
    let resp = raw_exchange(&gw, head.as_bytes()).await;
    if let Some(code) = status_of(&resp) {
        assert!((400..500).contains(&code), "{resp}");
    }
    assert_eq!(m.requests.load(SeqCst), 0);
    still_serves(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_in_header_values_is_harmless() {
    let (m, gw) = gateway("").await;
    let body = chat_body("m", 200, false);
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    )
    .into_bytes();
    // Obsolete-text bytes in a request id, a session id and an unknown header.
    req.extend_from_slice(
        b"x-request-id: \xff\xfe\x80\r\nx-session-id: \xc3\x28\r\nx-other: caf\xe9\r\n\r\n",
    );
    req.extend_from_slice(&body);
    let resp = raw_exchange(&gw, &req).await;
    // Served (the bytes are opaque to the gateway; a fresh request id is generated).
    assert_eq!(status_of(&resp), Some(200), "{resp}");
    let rid = resp
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("x-request-id");
    assert_eq!(rid.trim().len(), 32, "{resp}");
    assert_eq!(m.requests.load(SeqCst), 1);
    // Control characters in a header value are not HTTP: rejected by the parser.
    let mut req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-bad: a\x01b\r\ncontent-length: 2\r\n\r\n{}".to_vec();
    let resp = raw_exchange(&gw, &req).await;
    assert_eq!(status_of(&resp), Some(400), "{resp}");
    // Not HTTP at all (a TLS ClientHello on the plain port).
    req = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".to_vec();
    let resp = raw_exchange(&gw, &req).await;
    assert_eq!(status_of(&resp), Some(400), "{resp}");
    // Content-Length and Transfer-Encoding together (a smuggling attempt): never two
    // requests out of one.
    let req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n";
    // Transfer-Encoding wins (RFC 9112): an empty chunked body, a 400; the bytes after it
    // are not read as a second request.
    let resp = raw_exchange(&gw, req).await;
    assert_eq!(status_of(&resp), Some(400), "{resp}");
    assert_eq!(resp.matches("HTTP/1.1 ").count(), 1, "{resp}");
    assert_eq!(m.requests.load(SeqCst), 1);
    still_serves(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_loris_upload_gets_408_within_client_body_timeout() {
    let (m, gw) = gateway("timeouts: {client_body: 1s}\n").await;
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"model\":\"m\",",
    )
    .await
    .unwrap();
    // Trickle a byte every 100 ms: each read is fast, the whole upload is hopeless.
    let start = Instant::now();
    let mut resp = String::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < DEADLINE {
        if s.write_all(b" ").await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                resp.push_str(&String::from_utf8_lossy(&buf[..n]));
                if resp.contains("request_timeout") {
                    break;
                }
            }
            Err(_) => {}
        }
    }
    assert_eq!(status_of(&resp), Some(408), "{resp}");
    assert!(resp.contains("timeouts.client_body"), "{resp}");
    assert!(resp.to_lowercase().contains("connection: close"), "{resp}");
    // The deadline is the whole upload, not one read: well under the test deadline.
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    // A client that sends nothing after the headers is cut off the same way.
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
        .await
        .unwrap();
    let resp = read_to_close(&mut s).await;
    assert_eq!(status_of(&resp), Some(408), "{resp}");
    assert_eq!(m.requests.load(SeqCst), 0);
    still_serves(&gw).await;
}

/// Slowloris: a client trickling its request head one byte at a time (each read fast, the
/// head never done) gets 408 once `timeouts.client_head` has passed since the head's first
/// byte, the connection is closed, and it is counted and logged. Neither an idle keep-alive
/// connection between requests nor a body uploaded slower than the head deadline (but
/// within `client_body`) is cut by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_loris_head_gets_408_within_client_head_timeout() {
    let (m, gw) = gateway("timeouts: {client_head: 500ms, client_body: 30s}\n").await;
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let mut resp = String::new();
    let mut buf = [0u8; 4096];
    let mut closed = false;
    while start.elapsed() < DEADLINE {
        if s.write_all(b"x").await.is_err() {
            closed = true;
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => resp.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(_) => {}
        }
    }
    assert!(closed, "the slow head was never closed: {resp}");
    assert_eq!(status_of(&resp), Some(408), "{resp}");
    assert!(resp.contains("timeouts.client_head"), "{resp}");
    assert_eq!(m.requests.load(SeqCst), 0);
    eventually("the head timeout to be counted", || async {
        gw.metrics()
            .await
            .contains("tokengate_protocol_errors_total{reason=\"head_timeout\"} 1")
    })
    .await;
    assert!(gw.log_text().contains("status=408 reason=head_timeout"));

    // One keep-alive connection: a request, an idle pause longer than the head deadline,
    // a second request whose body arrives in two parts further apart than that.
    let body = chat_body("m", 200, false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    assert_eq!(status_of(&read_answer(&mut s).await), Some(200));
    tokio::time::sleep(Duration::from_millis(800)).await; // ok-sleep: the idle pause under test
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body[..10]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await; // ok-sleep: the slow upload under test
    s.write_all(&body[10..]).await.unwrap();
    assert_eq!(status_of(&read_answer(&mut s).await), Some(200));
    assert!(gw
        .metrics()
        .await
        .contains("tokengate_protocol_errors_total{reason=\"head_timeout\"} 1"));
}

/// Reads one answer with a `Content-Length` body from a kept-alive connection.
async fn read_answer(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((h, b)) = text.split_once("\r\n\r\n") {
            let len: usize = h
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if b.len() >= len {
                return text;
            }
        }
    }
}
