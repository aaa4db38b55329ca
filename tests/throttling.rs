//! Request throttling through the real binary: slot limits per instance or per service,
//! reject (429 at once) or a FIFO queue (timeout 503, overflow 429, clients leaving), with
//! engine-sim's own peak of requests in their prefill phase as the judge.

mod common;

use common::*;
use std::time::Duration;

async fn slow_sim(id: &str, prefill_tps: f64) -> engine_sim::SimHandle {
    engine_sim::spawn_local(engine_sim::SimConfig {
        id: id.into(),
        model: "m".into(),
        prefill_tps,
        time_scale: 1.0,
        decode_step_ms: 2.0,
        decode_per_req_ms: 0.0,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn body(prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": 2,
        "messages": [{"role": "user", "content": prompt}]})
}

fn gw(throttling: &str, fleet: &[engine_sim::SimHandle], extra: &str) -> GatewayProc {
    GatewayProc::start(&format!(
        "services:\n  - name: m\n    throttling: {throttling}\n{extra}{}",
        sim_instances(fleet)
    ))
}

/// A stream request that sits in its prefill phase until dropped (a long prompt on a slow
/// engine); returns once its header arrived, i.e. it holds a slot.
async fn hold(c: &reqwest::Client, gw: &GatewayProc, tag: &str) -> reqwest::Response {
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body(&words(tag, 4000), true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

async fn queued(gw: &GatewayProc) -> u64 {
    gw.instances().await["throttles"][0]["queued"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_engine_ever_prefills_more_than_the_limit_and_the_queue_serves_everyone() {
    // Prefill at 20k tok/s: each 2 KB prompt prefills in ~25 ms; 24 concurrent streams
    // against 2 engines with at most 2 requests in prefill each.
    let fleet = vec![
        slow_sim("e1", 20_000.0).await,
        slow_sim("e2", 20_000.0).await,
    ];
    let gw = gw("{overflow: queue, prefill: 2}", &fleet, "");
    let c = reqwest::Client::new();
    let reqs: Vec<_> = (0..24)
        .map(|i| {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            let b = body(&words(&format!("r{i}x"), 400), true);
            tokio::spawn(async move {
                let r = c.post(url).json(&b).send().await.unwrap();
                let status = r.status();
                let text = r.text().await.unwrap();
                (status, text)
            })
        })
        .collect();
    for r in reqs {
        let (status, text) = r.await.unwrap();
        assert_eq!(status, 200, "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    for s in &fleet {
        let st = s.stats();
        assert!(
            st.max_prefill_phase <= 2,
            "engine {} had {} requests in prefill at once (limit 2)",
            s.id(),
            st.max_prefill_phase
        );
        assert!(st.requests_finished > 0);
    }
    let v = gw.wait_idle().await;
    assert_eq!(v["throttles"][0]["queued"], 0, "{v:#}");
    let m = gw.metrics().await;
    assert!(
        m.contains("tokengate_throttle_queue_wait_seconds_count{service=\"m\"}"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_answers_429_at_once_in_the_clients_api_shape() {
    let fleet = vec![slow_sim("e1", 400.0).await];
    let gw = gw(
        "{overflow: reject, prefill: 1, retry_after: 3s}",
        &fleet,
        "",
    );
    let c = reqwest::Client::new();
    let held = hold(&c, &gw, "h").await;
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("hello", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "3");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("throttling limits"));
    // Anthropic clients get Anthropic's shape.
    let r = c
        .post(gw.url("/v1/messages"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    drop(held);
    gw.wait_idle().await;
    // The slot is back: the next request is served.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("hello", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_throttle_rejections_total{reason=\"limit\",service=\"m\"}"
        ),
        Some(2.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_are_served_in_arrival_order() {
    let fleet = vec![slow_sim("e1", 400.0).await];
    let gw = gw("{overflow: queue, prefill: 1}", &fleet, "");
    let c = reqwest::Client::new();
    let held = hold(&c, &gw, "h").await;
    // Five requests join the queue one after the other.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..5u64 {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .json(&body(&format!("q{i}"), false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            tx.send(i).unwrap();
        }));
        eventually("the request to be queued", || async {
            queued(&gw).await == i + 1
        })
        .await;
    }
    drop(held);
    let mut order = Vec::new();
    for _ in 0..5 {
        order.push(rx.recv().await.unwrap());
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_overflow_and_leaving_clients_end_clean() {
    let fleet = vec![slow_sim("e1", 400.0).await];
    let gw = gw(
        "{overflow: queue, prefill: 1, max_queue: 2, queue_timeout: 300ms}",
        &fleet,
        "",
    );
    let c = reqwest::Client::new();
    let held = hold(&c, &gw, "h").await;
    // Timeout: 503 with a message that names the setting.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("late", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("throttling.queue_timeout"),
        "{v}"
    );
    // A client that hangs up while queued leaves the queue.
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    assert!(short
        .post(gw.url("/v1/chat/completions"))
        .json(&body("impatient", false))
        .send()
        .await
        .is_err());
    eventually("the leaving client to leave the queue", || async {
        queued(&gw).await == 0
    })
    .await;
    // Overflow: two wait (the queue's bound), the third is refused at once.
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let c = reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap();
            let url = gw.url("/v1/chat/completions");
            tokio::spawn(async move {
                c.post(url)
                    .json(&body(&format!("w{i}"), false))
                    .send()
                    .await
            })
        })
        .collect();
    eventually("two waiters", || async { queued(&gw).await == 2 }).await;
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body("third", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_queue"),
        "{v}"
    );
    for w in waiters {
        // They time out too (the slot is still held).
        assert_eq!(w.await.unwrap().unwrap().status(), 503);
    }
    drop(held);
    let v = gw.wait_idle().await;
    assert_eq!(v["throttles"][0]["queued"], 0);
    assert_eq!(v["throttles"][0]["service_slots_in_use"]["prefill"], 0);
    let m = gw.metrics().await;
    for (reason, n) in [("queue_timeout", 3.0), ("queue_full", 1.0)] {
        assert_eq!(
            metric(
                &m,
                &format!(
                    "tokengate_throttle_rejections_total{{reason=\"{reason}\",service=\"m\"}}"
                )
            ),
            Some(n),
            "{m}"
        );
    }
}

/// Instance scope checks each instance alone; service scope the combined load against
/// limit × instances. With strict affinity pinning every request to one instance, service
/// scope lets two prefill there at once; instance scope never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_and_service_scope_give_different_answers() {
    for (scope, want_peak_on_bound) in [("service", 2), ("instance", 1)] {
        let fleet = vec![slow_sim("e1", 400.0).await, slow_sim("e2", 400.0).await];
        let gw = gw(
            &format!("{{overflow: reject, scope: {scope}, prefill: 1}}"),
            &fleet,
            "    scheduler: {mode: layered, affinity: {mode: strict}}\n",
        );
        let c = reqwest::Client::new();
        let send = |tag: &'static str| {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            async move {
                c.post(url)
                    .header("x-session-id", "pinned")
                    .json(&body(&words(tag, 4000), true))
                    .send()
                    .await
                    .unwrap()
            }
        };
        let a = send("a").await;
        assert_eq!(a.status(), 200);
        let bound = a.headers()["x-tokengate-instance"]
            .to_str()
            .unwrap()
            .to_string();
        let b = send("b").await;
        assert_eq!(b.status(), 200, "{scope}");
        let b_inst = b.headers()["x-tokengate-instance"]
            .to_str()
            .unwrap()
            .to_string();
        let bound_sim = fleet.iter().find(|s| s.id() == bound).unwrap();
        eventually("both requests at the engines", || async {
            fleet.iter().map(|s| s.stats().prefill_phase).sum::<usize>() == 2
        })
        .await;
        assert_eq!(
            bound_sim.stats().max_prefill_phase,
            want_peak_on_bound,
            "{scope}: b went to {b_inst}"
        );
        if scope == "instance" {
            assert_ne!(
                b_inst, bound,
                "instance scope: the full instance is no candidate"
            );
            assert_eq!(b.headers()["x-tokengate-reason"], "affinity-rebind");
        } else {
            assert_eq!(b_inst, bound, "service scope: strict affinity keeps it");
        }
        // A third request exceeds both scopes' limits (2 slots in all): refused.
        let r3 = send("c").await;
        assert_eq!(r3.status(), 429, "{scope}");
        drop((a, b));
        gw.wait_idle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_bodies_and_retries_keep_slots_exact() {
    // e1 answers 503 to everything: each request is retried on e2, taking a slot there after
    // giving back e1's.
    let e1 = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        faults: engine_sim::Faults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    let e2 = slow_sim("e2", 4000.0).await;
    let fleet = vec![e1, e2];
    let gw = gw(
        "{overflow: queue, prefill: 1}",
        &fleet,
        "    load_balancing: round-robin\n",
    );
    let c = reqwest::Client::new();
    for i in 0..4 {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&body(&format!("retry {i}"), false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-tokengate-instance"], "e2");
        r.bytes().await.unwrap();
        gw.wait_idle().await;
    }
    // A 70 KB prompt (the subrequest path) waits in the queue behind a held slot on e2
    // (a 60k-token prompt: 15 s of prefill, until dropped).
    let held = c
        .post(gw.url("/v1/chat/completions"))
        .json(&body(&words("h", 40_000), true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    assert_eq!(held.headers()["x-tokengate-instance"], "e2");
    let big = serde_json::json!({"model": "m", "max_tokens": 2,
        "messages": [{"role": "user", "content": "x".repeat(70_000)}]});
    let url = gw.url("/v1/chat/completions");
    let c2 = c.clone();
    let waiter = tokio::spawn(async move { c2.post(url).json(&big).send().await.unwrap() });
    eventually("the big request to queue", || async {
        queued(&gw).await == 1
    })
    .await;
    drop(held);
    let r = waiter.await.unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    let v = gw.wait_idle().await;
    assert_eq!(v["throttles"][0]["queued"], 0, "{v:#}");
}

/// One engine-sim `e1` serving `m` whose prefill is near-instant and whose decode steps take
/// `step_ms` each, whatever the batch (the engine drops a disconnected request at a step).
async fn stepping_engine(step_ms: f64) -> engine_sim::SimHandle {
    engine_sim::spawn_local(engine_sim::SimConfig {
        id: "e1".into(),
        model: "m".into(),
        prefill_tps: 100_000.0,
        time_scale: 1.0,
        decode_step_ms: step_ms,
        decode_per_req_ms: 0.0,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A slot is held until the engine lets go of the request, not merely until its client left:
/// `total: 1`, stream A decoding, B queued, A's client hangs up. The engine notices a
/// disconnected request only at its next decode step (100 ms here, as a real engine checks
/// between steps); B must not reach it before, so the engine never runs two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_does_not_let_the_engine_exceed_the_limit() {
    let fleet = vec![stepping_engine(100.0).await];
    let gw = gw(
        "{overflow: queue, total: 1, queue_timeout: 30s}",
        &fleet,
        "",
    );
    let c = reqwest::Client::new();
    let long = |tag: &str| {
        serde_json::json!({"model": "m", "stream": true, "max_tokens": 300,
            "messages": [{"role": "user", "content": tag}]})
    };
    for round in 0..3 {
        // A: decoding (a few tokens arrived).
        let a = c
            .post(gw.url("/v1/chat/completions"))
            .json(&long(&format!("a{round}")))
            .send()
            .await
            .unwrap();
        assert_eq!(a.status(), 200);
        let mut a = a.bytes_stream();
        let mut seen = 0;
        while seen < 3 {
            use futures_util::StreamExt;
            let chunk = a.next().await.unwrap().unwrap();
            seen += chunk.windows(5).filter(|w| w == b"data:").count();
        }
        // B: queued behind A.
        let b = {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            let body = body(&format!("b{round}"), false);
            tokio::spawn(async move { c.post(url).json(&body).send().await })
        };
        eventually("B in the queue", || async { queued(&gw).await == 1 }).await;
        // A's client hangs up.
        drop(a);
        let r = b.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        gw.wait_idle().await;
        let st = fleet[0].stats();
        assert!(
            st.max_running <= 1,
            "round {round}: the engine ran {} requests at once against a limit of 1 (stats: {st:?})",
            st.max_running
        );
        // A was aborted by the engine, not run to its end.
        assert_eq!(st.requests_aborted, round + 1, "{st:?}");
    }
}

/// The overload run of issue 27: three times as many streaming clients as slots
/// (`total: 4`), every tenth one hanging up after its first tokens; the engine's own peak
/// batch never exceeds the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_overload_with_clients_giving_up_the_engine_batch_stays_within_the_limit() {
    let fleet = vec![stepping_engine(25.0).await];
    let gw = gw(
        "{overflow: queue, total: 4, queue_timeout: 60s}",
        &fleet,
        "",
    );
    let c = reqwest::Client::new();
    let clients: Vec<_> = (0..12)
        .map(|k| {
            let c = c.clone();
            let url = gw.url("/v1/chat/completions");
            tokio::spawn(async move {
                let mut gave_up = 0;
                for i in 0..6 {
                    let n = k * 6 + i;
                    let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 12,
                        "messages": [{"role": "user", "content": format!("r{n}")}]});
                    let r = c.post(&url).json(&body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    let mut s = r.bytes_stream();
                    use futures_util::StreamExt;
                    if n % 10 == 3 {
                        // Gives up after its first tokens.
                        let _ = s.next().await;
                        gave_up += 1;
                        continue;
                    }
                    while let Some(chunk) = s.next().await {
                        chunk.unwrap();
                    }
                }
                gave_up
            })
        })
        .collect();
    let mut gave_up = 0;
    for h in clients {
        gave_up += h.await.unwrap();
    }
    assert_eq!(gave_up, 7);
    gw.wait_idle().await;
    let st = fleet[0].stats();
    assert!(
        st.max_running <= 4,
        "the engine ran {} requests at once against a limit of 4 ({st:?})",
        st.max_running
    );
    assert_eq!(st.requests_finished + st.requests_aborted, 72, "{st:?}");
}
