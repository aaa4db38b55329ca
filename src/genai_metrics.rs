//! The OpenTelemetry GenAI metrics as Prometheus histograms, next to tokengate's own
//! (`tokengate_ttft_seconds`, `tokengate_request_duration_seconds`, …, unchanged): the
//! semantic conventions' instruments under their conventional Prometheus names (dots to
//! underscores, the unit as a suffix) and bucket boundaries, so dashboards built for GenAI
//! servers read the gateway too.
//!
//! | family | convention | labels |
//! |---|---|---|
//! | `gen_ai_server_time_to_first_token_seconds` | `gen_ai.server.time_to_first_token` (streams) | operation, provider, model |
//! | `gen_ai_server_request_duration_seconds` | `gen_ai.server.request.duration` | operation, provider, model, `error_type` |
//! | `gen_ai_client_token_usage` | `gen_ai.client.token.usage` | operation, provider, model, `gen_ai_token_type` (`input`, `output`) |
//!
//! The model label is the service or route the request resolved to (bounded: a client's
//! unknown model names never become label values).

use parking_lot::RwLock;
use prometheus::{Histogram, HistogramOpts, HistogramVec, Registry};
use std::collections::HashMap;
use std::sync::Arc;

/// The GenAI histograms.
pub struct GenAiMetrics {
    ttft: HistogramVec,
    duration: HistogramVec,
    tokens: HistogramVec,
    /// The series of a successful request, resolved once per (operation, provider, model):
    /// one map lookup per request instead of four label lookups.
    resolved: RwLock<HashMap<String, Vec<Resolved>>>,
}

/// One model's series for an operation and provider.
type Resolved = (&'static str, &'static str, Arc<Series>);

/// The series a successful request observes.
struct Series {
    ttft: Histogram,
    duration: Histogram,
    input: Histogram,
    output: Histogram,
}

/// How a request ended, for [`GenAiMetrics::observe`].
pub struct Observation<'a> {
    pub operation: &'static str,
    pub provider: &'static str,
    pub model: &'a str,
    /// `""` for a success, else the status code (or `error`).
    pub error_type: &'a str,
    pub ttft: Option<std::time::Duration>,
    pub duration: std::time::Duration,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

const LABELS: [&str; 3] = [
    "gen_ai_operation_name",
    "gen_ai_provider_name",
    "gen_ai_request_model",
];

impl GenAiMetrics {
    /// The families, registered in `registry`.
    pub fn new(registry: &Registry) -> GenAiMetrics {
        let h = |name: &str, help: &str, buckets: &[f64], extra: Option<&str>| {
            let mut labels = LABELS.to_vec();
            labels.extend(extra);
            let v = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                &labels,
            )
            .expect("metric");
            // A second instance in one process (tests) shares the first's family.
            let _ = registry.register(Box::new(v.clone()));
            v
        };
        GenAiMetrics {
            ttft: h(
                "gen_ai_server_time_to_first_token_seconds",
                "Time to generate the first token of a streamed response (OpenTelemetry gen_ai.server.time_to_first_token)",
                &[
                    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0,
                ],
                None,
            ),
            duration: h(
                "gen_ai_server_request_duration_seconds",
                "Request duration, arrival to last byte (OpenTelemetry gen_ai.server.request.duration)",
                &[
                    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92,
                ],
                Some("error_type"),
            ),
            tokens: h(
                "gen_ai_client_token_usage",
                "Tokens per request by type, input or output, as the engine reported them (OpenTelemetry gen_ai.client.token.usage)",
                &[
                    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
                    1048576.0, 4194304.0, 16777216.0, 67108864.0,
                ],
                Some("gen_ai_token_type"),
            ),
            resolved: RwLock::new(HashMap::new()),
        }
    }

    fn series(&self, operation: &'static str, provider: &'static str, model: &str) -> Arc<Series> {
        let find = |v: &Vec<Resolved>| {
            v.iter()
                .find(|(o, p, _)| *o == operation && *p == provider)
                .map(|(_, _, s)| s.clone())
        };
        if let Some(s) = self.resolved.read().get(model).and_then(find) {
            return s;
        }
        let base = [operation, provider, model];
        let s = Arc::new(Series {
            ttft: self.ttft.with_label_values(&base),
            duration: self
                .duration
                .with_label_values(&[operation, provider, model, ""]),
            input: self
                .tokens
                .with_label_values(&[operation, provider, model, "input"]),
            output: self
                .tokens
                .with_label_values(&[operation, provider, model, "output"]),
        });
        let mut w = self.resolved.write();
        let v = w.entry(model.to_string()).or_default();
        if let Some(existing) = find(v) {
            return existing; // resolved by a concurrent request meanwhile
        }
        v.push((operation, provider, s.clone()));
        s
    }

    /// Records one planned request.
    pub fn observe(&self, o: &Observation<'_>) {
        let s = self.series(o.operation, o.provider, o.model);
        if let Some(t) = o.ttft {
            s.ttft.observe(t.as_secs_f64());
        }
        if o.error_type.is_empty() {
            s.duration.observe(o.duration.as_secs_f64());
        } else {
            self.duration
                .with_label_values(&[o.operation, o.provider, o.model, o.error_type])
                .observe(o.duration.as_secs_f64());
        }
        if let Some(n) = o.input_tokens {
            s.input.observe(n as f64);
        }
        if let Some(n) = o.output_tokens {
            s.output.observe(n as f64);
        }
    }
}

/// `gen_ai.operation.name` and `gen_ai.provider.name` of an API.
pub fn operation_of(api: crate::api::Api) -> (&'static str, &'static str) {
    use crate::api::Api;
    match api {
        Api::Completions => ("text_completion", "openai"),
        Api::Messages => ("chat", "anthropic"),
        Api::ChatCompletions | Api::Responses => ("chat", "openai"),
    }
}
