use super::*;
use engine_sim::{Faults, SimConfig, SimHandle};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn targets(names: &[&str]) -> Vec<TargetCriteria> {
    names
        .iter()
        .map(|n| TargetCriteria {
            name: n.to_string(),
            criteria: None,
        })
        .collect()
}

const GREETING: &str = "Write a one-line greeting card.";
const PROOF: &str =
    "Prove that there are infinitely many primes, then implement the proof sketch in Python.";

fn seed_spec() -> DecisionSpec {
    DecisionSpec::new(
        "Route each request to the model that fits it best.",
        vec![
            TargetCriteria {
                name: "qwen3-0.6b".into(),
                criteria: Some(
                    "short factual questions, greetings, small talk, simple one-line writing"
                        .into(),
                ),
            },
            TargetCriteria {
                name: "qwen3-32b".into(),
                criteria: Some(
                    "reasoning, math, proofs, prove, code, programming, python, implement, \
                     algorithms"
                        .into(),
                ),
            },
        ],
    )
}

#[test]
fn answer_exact_and_trimmed() {
    let t = targets(&["qwen3-0.6b", "qwen3-32b"]);
    assert_eq!(parse_answer("qwen3-32b", &t), Some(1));
    assert_eq!(parse_answer("  QWEN3-0.6B \n", &t), Some(0));
    assert_eq!(parse_answer("\"qwen3-32b\".", &t), Some(1));
    assert_eq!(parse_answer("`qwen3-0.6b`", &t), Some(0));
    assert_eq!(parse_answer("**qwen3-32b**", &t), Some(1));
    assert_eq!(
        parse_answer("<think>\nqwen3-0.6b? no.\n</think>\nqwen3-32b", &t),
        Some(1)
    );
    assert_eq!(parse_answer("2", &t), Some(1));
    assert_eq!(parse_answer("3", &t), None);
    assert_eq!(parse_answer("", &t), None);
    assert_eq!(parse_answer(" .. ", &t), None);
}

#[test]
fn answer_contained() {
    let t = targets(&["qwen3-0.6b", "qwen3-32b"]);
    assert_eq!(parse_answer("The best target is qwen3-32b.", &t), Some(1));
    assert_eq!(parse_answer("1. qwen3-0.6b", &t), Some(0));
    assert_eq!(parse_answer("Target: QWEN3-0.6B (small)", &t), Some(0));
    // two different names: ambiguous
    assert_eq!(parse_answer("qwen3-32b or qwen3-0.6b", &t), None);
    // the same name twice is fine
    assert_eq!(parse_answer("qwen3-32b, definitely qwen3-32b", &t), Some(1));
    // filler text names nothing
    assert_eq!(
        parse_answer("the model is a simulated engine that streams", &t),
        None
    );
}

#[test]
fn answer_longest_name_wins() {
    let t = targets(&["qwen3-3", "qwen3-32b", "qwen3"]);
    assert_eq!(parse_answer("use qwen3-32b", &t), Some(1));
    assert_eq!(parse_answer("use qwen3-3", &t), Some(0));
    assert_eq!(parse_answer("use qwen3 please", &t), Some(2));
    assert_eq!(parse_answer("qwen3-32b, not qwen3", &t), None);
    // whole words only: gpt-4 is not in gpt-4o
    let t = targets(&["gpt-4", "small"]);
    assert_eq!(parse_answer("gpt-4o", &t), None);
    assert_eq!(parse_answer("smaller", &t), None);
    assert_eq!(parse_answer("gpt-4, of course", &t), Some(0));
    // duplicate names: the first
    let t = targets(&["a-model", "A-Model"]);
    assert_eq!(parse_answer("a-model", &t), Some(0));
    assert_eq!(parse_answer("so: a-model", &t), Some(0));
}

#[test]
fn system_prompt_format() {
    let mut spec = seed_spec();
    spec.targets.push(TargetCriteria {
        name: "other\nname".into(),
        criteria: Some("multi\nline".into()),
    });
    assert_eq!(
        system_prompt(&spec),
        "Route each request to the model that fits it best.\n\nTargets:\n\
         1. qwen3-0.6b: short factual questions, greetings, small talk, simple one-line writing\n\
         2. qwen3-32b: reasoning, math, proofs, prove, code, programming, python, implement, algorithms\n\
         3. other name: multi line\n\n\
         Answer with exactly one target name from the list and nothing else."
    );
    let no_instr = DecisionSpec::new("  ", targets(&["x"]));
    assert_eq!(
        system_prompt(&no_instr),
        "Targets:\n1. x: the model `x`\n\n".to_string() + ANSWER_RULE
    );
}

#[test]
fn generated_criteria_hint_sizes() {
    assert_eq!(size_from_name("qwen3-32b"), Some(32.0));
    assert_eq!(size_from_name("Qwen3-0.6B-Instruct"), Some(0.6));
    assert_eq!(size_from_name("smollm-135m"), Some(0.135));
    assert_eq!(size_from_name("llama-3.1-70b"), Some(70.0));
    assert_eq!(size_from_name("gpt-4o-mini"), None);
    assert_eq!(size_from_name("jev-latest"), None);
    let g = generated_criteria(&targets(&["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "gpt-x"]));
    assert!(g[0].starts_with("the model `qwen3-0.6b`, about 0.6B parameters: the smallest"));
    assert_eq!(g[1], "the model `qwen3-8b`, about 8B parameters");
    assert!(g[2].contains("the largest listed") && g[2].contains("proofs and code"));
    assert_eq!(g[3], "the model `gpt-x`");
    // one size only: no hint
    let g = generated_criteria(&targets(&["a-7b", "b-7b"]));
    assert_eq!(g[0], "the model `a-7b`, about 7B parameters");
    // configured criteria win over generated ones
    let p = system_prompt(&seed_spec());
    assert!(!p.contains("the model `"));
}

#[test]
fn request_body_shape() {
    let p = Provider {
        name: "dec".into(),
        base_url: "http://127.0.0.1:1/v1/".into(),
        api_key: None,
        model: "jev-latest".into(),
    };
    assert_eq!(p.chat_url(), "http://127.0.0.1:1/v1/chat/completions");
    let long = "é".repeat(MAX_REQUEST_CHARS + 10);
    let b = request_body(&p, &seed_spec(), &long);
    assert_eq!(b["model"], "jev-latest");
    assert_eq!(b["max_tokens"], MAX_ANSWER_TOKENS);
    assert_eq!(b["temperature"], 0);
    assert_eq!(b["stream"], false);
    assert_eq!(b["messages"][0]["role"], "system");
    assert_eq!(b["messages"][0]["content"], system_prompt(&seed_spec()));
    assert_eq!(b["messages"][1]["role"], "user");
    let sent = b["messages"][1]["content"].as_str().unwrap();
    assert_eq!(sent.chars().count(), MAX_REQUEST_CHARS);
}

#[test]
fn request_text_takes_the_last_user_turn() {
    let p = "<|tools|>\n[]\n<|system|>\nbe nice\n<|user|>\nfirst\n<|assistant|>\nok\n<|user|>\n Prove it.\nline two \n";
    assert_eq!(request_text(p), "Prove it.\nline two");
    let p = "<|system|>\ns\n<|user|>\nq <|x|> inline\n<|assistant|>\na\n";
    assert_eq!(request_text(p), "q <|x|> inline");
    // Responses API with instructions and a string input: no user marker
    assert_eq!(request_text("<|system|>\nS\nthe input"), "S\nthe input");
    // completions: the raw prompt
    assert_eq!(request_text("  raw prompt "), "raw prompt");
    let long = "x".repeat(MAX_REQUEST_CHARS * 2);
    assert_eq!(request_text(&long).len(), MAX_REQUEST_CHARS);
    assert_eq!(truncate_chars("héllo", 2), "hé");
}

#[test]
fn answer_text_shapes() {
    let ok = br#"{"choices":[{"message":{"role":"assistant","content":"qwen3-32b"}}]}"#;
    assert_eq!(answer_text(ok).unwrap(), "qwen3-32b");
    let parts =
        br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"text":"b"}]}}]}"#;
    assert_eq!(answer_text(parts).unwrap(), "ab");
    let null = br#"{"choices":[{"message":{"content":null}}]}"#;
    assert_eq!(answer_text(null).unwrap(), "");
    assert!(answer_text(b"not json").is_err());
    assert!(answer_text(br#"{"choices":[]}"#).is_err());
    assert!(answer_text(br#"{"choices":[{"message":{"content":5}}]}"#).is_err());
}

// ---- against engine-sim and a scripted server on 127.0.0.1:0 ----

fn sim_cfg(decision_mode: bool) -> SimConfig {
    SimConfig {
        id: "decider".into(),
        model: "jev-latest".into(),
        time_scale: 20.0,
        decision_mode,
        ..SimConfig::default()
    }
}

fn provider_for(sim: &SimHandle) -> Provider {
    Provider {
        name: "jev".into(),
        base_url: format!("{}/v1", sim.url()),
        api_key: Some("sk-test".into()),
        model: "jev-latest".into(),
    }
}

#[tokio::test]
async fn decision_model_routes_the_seed_examples() {
    let sim = engine_sim::spawn_local(sim_cfg(true)).await.unwrap();
    let p = provider_for(&sim);
    let c = DecisionClient::new();
    let spec = seed_spec();
    let (o, latency) = c.decide(&p, &spec, GREETING).await;
    assert_eq!(o, DecisionOutcome::Target(0), "{o}");
    assert!(latency > Duration::ZERO && latency < spec.timeout);
    let (o, _) = c.decide(&p, &spec, PROOF).await;
    assert_eq!(o, DecisionOutcome::Target(1), "{o}");
    assert_eq!(o.label(), "target");
    // generated criteria (sizes from the names) route the same way
    let generated = DecisionSpec::new("", targets(&["qwen3-0.6b", "qwen3-32b"]));
    assert_eq!(
        c.decide(&p, &generated, GREETING).await.0,
        DecisionOutcome::Target(0)
    );
    assert_eq!(
        c.decide(&p, &generated, PROOF).await.0,
        DecisionOutcome::Target(1)
    );
    // through the gateway's rendering of a multi-turn chat
    let rendered = format!(
        "<|system|>\nyou help\n<|user|>\n{GREETING}\n<|assistant|>\nok\n<|user|>\n{PROOF}\n"
    );
    let (o, _) = c.decide(&p, &spec, request_text(&rendered)).await;
    assert_eq!(o, DecisionOutcome::Target(1));
    sim.stop().await;
}

#[tokio::test]
async fn filler_answer_abstains_with_no_target() {
    let sim = engine_sim::spawn_local(sim_cfg(false)).await.unwrap();
    let (o, _) = DecisionClient::new()
        .decide(&provider_for(&sim), &seed_spec(), GREETING)
        .await;
    match &o {
        DecisionOutcome::Abstain(AbstainReason::NoTarget(a)) => {
            assert!(!a.is_empty() && !a.contains("qwen3"), "{a:?}")
        }
        other => panic!("expected NoTarget, got {other:?}"),
    }
    assert_eq!(o.label(), "no_target");
    sim.stop().await;
}

#[tokio::test]
async fn stalled_provider_times_out() {
    let c = DecisionClient::new();
    let mut spec = seed_spec();
    spec.timeout = Duration::from_millis(200);
    for faults in [
        Faults {
            stall_ms: 60_000,
            ..Faults::default()
        },
        Faults {
            first_byte_delay_ms: 60_000,
            ..Faults::default()
        },
    ] {
        let sim = engine_sim::spawn_local(SimConfig {
            faults,
            ..sim_cfg(true)
        })
        .await
        .unwrap();
        let (o, latency) = c.decide(&provider_for(&sim), &spec, PROOF).await;
        assert_eq!(o, DecisionOutcome::Abstain(AbstainReason::Timeout));
        assert_eq!(o.label(), "timeout");
        // Bounded by the spec's timeout (the outcome says so), not by a stopwatch here.
        assert!(latency >= spec.timeout, "{latency:?}");
        sim.stop().await;
    }
}

#[tokio::test]
async fn provider_errors_abstain() {
    let c = DecisionClient::new();
    let spec = seed_spec();
    // 503 from the engine
    let sim = engine_sim::spawn_local(SimConfig {
        faults: Faults {
            error_rate: 1.0,
            ..Faults::default()
        },
        ..sim_cfg(true)
    })
    .await
    .unwrap();
    let (o, _) = c.decide(&provider_for(&sim), &spec, PROOF).await;
    match &o {
        DecisionOutcome::Abstain(AbstainReason::Error(e)) => assert!(e.contains("503"), "{e}"),
        other => panic!("expected Error, got {other:?}"),
    }
    assert_eq!(o.label(), "error");
    // unknown model: 404
    let mut p = provider_for(&sim);
    p.model = "nope".into();
    sim.set_faults(Faults::default());
    let (o, _) = c.decide(&p, &spec, PROOF).await;
    assert!(
        matches!(o, DecisionOutcome::Abstain(AbstainReason::Error(ref e)) if e.contains("404")),
        "{o}"
    );
    // connection reset
    sim.set_faults(Faults {
        refuse: true,
        ..Faults::default()
    });
    let (o, _) = c.decide(&provider_for(&sim), &spec, PROOF).await;
    assert_eq!(o.label(), "error", "{o}");
    sim.stop().await;
    // no targets: no call at all
    let empty = DecisionSpec::new("x", vec![]);
    assert_eq!(c.decide(&p, &empty, PROOF).await.0.label(), "error");
}

/// Serves one HTTP/1.1 request with `status` and `body`; returns the raw request.
async fn one_shot(
    status: &'static str,
    body: &'static str,
) -> (String, tokio::task::JoinHandle<String>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "client closed early");
            buf.extend_from_slice(&chunk[..n]);
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut req = httparse::Request::new(&mut headers);
            if let Ok(httparse::Status::Complete(head)) = req.parse(&buf) {
                let len: usize = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                    .unwrap_or(0);
                if buf.len() >= head + len {
                    break;
                }
            }
        }
        let resp = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).await.unwrap();
        String::from_utf8(buf).unwrap()
    });
    (url, task)
}

#[tokio::test]
async fn sends_bearer_and_parses_a_real_shaped_answer() {
    let (url, task) = one_shot(
        "200 OK",
        r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"<think>\n\n</think>\n\nqwen3-32b"},"finish_reason":"stop"}]}"#,
    )
    .await;
    let p = Provider {
        name: "jev".into(),
        base_url: url,
        api_key: Some("sk-secret".into()),
        model: "jev-latest".into(),
    };
    let (o, _) = DecisionClient::new().decide(&p, &seed_spec(), PROOF).await;
    assert_eq!(o, DecisionOutcome::Target(1));
    let req = task.await.unwrap();
    assert!(
        req.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
        "{req}"
    );
    assert!(
        req.to_ascii_lowercase()
            .contains("authorization: bearer sk-secret\r\n"),
        "{req}"
    );
    let body: Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body, request_body(&p, &seed_spec(), PROOF));
}

#[tokio::test]
async fn bad_json_and_no_key() {
    let (url, task) = one_shot("200 OK", "{not json").await;
    let p = Provider {
        name: "jev".into(),
        base_url: url,
        api_key: None,
        model: "m".into(),
    };
    let (o, _) = DecisionClient::new()
        .decide(&p, &seed_spec(), GREETING)
        .await;
    assert!(
        matches!(o, DecisionOutcome::Abstain(AbstainReason::Error(ref e)) if e.contains("not JSON")),
        "{o}"
    );
    let req = task.await.unwrap();
    assert!(
        !req.to_ascii_lowercase().contains("authorization:"),
        "{req}"
    );
}
