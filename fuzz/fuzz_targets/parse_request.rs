//! The request parser on arbitrary bytes, for every API: never a panic; an error is a 400;
//! the body rewrites never panic and keep a valid JSON object valid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokengate::api::{self, Api};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let a = match sel % 4 {
        0 => Api::ChatCompletions,
        1 => Api::Completions,
        2 => Api::Responses,
        _ => Api::Messages,
    };
    match api::parse_request(a, body) {
        Ok(info) => {
            assert!(!info.model.is_empty());
            assert!(info.expected_tokens() >= info.prompt_tokens_est);
        }
        Err(e) => assert_eq!(e.status(), 400),
    }
    let was_object = serde_json_is_object(body);
    if let Some(out) = api::inject_include_usage(body) {
        if was_object {
            assert!(serde_json_is_object(&out), "injection broke a valid object");
        }
    }
    if let Some(out) = api::rewrite_model(body, "m") {
        assert!(serde_json_is_object(&out));
    }
});

fn serde_json_is_object(b: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(b).is_ok_and(|v| v.is_object())
}
