//! One error type for everything the gateway answers itself, rendered in the shape the
//! client's SDK expects: OpenAI's `{"error":{"message","type","code"}}`, or Anthropic's
//! `{"type":"error","error":{"type","message"}}` on `/v1/messages`.

use serde::Serialize;

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    ModelNotFound(String),
    /// The key's tenant may not call this model.
    #[error("{0}")]
    ModelNotAllowed(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    TooManyRequests(String),
    #[error("{0}")]
    BadGateway(String),
    #[error("{0}")]
    Unavailable(String),
    /// No throttling slot freed within `queue_timeout` (503 with `Retry-After`).
    #[error("{0}")]
    QueueTimeout(String),
    #[error("{0}")]
    GatewayTimeout(String),
    #[error("{0}")]
    Internal(String),
}

impl GatewayError {
    pub fn status(&self) -> u16 {
        match self {
            GatewayError::BadRequest(_) => 400,
            GatewayError::Unauthorized(_) => 401,
            GatewayError::ModelNotAllowed(_) => 403,
            GatewayError::ModelNotFound(_) | GatewayError::NotFound(_) => 404,
            GatewayError::MethodNotAllowed(_) => 405,
            GatewayError::RequestTimeout(_) => 408,
            GatewayError::PayloadTooLarge(_) => 413,
            GatewayError::UnsupportedMediaType(_) => 415,
            GatewayError::TooManyRequests(_) => 429,
            GatewayError::BadGateway(_) => 502,
            GatewayError::Unavailable(_) | GatewayError::QueueTimeout(_) => 503,
            GatewayError::GatewayTimeout(_) => 504,
            GatewayError::Internal(_) => 500,
        }
    }

    /// OpenAI's `error.type`.
    fn openai_type(&self) -> &'static str {
        match self {
            GatewayError::BadRequest(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::PayloadTooLarge(_)
            | GatewayError::UnsupportedMediaType(_)
            | GatewayError::RequestTimeout(_) => "invalid_request_error",
            GatewayError::Unauthorized(_) => "authentication_error",
            GatewayError::ModelNotAllowed(_) => "permission_error",
            GatewayError::ModelNotFound(_) | GatewayError::NotFound(_) => "not_found_error",
            GatewayError::TooManyRequests(_) => "rate_limit_error",
            _ => "api_error",
        }
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::BadRequest(_) => "invalid_request",
            GatewayError::Unauthorized(_) => "invalid_api_key",
            GatewayError::ModelNotFound(_) => "model_not_found",
            GatewayError::ModelNotAllowed(_) => "model_not_allowed",
            GatewayError::NotFound(_) => "unknown_url",
            GatewayError::MethodNotAllowed(_) => "method_not_allowed",
            GatewayError::RequestTimeout(_) => "request_timeout",
            GatewayError::PayloadTooLarge(_) => "request_too_large",
            GatewayError::UnsupportedMediaType(_) => "unsupported_media_type",
            GatewayError::TooManyRequests(_) => "rate_limit_exceeded",
            GatewayError::BadGateway(_) => "upstream_error",
            GatewayError::Unavailable(_) => "no_healthy_upstream",
            GatewayError::QueueTimeout(_) => "queue_timeout",
            GatewayError::GatewayTimeout(_) => "upstream_timeout",
            GatewayError::Internal(_) => "internal_error",
        }
    }

    /// Anthropic's `error.type`.
    fn anthropic_type(&self) -> &'static str {
        match self {
            GatewayError::BadRequest(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::UnsupportedMediaType(_)
            | GatewayError::RequestTimeout(_) => "invalid_request_error",
            GatewayError::Unauthorized(_) => "authentication_error",
            GatewayError::ModelNotAllowed(_) => "permission_error",
            GatewayError::ModelNotFound(_) | GatewayError::NotFound(_) => "not_found_error",
            GatewayError::PayloadTooLarge(_) => "request_too_large",
            GatewayError::TooManyRequests(_) => "rate_limit_error",
            GatewayError::Unavailable(_) | GatewayError::QueueTimeout(_) => "overloaded_error",
            GatewayError::GatewayTimeout(_) => "timeout_error",
            _ => "api_error",
        }
    }

    /// The JSON body, Anthropic-shaped when `anthropic`.
    pub fn body(&self, anthropic: bool) -> Vec<u8> {
        let message = self.to_string();
        let r = if anthropic {
            serde_json::to_vec(&AnthropicBody {
                r#type: "error",
                error: AnthropicError {
                    r#type: self.anthropic_type(),
                    message: &message,
                },
            })
        } else {
            serde_json::to_vec(&OpenAiBody {
                error: OpenAiError {
                    message: &message,
                    r#type: self.openai_type(),
                    code: self.code(),
                },
            })
        };
        r.unwrap_or_default()
    }
}

/// OpenAI's error body: `{"error":{"message","type","code"}}`.
#[derive(Serialize)]
struct OpenAiBody<'a> {
    error: OpenAiError<'a>,
}

#[derive(Serialize)]
struct OpenAiError<'a> {
    message: &'a str,
    r#type: &'static str,
    code: &'static str,
}

/// Anthropic's error body: `{"type":"error","error":{"type","message"}}`.
#[derive(Serialize)]
struct AnthropicBody<'a> {
    r#type: &'static str,
    error: AnthropicError<'a>,
}

#[derive(Serialize)]
struct AnthropicError<'a> {
    r#type: &'static str,
    message: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let e = GatewayError::ModelNotFound("model \"x\" is not served".into());
        let v: serde_json::Value = serde_json::from_slice(&e.body(false)).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["message"], "model \"x\" is not served");
        let v: serde_json::Value = serde_json::from_slice(&e.body(true)).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(e.status(), 404);
    }
}
