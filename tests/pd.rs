//! Prefill/decode disaggregation through the real binary, against engine-sim prefill and
//! decode fleets speaking SGLang's (Mooncake bootstrap rooms) and vLLM's (NIXL
//! kv_transfer_params) protocols. The engines are the judges: a decode only answers when it
//! received the KV of its own prompt from the prefill it was told about.

mod common;

use common::*;
use engine_sim::{Faults, PdMode, Role, SimConfig, SimHandle};
use std::time::Duration;

async fn sim(id: &str, role: Role, mode: PdMode, f: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut c = SimConfig {
        id: id.into(),
        model: "m".into(),
        time_scale: 20.0,
        role,
        pd_mode: mode,
        bootstrap_port: (role == Role::Prefill && mode == PdMode::Sglang).then_some(0),
        pd_timeout_ms: 30_000,
        ..Default::default()
    };
    f(&mut c);
    engine_sim::spawn_local(c).await.unwrap()
}

/// A fleet of `p` prefill and `d` decode engine-sims, ids p1.. and d1...
async fn fleet(p: usize, d: usize, mode: PdMode) -> (Vec<SimHandle>, Vec<SimHandle>) {
    let mut ps = Vec::new();
    for i in 1..=p {
        ps.push(sim(&format!("p{i}"), Role::Prefill, mode, |_| {}).await);
    }
    let mut ds = Vec::new();
    for i in 1..=d {
        ds.push(sim(&format!("d{i}"), Role::Decode, mode, |_| {}).await);
    }
    (ps, ds)
}

fn instances(ps: &[SimHandle], ds: &[SimHandle]) -> String {
    let mut s = String::from("    instances:\n");
    for h in ps {
        let bp = h
            .bootstrap_addr()
            .map_or(String::new(), |a| format!(", bootstrap_port: {}", a.port()));
        s.push_str(&format!(
            "      - {{id: {}, addr: \"{}\", role: prefill{bp}}}\n",
            h.id(),
            h.addr
        ));
    }
    for h in ds {
        s.push_str(&format!(
            "      - {{id: {}, addr: \"{}\", role: decode}}\n",
            h.id(),
            h.addr
        ));
    }
    s
}

fn mode_name(mode: PdMode) -> &'static str {
    match mode {
        PdMode::Sglang => "sglang-mooncake",
        PdMode::Vllm => "vllm-nixl",
    }
}

fn gateway(mode: PdMode, ps: &[SimHandle], ds: &[SimHandle], extra: &str) -> GatewayProc {
    GatewayProc::start(&format!(
        "passive_health: {{max_failures: 100}}\nservices:\n  - name: m\n    scheduler: {{mode: layered}}\n    pd: {{mode: {}, decode_policy: least-request}}\n{extra}{}",
        mode_name(mode),
        instances(ps, ds)
    ))
}

fn body(prompt: &str, stream: bool, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}]})
}

struct Answer {
    status: u16,
    pair: String,
    reason: String,
    text: String,
}

async fn ask(c: &reqwest::Client, gw: &GatewayProc, b: &serde_json::Value) -> Answer {
    let r = c
        .post(gw.url("/v1/chat/completions"))
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
    let (pair, reason) = (h("x-tokengate-instance"), h("x-tokengate-reason"));
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    Answer {
        status,
        pair,
        reason,
        text,
    }
}

fn by_id<'a>(hs: &'a [SimHandle], id: &str) -> &'a SimHandle {
    hs.iter().find(|h| h.id() == id).unwrap()
}

/// Every instance's load back to zero.
async fn assert_idle(gw: &GatewayProc) {
    let v = gw.wait_idle().await;
    for i in v["instances"].as_array().unwrap() {
        assert_eq!(i["inflight_requests"], 0, "{i}");
        assert_eq!(i["waiting"], 0, "{i}");
        assert_eq!(i["inflight_tokens"], 0, "{i}");
    }
}

async fn pair_streams_and_the_prefix_cache_keeps_the_prefill(mode: PdMode) {
    let (ps, ds) = fleet(2, 2, mode).await;
    let gw = gateway(mode, &ps, &ds, "");
    let c = reqwest::Client::new();
    let prompt = words("shared-prefix-", 600);
    let mut prefill_of = None;
    for turn in 0..4 {
        let a = ask(&c, &gw, &body(&prompt, true, 12)).await;
        assert_eq!(a.status, 200, "{}", a.text);
        // The decode's stream reaches the client unchanged: chunks, usage, [DONE].
        assert!(a.text.contains("chat.completion.chunk"), "{}", a.text);
        assert!(a.text.trim_end().ends_with("data: [DONE]"), "{}", a.text);
        let (p, d) = a.pair.split_once('+').expect("x-tokengate-instance is p+d");
        assert!(p.starts_with('p') && d.starts_with('d'), "{}", a.pair);
        assert!(a.reason.contains("+decode(least-request)"), "{}", a.reason);
        // The prefix cache lives on the prefill side: the repeated prompt stays there.
        match &prefill_of {
            None => prefill_of = Some(p.to_string()),
            Some(first) => {
                assert_eq!(p, first, "turn {turn}: {}", a.reason);
                assert!(a.reason.starts_with("prefix("), "{}", a.reason);
            }
        }
    }
    // The engines agree: the chosen prefill handed over 4 KV caches, and computed the prompt
    // once (its cache served the repeats); the other prefill saw nothing.
    let p = prefill_of.unwrap();
    let chosen = by_id(&ps, &p).stats();
    assert_eq!(chosen.pd_prefills_published, 4);
    assert_eq!(chosen.pd_transfers_sent, 4);
    assert!(chosen.prefix_cache_hits > 0, "{chosen:?}");
    let other = ps.iter().find(|h| h.id() != p).unwrap().stats();
    assert_eq!(other.pd_prefills_published, 0);
    let received: u64 = ds.iter().map(|h| h.stats().pd_transfers_received).sum();
    assert_eq!(received, 4);
    assert!(ds.iter().all(|h| h.stats().prefill_computed_tokens == 0));
    // A non-stream request too.
    let a = ask(&c, &gw, &body(&words("unary", 50), false, 5)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    let v: serde_json::Value = serde_json::from_str(&a.text).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_idle(&gw).await;
    let m = gw.metrics().await;
    let ok: f64 = ps
        .iter()
        .filter_map(|h| {
            metric(
                &m,
                &format!(
                    "tokengate_pd_prefill_total{{instance=\"{}\",outcome=\"ok\"}}",
                    h.id()
                ),
            )
        })
        .sum();
    assert_eq!(ok, 5.0, "{m}");
    let inst = gw.instances().await;
    let roles: Vec<&str> = inst["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["prefill", "prefill", "decode", "decode"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pair_streams_the_decode_and_the_prefix_cache_keeps_the_prefill() {
    pair_streams_and_the_prefix_cache_keeps_the_prefill(PdMode::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pair_streams_the_decode_and_the_prefix_cache_keeps_the_prefill() {
    pair_streams_and_the_prefix_cache_keeps_the_prefill(PdMode::Vllm).await;
}

/// One prefill always fails: every request still succeeds (a new pair, a fresh room), the
/// failed prefill is counted, the decode waiting for the failed room is aborted at once
/// (SGLang) — not after its 30 s KV timeout — and every counter returns to zero.
async fn a_failing_prefill_is_retried_on_a_new_pair(mode: PdMode) {
    let bad = sim("p1", Role::Prefill, mode, |c| {
        c.faults = Faults {
            error_rate: 1.0,
            error_status: 500,
            ..Default::default()
        };
    })
    .await;
    let good = sim("p2", Role::Prefill, mode, |_| {}).await;
    let d = sim("d1", Role::Decode, mode, |_| {}).await;
    let ps = vec![bad, good];
    let ds = vec![d];
    // Round-robin over the prefills: the failing one is picked every other request.
    let gw = GatewayProc::start(&format!(
        "passive_health: {{max_failures: 100}}\nservices:\n  - name: m\n    load_balancing: round-robin\n    pd: {{mode: {}}}\n{}",
        mode_name(mode),
        instances(&ps, &ds)
    ));
    let c = reqwest::Client::new();
    for i in 0..4 {
        let a = ask(&c, &gw, &body(&words(&format!("r{i}-"), 80), true, 4)).await;
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!(a.pair, "p2+d1");
    }
    let m = gw.metrics().await;
    let failed = metric(
        &m,
        "tokengate_pd_prefill_total{instance=\"p1\",outcome=\"error\"}",
    )
    .unwrap_or(0.0);
    assert!(failed >= 2.0, "{m}");
    assert_eq!(ds[0].stats().pd_transfers_received, 4);
    assert_idle(&gw).await;
    eventually("the decode engine idle", || async {
        let s = ds[0].stats();
        s.pd_awaiting_kv == 0 && s.running == 0
    })
    .await;
    // The decodes of the failed rooms were aborted, none waited out its KV timeout.
    assert_eq!(ds[0].stats().pd_transfer_timeouts, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_failing_prefill_is_retried_on_a_new_pair() {
    a_failing_prefill_is_retried_on_a_new_pair(PdMode::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_failing_prefill_is_retried_on_a_new_pair() {
    a_failing_prefill_is_retried_on_a_new_pair(PdMode::Vllm).await;
}

/// The decode engine holds nothing any more, and no request there waited out its KV
/// timeout (the gateway aborted it). The engine's 30 s KV timeout is the test deadline's
/// length: a decode left to it fails this either way.
async fn decode_ended_without_timeout(d: &SimHandle) {
    eventually("the decode engine idle", || async {
        let s = d.stats();
        s.pd_awaiting_kv == 0 && s.running == 0
    })
    .await;
    assert_eq!(d.stats().pd_transfer_timeouts, 0);
}

/// Failure paths that cannot be retried end clean: no prefill left (502 in the client's API
/// shape), a prefill's 4xx (the client's bad request), a decode that dies mid-stream (the
/// stream ends), a dead decode instance with another one left (retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_path_ends_clean_with_counters_at_zero() {
    let mode = PdMode::Sglang;
    let p = sim("p1", Role::Prefill, mode, |c| {
        c.max_model_len = 4000;
    })
    .await;
    let d = sim("d1", Role::Decode, mode, |_| {}).await;
    let (ps, ds) = (vec![p], vec![d]);
    let gw = gateway(mode, &ps, &ds, "");
    let c = reqwest::Client::new();

    // A prompt too long for the prefill: its 400 is the answer, at once.
    let a = ask(&c, &gw, &body(&words("long", 3000), true, 4)).await;
    assert_eq!(a.status, 400, "{}", a.text);
    assert!(a.text.contains("prefill instance p1 failed"), "{}", a.text);
    assert!(a.text.contains("maximum context length"), "{}", a.text);
    assert_idle(&gw).await;
    decode_ended_without_timeout(&ds[0]).await;

    // The prefill fails with a server error, nothing else to try: a clean 502.
    ps[0].update_faults(|f| {
        f.error_rate = 1.0;
        f.error_status = 503;
    });
    let a = ask(&c, &gw, &body(&words("x", 50), true, 4)).await;
    // The decode waiting for that room was aborted, not left to its 30 s KV timeout.
    decode_ended_without_timeout(&ds[0]).await;
    assert!(
        a.status == 502 || a.status == 503,
        "{} {}",
        a.status,
        a.text
    );
    let v: serde_json::Value = serde_json::from_str(&a.text).unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("p1"),
        "{v}"
    );
    assert_idle(&gw).await;
    ps[0].update_faults(|f| *f = Faults::default());

    // The decode dies mid-stream: the client's stream ends (cut short: no [DONE]), nothing
    // hangs.
    ds[0].update_faults(|f| f.close_after_chunks = Some(2));
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body(&words("y", 50), true, 40))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(20), async {
        let mut r = r;
        let mut text = String::new();
        while let Ok(Some(c)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        text
    })
    .await
    .expect("the stream ends");
    assert!(!text.contains("[DONE]"), "{text}");
    ds[0].update_faults(|f| *f = Faults::default());
    assert_idle(&gw).await;
    eventually("the engines idle", || async {
        let (p, d) = (ps[0].stats(), ds[0].stats());
        p.running == 0 && p.pd_kv_pinned == 0 && d.running == 0 && d.pd_awaiting_kv == 0
    })
    .await;

    // A healthy request afterwards.
    let a = ask(&c, &gw, &body(&words("z", 50), true, 4)).await;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_idle(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_instance_is_retried_with_a_fresh_room() {
    let mode = PdMode::Sglang;
    let p = sim("p1", Role::Prefill, mode, |_| {}).await;
    let d = sim("d2", Role::Decode, mode, |_| {}).await;
    let dead = dead_addr();
    let bp = p.bootstrap_addr().unwrap().port();
    let gw = GatewayProc::start(&format!(
        "passive_health: {{max_failures: 100}}\nhealth_check: {{enabled: false}}\nservices:\n  - name: m\n    load_balancing: round-robin\n    pd: {{mode: sglang-mooncake, decode_policy: round-robin}}\n    instances:\n      - {{id: p1, addr: \"{}\", role: prefill, bootstrap_port: {bp}}}\n      - {{id: d1, addr: \"{dead}\", role: decode}}\n      - {{id: d2, addr: \"{}\", role: decode}}\n",
        p.addr, d.addr
    ));
    let c = reqwest::Client::new();
    for i in 0..4 {
        let a = ask(&c, &gw, &body(&words(&format!("q{i}-"), 60), true, 4)).await;
        assert_eq!(a.status, 200, "{}", a.text);
        assert_eq!(a.pair, "p1+d2");
    }
    assert_eq!(d.stats().pd_transfers_received, 4);
    assert_idle(&gw).await;
    // The prefills whose decode never came were aborted, not left pinned.
    eventually("no KV pinned on the prefill", || async {
        p.stats().pd_kv_pinned == 0
    })
    .await;
    // The aborted prefills are counted when their abort completes (after the answers).
    eventually("an aborted prefill counted", || async {
        metric(
            &gw.metrics().await,
            "tokengate_pd_prefill_total{instance=\"p1\",outcome=\"aborted\"}",
        )
        .unwrap_or(0.0)
            >= 1.0
    })
    .await;
}

/// Decode limits hold under concurrent load: 12 streams against 2 decode nodes limited to 2
/// requests each (queue mode); the decode engines' own peak batch is the judge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_limits_hold_under_concurrent_load() {
    let mode = PdMode::Vllm;
    let (ps, ds) = fleet(1, 2, mode).await;
    let gw = gateway(
        mode,
        &ps,
        &ds,
        "    throttling: {overflow: queue, decode: 2, prefill: 8}\n",
    );
    let c = reqwest::Client::new();
    let reqs: Vec<_> = (0..12)
        .map(|i| {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            let b = body(&words(&format!("c{i}-"), 100), true, 30);
            tokio::spawn(async move {
                let r = c.post(url).json(&b).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    for r in reqs {
        let (status, text) = r.await.unwrap();
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("[DONE]"));
    }
    for d in &ds {
        let s = d.stats();
        assert!(s.max_running <= 2, "{}: {s:?}", d.id());
        assert!(s.requests_finished > 0, "{}: {s:?}", d.id());
    }
    assert_idle(&gw).await;
    let inst = gw.instances().await;
    let d1 = inst["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == "d1")
        .unwrap()
        .clone();
    assert_eq!(d1["slots"]["limits"]["decode"], 2, "{d1}");
}

/// A prompt above Pingora's 64 KiB retry buffer goes through the big-body path, in both
/// protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_above_64_kib_work() {
    for mode in [PdMode::Sglang, PdMode::Vllm] {
        let (ps, ds) = fleet(1, 1, mode).await;
        let gw = gateway(mode, &ps, &ds, "");
        let c = reqwest::Client::new();
        let prompt = words("big", 14_000);
        assert!(prompt.len() > 100 * 1024);
        let a = ask(&c, &gw, &body(&prompt, true, 4)).await;
        assert_eq!(a.status, 200, "{mode:?}: {}", a.text);
        assert_eq!(a.pair, "p1+d1");
        assert_eq!(ds[0].stats().pd_transfers_received, 1);
        assert_idle(&gw).await;
    }
}

#[test]
fn bad_pd_config_names_the_yaml_path() {
    let check = |yaml: &str, want: &str| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["check", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let out = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(out.contains(want), "want {want:?} in:\n{out}");
    };
    check(
        "services:\n  - name: m\n    pd: {mode: sglang-mooncake}\n    instances:\n      - {id: p1, addr: \"127.0.0.1:1\", role: prefill}\n      - {id: d1, addr: \"127.0.0.1:2\", role: decode}\n",
        "services[0].instances[0].bootstrap_port: required",
    );
    check(
        "services:\n  - name: m\n    pd: {mode: vllm-nixl}\n    instances:\n      - {id: p1, addr: \"127.0.0.1:1\", role: prefill}\n",
        "needs at least one prefill and one decode instance",
    );
    check(
        "services:\n  - name: m\n    instances:\n      - {id: p1, addr: \"127.0.0.1:1\", role: prefill}\n",
        "services[0].instances[0].role: instances have roles only",
    );
    check(
        "services:\n  - name: m\n    pd: {mode: mooncake}\n    instances:\n      - {id: p1, addr: \"127.0.0.1:1\", role: prefill}\n",
        "services[0].pd.mode",
    );
    check(
        "services:\n  - name: m\n    pd: {mode: vllm-nixl}\n    throttling: {total: 3}\n    instances:\n      - {id: p1, addr: \"127.0.0.1:1\", role: prefill}\n      - {id: d1, addr: \"127.0.0.1:2\", role: decode}\n",
        "services[0].throttling.total: not counted",
    );
}
