//! Unit tests of the prefill bodies and failures.

use super::prefill::{vllm_prefill_body, with_fields};
use super::side::Failure;
use serde_json::{json, Value};

#[test]
fn fields_go_in_without_a_parse_and_replace_when_present() {
    let b = br#" {"model":"m","messages":[]}"#;
    let out = with_fields(b, &[("bootstrap_room", json!(7)), ("rid", json!("r"))]).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["bootstrap_room"], 7);
    assert_eq!(v["rid"], "r");
    assert_eq!(v["model"], "m");
    let out = with_fields(b"{}", &[("a", json!(1))]).unwrap();
    assert_eq!(out, br#"{"a":1}"#);
    // Already there: replaced, not duplicated.
    let out = with_fields(br#"{"rid":"client","x":1}"#, &[("rid", json!("gw"))]).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["rid"], "gw");
    assert_eq!(v["x"], 1);
    assert!(with_fields(b"[1]", &[("a", json!(1))]).is_none());
}

#[test]
fn vllm_prefill_asks_one_token_and_remote_decode() {
    let b = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"messages":[]}"#;
    let v: Value = serde_json::from_slice(&vllm_prefill_body(b)).unwrap();
    assert_eq!(v["stream"], false);
    assert_eq!(v["max_tokens"], 1);
    assert_eq!(v["max_completion_tokens"], 1);
    assert!(v.get("stream_options").is_none());
    assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
}

#[test]
fn failures_say_whether_to_retry() {
    let f = |s: Option<u16>| Failure {
        status: s,
        message: String::new(),
    };
    assert!(f(None).retryable());
    assert!(f(Some(503)).retryable());
    assert!(f(Some(429)).retryable());
    assert!(!f(Some(400)).retryable());
    assert_eq!(f(Some(400)).gateway_error("p", "id").status(), 400);
    assert_eq!(f(None).gateway_error("p", "id").status(), 502);
    assert!(!f(Some(429)).instance_failed());
}
