//! `response_headers:`: what the gateway's own and the engines' response headers tell clients.

use serde::{Deserialize, Serialize};

/// Which headers reach the client besides the answer's own (`content-type`, …) and
/// `x-request-id` (always sent).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseHeaders {
    /// `x-tokengate-instance` (the instance that served the request) and
    /// `x-tokengate-reason` (why it was chosen) on every proxied response. `false`: neither
    /// (the access log and `/admin/status` still say both).
    #[serde(default = "d_true")]
    pub routing: bool,
    /// The engines' own `x-*` response headers that are passed to the client (for example
    /// `x-engine-id`), by name, case-insensitive; a name ending in `*` passes every header
    /// it begins (`x-ratelimit-*`). Every other `x-*` header of an engine's (or an external
    /// API's) answer is removed. Default: none.
    #[serde(default)]
    pub engine: Vec<String>,
}

fn d_true() -> bool {
    true
}

impl Default for ResponseHeaders {
    fn default() -> Self {
        ResponseHeaders {
            routing: true,
            engine: Vec::new(),
        }
    }
}

impl ResponseHeaders {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        for (i, name) in self.engine.iter().enumerate() {
            let bare = name.strip_suffix('*').unwrap_or(name);
            let p = format!("response_headers.engine[{i}]");
            if bare.is_empty() && !name.is_empty() {
                errs.push(format!(
                    "{p}: {name:?} would pass every engine header; name them (e.g. x-engine-id, x-ratelimit-*)"
                ));
            } else if bare.is_empty() || http::HeaderName::from_bytes(bare.as_bytes()).is_err() {
                errs.push(format!(
                    "{p}: {name:?} is not a header name (letters, digits and - ; an optional * at the end)"
                ));
            } else if !bare.to_ascii_lowercase().starts_with("x-") {
                errs.push(format!(
                    "{p}: {name:?} does not begin with x- (only the engines' x-* headers are removed; others pass already)"
                ));
            } else if bare.eq_ignore_ascii_case("x-tokengate-") || is_ours(bare) {
                errs.push(format!(
                    "{p}: {name:?} is the gateway's own header (response_headers.routing turns it on or off)"
                ));
            }
        }
    }

    /// Whether an engine's response header `name` (lowercase, as `http` stores it) reaches
    /// the client.
    pub fn passes(&self, name: &str) -> bool {
        if !name.starts_with("x-") || name == "x-request-id" {
            return true;
        }
        self.engine.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => {
                name.len() >= prefix.len() && name[..prefix.len()].eq_ignore_ascii_case(prefix)
            }
            None => name.eq_ignore_ascii_case(p),
        })
    }
}

fn is_ours(name: &str) -> bool {
    name.eq_ignore_ascii_case("x-tokengate-instance")
        || name.eq_ignore_ascii_case("x-tokengate-reason")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_headers_pass_only_when_named() {
        let h = ResponseHeaders {
            routing: true,
            engine: vec!["X-Engine-Id".into(), "x-ratelimit-*".into()],
        };
        assert!(h.passes("x-engine-id"));
        assert!(h.passes("x-ratelimit-remaining-tokens"));
        assert!(h.passes("content-type"));
        assert!(h.passes("x-request-id"));
        assert!(!h.passes("x-served-by"));
        assert!(!ResponseHeaders::default().passes("x-engine-id"));
        let mut errs = Vec::new();
        ResponseHeaders {
            routing: true,
            engine: vec!["*".into(), "server".into(), "x bad".into(), "".into()],
        }
        .validate(&mut errs);
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert!(
            errs[0].starts_with("response_headers.engine[0]: "),
            "{errs:?}"
        );
    }
}
