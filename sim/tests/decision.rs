//! Decision mode: the rule-based stand-in for the decision service's model.

mod common;

use common::*;
use engine_sim::SimConfig;
use serde_json::{json, Value};

/// The target list in the format tokengate's decision client sends.
const SYSTEM: &str = "Route each request to the model that fits it best.\n\nTargets:\n\
1. qwen3-0.6b: short factual questions, greetings, small talk, simple one-line writing\n\
2. qwen3-32b: reasoning, math, proofs, prove, code, programming, python, implement, algorithms\n\n\
Answer with exactly one target name from the list and nothing else.";

const GREETING: &str = "Write a one-line greeting card.";
const PROOF: &str =
    "Prove that there are infinitely many primes, then implement the proof sketch in Python.";

fn decision_cfg() -> SimConfig {
    SimConfig {
        decision_mode: true,
        ..fast_cfg()
    }
}

fn body(user: &str, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "an earlier turn about math proofs"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": user},
        ],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

async fn answer(c: &reqwest::Client, sim: &engine_sim::SimHandle, user: &str) -> Value {
    let r = post(c, sim, "/v1/chat/completions", &body(user, false)).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test]
async fn seed_examples_pick_the_expected_model() {
    let sim = sim(decision_cfg()).await;
    let c = client();
    for (user, want) in [(GREETING, "qwen3-0.6b"), (PROOF, "qwen3-32b")] {
        let v = answer(&c, &sim, user).await;
        assert_eq!(v["choices"][0]["message"]["content"], want, "{user}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // usage as usual: the answer's length at 4 bytes per token
        let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(completion, want.len().div_ceil(4) as u64);
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            v["usage"]["total_tokens"].as_u64().unwrap(),
            prompt + completion
        );
    }
    sim.stop().await;
}

#[tokio::test]
async fn streamed_answer_concatenates_to_the_name() {
    let sim = sim(decision_cfg()).await;
    let c = client();
    for (user, want) in [(GREETING, "qwen3-0.6b"), (PROOF, "qwen3-32b")] {
        let r = post(&c, &sim, "/v1/chat/completions", &body(user, true)).await;
        assert_eq!(r.status(), 200);
        let evs = read_sse(r).await.unwrap();
        assert_eq!(evs.last().unwrap().data, "[DONE]");
        let mut text = String::new();
        let mut finish = None;
        for e in &evs[..evs.len() - 1] {
            let v = e.json();
            if let Some(ch) = v["choices"].get(0) {
                text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
                if let Some(f) = ch["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            } else {
                assert_eq!(
                    v["usage"]["completion_tokens"].as_u64().unwrap(),
                    want.len().div_ceil(4) as u64
                );
            }
        }
        assert_eq!(text, want);
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    sim.stop().await;
}

#[tokio::test]
async fn other_apis_and_truncation() {
    let sim = sim(decision_cfg()).await;
    let c = client();
    // Anthropic Messages: `system` field
    let r = post(
        &c,
        &sim,
        "/v1/messages",
        &json!({"model": "sim-model", "system": SYSTEM, "max_tokens": 16,
                "messages": [{"role": "user", "content": PROOF}]}),
    )
    .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["content"][0]["text"], "qwen3-32b");
    // Responses: `instructions` + string input
    let r = post(
        &c,
        &sim,
        "/v1/responses",
        &json!({"model": "sim-model", "instructions": SYSTEM, "input": GREETING}),
    )
    .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["output"][0]["content"][0]["text"], "qwen3-0.6b");
    // max_tokens below the answer's length cuts it, like a real model
    let mut b = body(PROOF, false);
    b["max_tokens"] = json!(1);
    let v: Value = post(&c, &sim, "/v1/chat/completions", &b)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "qwen");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    sim.stop().await;
}

#[tokio::test]
async fn no_target_list_or_normal_mode_gives_filler() {
    // decision mode without a target list: answered normally
    let sim = sim(decision_cfg()).await;
    let c = client();
    let v = chat_json(&c, &sim, GREETING, 3).await;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 3, "{text:?}");
    sim.stop().await;
    // normal mode ignores the target list
    let sim = common::sim(fast_cfg()).await;
    let v = answer(&c, &sim, GREETING).await;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.contains("qwen3"), "{text:?}");
    assert_eq!(text.split(' ').count(), 16);
    sim.stop().await;
}

#[test]
fn rule_scores() {
    use engine_sim::decision::{choose, parse_targets, scores};
    let targets = parse_targets(SYSTEM);
    assert_eq!(targets.len(), 2);
    // greeting: write~writing, one, line, greeting~greetings
    assert_eq!(scores(&targets, GREETING), [4, 0]);
    // proof: prove, proof~proofs, implement, python
    assert_eq!(scores(&targets, PROOF), [0, 4]);
    assert_eq!(choose(SYSTEM, PROOF).as_deref(), Some("qwen3-32b"));
}

#[test]
fn cli_flag() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: engine_sim::SimArgs,
    }
    assert!(
        Cli::parse_from(["x", "--decision-mode"])
            .sim
            .into_config()
            .decision_mode
    );
    assert!(!Cli::parse_from(["x"]).sim.into_config().decision_mode);
}
