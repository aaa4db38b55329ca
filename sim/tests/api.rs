//! All four APIs, stream and non-stream, plus the auxiliary endpoints.

mod common;

use common::*;
use serde_json::{json, Value};

fn assert_openai_usage(u: &Value, completion: u64) {
    let p = u["prompt_tokens"].as_u64().unwrap();
    assert!(p > 0);
    assert_eq!(u["completion_tokens"].as_u64().unwrap(), completion);
    assert_eq!(u["total_tokens"].as_u64().unwrap(), p + completion);
    assert!(
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            < p
    );
}

#[tokio::test]
async fn chat_completions() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let r = post(
        &c,
        &sim,
        "/v1/chat/completions",
        &chat("hello there", 5, false),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 5, "one word per token: {text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_openai_usage(&v["usage"], 5);
    // "<|user|>\nhello there\n" = 21 bytes = 6 tokens
    assert_eq!(v["usage"]["prompt_tokens"], 6);

    // stream with usage
    let r = post(
        &c,
        &sim,
        "/v1/chat/completions",
        &chat("hello there", 5, true),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let evs = read_sse(r).await.unwrap();
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = evs[..evs.len() - 1].iter().map(Sse::json).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: Vec<&Value> = chunks[1..chunks.len() - 1].iter().collect();
    assert_eq!(content.len(), 5, "one chunk per token");
    let mut streamed = String::new();
    for ch in &content {
        assert_eq!(ch["object"], "chat.completion.chunk");
        streamed.push_str(ch["choices"][0]["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(streamed, text, "deterministic text");
    assert_eq!(content[4]["choices"][0]["finish_reason"], "length");
    assert!(content[3]["choices"][0]["finish_reason"].is_null());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_openai_usage(&last["usage"], 5);

    // stream without include_usage: no usage chunk
    let mut body = chat("hello there", 3, true);
    body.as_object_mut().unwrap().remove("stream_options");
    let evs = read_sse(post(&c, &sim, "/v1/chat/completions", &body).await)
        .await
        .unwrap();
    assert_eq!(evs.len(), 1 + 3 + 1);
    assert!(evs.iter().all(|e| !e.data.contains("\"usage\"")));

    // no max_tokens: default output length, finish_reason stop
    let v: Value = post(
        &c,
        &sim,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // x-sim-output-tokens overrides max_tokens
    let v: Value = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .header("x-sim-output-tokens", "3")
        .json(&chat("hi", 50, false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    sim.stop().await;
}

#[tokio::test]
async fn completions() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let body = json!({"model": "sim-model", "prompt": "abcdefgh", "max_tokens": 4});
    let v: Value = post(&c, &sim, "/v1/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_openai_usage(&v["usage"], 4);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();

    let body = json!({"model": "sim-model", "prompt": "abcdefgh", "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true}});
    let evs = read_sse(post(&c, &sim, "/v1/completions", &body).await)
        .await
        .unwrap();
    assert_eq!(evs.len(), 4 + 1 + 1);
    assert_eq!(evs[5].data, "[DONE]");
    let streamed: String = evs[..4]
        .iter()
        .map(|e| e.json()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);
    assert_openai_usage(&evs[4].json()["usage"], 4);

    // token-id prompts count one token per id
    let body = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 1});
    let v: Value = post(&c, &sim, "/v1/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    sim.stop().await;
}

#[tokio::test]
async fn responses_api() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let body = json!({"model": "sim-model", "instructions": "be brief",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        "max_output_tokens": 6});
    let v: Value = post(&c, &sim, "/v1/responses", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "response");
    let text = v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(text.split(' ').count(), 6);
    let u = &v["usage"];
    assert_eq!(u["output_tokens"], 6);
    assert!(u["input_tokens"].as_u64().unwrap() > 0);
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64());

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post(&c, &sim, "/v1/responses", &sbody).await;
    assert_eq!(r.status(), 200);
    let evs = read_sse(r).await.unwrap();
    let names: Vec<&str> = evs.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(names[0], "response.created");
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "response.output_text.delta")
            .count(),
        6
    );
    let last = evs.last().unwrap();
    assert!(matches!(
        last.event.as_deref(),
        Some("response.completed") | Some("response.incomplete")
    ));
    let mut streamed = String::new();
    for (seq, e) in evs.iter().enumerate() {
        let j = e.json();
        assert_eq!(
            j["type"],
            e.event.as_deref().unwrap(),
            "type matches event name"
        );
        assert_eq!(j["sequence_number"], seq);
        if j["type"] == "response.output_text.delta" {
            streamed.push_str(j["delta"].as_str().unwrap());
        }
    }
    assert_eq!(streamed, text);
    let fin = last.json();
    assert_eq!(fin["response"]["usage"]["output_tokens"], 6);
    assert_eq!(
        fin["response"]["output"][0]["content"][0]["text"],
        text.as_str()
    );
    assert!(!evs.iter().any(|e| e.data == "[DONE]"));

    // string input, no max_output_tokens
    let v: Value = post(&c, &sim, "/v1/responses", &json!({"input": "hi"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "completed");
    assert_eq!(v["usage"]["output_tokens"], 8);
    sim.stop().await;
}

#[tokio::test]
async fn anthropic_messages() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let body = json!({"model": "sim-model", "system": "you are terse", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]});
    let v: Value = post(&c, &sim, "/v1/messages", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["stop_reason"], "max_tokens");
    let text = v["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["usage"]["output_tokens"], 4);
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 0);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let evs = read_sse(post(&c, &sim, "/v1/messages", &sbody).await)
        .await
        .unwrap();
    let names: Vec<&str> = evs.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let mut streamed = String::new();
    for e in &evs {
        let j = e.json();
        assert_eq!(j["type"], e.event.as_deref().unwrap());
        if j["type"] == "content_block_delta" {
            assert_eq!(j["delta"]["type"], "text_delta");
            streamed.push_str(j["delta"]["text"].as_str().unwrap());
        }
    }
    assert_eq!(streamed, text);
    let start = evs[0].json();
    assert_eq!(
        start["message"]["usage"]["input_tokens"],
        v["usage"]["input_tokens"]
    );
    let md = evs[7].json();
    assert_eq!(md["delta"]["stop_reason"], "max_tokens");
    assert_eq!(md["usage"]["output_tokens"], 4);

    // missing max_tokens is an Anthropic-shaped 400
    let r = post(&c, &sim, "/v1/messages", &json!({"messages": []})).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    sim.stop().await;
}

#[tokio::test]
async fn errors_and_aux_endpoints() {
    let sim = sim(fast_cfg()).await;
    let c = client();
    let url = sim.url();
    // bad JSON
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], 400);
    assert!(e["error"]["message"].is_string());
    // wrong model
    let mut body = chat("x", 1, false);
    body["model"] = json!("other-model");
    let r = post(&c, &sim, "/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "NotFoundError");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("other-model"));
    // too long
    let r = post(&c, &sim, "/v1/chat/completions", &chat("x", 1 << 20, false)).await;
    assert_eq!(r.status(), 400);
    // unknown path, wrong method
    let r = c.get(format!("{url}/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    let r = c
        .get(format!("{url}/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    // health, models, SGLang probes, metrics
    let r = c.get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-engine-id"], "sim-test");
    let v: Value = c
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "sim-model");
    for p in ["/get_model_info", "/model_info"] {
        let v: Value = c
            .get(format!("{url}{p}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["model_path"], "sim-model");
        assert_eq!(v["is_generation"], true);
    }
    let v: Value = c
        .get(format!("{url}/get_server_info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["tokenizer_path"], "sim-model");
    assert_eq!(v["page_size"], 16);
    let r = c.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    for name in [
        "vllm:num_requests_running{model_name=\"sim-model\"}",
        "vllm:num_requests_waiting{model_name=\"sim-model\"}",
        "vllm:kv_cache_usage_perc{model_name=\"sim-model\"}",
        "vllm:prefix_cache_queries_total{model_name=\"sim-model\"}",
        "vllm:prefix_cache_hits_total{model_name=\"sim-model\"}",
        "vllm:prompt_tokens_total{model_name=\"sim-model\"}",
        "vllm:generation_tokens_total{model_name=\"sim-model\"}",
        "vllm:request_success_total{model_name=\"sim-model\",finished_reason=\"length\"}",
        "vllm:time_to_first_token_seconds_bucket{model_name=\"sim-model\",le=\"+Inf\"}",
        "vllm:time_to_first_token_seconds_count{model_name=\"sim-model\"}",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing:\n{text}"
        );
    }
    sim.stop().await;
}

#[tokio::test]
async fn stop_closes_port() {
    let sim = sim(fast_cfg()).await;
    let addr = sim.addr;
    assert!(tokio::net::TcpStream::connect(addr).await.is_ok());
    sim.stop().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn cli_args_parse() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: engine_sim::SimArgs,
    }
    let cli = Cli::parse_from([
        "x",
        "--listen",
        "127.0.0.1:9999",
        "--kv-blocks",
        "10",
        "--error-rate",
        "0.5",
        "--close-after-chunks",
        "3",
    ]);
    let cfg = cli.sim.into_config();
    assert_eq!(cfg.id, "127.0.0.1:9999");
    assert_eq!(cfg.kv_blocks, 10);
    assert_eq!(cfg.faults.error_rate, 0.5);
    assert_eq!(cfg.faults.error_status, 503);
    assert_eq!(cfg.faults.close_after_chunks, Some(3));
    assert_eq!(cfg.block_size, 16);
}
