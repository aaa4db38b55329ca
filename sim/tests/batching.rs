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
    let (min, max) = (ttfts[0], ttfts[5]);
    assert!(
        max >= Duration::from_millis(150),
        "last wave waited: {ttfts:?}"
    );
    assert!(max > min * 3, "TTFT rises with queueing: {ttfts:?}");
    assert!(sim.stats().max_waiting >= 3);
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
    let tasks: Vec<_> = (0..16)
        .map(|i| tokio::spawn(stream_times(c.clone(), sim.url(), format!("batch {i}"), 12)))
        .collect();
    let mut itls = Vec::new();
    for t in tasks {
        itls.push(itl(&t.await.unwrap().1));
    }
    itls.sort();
    let median = itls[8];
    // expected ~7 ms vs ~82 ms
    assert!(alone < Duration::from_millis(40), "alone {alone:?}");
    assert!(
        median > alone * 3,
        "batched ITL {median:?} vs alone {alone:?}"
    );
    assert!(
        median >= Duration::from_millis(40),
        "batched ITL {median:?}"
    );
    sim.stop().await;
}
