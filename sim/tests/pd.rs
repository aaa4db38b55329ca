//! Prefill/decode disaggregation: a prefill engine-sim and a decode engine-sim on
//! loopback, and the test playing the gateway (SGLang's router: the same request
//! to both at once; vLLM's proxy: the prefill first, then the decode with the
//! prefill's `kv_transfer_params`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use engine_sim::{MetricsFlavor, PdMode, Role, SimConfig, SimHandle};
use serde_json::{json, Value};

fn pd_cfg(id: &str, role: Role, mode: PdMode) -> SimConfig {
    SimConfig {
        id: id.into(),
        role,
        pd_mode: mode,
        bootstrap_port: (role == Role::Prefill && mode == PdMode::Sglang).then_some(0),
        ..fast_cfg()
    }
}

/// The request as SGLang's router forwards it: bootstrap fields injected.
fn with_room(mut body: Value, port: u16, room: u64) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(port);
    body["bootstrap_room"] = json!(room);
    body
}

async fn send(c: &reqwest::Client, sim: &SimHandle, body: &Value) -> reqwest::Response {
    post(c, sim, "/v1/chat/completions", body).await
}

/// The text and usage of a complete chat SSE stream (asserts it is complete).
async fn stream_answer(r: reqwest::Response, tokens: u64) -> (String, Value) {
    assert_eq!(r.status(), 200);
    let evs = read_sse(r).await.unwrap();
    assert_eq!(evs.last().unwrap().data, "[DONE]", "{evs:?}");
    let chunks: Vec<Value> = evs[..evs.len() - 1].iter().map(|e| e.json()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")], "{chunks:?}");
    let usage = chunks.last().unwrap()["usage"].clone();
    assert_eq!(usage["completion_tokens"], tokens, "{usage}");
    assert_eq!(text.split(' ').count() as u64, tokens, "{text:?}");
    (text, usage)
}

async fn error_of(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    (status, v["error"]["message"].as_str().unwrap().to_string())
}

#[tokio::test]
async fn sglang_pair_serves_the_decode_stream() {
    let prefill = sim(SimConfig {
        kv_transfer_ms_per_1k_tokens: 0.0,
        ..pd_cfg("p1", Role::Prefill, PdMode::Sglang)
    })
    .await;
    let decode = sim(SimConfig {
        // 2 s per 1000 tokens (time-scaled by 20): ≥ 50 ms for a 500-token prompt
        kv_transfer_ms_per_1k_tokens: 2000.0,
        metrics_flavor: MetricsFlavor::Sglang,
        ..pd_cfg("d1", Role::Decode, PdMode::Sglang)
    })
    .await;
    let c = client();
    let bport = prefill.bootstrap_addr().expect("bootstrap listener").port();
    assert_ne!(bport, prefill.addr.port());
    let prompt = text(1, 2000);
    let gateway = |room: u64, stream: bool| {
        let body = with_room(chat(&prompt, 12, stream), bport, room);
        let (c, prefill, decode) = (&c, &prefill, &decode);
        async move {
            // SGLang's router: both requests at once, the same body.
            let t0 = Instant::now();
            let (p, d) = tokio::join!(send(c, prefill, &body), send(c, decode, &body));
            (p, d, t0)
        }
    };

    let (p, d, t0) = gateway(6593551520068383758, true).await;
    let (text1, usage) = stream_answer(d, 12).await;
    let elapsed = t0.elapsed();
    assert!(
        elapsed >= Duration::from_millis(50),
        "transfer time: {elapsed:?}"
    );
    // the prefill's own response (drained by the router): one token, "length"
    let (_, pusage) = stream_answer(p, 1).await;
    assert_eq!(pusage["prompt_tokens"], usage["prompt_tokens"]);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt_tokens, 503);

    let (ps, ds) = (prefill.stats(), decode.stats());
    // The prefill did the prefill, the decode none of it.
    assert_eq!(ps.prefill_computed_tokens, prompt_tokens);
    assert_eq!(ps.generation_tokens, 1);
    assert_eq!((ps.pd_prefills_published, ps.pd_transfers_sent), (1, 1));
    assert_eq!(ps.pd_kv_pinned, 0);
    assert_eq!(ds.prefill_computed_tokens, 0);
    assert_eq!(ds.prefix_cache_queries, 0);
    assert_eq!(ds.pd_transfers_received, 1);
    assert_eq!(ds.generation_tokens, 12);
    assert_eq!(ds.pd_awaiting_kv, 0);
    assert_eq!((ds.role, ps.role), (Role::Decode, Role::Prefill));

    // The same prompt again (a new room): the prefill's cache hits and says so, and
    // the decode reports the prefill's cached tokens.
    let (p, d, _) = gateway(1234567890123, false).await;
    assert_eq!(p.status(), 200);
    assert_eq!(d.status(), 200);
    let (pv, dv): (Value, Value) = (p.json().await.unwrap(), d.json().await.unwrap());
    assert_eq!(pv["usage"]["completion_tokens"], 1);
    assert_eq!(pv["choices"][0]["finish_reason"], "length");
    assert_eq!(cached(&pv), 496, "31 full blocks of 16 hit");
    assert_eq!(cached(&dv), 496);
    assert_eq!(dv["usage"]["completion_tokens"], 12);
    assert_eq!(dv["choices"][0]["message"]["content"], text1);
    let (ps, ds) = (prefill.stats(), decode.stats());
    assert_eq!(ps.prefill_computed_tokens, prompt_tokens + 7);
    assert_eq!(ds.prefill_computed_tokens, 0);
    assert_eq!(ds.pd_transfers_received, 2);

    // Roles in /metrics: SGLang's engine_type label and engine-sim's info series.
    assert_eq!(
        metric(
            &c,
            &decode,
            "sglang:num_running_reqs{model_name=\"sim-model\",engine_type=\"decode\""
        )
        .await,
        0.0
    );
    assert_eq!(
        metric(&c, &decode, "engine_sim:pd_transfers_received_total{").await,
        2.0
    );
    assert_eq!(
        metric(
            &c,
            &prefill,
            "engine_sim:info{model_name=\"sim-model\",engine_id=\"p1\",role=\"prefill\",pd_mode=\"sglang\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&c, &prefill, "engine_sim:pd_prefills_published_total{").await,
        2.0
    );
    // The bootstrap port answers its health check like SGLang's bootstrap server.
    let h = c
        .get(format!(
            "http://{}/health",
            prefill.bootstrap_addr().unwrap()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
    prefill.stop().await;
    decode.stop().await;
}

#[tokio::test]
async fn sglang_bootstrap_on_the_main_port() {
    // Without --bootstrap-port the rooms are served on the prefill's main port.
    let prefill = sim(SimConfig {
        bootstrap_port: None,
        ..pd_cfg("p2", Role::Prefill, PdMode::Sglang)
    })
    .await;
    assert!(prefill.bootstrap_addr().is_none());
    let decode = sim(pd_cfg("d2", Role::Decode, PdMode::Sglang)).await;
    let c = client();
    let body = with_room(chat(&text(2, 300), 5, false), prefill.addr.port(), 42);
    let (p, d) = tokio::join!(send(&c, &prefill, &body), send(&c, &decode, &body));
    assert_eq!(p.status(), 200);
    let v: Value = d.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    assert_eq!(decode.stats().pd_transfers_received, 1);
    prefill.stop().await;
    decode.stop().await;
}

#[tokio::test]
async fn sglang_requests_need_a_room() {
    let prefill = sim(pd_cfg("p3", Role::Prefill, PdMode::Sglang)).await;
    let decode = sim(pd_cfg("d3", Role::Decode, PdMode::Sglang)).await;
    let c = client();
    for s in [&prefill, &decode] {
        let (status, msg) = error_of(send(&c, s, &chat("hi", 3, false)).await).await;
        assert_eq!(status, 400);
        assert_eq!(
            msg,
            "Disaggregated request received without bootstrap room id"
        );
    }
    // an integrated engine ignores the PD fields
    let plain = sim(fast_cfg()).await;
    let r = send(&c, &plain, &with_room(chat("hi", 3, false), 1, 7)).await;
    assert_eq!(r.status(), 200);
    prefill.stop().await;
    decode.stop().await;
    plain.stop().await;
}

#[tokio::test]
async fn sglang_decode_fails_when_the_room_never_comes() {
    let prefill = sim(pd_cfg("p4", Role::Prefill, PdMode::Sglang)).await;
    let decode = sim(SimConfig {
        pd_timeout_ms: 300,
        ..pd_cfg("d4", Role::Decode, PdMode::Sglang)
    })
    .await;
    let c = client();
    let bport = prefill.bootstrap_addr().unwrap().port();
    // The router never sent the prefill its half.
    let t0 = Instant::now();
    let r = send(&c, &decode, &with_room(chat("alone", 4, true), bport, 99)).await;
    let (status, msg) = error_of(r).await;
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(status, 500);
    assert!(
        msg.starts_with("Decode transfer failed for request")
            && msg.contains("bootstrap_room=99")
            && msg.contains("KVTransferError(bootstrap_room=99): Request 99 timed out after")
            && msg.ends_with("s in KVPoll.WaitingForInput"),
        "{msg}"
    );
    // Nobody listens at the bootstrap address at all: the same timeout.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = gone.local_addr().unwrap().port();
    drop(gone);
    let r = send(
        &c,
        &decode,
        &with_room(chat("alone", 4, false), dead_port, 100),
    )
    .await;
    assert_eq!(error_of(r).await.0, 500);
    // The bootstrap address is an engine that is no SGLang prefill: refused at once.
    let plain = sim(fast_cfg()).await;
    let r = send(
        &c,
        &decode,
        &with_room(chat("alone", 4, false), plain.addr.port(), 101),
    )
    .await;
    let (status, msg) = error_of(r).await;
    assert_eq!(status, 500);
    assert!(msg.contains("is not a sglang prefill engine"), "{msg}");
    let ds = decode.stats();
    assert_eq!(ds.pd_transfer_timeouts, 2);
    assert_eq!(ds.pd_transfer_errors, 1);
    assert_eq!(ds.pd_transfers_received, 0);
    assert_eq!(ds.requests_finished + ds.generation_tokens, 0);
    assert_eq!(ds.pd_awaiting_kv, 0);
    prefill.stop().await;
    decode.stop().await;
    plain.stop().await;
}

#[tokio::test]
async fn sglang_rooms_do_not_cross() {
    let timeout = 800;
    let prefill = sim(SimConfig {
        pd_timeout_ms: timeout,
        ..pd_cfg("p5", Role::Prefill, PdMode::Sglang)
    })
    .await;
    let decode = sim(SimConfig {
        pd_timeout_ms: timeout,
        ..pd_cfg("d5", Role::Decode, PdMode::Sglang)
    })
    .await;
    let c = client();
    let bport = prefill.bootstrap_addr().unwrap().port();
    let body = chat(&text(5, 400), 6, false);

    // Prefill for room 1, decode for room 2, and a well-formed pair for room 3 at
    // the same time: only room 3 is served.
    let (r1, r2, r3) = (
        with_room(body.clone(), bport, 1),
        with_room(body.clone(), bport, 2),
        with_room(body.clone(), bport, 3),
    );
    let (p1, d2, p3, d3) = tokio::join!(
        send(&c, &prefill, &r1),
        send(&c, &decode, &r2),
        send(&c, &prefill, &r3),
        send(&c, &decode, &r3),
    );
    assert_eq!(p3.status(), 200);
    let v: Value = d3.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    let (status, msg) = error_of(d2).await;
    assert_eq!(status, 500);
    assert!(msg.contains("Request 2 timed out"), "{msg}");
    // The prefill of room 1 gives up after the same timeout and releases its KV.
    let (status, msg) = error_of(p1).await;
    assert_eq!(status, 500);
    assert!(
        msg.starts_with("Prefill transfer failed for request") && msg.contains("bootstrap_room=1"),
        "{msg}"
    );
    let ps = prefill.stats();
    assert_eq!(ps.pd_prefills_published, 2);
    assert_eq!((ps.pd_transfers_sent, ps.pd_transfers_expired), (1, 1));
    assert_eq!(ps.pd_kv_pinned, 0);
    assert_eq!(ps.kv_usage, 0.0);
    let ds = decode.stats();
    assert_eq!((ds.pd_transfers_received, ds.pd_transfer_timeouts), (1, 1));

    // One room, two different prompts: the decode refuses KV that is not its own.
    let (mine, other) = (
        with_room(body.clone(), bport, 7),
        with_room(chat(&text(6, 400), 6, false), bport, 7),
    );
    let (p, d) = tokio::join!(send(&c, &prefill, &mine), send(&c, &decode, &other));
    let (status, msg) = error_of(d).await;
    assert_eq!(status, 500);
    assert!(msg.contains("the KV is for another prompt"), "{msg}");
    assert_eq!(p.status(), 200, "the prefill's KV was taken (and freed)");

    // One room, two decodes: one gets the KV, the other is refused.
    let room = with_room(body.clone(), bport, 8);
    let (p, d1, d2) = tokio::join!(
        send(&c, &prefill, &room),
        send(&c, &decode, &room),
        send(&c, &decode, &room),
    );
    assert_eq!(p.status(), 200);
    let mut statuses = [d1.status().as_u16(), d2.status().as_u16()];
    statuses.sort();
    assert_eq!(statuses, [200, 500]);
    let ds = decode.stats();
    assert_eq!(ds.pd_transfer_errors, 2);
    assert_eq!(ds.pd_transfers_received, 2);
    prefill.stop().await;
    decode.stop().await;
}

/// The prefill request as vLLM's proxy sends it.
fn vllm_prefill_body(original: &Value) -> Value {
    let mut b = original.clone();
    b["kv_transfer_params"] = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    b["stream"] = json!(false);
    b["max_tokens"] = json!(1);
    b.as_object_mut().unwrap().remove("stream_options");
    b
}

/// vLLM's proxy: prefill, then the original request with the prefill's params.
async fn vllm_prefill(c: &reqwest::Client, prefill: &SimHandle, original: &Value) -> Value {
    let r = send(c, prefill, &vllm_prefill_body(original)).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn decode_body(original: &Value, params: &Value) -> Value {
    let mut b = original.clone();
    b["kv_transfer_params"] = params.clone();
    b
}

#[tokio::test]
async fn vllm_prefill_then_decode() {
    let prefill = sim(pd_cfg("vp1", Role::Prefill, PdMode::Vllm)).await;
    let decode = sim(pd_cfg("vd1", Role::Decode, PdMode::Vllm)).await;
    let c = client();
    let original = chat(&text(11, 1000), 10, true);

    let pv = vllm_prefill(&c, &prefill, &original).await;
    assert_eq!(pv["usage"]["completion_tokens"], 1);
    assert_eq!(pv["choices"][0]["finish_reason"], "length");
    let prompt_tokens = pv["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt_tokens, 253);
    let params = pv["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "vp1");
    assert_eq!(params["remote_request_id"], pv["id"]);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.addr.port());
    assert_eq!(params["tp_size"], 1);
    let blocks = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(blocks.len() as u64, prompt_tokens.div_ceil(16));
    // The prefill keeps the KV pinned until the decode read it.
    let ps = prefill.stats();
    assert_eq!((ps.pd_prefills_published, ps.pd_kv_pinned), (1, 1));
    assert!(ps.kv_usage > 0.0);

    let d = send(&c, &decode, &decode_body(&original, &params)).await;
    let (_, usage) = stream_answer(d, 10).await;
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let ds = decode.stats();
    assert_eq!(ds.prefill_computed_tokens, 0);
    assert_eq!(ds.prefix_cache_queries, 0);
    assert_eq!(ds.pd_transfers_received, 1);
    assert_eq!(ds.generation_tokens, 10);
    eventually(|| async { prefill.stats().pd_kv_pinned == 0 }).await;
    let ps = prefill.stats();
    assert_eq!(ps.pd_transfers_sent, 1);
    assert_eq!(ps.kv_usage, 0.0);
    assert_eq!(ps.prefill_computed_tokens, prompt_tokens);

    // A repeated prompt: the prefill reports its cache hit; the decode passes it on.
    let pv = vllm_prefill(&c, &prefill, &original).await;
    assert_eq!(cached(&pv), 240);
    let mut plain = original.clone();
    plain["stream"] = json!(false);
    let d = send(&c, &decode, &decode_body(&plain, &pv["kv_transfer_params"])).await;
    assert_eq!(d.status(), 200);
    let dv: Value = d.json().await.unwrap();
    assert_eq!(cached(&dv), 240);
    assert_eq!(dv["usage"]["completion_tokens"], 10);
    assert!(dv.get("kv_transfer_params").is_none());
    assert_eq!(decode.stats().prefill_computed_tokens, 0);
    assert_eq!(prefill.stats().prefill_computed_tokens, prompt_tokens + 13);
    prefill.stop().await;
    decode.stop().await;
}

#[tokio::test]
async fn vllm_decode_errors_and_expiry() {
    let timeout = 300;
    // The prefill keeps its KV longer than the decode waits for a transfer.
    let prefill = sim(SimConfig {
        pd_timeout_ms: 1500,
        ..pd_cfg("vp2", Role::Prefill, PdMode::Vllm)
    })
    .await;
    let decode = sim(SimConfig {
        pd_timeout_ms: timeout,
        ..pd_cfg("vd2", Role::Decode, PdMode::Vllm)
    })
    .await;
    let c = client();
    let original = chat(&text(21, 600), 4, false);
    let pv = vllm_prefill(&c, &prefill, &original).await;
    let params = pv["kv_transfer_params"].clone();

    // Another engine id or other blocks: refused at once.
    let mut wrong_engine = params.clone();
    wrong_engine["remote_engine_id"] = json!("vp-other");
    let (status, msg) =
        error_of(send(&c, &decode, &decode_body(&original, &wrong_engine)).await).await;
    assert_eq!(status, 500);
    assert!(msg.contains("is not this engine"), "{msg}");
    let mut wrong_blocks = params.clone();
    wrong_blocks["remote_block_ids"] = json!([1, 2, 3]);
    let (status, msg) =
        error_of(send(&c, &decode, &decode_body(&original, &wrong_blocks)).await).await;
    assert_eq!(status, 500);
    assert!(msg.contains("remote_block_ids do not match"), "{msg}");
    // A transfer id the prefill never had: the decode waits, then fails.
    let mut unknown = params.clone();
    unknown["remote_request_id"] = json!("chatcmpl-nope");
    let t0 = Instant::now();
    let (status, msg) = error_of(send(&c, &decode, &decode_body(&original, &unknown)).await).await;
    assert!(t0.elapsed() >= Duration::from_millis(timeout));
    assert_eq!(status, 500);
    assert!(
        msg.contains("remote_request_id=chatcmpl-nope") && msg.contains("did not arrive"),
        "{msg}"
    );
    let ds = decode.stats();
    assert_eq!((ds.pd_transfer_timeouts, ds.pd_transfer_errors), (1, 2));
    assert_eq!(ds.requests_finished, 0);

    // Nobody read the real transfer: the prefill releases it at the timeout, and a
    // late decode is refused.
    eventually(|| async { prefill.stats().pd_kv_pinned == 0 }).await;
    let ps = prefill.stats();
    assert_eq!((ps.pd_transfers_expired, ps.pd_transfers_sent), (1, 0));
    assert_eq!(ps.kv_usage, 0.0);
    let (status, _) = error_of(send(&c, &decode, &decode_body(&original, &params)).await).await;
    assert_eq!(status, 500);

    // Incomplete params (here: no remote_host): like vLLM, the decode prefills itself.
    let mut partial = params.clone();
    partial.as_object_mut().unwrap().remove("remote_host");
    let r = send(&c, &decode, &decode_body(&original, &partial)).await;
    assert_eq!(r.status(), 200);
    let ds = decode.stats();
    assert!(ds.prefill_computed_tokens > 0, "{ds:?}");
    assert_eq!(ds.pd_transfers_received, 0);
    prefill.stop().await;
    decode.stop().await;
}
