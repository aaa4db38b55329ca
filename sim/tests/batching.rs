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

/// A stream decoding while a long prompt arrives; returns the stream's largest token gap.
async fn decode_beside_a_long_prefill(sim: &engine_sim::SimHandle) -> Duration {
    let c = client();
    let a = tokio::spawn(stream_times(c.clone(), sim.url(), "short".into(), 40));
    // Once the short one is decoding (its prompt prefilled, its first tokens out), send a
    // 4,000-token prompt (16,000 bytes).
    eventually(|| {
        let s = sim.stats();
        async move { s.running == 1 && s.prefill_phase == 0 && s.generation_tokens > 0 }
    })
    .await;
    let (ttft_b, _) = stream_times(c.clone(), sim.url(), text(7, 16_000), 2).await;
    // 4,000 tokens at 10,000 tokens/s: 400 ms of prefill whatever the mode.
    assert!(ttft_b >= Duration::from_millis(400), "{ttft_b:?}");
    let (_, toks) = a.await.unwrap();
    toks.windows(2).map(|w| w[1] - w[0]).max().unwrap()
}

#[tokio::test]
async fn chunked_prefill_stalls_the_decode_steps() {
    let cfg = SimConfig {
        time_scale: 1.0,
        prefill_tps: 10_000.0,
        decode_step_ms: 5.0,
        decode_per_req_ms: 0.0,
        ..fast_cfg()
    };
    // Default: prefill runs beside the decode steps, which stay 5 ms.
    let beside = sim(cfg.clone()).await;
    decode_beside_a_long_prefill(&beside).await;
    let st = beside.stats();
    assert_eq!(st.max_step_ms, 5.0, "{st:?}");
    assert_eq!(st.mixed_steps, 0, "{st:?}");
    assert!(st.decode_steps >= 40, "{st:?}");
    beside.stop().await;
    // Shared compute, chunks of 1,000 tokens (100 ms): while the long prompt is prefilled
    // every step carries a chunk, so the stream's token gaps grow to 5 + 100 ms.
    let shared = sim(SimConfig {
        prefill_chunk_tokens: 1000,
        ..cfg
    })
    .await;
    let gap = decode_beside_a_long_prefill(&shared).await;
    let st = shared.stats();
    assert_eq!(st.max_step_ms, 105.0, "{st:?}");
    assert!(st.mixed_steps >= 3, "{st:?}");
    assert!(
        gap >= Duration::from_millis(100),
        "largest token gap {gap:?}"
    );
    shared.stop().await;
}
