//! The split proxy through the binary: requests split by weight (exact shares over 10,000
//! requests) or by the longest model prefix between our own services and external APIs
//! (mocks on loopback standing in for them), each external entry getting its own model name,
//! key and base path; failover in list order on a refused connection, a 5xx, a 429 and a
//! timeout, never after the first byte and never to an entry with `failover: none`; an entry
//! over HTTPS with a private CA and one addressed by name; keys never shown.

mod common;

use common::tls::{tls_front, TestPki};
use common::*;

const CLIENT_KEY: &str = "sk-client-7781";
const PARTNER_KEY: &str = "sk-partner-secret-91ab";

fn body(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": 3,
        "messages": [{"role": "user", "content": "hello there"}]})
}

struct Answer {
    status: u16,
    reason: String,
    instance: String,
    text: String,
}

async fn ask(
    c: &reqwest::Client,
    gw: &GatewayProc,
    path: &str,
    b: &serde_json::Value,
    mock: &str,
) -> Answer {
    let r = c
        .post(gw.url(path))
        .header("authorization", format!("Bearer {CLIENT_KEY}"))
        .header("x-mock", mock)
        .json(b)
        .send()
        .await
        .unwrap();
    let h = |k: &str| {
        r.headers()
            .get(k)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let (reason, instance) = (h("x-tokengate-reason"), h("x-tokengate-instance"));
    let status = r.status().as_u16();
    // Chunk by chunk: a stream cut by its upstream keeps what arrived.
    let mut r = r;
    let mut bytes = Vec::new();
    let mut cut = false;
    loop {
        match r.chunk().await {
            Ok(Some(b)) => bytes.extend_from_slice(&b),
            Ok(None) => break,
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    let mut text = String::from_utf8_lossy(&bytes).to_string();
    if cut {
        text.push_str("<cut>");
    }
    Answer {
        status,
        reason,
        instance,
        text,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_split_exactly_and_an_external_entry_gets_its_model_key_and_path() {
    let local = Mock::recording().await;
    let partner = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "api_keys: [{CLIENT_KEY}]\nhealth_check: {{interval: 1h}}\nservices:\n  - name: qwen\n    instances:\n      - {{id: q1, addr: \"{}\"}}\nsplit:\n  strategy: weight\n  proxies:\n    - {{local: true, weight: 80}}\n    - {{name: partner, address: \"http://{}/v1\", model: partner-large, api_key: {PARTNER_KEY}, weight: 20}}\n",
        local.addr, partner.addr
    ));
    let c = reqwest::Client::new();
    const N: usize = 10_000;
    let counts = std::sync::Arc::new(std::sync::Mutex::new([0usize; 2]));
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let (c, counts, next) = (c.clone(), counts.clone(), next.clone());
            let url = gw.url("/v1/chat/completions");
            tokio::spawn(async move {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < N {
                    let r = c
                        .post(&url)
                        .header("authorization", format!("Bearer {CLIENT_KEY}"))
                        .json(&body("qwen", false))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    let ext = r.headers()["x-tokengate-reason"] == "split(partner)";
                    if ext {
                        assert_eq!(r.headers()["x-tokengate-instance"], "partner");
                    }
                    r.bytes().await.unwrap();
                    counts.lock().unwrap()[usize::from(ext)] += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let [ours, theirs] = *counts.lock().unwrap();
    assert_eq!(ours + theirs, N);
    let share = theirs as f64 / N as f64;
    assert!((share - 0.20).abs() <= 0.03, "partner share {share}");
    assert_eq!(
        partner.requests.load(std::sync::atomic::Ordering::SeqCst) as usize,
        theirs
    );
    assert_eq!(
        local.requests.load(std::sync::atomic::Ordering::SeqCst) as usize,
        ours
    );
    // The partner got its own model name, its key instead of the client's, its path; our
    // engine got the client's model and no key at all (the client's key is the gateway's).
    let seen = partner.seen();
    let s = &seen[0];
    assert_eq!(s.path, "/v1/chat/completions");
    assert_eq!(
        s.header("authorization"),
        Some(format!("Bearer {PARTNER_KEY}").as_str())
    );
    assert_eq!(s.json()["model"], "partner-large");
    assert_eq!(s.json()["messages"][0]["content"], "hello there");
    assert_eq!(s.header("host"), Some(partner.addr.to_string().as_str()));
    assert!(s.header("x-tokengate-hop").is_none());
    let ours_seen = local.seen();
    assert_eq!(ours_seen[0].json()["model"], "qwen");
    assert!(ours_seen[0].header("authorization").is_none());
    // Metrics per entry and outcome; the key is nowhere to be seen.
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_split_requests_total{entry=\"partner\",outcome=\"ok\"}"
        ),
        Some(theirs as f64),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "tokengate_split_requests_total{entry=\"local\",outcome=\"ok\"}"
        ),
        Some(ours as f64)
    );
    let admin = reqwest::get(gw.admin_url("/admin/instances"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(admin.contains("\"partner\""), "{admin}");
    for text in [&m, &admin, &gw.log_text()] {
        assert!(!text.contains(PARTNER_KEY));
    }
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_prefix_wins_and_both_api_shapes_and_body_sizes_pass() {
    let local = Mock::start().await;
    let g = Mock::recording().await;
    let g4 = Mock::recording().await;
    let rest = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "api_keys: [{CLIENT_KEY}]\nservices:\n  - name: qwen3\n    instances:\n      - {{id: q1, addr: \"{}\"}}\nsplit:\n  strategy: prefix\n  proxies:\n    - {{local: true, prefix: \"qwen*\"}}\n    - {{name: g, address: \"http://{}/v1\", prefix: \"gpt*\"}}\n    - {{name: g4, address: \"http://{}/openai/v1/\", prefix: \"gpt-4*\", api_key: {PARTNER_KEY}}}\n    - {{name: rest, address: \"http://{}/v1\", prefix: \"*\"}}\n",
        local.addr, g.addr, g4.addr, rest.addr
    ));
    let c = reqwest::Client::new();
    for (model, reason, instance) in [
        ("qwen3", "", "q1"),
        ("gpt-3.5-turbo", "split(g)", "g"),
        ("gpt-4o", "split(g4)", "g4"),
        ("llama-3", "split(rest)", "rest"),
    ] {
        let a = ask(&c, &gw, "/v1/chat/completions", &body(model, false), "echo").await;
        assert_eq!(a.status, 200, "{model}: {}", a.text);
        assert_eq!(a.instance, instance, "{model}");
        if !reason.is_empty() {
            assert_eq!(a.reason, reason, "{model}");
        }
    }
    // The base path of g4 is /openai/v1: the client's path after /v1 goes under it; with no
    // entry key, the client's (the gateway's) key is not passed on.
    let s = g4.seen().pop().unwrap();
    assert_eq!(s.path, "/openai/v1/chat/completions");
    assert_eq!(s.json()["model"], "gpt-4o");
    assert_eq!(
        s.header("authorization"),
        Some(format!("Bearer {PARTNER_KEY}").as_str())
    );
    assert!(g.seen()[0].header("authorization").is_none());
    // An Anthropic request keeps its path and gets the key as x-api-key.
    let anth = serde_json::json!({"model": "gpt-4-claude-compat", "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}]});
    let a = ask(&c, &gw, "/v1/messages", &anth, "echo").await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "split(g4)");
    let s = g4.seen().pop().unwrap();
    assert_eq!(s.path, "/openai/v1/messages");
    assert_eq!(s.header("x-api-key"), Some(PARTNER_KEY));
    assert!(s.header("authorization").is_none());
    // A stream.
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("gpt-3.5", true),
        "sse",
    )
    .await;
    assert_eq!(a.status, 200);
    assert!(a.text.trim_end().ends_with("data: [DONE]"), "{}", a.text);
    // A body above 64 KiB (the big-body path), byte for byte.
    let big = chat_body("llama-3", 300_000, false);
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {CLIENT_KEY}"))
        .header("content-type", "application/json")
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-reason"], "split(rest)");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["len"], big.len());
    assert_eq!(v["hash"], xxhash_rust::xxh3::xxh3_64(&big));
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_goes_in_list_order_before_the_first_byte_and_never_after() {
    let refused = dead_addr();
    let e500 = Mock::start().await;
    e500.force("x-mock", "status");
    e500.force("x-mock-status", "500");
    let e429 = Mock::start().await;
    e429.force("x-mock", "status");
    e429.force("x-mock-status", "429");
    let stall = Mock::start().await;
    stall.force("x-mock", "stall");
    let solo = Mock::start().await;
    solo.force("x-mock", "status");
    solo.force("x-mock-status", "503");
    let good = Mock::recording().await;
    let mid = Mock::start().await;
    mid.force("x-mock", "close-mid");
    let gw = GatewayProc::start(&format!(
        "timeouts: {{first_byte: 400ms, idle: 400ms}}\nservices:\n  - name: qwen\n    instances:\n      - {{id: q1, addr: \"no-such-engine.invalid:8000\"}}\nsplit:\n  strategy: prefix\n  proxies:\n    - {{local: true, prefix: \"qwen*\", failover: participate}}\n    - {{name: refused, address: \"http://{refused}/v1\", prefix: chain}}\n    - {{name: e500, address: \"http://{}/v1\"}}\n    - {{name: e429, address: \"http://{}/v1\"}}\n    - {{name: stall, address: \"http://{}/v1\"}}\n    - {{name: solo, address: \"http://{}/v1\", prefix: solo, failover: none}}\n    - {{name: good, address: \"http://{}/v1\", model: good-model}}\n    - {{name: mid, address: \"http://{}/v1\", prefix: mid}}\n",
        e500.addr, e429.addr, stall.addr, solo.addr, good.addr, mid.addr
    ));
    let c = reqwest::Client::new();
    use std::sync::atomic::Ordering::SeqCst;
    // refused (connect error) → e500 → e429 → stall (timeout) → good; `solo` (failover:
    // none) is skipped.
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("chain", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "failover(good)");
    assert_eq!(a.instance, "good");
    for (m, n) in [(&e500, 1), (&e429, 1), (&stall, 1), (&solo, 0), (&good, 1)] {
        assert_eq!(m.requests.load(SeqCst), n);
    }
    // The entry that took it over sends its own model name.
    assert_eq!(good.seen()[0].json()["model"], "good-model");
    let m = gw.metrics().await;
    for (entry, outcome) in [
        ("refused", "error"),
        ("e500", "refused"),
        ("e429", "refused"),
        ("stall", "error"),
        ("good", "ok"),
    ] {
        assert_eq!(
            metric(
                &m,
                &format!(
                    "tokengate_split_requests_total{{entry=\"{entry}\",outcome=\"{outcome}\"}}"
                )
            ),
            Some(1.0),
            "{entry} {outcome}: {m}"
        );
    }
    // An entry with failover: none answers with its own failure; nobody else is asked.
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("solo", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 503, "{}", a.text);
    assert_eq!(a.reason, "split(solo)");
    assert_eq!(good.requests.load(SeqCst), 1);
    // After the first byte there is no failover: the stream ends where the entry stopped.
    let a = ask(&c, &gw, "/v1/chat/completions", &body("mid", true), "sse").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.reason, "split(mid)");
    assert!(a.text.contains("t1 "), "{}", a.text);
    assert!(!a.text.contains("[DONE]"), "{}", a.text);
    assert_eq!(good.requests.load(SeqCst), 1);
    // Our own service cannot take it (its only engine does not resolve): the local entry
    // fails over to the external entries, in the same order.
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("qwen", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "failover(good)");
    assert_eq!(good.requests.load(SeqCst), 2);
    assert_eq!(e500.requests.load(SeqCst), 2);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_over_https_with_a_private_ca_and_one_by_name() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.pem");
    let tls_mock = Mock::recording().await;
    let front = tls_front(&pki, tls_mock.addr).await;
    let named = Mock::recording().await;
    let local = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{id: l1, addr: \"{}\"}}\nsplit:\n  proxies:\n    - {{local: true, weight: 0}}\n    - {{name: secure, address: \"https://localhost:{}/v1\", api_key: {PARTNER_KEY}, tls: {{ca_file: \"{}\"}}}}\n    - {{name: named, address: \"http://localhost:{}/v1\"}}\n",
        local.addr,
        front.port(),
        ca.display(),
        named.addr.port()
    ));
    let c = reqwest::Client::new();
    let mut reasons = Vec::new();
    for stream in [false, true, false, true] {
        let a = ask(
            &c,
            &gw,
            "/v1/chat/completions",
            &body("m", stream),
            if stream { "sse" } else { "echo" },
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text);
        if stream {
            assert!(a.text.contains("[DONE]"), "{}", a.text);
        }
        reasons.push(a.reason);
    }
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "split(named)",
            "split(named)",
            "split(secure)",
            "split(secure)"
        ]
    );
    let s = tls_mock.seen().pop().unwrap();
    assert_eq!(
        s.header("authorization"),
        Some(format!("Bearer {PARTNER_KEY}").as_str())
    );
    assert_eq!(
        s.header("host"),
        Some(format!("localhost:{}", front.port()).as_str())
    );
    assert_eq!(named.requests.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(local.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(!gw.log_text().contains(PARTNER_KEY));

    // Without the private CA the certificate is refused: the only other entry takes it.
    let gw2 = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{id: l1, addr: \"{}\"}}\nsplit:\n  proxies:\n    - {{local: true, weight: 0}}\n    - {{name: secure, address: \"https://localhost:{}/v1\"}}\n    - {{name: named, address: \"http://localhost:{}/v1\", weight: 0}}\n",
        local.addr,
        front.port(),
        named.addr.port()
    ));
    let a = ask(&c, &gw2, "/v1/chat/completions", &body("m", false), "echo").await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "failover(named)");
}

/// Engine-sims play the external APIs (one over HTTPS with the test CA, one on `localhost` by
/// name): an engine-sim answers 404 for a model it does not serve, so each 200 proves the
/// entry's model rewrite; streams, Anthropic requests and a failover on the engine's own 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sims_play_the_external_apis() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.pem");
    let partner = sims(1, "partner-large", "partner", 100.0).await;
    let backup = sims(1, "backup-m", "backup", 100.0).await;
    let ours = sims(1, "qwen3", "q", 100.0).await;
    let front = tls_front(&pki, partner[0].addr).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: qwen3\n{}split:\n  strategy: prefix\n  proxies:\n    - {{local: true, prefix: \"qwen*\"}}\n    - {{name: secure, address: \"https://localhost:{}/v1\", model: partner-large, prefix: \"gpt*\", tls: {{ca_file: \"{}\"}}}}\n    - {{name: named, address: \"http://localhost:{}/v1\", model: backup-m, prefix: \"*\"}}\n",
        sim_instances(&ours),
        front.port(),
        ca.display(),
        backup[0].addr.port()
    ));
    let c = reqwest::Client::new();
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("gpt-4o", true),
        "sse",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "split(secure)");
    assert!(a.text.trim_end().ends_with("data: [DONE]"), "{}", a.text);
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("llama-3", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "split(named)");
    let anth = serde_json::json!({"model": "gpt-4o", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let a = ask(&c, &gw, "/v1/messages", &anth, "sse").await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "split(secure)");
    assert!(a.text.contains("message_stop"), "{}", a.text);
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("qwen3", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.instance, "q1");
    assert_eq!(partner[0].stats().requests_finished, 2);
    assert_eq!(backup[0].stats().requests_finished, 1);
    assert_eq!(ours[0].stats().requests_finished, 1);
    // The partner engine fails: the request fails over to the named entry, as its model.
    partner[0].update_faults(|f| {
        f.error_rate = 1.0;
        f.error_status = 503;
    });
    let a = ask(
        &c,
        &gw,
        "/v1/chat/completions",
        &body("gpt-4o", false),
        "echo",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(a.reason, "failover(named)");
    assert_eq!(backup[0].stats().requests_finished, 2);
    gw.wait_idle().await;
}

/// The local entry with `failover: participate`: when every attempt on our own engines
/// fails before the first response byte (each engine answers 503, or 429, or refuses the
/// connection, or sends nothing within `timeouts.first_byte`), the request goes to the first
/// participating external entry (an engine-sim playing the partner, as its own model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_failures_before_the_first_byte_fail_over_to_an_external_entry() {
    let e503 = sims(2, "qwen-503", "a", 100.0).await;
    for s in &e503 {
        s.update_faults(|f| {
            f.error_rate = 1.0;
            f.error_status = 503;
        });
    }
    let e429 = sims(1, "qwen-429", "b", 100.0).await;
    e429[0].update_faults(|f| f.rate_limit = true);
    let slow = sims(1, "qwen-slow", "c", 100.0).await;
    slow[0].update_faults(|f| f.first_byte_delay_ms = 3_000);
    let partner = sims(1, "partner-m", "partner", 100.0).await;
    let refused = dead_addr();
    let gw = GatewayProc::start(&format!(
        "timeouts: {{first_byte: 400ms, idle: 400ms}}\nhealth_check: {{interval: 1h}}\nservices:\n  - name: qwen-503\n{}  - name: qwen-429\n{}  - name: qwen-slow\n{}  - name: qwen-dead\n    instances:\n      - {{id: d1, addr: \"{refused}\"}}\nsplit:\n  proxies:\n    - {{local: true, weight: 1, failover: participate}}\n    - {{name: partner, address: \"http://{}/v1\", model: partner-m, weight: 0}}\n",
        sim_instances(&e503),
        sim_instances(&e429),
        sim_instances(&slow),
        partner[0].addr
    ));
    let c = reqwest::Client::new();
    let mut served = 0;
    for (model, stream) in [
        ("qwen-503", false),
        ("qwen-429", true),
        ("qwen-dead", false),
        ("qwen-slow", false),
    ] {
        let a = ask(
            &c,
            &gw,
            "/v1/chat/completions",
            &body(model, stream),
            "echo",
        )
        .await;
        served += 1;
        assert_eq!(a.status, 200, "{model}: {}", a.text);
        assert_eq!(a.reason, "failover(partner)", "{model}");
        assert_eq!(a.instance, "partner", "{model}");
        if stream {
            assert!(a.text.trim_end().ends_with("data: [DONE]"), "{}", a.text);
        }
        assert_eq!(partner[0].stats().requests_finished, served, "{model}");
    }
    // A body above 64 KiB (the big-body path) fails over the same way, as the partner's
    // model.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat_body("qwen-503", 300_000, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-reason"], "failover(partner)");
    r.bytes().await.unwrap();
    assert_eq!(partner[0].stats().requests_finished, served + 1);
    // Both of our engines were tried before the partner.
    let log = gw.log_text();
    for id in ["a1", "a2"] {
        assert!(
            log.contains(&format!("instance {id} answered 503")),
            "{log}"
        );
    }
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_split_requests_total{entry=\"partner\",outcome=\"ok\"}"
        ),
        Some(5.0),
        "{m}"
    );
    gw.wait_idle().await;
}

#[test]
fn bad_split_configs_name_their_yaml_path() {
    for (split, want) in [
        (
            "  proxies:\n    - {name: a, address: \"http://127.0.0.1:1/v1\"}\n",
            "split.proxies: needs exactly one entry with local: true",
        ),
        (
            "  proxies:\n    - {local: true}\n    - {name: a}\n",
            "split.proxies[1].address: required",
        ),
        (
            "  proxies:\n    - {local: true}\n    - {name: a, address: \"ftp://x\"}\n",
            "split.proxies[1].address: \"ftp://x\" must start with http:// or https://",
        ),
        (
            "  strategy: prefix\n  proxies:\n    - {local: true, prefix: \"q*x\"}\n    - {name: a, address: \"http://h/v1\", prefix: \"*\"}\n",
            "split.proxies[0].prefix: \"q*x\"",
        ),
        (
            "  proxies:\n    - {local: true, api_key: k}\n",
            "split.proxies[0].api_key: not for the local entry",
        ),
        (
            "  proxies:\n    - {local: true}\n    - {name: a, address: \"http://h/v1\", failover: sometimes}\n",
            "failover",
        ),
        (
            "  proxies:\n    - {local: true, weight: 0}\n    - {name: a, address: \"http://h/v1\", weight: 0}\n",
            "split.proxies: strategy weight needs an enabled entry with weight > 0",
        ),
        (
            "  proxies:\n    - {local: true}\n    - {name: a, address: \"http://h/v1\"}\n    - {name: a, address: \"http://h/v1\"}\n",
            "split.proxies[2].name: duplicate entry \"a\"",
        ),
    ] {
        let (ok, err) = check_yaml(&format!(
            "services:\n  - name: m\n    instances:\n      - {{id: a, addr: \"127.0.0.1:1\"}}\nsplit:\n{split}"
        ));
        assert!(!ok, "{split}");
        assert!(err.contains(want), "{split}: {err}");
    }
}
