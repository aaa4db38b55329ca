//! SGLang-style abort: requests carry a `rid`, and `POST /abort_request`
//! (`{"rid"}` or `{"abort_all": true}`) ends them in any phase — a PD decode
//! waiting for its KV, a PD prefill queued, prefilling or holding its KV, an
//! integrated request queued or streaming — and every counter returns to rest.

mod common;

use std::time::{Duration, Instant};

use common::*;
use engine_sim::{PdMode, Role, SimConfig, SimHandle};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// Every wait on a response is bounded by this.
const DEADLINE: Duration = Duration::from_secs(5);

fn pd_cfg(id: &str, role: Role) -> SimConfig {
    SimConfig {
        id: id.into(),
        role,
        pd_mode: PdMode::Sglang,
        bootstrap_port: (role == Role::Prefill).then_some(0),
        // far beyond any wait below: only an abort can end these requests early
        pd_timeout_ms: 30_000,
        ..fast_cfg()
    }
}

/// Real-time decoding (10 ms a step), so a long output streams for minutes.
fn slow_cfg() -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        decode_step_ms: 10.0,
        decode_per_req_ms: 0.0,
        ..fast_cfg()
    }
}

/// A chat body as SGLang's router forwards it, with the gateway's rid.
fn pd_body(prompt: &str, port: u16, room: u64, rid: &str, stream: bool) -> Value {
    let mut b = chat(prompt, 8, stream);
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(port);
    b["bootstrap_room"] = json!(room);
    b["rid"] = json!(rid);
    b
}

fn with_rid(mut body: Value, rid: &str) -> Value {
    body["rid"] = json!(rid);
    body
}

/// POST in the background (the test goes on while the request is in flight).
fn spawn_post(
    c: &reqwest::Client,
    sim: &SimHandle,
    path: &str,
    body: Value,
) -> JoinHandle<reqwest::Response> {
    let req = c.post(format!("{}{path}", sim.url())).json(&body);
    tokio::spawn(async move { req.send().await.unwrap() })
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"))
}

/// `POST /abort_request`: (status, body).
async fn abort(c: &reqwest::Client, sim: &SimHandle, body: &str) -> (u16, Value) {
    let r = c
        .post(format!("{}/abort_request", sim.url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn error_of(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message in {v}"));
    (status, msg.to_string())
}

async fn admin_stats(c: &reqwest::Client, sim: &SimHandle) -> Value {
    c.get(format!("{}/admin/stats", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Read a stream until its text contains `marker` (bounded by [`DEADLINE`]).
async fn read_until(r: &mut reqwest::Response, buf: &mut String, marker: &str) {
    within(marker, async {
        while !buf.contains(marker) {
            let chunk = r.chunk().await.unwrap().expect("stream ended early");
            buf.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    })
    .await;
}

/// Read a stream to its end; the SSE events as (event name, data).
async fn read_rest(mut r: reqwest::Response, mut buf: String) -> Vec<(Option<String>, String)> {
    within("end of stream", async {
        while let Some(chunk) = r.chunk().await.unwrap() {
            buf.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    })
    .await;
    assert!(buf.ends_with("\n\n"), "partial event at the end: {buf:?}");
    buf.split_terminator("\n\n")
        .map(|block| {
            let mut ev = (None, String::new());
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    ev.0 = Some(e.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    ev.1.push_str(d);
                }
            }
            ev
        })
        .collect()
}

fn json_of(data: &str) -> Value {
    serde_json::from_str(data).unwrap_or_else(|e| panic!("bad JSON {data:?}: {e}"))
}

#[tokio::test]
async fn abort_frees_a_decode_waiting_for_its_kv() {
    // The prefill never gets the request: only an abort can end the decode's wait
    // before the 30 s PD timeout.
    let prefill = sim(pd_cfg("p1", Role::Prefill)).await;
    let decode = sim(pd_cfg("d1", Role::Decode)).await;
    let c = client();
    let port = prefill.addr.port();
    let prompt = text(1, 400);
    let t0 = Instant::now();
    // two requests under one rid (non-stream and stream)
    let r1 = spawn_post(
        &c,
        &decode,
        "/v1/chat/completions",
        pd_body(&prompt, port, 11, "pair-1", false),
    );
    let r2 = spawn_post(
        &c,
        &decode,
        "/v1/chat/completions",
        pd_body(&prompt, port, 12, "pair-1", true),
    );
    eventually(|| async { decode.stats().pd_awaiting_kv == 2 }).await;
    assert_eq!(
        abort(&c, &decode, r#"{"rid": "pair-1"}"#).await,
        (200, json!({"aborted": 2}))
    );
    for r in [r1, r2] {
        let r = within("aborted decode", r).await.unwrap();
        let (status, msg) = error_of(r).await;
        assert_eq!(status, 500);
        assert!(msg.starts_with("Abort request pair-1"), "{msg}");
        assert!(msg.contains("waiting for its KV"), "{msg}");
    }
    let elapsed = t0.elapsed();
    assert!(elapsed < DEADLINE, "{elapsed:?}");
    let ds = decode.stats();
    assert_eq!(ds.pd_awaiting_kv, 0);
    assert_eq!(ds.aborted_by_request, 2);
    assert_eq!((ds.running, ds.waiting, ds.prefill_phase), (0, 0, 0));
    assert_eq!((ds.pd_transfer_timeouts, ds.pd_transfer_errors), (0, 0));
    // never reached the scheduler
    assert_eq!(ds.requests_aborted, 0);
    assert_eq!(admin_stats(&c, &decode).await["aborted_by_request"], 2);
    // unregistered once answered
    assert_eq!(
        abort(&c, &decode, r#"{"abort_all": true}"#).await,
        (200, json!({"aborted": 0}))
    );
    assert_eq!(prefill.stats().pd_prefills_published, 0);
    decode.stop().await;
    prefill.stop().await;
}

#[tokio::test]
async fn abort_releases_a_prefill_holding_its_kv() {
    // The decode never comes: the prefill holds its KV until the 30 s timeout,
    // unless aborted.
    let prefill = sim(pd_cfg("p2", Role::Prefill)).await;
    let c = client();
    let port = prefill.addr.port();
    let r1 = spawn_post(
        &c,
        &prefill,
        "/v1/chat/completions",
        pd_body(&text(2, 400), port, 21, "hold-1", false),
    );
    let mut r2 = within(
        "stream headers",
        spawn_post(
            &c,
            &prefill,
            "/v1/chat/completions",
            pd_body(&text(3, 400), port, 22, "hold-2", true),
        ),
    )
    .await
    .unwrap();
    assert_eq!(r2.status(), 200);
    // the prefill streams its one token, then waits for a decode
    let mut buf = String::new();
    read_until(&mut r2, &mut buf, "\"finish_reason\":\"length\"").await;
    eventually(|| async { prefill.stats().pd_kv_pinned == 2 }).await;
    assert!(prefill.stats().kv_usage > 0.0);

    // not on the bootstrap port
    let b = prefill.bootstrap_addr().unwrap();
    let r = c
        .post(format!("http://{b}/abort_request"))
        .json(&json!({"rid": "hold-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    assert_eq!(
        abort(&c, &prefill, r#"{"rid": "hold-1"}"#).await,
        (200, json!({"aborted": 1}))
    );
    let (status, msg) = error_of(within("aborted prefill", r1).await.unwrap()).await;
    assert_eq!(status, 500);
    assert!(msg.starts_with("Abort request hold-1"), "{msg}");
    assert!(msg.contains("bootstrap_room=21"), "{msg}");
    assert_eq!(prefill.stats().pd_kv_pinned, 1);
    // a decode coming late for the room gets the failure
    let r = post(&c, &prefill, "/sim/pd/rooms/21/claim", &json!({})).await;
    assert_eq!(r.status(), 410);
    let why = r.json::<Value>().await.unwrap()["error"].clone();
    assert!(why.as_str().unwrap().contains("abort_request"), "{why}");

    // the stream: an error event, then [DONE]
    assert_eq!(
        abort(&c, &prefill, r#"{"abort_all": true}"#).await,
        (200, json!({"aborted": 1}))
    );
    let evs = read_rest(r2, buf).await;
    let n = evs.len();
    assert_eq!(evs[n - 1].1, "[DONE]", "{evs:?}");
    let err = json_of(&evs[n - 2].1);
    assert_eq!(err["error"]["code"], 500, "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("Abort request hold-2"), "{msg}");

    let ps = prefill.stats();
    assert_eq!((ps.pd_kv_pinned, ps.kv_usage), (0, 0.0));
    assert_eq!((ps.running, ps.waiting, ps.prefill_phase), (0, 0, 0));
    assert_eq!(ps.pd_prefills_published, 2);
    assert_eq!((ps.pd_transfers_sent, ps.pd_transfers_expired), (0, 0));
    assert_eq!(ps.aborted_by_request, 2);
    // both had finished their prefill in the scheduler
    assert_eq!((ps.requests_finished, ps.requests_aborted), (2, 0));
    prefill.stop().await;
}

#[tokio::test]
async fn abort_drops_a_prefill_queued_or_prefilling() {
    // 2 prompt tokens a second, one request at a time: a ~100-token prefill takes
    // ~50 s, the second request waits behind it.
    let prefill = sim(SimConfig {
        prefill_tps: 2.0,
        time_scale: 1.0,
        max_running: 1,
        ..pd_cfg("p3", Role::Prefill)
    })
    .await;
    let c = client();
    let port = prefill.addr.port();
    let prompt = text(4, 400);
    let slow = spawn_post(
        &c,
        &prefill,
        "/v1/chat/completions",
        pd_body(&prompt, port, 31, "prefilling", false),
    );
    eventually(|| async { prefill.stats().running == 1 }).await;
    let queued = spawn_post(
        &c,
        &prefill,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 4, "bootstrap_room": 32, "rid": "queued"}),
    );
    eventually(|| async { prefill.stats().waiting == 1 }).await;
    assert_eq!(prefill.stats().prefill_phase, 2);

    assert_eq!(
        abort(&c, &prefill, r#"{"rid": "queued"}"#).await,
        (200, json!({"aborted": 1}))
    );
    let (status, msg) = error_of(within("queued", queued).await.unwrap()).await;
    assert_eq!(
        (status, msg.as_str()),
        (500, "Abort request queued: aborted by POST /abort_request")
    );
    let ps = prefill.stats();
    assert_eq!((ps.running, ps.waiting, ps.prefill_phase), (1, 0, 1));

    assert_eq!(
        abort(&c, &prefill, r#"{"rid": "prefilling"}"#).await,
        (200, json!({"aborted": 1}))
    );
    let (status, msg) = error_of(within("prefilling", slow).await.unwrap()).await;
    assert_eq!(status, 500);
    assert!(msg.starts_with("Abort request prefilling"), "{msg}");
    let ps = prefill.stats();
    assert_eq!((ps.running, ps.waiting, ps.prefill_phase), (0, 0, 0));
    assert_eq!((ps.kv_usage, ps.pd_kv_pinned), (0.0, 0));
    assert_eq!((ps.requests_aborted, ps.aborted_by_request), (2, 2));
    assert_eq!((ps.requests_finished, ps.pd_prefills_published), (0, 0));
    // both rooms failed
    for room in [31, 32] {
        let r = post(
            &c,
            &prefill,
            &format!("/sim/pd/rooms/{room}/claim"),
            &json!({}),
        )
        .await;
        assert_eq!(r.status(), 410, "room {room}");
    }
    prefill.stop().await;
}

#[tokio::test]
async fn abort_ends_an_integrated_stream_with_finish_reason_abort() {
    let sim = sim(SimConfig {
        max_running: 1,
        ..slow_cfg()
    })
    .await;
    let c = client();
    // 100 000 tokens at 10 ms: only an abort ends it
    let mut s = within(
        "stream headers",
        spawn_post(
            &c,
            &sim,
            "/v1/chat/completions",
            with_rid(chat("tell me everything", 100_000, true), "long"),
        ),
    )
    .await
    .unwrap();
    assert_eq!(s.status(), 200);
    let mut buf = String::new();
    read_until(&mut s, &mut buf, "\"content\":\"").await;
    // a second request waits behind it
    let queued = spawn_post(
        &c,
        &sim,
        "/v1/chat/completions",
        with_rid(chat("and me", 4, false), "later"),
    );
    eventually(|| async { sim.stats().waiting == 1 }).await;
    assert_eq!(
        abort(&c, &sim, r#"{"rid": "later"}"#).await,
        (200, json!({"aborted": 1}))
    );
    let (status, msg) = error_of(within("queued", queued).await.unwrap()).await;
    assert_eq!(status, 500);
    assert!(msg.starts_with("Abort request later"), "{msg}");

    assert_eq!(
        abort(&c, &sim, r#"{"rid": "long"}"#).await,
        (200, json!({"aborted": 1}))
    );
    let evs = read_rest(s, buf).await;
    let n = evs.len();
    assert_eq!(evs[n - 1].1, "[DONE]");
    let last = json_of(&evs[n - 3].1);
    assert_eq!(last["choices"][0]["finish_reason"], "abort", "{last}");
    let usage = &json_of(&evs[n - 2].1)["usage"];
    let done = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..100_000).contains(&done), "{usage}");
    let finishes = evs[..n - 1]
        .iter()
        .map(|e| json_of(&e.1))
        .filter(|v| v["choices"].as_array().is_some_and(|a| !a.is_empty()))
        .filter(|v| !v["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "{evs:?}");

    let st = admin_stats(&c, &sim).await;
    assert_eq!(st["running"], 0, "{st}");
    assert_eq!(st["waiting"], 0, "{st}");
    assert_eq!(st["kv_usage"], 0.0, "{st}");
    assert_eq!(st["requests_aborted"], 2, "{st}");
    assert_eq!(st["aborted_by_request"], 2, "{st}");
    assert_eq!(st["requests_finished"], 0, "{st}");
    assert_eq!(
        metric(&c, &sim, "engine_sim:aborted_by_request_total{").await,
        2.0
    );
    assert_eq!(
        metric(
            &c,
            &sim,
            "vllm:request_success_total{model_name=\"sim-model\",finished_reason=\"abort\"}"
        )
        .await,
        2.0
    );
    sim.stop().await;
}

#[tokio::test]
async fn abort_ends_streams_of_every_api() {
    let sim = sim(slow_cfg()).await;
    let c = client();
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 100_000, "stream": true}),
            "\"text\":\"",
        ),
        (
            "/v1/responses",
            json!({"input": "x", "max_output_tokens": 100_000, "stream": true}),
            "event: response.output_text.delta",
        ),
        (
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000, "stream": true}),
            "event: content_block_delta",
        ),
    ];
    for (path, body, marker) in cases {
        let mut r = within(path, spawn_post(&c, &sim, path, with_rid(body, path)))
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let mut buf = String::new();
        read_until(&mut r, &mut buf, marker).await;
        let (status, v) = abort(&c, &sim, &json!({"rid": path}).to_string()).await;
        assert_eq!((status, v), (200, json!({"aborted": 1})), "{path}");
        let evs = read_rest(r, buf).await;
        let (event, data) = evs.last().unwrap();
        match path {
            "/v1/completions" => {
                assert_eq!(data, "[DONE]");
                let last = json_of(&evs[evs.len() - 2].1);
                assert_eq!(last["choices"][0]["finish_reason"], "abort", "{last}");
            }
            "/v1/responses" => {
                assert_eq!(event.as_deref(), Some("error"), "{evs:?}");
                let v = json_of(data);
                assert_eq!(v["code"], "500");
                assert!(
                    v["message"].as_str().unwrap().starts_with("Abort request"),
                    "{v}"
                );
            }
            _ => {
                assert_eq!(event.as_deref(), Some("error"), "{evs:?}");
                let v = json_of(data);
                assert_eq!(v["error"]["type"], "api_error");
            }
        }
    }
    eventually(|| async { sim.stats().running == 0 }).await;
    let st = sim.stats();
    assert_eq!(
        (st.kv_usage, st.requests_aborted, st.aborted_by_request),
        (0.0, 3, 3)
    );
    sim.stop().await;
}

#[tokio::test]
async fn abort_request_edge_cases() {
    let sim = sim(slow_cfg()).await;
    let c = client();
    // an unknown rid (or an empty one) aborts nothing
    let mut r = within(
        "stream headers",
        spawn_post(
            &c,
            &sim,
            "/v1/chat/completions",
            with_rid(chat("x", 30, true), "keep"),
        ),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    read_until(&mut r, &mut buf, "\"content\":\"").await;
    for body in [
        r#"{"rid": "nope"}"#,
        r#"{"rid": "nope", "abort_all": false, "extra": 1}"#,
        r#"{"rid": "KEEP", "abort_all": null}"#,
        r#"{"rid": ""}"#,
        r#"{}"#,
    ] {
        let (status, v) = abort(&c, &sim, body).await;
        assert_eq!((status, v), (200, json!({"aborted": 0})), "{body}");
    }
    let evs = read_rest(r, buf).await;
    let n = evs.len();
    assert_eq!(evs[n - 1].1, "[DONE]");
    let last = json_of(&evs[n - 3].1);
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{evs:?}");

    // a normal request without abort is untouched by an unknown rid
    let r = spawn_post(
        &c,
        &sim,
        "/v1/chat/completions",
        with_rid(chat("x", 5, false), "fine"),
    );
    assert_eq!(
        abort(&c, &sim, r#"{"rid": "other"}"#).await.1,
        json!({"aborted": 0})
    );
    let r = within("normal request", r).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // malformed bodies
    for body in [
        "{not json",
        "",
        "[1]",
        r#"{"rid": 5}"#,
        r#"{"rid": ["a"]}"#,
        r#"{"abort_all": "yes"}"#,
    ] {
        let (status, v) = abort(&c, &sim, body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let r = c
        .get(format!("{}/abort_request", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // a non-string rid in an inference body
    let mut batch = chat("x", 2, false);
    batch["rid"] = json!(["a", "b"]);
    let cases = [
        ("/v1/chat/completions", batch),
        ("/v1/completions", json!({"prompt": "x", "rid": 7})),
        ("/v1/responses", json!({"input": "x", "rid": {"a": 1}})),
        (
            "/v1/messages",
            json!({"messages": [], "max_tokens": 2, "rid": ["a", "b"]}),
        ),
    ];
    for (path, body) in cases {
        let r = post(&c, &sim, path, &body).await;
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r.json().await.unwrap();
        if path == "/v1/messages" {
            assert_eq!(v["type"], "error", "{v}");
        }
        let msg = v["error"]["message"].as_str().unwrap();
        if body["rid"].is_array() {
            assert!(
                msg.contains("batched requests (rid arrays)"),
                "{path}: {msg}"
            );
        } else {
            assert!(msg.starts_with("rid must be a string"), "{path}: {msg}");
        }
    }

    // a client that goes away unregisters its request
    let mut r = within(
        "stream headers",
        spawn_post(
            &c,
            &sim,
            "/v1/chat/completions",
            with_rid(chat("x", 100_000, true), "gone"),
        ),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    read_until(&mut r, &mut buf, "\"content\":\"").await;
    drop(r);
    eventually(|| async { sim.stats().running == 0 }).await;
    assert_eq!(
        abort(&c, &sim, r#"{"abort_all": true}"#).await,
        (200, json!({"aborted": 0}))
    );
    let st = sim.stats();
    assert_eq!(
        (st.requests_aborted, st.aborted_by_request, st.kv_usage),
        (1, 0, 0.0)
    );
    sim.stop().await;
}
