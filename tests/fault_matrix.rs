//! The fault matrix: what a client sees, and what the gateway records, for every way an
//! engine or a client can fail. Each case checks the client's outcome (a clean JSON error with
//! the right status, a transparent retry, or a truncated stream), that the load table returns
//! to zero (`wait_idle`) and that the instance's health and error counters moved as they
//! should. Engines are engine-sims with injected faults, or small raw servers where exact
//! bytes matter.
//!
//! Not repeated here: a config reload while a stream is in flight
//! (`tests/reload.rs::reload_swaps_config_without_dropping_streams`), connect failures on a
//! dead address (`tests/gateway.rs::connect_failures_retry_on_another_instance`), a client
//! leaving mid-stream on both body paths and the engine's 5xx passed through with one
//! instance (`tests/gateway.rs::counters_return_to_zero_on_every_path`).

mod common;

use common::*;
use futures_util::StreamExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that answers every inference request with the same raw bytes and closes the
/// connection; `GET /health` gets 200. Records the length and hash of every body it got.
#[derive(Clone)]
struct Fixed {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<(usize, u64)>>>,
    requests: Arc<AtomicU64>,
}

impl Fixed {
    async fn start(response: Vec<u8>) -> Fixed {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let f = Fixed {
            addr: l.local_addr().unwrap(),
            bodies: Arc::default(),
            requests: Arc::default(),
        };
        let ff = f.clone();
        let response = Arc::new(response);
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (ff, response) = (ff.clone(), response.clone());
                tokio::spawn(async move {
                    let _ = Box::pin(ff.serve(s, &response)).await;
                });
            }
        });
        f
    }

    /// An engine error answer: `status` with a JSON body naming it.
    async fn status(status: u16) -> Fixed {
        let body = format!(r#"{{"error":{{"message":"engine says {status}","type":"engine"}}}}"#);
        Fixed::start(
            format!(
                "HTTP/1.1 {status} Engine\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
        .await
    }

    async fn serve(&self, mut s: TcpStream, response: &[u8]) -> std::io::Result<()> {
        let mut buf = Vec::new();
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let mut tmp = [0u8; 16384];
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&tmp[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
        if head.starts_with("get /health") {
            return s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n")
                .await;
        }
        let cl: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let mut body = buf.split_off(head_end);
        while body.len() < cl {
            let mut tmp = [0u8; 65536];
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                return Ok(());
            }
            body.extend_from_slice(&tmp[..n]);
        }
        self.requests.fetch_add(1, SeqCst);
        self.bodies
            .lock()
            .unwrap()
            .push((body.len(), xxhash_rust::xxh3::xxh3_64(&body)));
        s.write_all(response).await?;
        s.shutdown().await
    }
}

fn instance<'a>(v: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .unwrap_or_else(|| panic!("no instance {id} in {v:#}"))
}

async fn json_error(r: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(r.status(), status);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    r.json().await.unwrap()
}

fn post(gw: &GatewayProc, body: Vec<u8>) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(body)
}

/// The gateway still serves after whatever a test did to it.
async fn still_serves(gw: &GatewayProc) {
    let r = reqwest::get(gw.url("/health")).await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_503_and_429_are_retried_on_another_instance_with_the_body_replayed() {
    for status in [503u16, 429] {
        let bad = Fixed::status(status).await;
        let good = Mock::start().await;
        let gw = GatewayProc::start(&format!(
            "services:\n  - name: m\n    load_balancing: round-robin\n    instances:\n      - {{id: bad-1, addr: \"{}\"}}\n      - {{id: up-1, addr: \"{}\"}}\n",
            bad.addr, good.addr
        ));
        let c = reqwest::Client::new();
        let mut sent = Vec::new();
        // Plain path (≤ 64 KiB) and subrequest path (200 KiB), Content-Length and chunked.
        for size in [300usize, 200 * 1024, 300, 200 * 1024] {
            for chunked in [false, true] {
                let body = chat_body("m", size, false);
                let hash = xxhash_rust::xxh3::xxh3_64(&body);
                sent.push((body.len(), hash));
                let req = c.post(gw.url("/v1/chat/completions"));
                let req = if chunked {
                    req.body(common::chunked(&body, 10_000))
                } else {
                    req.body(body.clone())
                };
                let r = req.send().await.unwrap();
                assert_eq!(r.status(), 200, "{status} size {size} chunked {chunked}");
                assert_eq!(r.headers()["x-tokengate-instance"], "up-1");
                let v: serde_json::Value = r.json().await.unwrap();
                assert_eq!(v["hash"], hash, "{status} size {size} chunked {chunked}");
                assert_eq!(v["content_length"], body.len().to_string());
            }
        }
        let v = gw.wait_idle().await;
        // The failing engine got every body it saw whole and byte-exact.
        let got = bad.bodies.lock().unwrap().clone();
        assert!(!got.is_empty(), "{status}: bad-1 was never tried");
        for b in &got {
            assert!(sent.contains(b), "{status}: bad-1 got a damaged body {b:?}");
        }
        let b = instance(&v, "bad-1");
        let u = instance(&v, "up-1");
        // Every attempt on bad-1 is one of its errors, every request completed on up-1.
        assert_eq!(b["errors"], got.len() as u64, "{status}: {v:#}");
        assert_eq!(b["completed"], 0, "{v:#}");
        assert_eq!(u["completed"], 8, "{v:#}");
        if status == 503 {
            // 5xx feed passive health: 3 consecutive failures eject the instance.
            assert_eq!(got.len(), 3, "{v:#}");
            assert_eq!(b["health"]["ejected"], true, "{v:#}");
        } else {
            // 429 means busy, not broken: never ejected, so it is tried again every time.
            assert_eq!(got.len(), 8, "{v:#}");
            assert_eq!(b["health"]["ejected"], false, "{v:#}");
        }
        assert!(gw
            .log_text()
            .contains(&format!("answered {status}; retrying on another instance")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_instance_answers_503_the_last_answer_is_passed_through() {
    let (a, b) = (Fixed::status(503).await, Fixed::status(503).await);
    let services = format!(
        "services:\n  - name: m\n    instances:\n      - {{id: a, addr: \"{}\"}}\n      - {{id: b, addr: \"{}\"}}\n",
        a.addr, b.addr
    );
    let gw = GatewayProc::start(&format!("passive_health: {{max_failures: 0}}\n{services}"));
    let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], "engine says 503");
    // Both instances tried, each once.
    assert_eq!((a.requests.load(SeqCst), b.requests.load(SeqCst)), (1, 1));
    let v = gw.wait_idle().await;
    assert_eq!(instance(&v, "a")["errors"], 1, "{v:#}");
    assert_eq!(instance(&v, "b")["errors"], 1, "{v:#}");
    drop(gw);

    // `retry_on_status: []`: the first answer goes straight through.
    let gw = GatewayProc::start(&format!(
        "passive_health: {{retry_on_status: []}}\n{services}"
    ));
    let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    r.bytes().await.unwrap();
    assert_eq!(a.requests.load(SeqCst) + b.requests.load(SeqCst), 3);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_engine_sim_is_skipped_for_streams_and_never_ejected() {
    let fleet = sims(2, "m", "e", 200.0).await;
    fleet[0].update_faults(|f| f.rate_limit = true);
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: round-robin\n{}",
        sim_instances(&fleet)
    ));
    for _ in 0..4 {
        let r = post(&gw, chat_body("m", 300, true)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-tokengate-instance"], "e2");
        let text = String::from_utf8(r.bytes().await.unwrap().to_vec()).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }
    let v = gw.wait_idle().await;
    assert_eq!(instance(&v, "e2")["completed"], 4, "{v:#}");
    assert!(instance(&v, "e1")["errors"].as_u64().unwrap() >= 1, "{v:#}");
    assert_eq!(instance(&v, "e1")["health"]["ejected"], false, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_engine_is_retried_then_ejected() {
    let fleet = sims(2, "m", "e", 200.0).await;
    fleet[0].update_faults(|f| f.refuse = true);
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: round-robin\n{}",
        sim_instances(&fleet)
    ));
    for size in [300usize, 200 * 1024, 300, 300, 300] {
        let r = post(&gw, chat_body("m", size, false)).send().await.unwrap();
        assert_eq!(r.status(), 200, "size {size}");
        assert_eq!(r.headers()["x-tokengate-instance"], "e2");
        r.bytes().await.unwrap();
    }
    let v = gw.wait_idle().await;
    let e1 = instance(&v, "e1");
    assert_eq!(e1["errors"], 3, "{v:#}");
    assert_eq!(e1["health"]["ejected"], true, "{v:#}");
    assert_eq!(instance(&v, "e2")["completed"], 5, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_silent_before_its_first_byte_is_a_504() {
    let fleet = sims(1, "m", "e", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "timeouts: {{first_byte: 300ms, idle: 300ms}}\nservices:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    // A stall (the engine does not even read the request) and a slow first byte (it works
    // on it but holds the status line) both exceed timeouts.first_byte.
    for (i, fault) in ["stall_ms", "first_byte_delay_ms"].iter().enumerate() {
        fleet[0].update_faults(|f| match *fault {
            "stall_ms" => f.stall_ms = 5_000,
            _ => f.first_byte_delay_ms = 5_000,
        });
        for stream in [false, true] {
            let r = post(&gw, chat_body("m", 300, stream)).send().await.unwrap();
            let v = json_error(r, 504).await;
            assert_eq!(v["error"]["code"], "upstream_timeout", "{fault}: {v}");
        }
        fleet[0].set_faults(Default::default());
        let v = gw.wait_idle().await;
        assert_eq!(instance(&v, "e1")["errors"], 2 * (i as u64 + 1), "{v:#}");
        // The engine recovered: served again.
        let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{fault}");
        r.bytes().await.unwrap();
    }
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dying_mid_stream_truncates_the_stream_and_counts_an_error() {
    let fleet = sims(1, "m", "e", 200.0).await;
    fleet[0].update_faults(|f| f.close_after_chunks = Some(2));
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    // A stream: the client got the status and some chunks, then the stream ends without
    // [DONE] (an error or a short body, depending on where the cut lands).
    let r = post(&gw, chat_body("m", 300, true)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut text = String::new();
    while let Some(c) = s.next().await {
        match c {
            Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
            Err(_) => break,
        }
    }
    assert!(!text.contains("[DONE]"), "{text}");
    // Non-stream: the engine closes without answering; one instance, nothing to retry on:
    // a clean 502.
    let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
    let v = json_error(r, 502).await;
    assert_eq!(v["error"]["code"], "upstream_error");
    let v = gw.wait_idle().await;
    assert_eq!(instance(&v, "e1")["errors"], 2, "{v:#}");
    assert_eq!(instance(&v, "e1")["completed"], 0, "{v:#}");
    still_serves(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_upstream_json_and_sse_pass_through_byte_exact() {
    let json = b"{\"choices\": [}, \"usage\": {\"prompt_tokens\": \"x\"\xff\xfe".to_vec();
    let sse_body: Vec<u8> = [
        &b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n"[..], // no blank line
        b"data: {\"usage\": {\"prompt_tokens\": 1,\n\n",                 // broken usage JSON
        b"\xff\xfe\x00 binary \r\r\n",
        b"data: {\"choices\":[],\"usage\":\"nope\"}\n\n",
        b"event: x\ndata: [DONE]", // unterminated
    ]
    .concat();
    let mut sse = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for part in sse_body.chunks(7) {
        sse.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        sse.extend_from_slice(part);
        sse.extend_from_slice(b"\r\n");
    }
    sse.extend_from_slice(b"0\r\n\r\n");
    let mut plain = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        json.len()
    )
    .into_bytes();
    plain.extend_from_slice(&json);
    for (raw, want, stream) in [(plain, json, false), (sse, sse_body, true)] {
        let up = Fixed::start(raw).await;
        let gw = GatewayProc::start(&format!(
            "services:\n  - name: m\n    instances:\n      - {{id: u, addr: \"{}\"}}\n",
            up.addr
        ));
        // stream=true without include_usage: the gateway injects it and scans in strip
        // mode; the garbage has no usage-only chunk it could remove.
        let r = post(&gw, chat_body("m", 300, stream)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let got = r.bytes().await.unwrap();
        assert_eq!(got.as_ref(), &want[..], "{}", String::from_utf8_lossy(&got));
        let v = gw.wait_idle().await;
        assert_eq!(instance(&v, "u")["completed"], 1, "{v:#}");
        still_serves(&gw).await;
    }
}

/// Sends `head` and `body` on a raw connection and returns it.
async fn raw(gw: &GatewayProc, head: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(gw.proxy).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s
}

async fn admin_json(gw: &GatewayProc) -> serde_json::Value {
    reqwest::get(gw.admin_url("/admin/instances"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_leaving_before_the_first_byte_mid_stream_and_mid_upload() {
    let fleet = sims(1, "m", "e", 1.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    // 1. Before the first byte: the engine holds its answer for 3 s; the client leaves while
    //    the request is waiting.
    fleet[0].update_faults(|f| f.first_byte_delay_ms = 3_000);
    for size in [300usize, 200 * 1024] {
        let body = chat_body("m", size, true);
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let s = raw(&gw, &head, &body).await;
        eventually("the request to be waiting on e1", || async {
            admin_json(&gw).await["instances"][0]["waiting"] == 1
        })
        .await;
        drop(s);
        let v = gw.wait_idle().await;
        assert_eq!(v["instances"][0]["errors"], 0, "{v:#}");
    }
    let v = gw.wait_idle().await;
    assert_eq!(v["instances"][0]["cancelled"], 2, "{v:#}");
    fleet[0].set_faults(Default::default());

    // 2. Mid-stream: a long generation; the client reads one chunk and leaves.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 2000,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    let mut s = r.bytes_stream();
    s.next().await.unwrap().unwrap();
    drop(s);
    let v = gw.wait_idle().await;
    assert_eq!(v["instances"][0]["cancelled"], 3, "{v:#}");
    // The engine stops generating for the client that left.
    eventually("the engine to drop the abandoned request", || async {
        fleet[0].stats().running == 0
    })
    .await;

    // 3. Mid-upload: half of a Content-Length body, then the client closes. Nothing is
    //    dispatched.
    let body = chat_body("m", 10_000, false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let s = raw(&gw, &head, &body[..body.len() / 2]).await;
    drop(s);
    let v = gw.wait_idle().await;
    let i = &v["instances"][0];
    assert_eq!(
        (
            i["completed"].as_u64(),
            i["errors"].as_u64(),
            i["cancelled"].as_u64()
        ),
        (Some(0), Some(0), Some(3)),
        "{v:#}"
    );
    // Still serving.
    let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_instances_down_is_a_clean_502_then_503() {
    let fleet = sims(2, "m", "e", 200.0).await;
    for s in &fleet {
        s.update_faults(|f| f.refuse = true);
    }
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    let send = |stream: bool| {
        let gw = &gw;
        async move {
            let r = post(gw, chat_body("m", 300, stream)).send().await.unwrap();
            let code = r.status().as_u16();
            let v = json_error(r, code).await;
            match code {
                502 => assert_eq!(v["error"]["code"], "upstream_error", "{v}"),
                503 => assert_eq!(v["error"]["code"], "no_healthy_upstream", "{v}"),
                other => panic!("unexpected {other}: {v}"),
            }
            code
        }
    };
    let mut codes = Vec::new();
    for stream in [false, true, false] {
        codes.push(send(stream).await);
    }
    // Each request tried both instances; after 3 such requests both are ejected. The third
    // failure is recorded when the gateway finishes the request, which may be just after the
    // client read its 502: wait for it before asking again.
    eventually("both instances to be ejected", || async {
        let v = gw.instances().await;
        ["e1", "e2"]
            .iter()
            .all(|id| instance(&v, id)["health"]["ejected"] == true)
    })
    .await;
    for stream in [true, false] {
        codes.push(send(stream).await);
    }
    // Then the gateway answers 503 at once.
    assert_eq!(codes, vec![502, 502, 502, 503, 503]);
    let v = gw.wait_idle().await;
    for id in ["e1", "e2"] {
        assert_eq!(instance(&v, id)["errors"], 3, "{v:#}");
        assert_eq!(instance(&v, id)["health"]["ejected"], true, "{v:#}");
    }
    still_serves(&gw).await;
}

/// An ejection ends only after a health check passes: once `eject_for` is over, an engine
/// that no check has seen answer since stays out (`awaiting_probe`) instead of being handed
/// requests again because time passed; with checks every 200 ms it is back once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_engine_is_back_only_after_a_check_passes() {
    for checks in ["1h", "200ms"] {
        let fleet = sims(2, "m", "e", 200.0).await;
        fleet[0].update_faults(|f| f.error_rate = 1.0);
        // `1h`: one round of checks at start, none after.
        let gw = GatewayProc::start(&format!(
            "health_check: {{interval: {checks}}}\npassive_health: {{max_failures: 1, eject_for: 300ms}}\nservices:\n  - name: m\n    load_balancing: round-robin\n{}",
            sim_instances(&fleet)
        ));
        // e1's 503 is retried on e2 and ejects e1.
        let mut ejected = false;
        for _ in 0..2 {
            let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            let v = gw.wait_idle().await;
            ejected |= instance(&v, "e1")["health"]["ejections"] == 1;
        }
        assert!(ejected, "{:#}", gw.instances().await);
        fleet[0].update_faults(|f| f.error_rate = 0.0);
        eventually("the ejection time to be over", || async {
            instance(&gw.instances().await, "e1")["health"]["ejected"] == false
        })
        .await;
        if checks == "1h" {
            let v = gw.instances().await;
            assert_eq!(
                instance(&v, "e1")["health"]["awaiting_probe"],
                true,
                "{v:#}"
            );
            for _ in 0..4 {
                let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
                assert_eq!(r.headers()["x-tokengate-instance"], "e2");
                r.bytes().await.unwrap();
            }
            let v = gw.wait_idle().await;
            assert_eq!(instance(&v, "e1")["completed"], 0, "{v:#}");
        } else {
            eventually("a passing check to bring e1 back", || async {
                let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
                let who = r.headers()["x-tokengate-instance"].clone();
                r.bytes().await.unwrap();
                who == "e1"
            })
            .await;
            assert!(gw.log_text().contains("instance e1: its ejection is over"));
        }
    }
}

/// A stopped engine (nothing listens on its port) is marked unhealthy by the first check
/// that cannot connect, not after `fall` (3) failed checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_engine_leaves_at_the_first_check_that_cannot_connect() {
    let mut fleet = sims(2, "m", "e", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "health_check: {{interval: 200ms, fall: 3}}\nservices:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    fleet.remove(0).stop().await;
    eventually("e1 to be marked unhealthy", || async {
        instance(&gw.instances().await, "e1")["health"]["healthy"] == false
    })
    .await;
    let log = gw.log_text();
    assert!(
        log.contains("instance e1 is unhealthy: its check of") && log.contains("could not connect"),
        "{log}"
    );
    for _ in 0..3 {
        let r = post(&gw, chat_body("m", 300, false)).send().await.unwrap();
        assert_eq!(r.headers()["x-tokengate-instance"], "e2");
        r.bytes().await.unwrap();
    }
}
