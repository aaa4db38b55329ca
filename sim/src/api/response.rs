//! What one response is ([`Meta`]) and its whole body in each API's shape, and the error
//! bodies.

use serde_json::{json, Value};

use crate::engine::Usage;

use super::request::Api;
use super::text::{full_text, push_tokens};

/// Static description of one response, shared by stream and non-stream.
pub(crate) struct Meta {
    pub api: Api,
    pub id: String,
    pub item_id: String,
    pub model: String,
    pub created: u64,
    pub seed: u64,
    pub length_limited: bool,
    pub include_usage: bool,
    pub target: u32,
    /// Decision mode: the answer text instead of filler words, 4 bytes per
    /// token ([`answer_tokens`]); `target` may cut it short.
    pub answer: Option<String>,
}

/// Output tokens needed for `answer` (4 bytes per token, at least 1).
pub(crate) fn answer_tokens(answer: &str) -> u32 {
    answer.len().div_ceil(4).max(1) as u32
}

impl Meta {
    /// Byte offset of the end of token `i` of the answer (on a char boundary;
    /// the last token takes the rest).
    fn answer_cut(answer: &str, i: u32) -> usize {
        if i >= answer_tokens(answer) {
            return answer.len();
        }
        let mut at = (i as usize * 4).min(answer.len());
        while !answer.is_char_boundary(at) {
            at -= 1;
        }
        at
    }

    /// Append the text of tokens `from..to`, JSON-escaped (no quotes).
    pub(super) fn push_text(&self, out: &mut String, from: u32, to: u32) {
        match &self.answer {
            None => push_tokens(out, self.seed, from, to),
            Some(a) => {
                let piece = &a[Self::answer_cut(a, from)..Self::answer_cut(a, to)];
                let quoted = Value::String(piece.to_string()).to_string();
                out.push_str(&quoted[1..quoted.len() - 1]);
            }
        }
    }

    /// The whole text of `n` generated tokens.
    pub(super) fn text(&self, n: u32) -> String {
        match &self.answer {
            None => full_text(self.seed, n),
            Some(a) => a[..Self::answer_cut(a, n)].to_string(),
        }
    }

    pub(super) fn finish_reason(&self) -> &'static str {
        match (self.api, self.length_limited) {
            (Api::Messages, true) => "max_tokens",
            (Api::Messages, false) => "end_turn",
            (_, true) => "length",
            (_, false) => "stop",
        }
    }

    pub(super) fn openai_usage(u: &Usage) -> Value {
        json!({
            "prompt_tokens": u.prompt,
            "total_tokens": u.prompt + u.completion,
            "completion_tokens": u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached},
        })
    }

    fn responses_usage(u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion,
        })
    }

    /// Anthropic semantics: `input_tokens` excludes cache reads.
    pub(super) fn anthropic_usage(u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt - u.cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached,
            "output_tokens": u.completion,
        })
    }

    pub(super) fn response_object(
        &self,
        status: &str,
        text: Option<&str>,
        usage: Option<&Usage>,
    ) -> Value {
        let incomplete = status == "incomplete";
        let output = match text {
            Some(t) => json!([{
                "type": "message",
                "id": self.item_id,
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": t, "annotations": []}],
            }]),
            None => json!([]),
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": null,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage.map(Self::responses_usage),
        })
    }

    pub(super) fn responses_status(&self) -> &'static str {
        if self.length_limited {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// Non-stream response body.
    pub(crate) fn full_response(&self, u: &Usage) -> Value {
        let text = self.text(u.completion);
        let fr = self.finish_reason();
        match self.api {
            Api::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null,
                    "finish_reason": fr,
                    "stop_reason": null,
                }],
                "usage": Self::openai_usage(u),
                "prompt_logprobs": null,
            }),
            Api::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": fr,
                    "stop_reason": null,
                    "prompt_logprobs": null,
                }],
                "usage": Self::openai_usage(u),
            }),
            Api::Responses => self.response_object(self.responses_status(), Some(&text), Some(u)),
            Api::Messages => json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": fr,
                "stop_sequence": null,
                "usage": Self::anthropic_usage(u),
            }),
        }
    }
}

/// An error body in the API's own shape.
pub(crate) fn error_body(api: Option<Api>, status: u16, message: &str) -> Value {
    if api == Some(Api::Messages) {
        let ty = match status {
            400 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            529 | 503 => "overloaded_error",
            _ => "api_error",
        };
        return json!({"type": "error", "error": {"type": ty, "message": message}});
    }
    let ty = match status {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": ty, "param": null, "code": status}})
}
