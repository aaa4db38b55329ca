#![allow(dead_code)]

use std::time::{Duration, Instant};

use engine_sim::{SimConfig, SimHandle};
use futures_util::StreamExt;
use serde_json::{json, Value};

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

pub(crate) fn fast_cfg() -> SimConfig {
    SimConfig {
        id: "sim-test".into(),
        time_scale: 20.0,
        default_output_tokens: 8,
        ..SimConfig::default()
    }
}

pub(crate) async fn sim(cfg: SimConfig) -> SimHandle {
    engine_sim::spawn_local(cfg).await.unwrap()
}

/// A chat request body.
pub(crate) fn chat(content: &str, max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// Deterministic filler text of `n` bytes, varying with `seed`.
pub(crate) fn text(seed: u32, n: usize) -> String {
    let mut s = String::with_capacity(n);
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    while s.len() < n {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        s.push((b'a' + (x % 26) as u8) as char);
    }
    s
}

/// One SSE event: (event name, data).
#[derive(Debug, Clone)]
pub(crate) struct Sse {
    pub event: Option<String>,
    pub data: String,
    pub at: Instant,
}

impl Sse {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("bad JSON in SSE data {:?}: {e}", self.data))
    }
}

/// Read a whole SSE response, time-stamping each event on arrival.
pub(crate) async fn read_sse(resp: reqwest::Response) -> Result<Vec<Sse>, reqwest::Error> {
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        let at = Instant::now();
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(i) = buf.find("\n\n") {
            let block: String = buf.drain(..i + 2).collect();
            let mut ev = Sse {
                event: None,
                data: String::new(),
                at,
            };
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    ev.event = Some(e.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    ev.data.push_str(d);
                }
            }
            out.push(ev);
        }
    }
    assert!(buf.trim().is_empty(), "trailing partial SSE event: {buf:?}");
    Ok(out)
}

pub(crate) async fn post(
    c: &reqwest::Client,
    sim: &SimHandle,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    c.post(format!("{}{path}", sim.url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Non-stream chat request; returns the response JSON.
pub(crate) async fn chat_json(
    c: &reqwest::Client,
    sim: &SimHandle,
    content: &str,
    max_tokens: u64,
) -> Value {
    let r = post(
        c,
        sim,
        "/v1/chat/completions",
        &chat(content, max_tokens, false),
    )
    .await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

pub(crate) fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Scrape /metrics: value of the first sample whose line starts with `prefix`.
pub(crate) async fn metric(c: &reqwest::Client, sim: &SimHandle, prefix: &str) -> f64 {
    let body = c
        .get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    body.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("metric {prefix} missing in\n{body}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Poll `f` until it returns true (up to 30 s).
pub(crate) async fn eventually<F, Fut>(mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await; // ok-sleep: poll interval under a deadline
    }
    panic!("condition not reached within 30 s");
}
