//! Unit tests of the parsing and the stream's events.

use super::*;
use crate::engine::Usage;
use serde_json::Value;

#[test]
fn chat_rendering() {
    let p = parse(
        Api::Chat,
        br#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_tokens":5}"#,
    )
    .unwrap();
    assert_eq!(p.prompt, b"<|system|>\nS\n<|user|>\nab\n");
    assert_eq!(p.max_tokens, Some(5));
    // the same conversation via the Anthropic API renders identically
    let q = parse(
        Api::Messages,
        br#"{"model":"m","system":"S","messages":[{"role":"user","content":"ab"}],"max_tokens":5}"#,
    )
    .unwrap();
    assert_eq!(p.prompt, q.prompt);
    let r = parse(Api::Responses, br#"{"instructions":"S","input":"ab"}"#).unwrap();
    assert_eq!(p.prompt, r.prompt);
}

#[test]
fn chat_role_chunk_is_valid_json() {
    let meta = Meta {
        api: Api::Chat,
        id: "chatcmpl-1".into(),
        item_id: "x".into(),
        model: "m".into(),
        created: 1,
        seed: 0,
        length_limited: true,
        include_usage: true,
        target: 2,
        answer: None,
    };
    let mut f = StreamFmt::new(meta, 10);
    let mut out = String::new();
    f.admitted(&mut out, 0);
    f.tokens(&mut out, 1);
    f.tokens(&mut out, 2);
    f.done(
        &mut out,
        &Usage {
            prompt: 10,
            cached: 0,
            completion: 2,
        },
    );
    let events: Vec<&str> = out
        .split("\n\n")
        .filter(|s| !s.is_empty())
        .map(|s| s.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.len(), 5);
    let v: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(v["choices"][0]["delta"]["content"], "");
    let v: Value = serde_json::from_str(events[2]).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(events[4], "[DONE]");
}
