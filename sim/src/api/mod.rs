//! Request parsing, prompt rendering and response formatting for the four
//! APIs (OpenAI chat/completions, OpenAI Responses, Anthropic Messages).

mod request;
mod response;
mod stream;
#[cfg(test)]
mod tests;
mod text;

pub(crate) use request::{decision_texts, parse, Api};
pub(crate) use response::{answer_tokens, error_body, Meta};
pub(crate) use stream::StreamFmt;
