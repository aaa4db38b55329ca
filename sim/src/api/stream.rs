//! A streamed response, event by event, in each API's shape.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::engine::Usage;

use super::request::Api;
use super::response::{error_body, Meta};

/// Incremental SSE formatter for one streamed response.
pub(crate) struct StreamFmt {
    pub meta: Meta,
    /// Prefix of every token chunk, up to the opening quote of the text.
    head: String,
    /// Suffix of a non-final token chunk.
    tail: String,
    /// Suffix of the final token chunk.
    tail_last: String,
    sent: u32,
    seq: u64,
    prompt: u32,
    pub chunks: u64,
    pub finished: bool,
    /// Cached prompt tokens once admitted to the batch; `None` while queued.
    admitted: Option<u32>,
}

fn sse(out: &mut String, event: Option<&str>, data: &Value) {
    if let Some(e) = event {
        let _ = writeln!(out, "event: {e}");
    }
    let _ = write!(out, "data: {data}\n\n");
}

impl StreamFmt {
    pub(crate) fn new(meta: Meta, prompt_tokens: u32) -> Self {
        let id = Value::String(meta.id.clone());
        let model = Value::String(meta.model.clone());
        let fr = meta.finish_reason();
        let (head, tail, tail_last) = match meta.api {
            Api::Chat => (
                format!(
                    "data: {{\"id\":{id},\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{model},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"",
                    meta.created
                ),
                "\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n".to_string(),
                format!("\"}},\"logprobs\":null,\"finish_reason\":\"{fr}\"}}]}}\n\n"),
            ),
            Api::Completions => (
                format!(
                    "data: {{\"id\":{id},\"object\":\"text_completion\",\"created\":{},\"model\":{model},\"choices\":[{{\"index\":0,\"text\":\"",
                    meta.created
                ),
                "\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n".to_string(),
                format!("\",\"logprobs\":null,\"finish_reason\":\"{fr}\",\"stop_reason\":null}}]}}\n\n"),
            ),
            Api::Responses => (
                format!(
                    "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"item_id\":{},\"output_index\":0,\"content_index\":0,\"logprobs\":[],\"delta\":\"",
                    Value::String(meta.item_id.clone())
                ),
                // sequence_number is appended per chunk
                "\",\"sequence_number\":".to_string(),
                String::new(),
            ),
            Api::Messages => (
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"".to_string(),
                "\"}}\n\n".to_string(),
                "\"}}\n\n".to_string(),
            ),
        };
        StreamFmt {
            meta,
            head,
            tail,
            tail_last,
            sent: 0,
            seq: 0,
            prompt: prompt_tokens,
            chunks: 0,
            finished: false,
            admitted: None,
        }
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// Events sent as soon as the stream starts.
    pub(crate) fn start(&mut self, out: &mut String) {
        if self.meta.api == Api::Responses {
            let r = self.meta.response_object("in_progress", None, None);
            let s = self.next_seq();
            sse(
                out,
                Some("response.created"),
                &json!({"type": "response.created", "sequence_number": s, "response": r}),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.in_progress"),
                &json!({"type": "response.in_progress", "sequence_number": s, "response": r}),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.output_item.added"),
                &json!({
                    "type": "response.output_item.added", "sequence_number": s, "output_index": 0,
                    "item": {"type": "message", "id": self.meta.item_id, "status": "in_progress", "role": "assistant", "content": []},
                }),
            );
            let s = self.next_seq();
            sse(
                out,
                Some("response.content_part.added"),
                &json!({
                    "type": "response.content_part.added", "sequence_number": s, "item_id": self.meta.item_id,
                    "output_index": 0, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }),
            );
        }
    }

    /// Events sent when the request is admitted to the batch.
    pub(crate) fn admitted(&mut self, out: &mut String, cached: u32) {
        self.admitted = Some(cached);
        match self.meta.api {
            Api::Chat => {
                // head ends with `"content":"`; insert the role before it
                out.push_str(&self.head[..self.head.len() - "\"content\":\"".len()]);
                out.push_str("\"role\":\"assistant\",\"content\":\"");
                out.push_str(&self.tail);
            }
            Api::Messages => {
                let u = Usage {
                    prompt: self.prompt,
                    cached,
                    completion: 1,
                };
                sse(
                    out,
                    Some("message_start"),
                    &json!({"type": "message_start", "message": {
                        "id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": Meta::anthropic_usage(&u),
                    }}),
                );
                sse(
                    out,
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                );
            }
            _ => {}
        }
    }

    /// One content chunk carrying the tokens generated up to `upto`.
    pub(crate) fn tokens(&mut self, out: &mut String, upto: u32) {
        if upto <= self.sent {
            return;
        }
        out.push_str(&self.head);
        self.meta.push_text(out, self.sent, upto);
        self.sent = upto;
        self.chunks += 1;
        if self.meta.api == Api::Responses {
            out.push_str(&self.tail);
            let s = self.next_seq();
            let _ = write!(out, "{s}}}\n\n");
        } else if upto >= self.meta.target {
            out.push_str(&self.tail_last);
        } else {
            out.push_str(&self.tail);
        }
    }

    /// An error after the stream started, in the API's own shape, then the end.
    pub(crate) fn failed(&mut self, out: &mut String, status: u16, message: &str) {
        self.finished = true;
        match self.meta.api {
            Api::Chat | Api::Completions => {
                sse(out, None, &error_body(Some(self.meta.api), status, message));
                out.push_str("data: [DONE]\n\n");
            }
            Api::Responses => {
                let s = self.next_seq();
                sse(
                    out,
                    Some("error"),
                    &json!({"type": "error", "code": status.to_string(), "message": message, "param": null, "sequence_number": s}),
                );
            }
            Api::Messages => sse(
                out,
                Some("error"),
                &error_body(Some(Api::Messages), status, message),
            ),
        }
    }

    /// The end of a stream aborted by `POST /abort_request` (SGLang: a graceful
    /// abort ends the normal way, with `finish_reason` `"abort"`). Chat and
    /// completions: a final chunk with `finish_reason: "abort"`, the usage chunk
    /// (if asked for) and `[DONE]`. The Responses and Messages APIs have no such
    /// finish reason: their error event, as [`failed`](Self::failed) with 500.
    pub(crate) fn aborted(&mut self, out: &mut String, message: &str) {
        let m = &self.meta;
        let (obj, choice) = match m.api {
            Api::Chat => {
                let delta = if self.admitted.is_some() {
                    json!({})
                } else {
                    json!({"role": "assistant", "content": ""})
                };
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": "abort"}),
                )
            }
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "abort", "stop_reason": null}),
            ),
            Api::Responses | Api::Messages => return self.failed(out, 500, message),
        };
        self.finished = true;
        sse(
            out,
            None,
            &json!({"id": m.id, "object": obj, "created": m.created, "model": m.model, "choices": [choice]}),
        );
        if m.include_usage {
            let u = Usage {
                prompt: self.prompt,
                cached: self.admitted.unwrap_or(0),
                completion: self.sent,
            };
            sse(
                out,
                None,
                &json!({
                    "id": m.id, "object": obj, "created": m.created, "model": m.model,
                    "choices": [], "usage": Meta::openai_usage(&u),
                }),
            );
        }
        out.push_str("data: [DONE]\n\n");
    }

    /// Closing events.
    pub(crate) fn done(&mut self, out: &mut String, u: &Usage) {
        self.finished = true;
        let m = &self.meta;
        match m.api {
            Api::Chat | Api::Completions => {
                if m.include_usage {
                    let obj = if m.api == Api::Chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    sse(
                        out,
                        None,
                        &json!({
                            "id": m.id, "object": obj, "created": m.created, "model": m.model,
                            "choices": [], "usage": Meta::openai_usage(u),
                        }),
                    );
                }
                out.push_str("data: [DONE]\n\n");
            }
            Api::Responses => {
                let text = m.text(u.completion);
                let item_id = m.item_id.clone();
                let status = m.responses_status();
                let full = m.response_object(status, Some(&text), Some(u));
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.output_text.done"),
                    &json!({
                        "type": "response.output_text.done", "sequence_number": s, "item_id": item_id,
                        "output_index": 0, "content_index": 0, "text": text, "logprobs": [],
                    }),
                );
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.content_part.done"),
                    &json!({
                        "type": "response.content_part.done", "sequence_number": s, "item_id": item_id,
                        "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": text, "annotations": []},
                    }),
                );
                let s = self.next_seq();
                sse(
                    out,
                    Some("response.output_item.done"),
                    &json!({
                        "type": "response.output_item.done", "sequence_number": s, "output_index": 0,
                        "item": full["output"][0],
                    }),
                );
                let s = self.next_seq();
                let ev = if status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                sse(
                    out,
                    Some(ev),
                    &json!({"type": ev, "sequence_number": s, "response": full}),
                );
            }
            Api::Messages => {
                sse(
                    out,
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": 0}),
                );
                sse(
                    out,
                    Some("message_delta"),
                    &json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": m.finish_reason(), "stop_sequence": null},
                        "usage": Meta::anthropic_usage(u),
                    }),
                );
                sse(out, Some("message_stop"), &json!({"type": "message_stop"}));
            }
        }
    }
}
