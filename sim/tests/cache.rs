//! Prefix caching through the HTTP API.

mod common;

use std::time::Instant;

use common::*;
use engine_sim::SimConfig;
use serde_json::json;

#[tokio::test]
async fn repeat_and_shared_prefix() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let p = text(1, 2000);
    // "<|user|>\n" + 2000 bytes + "\n" = 2010 bytes = 503 tokens
    let v = chat_json(&c, &sim, &p, 4).await;
    assert_eq!(v["usage"]["prompt_tokens"], 503);
    assert_eq!(cached(&v), 0);
    let v = chat_json(&c, &sim, &p, 4).await;
    assert_eq!(cached(&v), 496, "31 full blocks of 16 tokens hit");

    // same 2000-byte prefix, different tail: only whole shared blocks hit
    let q = format!("{}{}", p, text(2, 1000));
    let v = chat_json(&c, &sim, &q, 4).await;
    let hit = cached(&v);
    assert!((480..=2009 / 4).contains(&hit), "shared prefix hit {hit}");
    assert_eq!(hit % 16, 0);
    // and now q itself is cached
    let v = chat_json(&c, &sim, &q, 4).await;
    assert!(cached(&v) > hit);

    // multi-turn: the second turn extends the first conversation
    let sys = text(3, 1500);
    let turn1 = json!({"messages": [
        {"role": "system", "content": sys},
        {"role": "user", "content": "first question"}], "max_tokens": 3});
    let r: serde_json::Value = post(&c, &sim, "/v1/chat/completions", &turn1)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(cached(&r), 0);
    let answer = r["choices"][0]["message"]["content"].as_str().unwrap();
    let turn2 = json!({"messages": [
        {"role": "system", "content": sys},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "second question"}], "max_tokens": 3});
    let r: serde_json::Value = post(&c, &sim, "/v1/chat/completions", &turn2)
        .await
        .json()
        .await
        .unwrap();
    assert!(
        cached(&r) >= 368,
        "system prompt blocks hit: {}",
        cached(&r)
    );

    // the same conversation over the Anthropic API shares the cache
    let m = json!({"system": sys, "max_tokens": 2,
        "messages": [{"role": "user", "content": "first question"}]});
    let r: serde_json::Value = post(&c, &sim, "/v1/messages", &m)
        .await
        .json()
        .await
        .unwrap();
    assert!(r["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= 368);

    // vLLM's /reset_prefix_cache drops it
    let st = c
        .post(format!("{}/reset_prefix_cache", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(st.status(), 200);
    let v = chat_json(&c, &sim, &p, 4).await;
    assert_eq!(cached(&v), 0);
    sim.stop().await;
}

#[tokio::test]
async fn lru_eviction_when_full() {
    // 64 blocks of 16 tokens; each prompt below needs 30 full blocks + 1
    let sim = sim(SimConfig {
        kv_blocks: 64,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let (a, b, d) = (text(10, 1920), text(11, 1920), text(12, 1920));
    for p in [&a, &b] {
        assert_eq!(cached(&chat_json(&c, &sim, p, 1).await), 0);
    }
    assert_eq!(cached(&chat_json(&c, &sim, &a, 1).await), 480, "a cached");
    assert_eq!(cached(&chat_json(&c, &sim, &b, 1).await), 480, "b cached");
    assert_eq!(sim.stats().cached_blocks, 60);
    // d does not fit next to a and b: the least recently used (a) is evicted
    assert_eq!(cached(&chat_json(&c, &sim, &d, 1).await), 0);
    assert!(sim.stats().evicted_blocks >= 27);
    assert_eq!(cached(&chat_json(&c, &sim, &b, 1).await), 480, "b survived");
    let a_hit = cached(&chat_json(&c, &sim, &a, 1).await);
    assert!(a_hit < 100, "a was evicted (tail first), hit {a_hit}");
    let st = sim.stats();
    assert!(st.cached_blocks <= 64);
    assert_eq!(st.kv_usage, 0.0, "nothing running");
    sim.stop().await;
}

#[tokio::test]
async fn cache_tokens_bound_the_prefix_cache_not_the_pool() {
    // A large pool, but idle blocks are kept for 40 blocks (640 tokens) only: one prompt
    // of 30 full blocks stays cached, two do not.
    let sim = sim(SimConfig {
        kv_blocks: 1024,
        cache_tokens: 640,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let (a, b) = (text(20, 1920), text(21, 1920));
    assert_eq!(cached(&chat_json(&c, &sim, &a, 1).await), 0);
    assert_eq!(cached(&chat_json(&c, &sim, &a, 1).await), 480, "a cached");
    assert_eq!(cached(&chat_json(&c, &sim, &b, 1).await), 0);
    assert!(sim.stats().cached_blocks <= 40);
    assert!(sim.stats().evicted_blocks >= 20);
    assert_eq!(cached(&chat_json(&c, &sim, &b, 1).await), 480, "b cached");
    let a_hit = cached(&chat_json(&c, &sim, &a, 1).await);
    assert!(a_hit < 480, "a lost its tail to b, hit {a_hit}");
    sim.stop().await;
}

#[tokio::test]
async fn cache_hit_cuts_prefill_time() {
    // 8000-token prompt at 8000 tok/s = 1 s of prefill (250 ms at scale 4)
    let sim = sim(SimConfig {
        time_scale: 4.0,
        ..fast_cfg()
    })
    .await;
    let c = client();
    let p = text(20, 32000);
    let ttft = |c: reqwest::Client, url: String, p: String| async move {
        let t0 = Instant::now();
        let r = c
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat(&p, 2, true))
            .send()
            .await
            .unwrap();
        let evs = read_sse(r).await.unwrap();
        evs[1].at - t0
    };
    let cold = ttft(c.clone(), sim.url(), p.clone()).await;
    let warm = ttft(c.clone(), sim.url(), p.clone()).await;
    assert!(cold.as_millis() >= 200, "cold TTFT {cold:?}");
    assert!(warm * 3 < cold, "warm {warm:?} vs cold {cold:?}");
    sim.stop().await;
}

/// A request queued behind a long prefill keeps its cached prefix only where the engine admits
/// it at once (the default); with `admit_at_prefill` (vLLM's and SGLang's behaviour) it is
/// looked up when its own prefill starts, after the long prompt finished and pushed it out.
#[tokio::test]
async fn a_queued_request_keeps_its_prefix_only_when_admitted_at_once() {
    for lazy in [false, true] {
        // One 30-block prompt stays cached (40 idle blocks at most); the long prompt takes
        // 16k tokens at 8k tokens/s: 2 s of prefill at scale 1.
        let sim = sim(SimConfig {
            kv_blocks: 4096,
            cache_tokens: 640,
            time_scale: 1.0,
            admit_at_prefill: lazy,
            ..fast_cfg()
        })
        .await;
        let c = client();
        let a = text(30, 1920);
        assert_eq!(cached(&chat_json(&c, &sim, &a, 1).await), 0);
        // The long prompt, one output token: it finishes when its prefill does, and its
        // blocks then fill the cache. `a` again is sent while it prefills.
        let long_prompt = text(31, 64000);
        let long = chat_json(&c, &sim, &long_prompt, 1);
        let again = async {
            eventually(|| async { sim.stats().running > 0 }).await;
            chat_json(&c, &sim, &a, 1).await
        };
        let (long, again) = tokio::join!(long, again);
        assert_eq!(cached(&long), 0);
        if lazy {
            assert_eq!(
                cached(&again),
                0,
                "looked up after the long prompt evicted it"
            );
        } else {
            assert_eq!(cached(&again), 480, "admitted at once: its prefix was kept");
        }
        sim.stop().await;
    }
}
