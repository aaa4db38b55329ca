//! Continuous batching: waiting queue and step time growing with the batch.

mod common;

use std::time::{Duration, Instant};

use common::*;
use engine_sim::SimConfig;

async fn stream_times(
    c: reqwest::Client,
    url: String,
    prompt: String,
    tokens: u64,
) -> (Duration, Vec<Instant>) {
    let t0 = Instant::now();
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat(&prompt, tokens, true))
        .send()
        .await
        .unwrap();
    let evs = read_sse(r).await.unwrap();
    // evs[0] = role chunk, then one chunk per token, usage, [DONE]
    let toks: Vec<Instant> = evs[1..1 + tokens as usize].iter().map(|e| e.at).collect();
    (toks[0] - t0, toks)
}

#[tokio::test]
async fn waiting_queue_raises_ttft() {
    let sim = sim(SimConfig {
        max_running: 2,
        time_scale: 1.0,
        decode_step_ms: 6.0,
        decode_per_req_ms: 0.0,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let tasks: Vec<_> = (0..6)
        .map(|i| tokio::spawn(stream_times(c.clone(), sim.url(), format!("req {i}"), 20)))
        .collect();
    // 3 waves of ~120 ms: the queue is visible in /metrics meanwhile
    eventually(|| {
        let c = c.clone();
        let sim = &sim;
        async move { metric(&c, sim, "vllm:num_requests_waiting{").await > 0.0 }
    })
    .await;
    assert!(metric(&c, &sim, "vllm:num_requests_running{").await <= 2.0);
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.push(t.await.unwrap().0);
    }
    ttfts.sort();
    // Lower bounds only (a loaded machine stretches time, it never shrinks it): the last
    // wave waited for two waves of 20 steps of 6 ms.
    assert!(
        ttfts[5] >= Duration::from_millis(150),
        "last wave waited: {ttfts:?}"
    );
    // The engine's own counters: the batch never exceeded its cap, the rest queued.
    let st = sim.stats();
    assert!(st.max_waiting >= 3, "{st:?}");
    assert!(st.max_running <= 2, "{st:?}");
    assert!(st.max_prefill_phase >= 3, "{st:?}");
    assert_eq!(metric(&c, &sim, "vllm:num_requests_waiting{").await, 0.0);
    sim.stop().await;
}

#[tokio::test]
async fn step_time_grows_with_batch() {
    // step = 2 ms + 5 ms per running request
    let sim = sim(SimConfig {
        time_scale: 1.0,
        decode_step_ms: 2.0,
        decode_per_req_ms: 5.0,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let itl = |toks: &[Instant]| (toks[toks.len() - 1] - toks[0]) / (toks.len() as u32 - 1);
    let (_, alone) = stream_times(c.clone(), sim.url(), "solo".into(), 12).await;
    let alone = itl(&alone);
    // Alone: every step was 2 + 5 × 1 ms (the engine's own record, not a stopwatch).
    assert_eq!(sim.stats().max_step_ms, 7.0);
    assert!(alone >= Duration::from_millis(6), "alone {alone:?}");
    let tasks: Vec<_> = (0..16)
        .map(|i| tokio::spawn(stream_times(c.clone(), sim.url(), format!("batch {i}"), 12)))
        .collect();
    let mut itls = Vec::new();
    for t in tasks {
        itls.push(itl(&t.await.unwrap().1));
    }
    itls.sort();
    let median = itls[8];
    // Batched: the steps grew with the batch (2 + 5 ms per running request; all 16 in one
    // batch make 82 ms) …
    let st = sim.stats();
    assert!(st.max_running >= 5 && st.max_running <= 16, "{st:?}");
    assert!(
        st.max_step_ms >= 22.0 && st.max_step_ms <= 2.0 + 5.0 * st.max_running as f64,
        "{st:?}"
    );
    // … and the clients saw it (a lower bound: load only stretches time).
    assert!(
        median >= Duration::from_millis(40),
        "batched ITL {median:?}"
    );
    sim.stop().await;
}
