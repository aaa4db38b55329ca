//! OpenTelemetry traces (`tracing:` in the config): one server span per request, a client
//! span per upstream attempt, exported over OTLP (HTTP/protobuf or gRPC) in the background.
//!
//! * **Off** (no `tracing:`): [`crate::shared::Shared::otel`] holds `None`, a request's
//!   [`crate::request::Ctx::trace`] stays `None`; no span object is ever created.
//! * **Sampled out**: the sampler is asked before anything else ([`Otel::start`]); an
//!   unsampled request's [`Trace`] is only its ids (no SDK span, no attribute formatted,
//!   nothing gathered for a span at completion), enough for the `traceparent` (flagged not
//!   sampled) its upstream requests carry.
//! * **Spans**: the request's span (kind server) is started once the request is admitted
//!   (its body parsed: a probe or a refused key makes none), at the request's arrival time,
//!   and named `{gen_ai.operation.name} {gen_ai.request.model}` once planned; it carries the
//!   GenAI semantic-convention attributes and tokengate's own (`tokengate.*`: service,
//!   instance, reason, predicted and engine prefix hits, queue wait), and events (first
//!   token, retry, failover, throttled, mirrored). Each upstream attempt is a child span
//!   (kind client) named `upstream {instance}`, and so is a route's decision-service call
//!   (`chat {decision model}`).
//! * **Propagation** (W3C trace context): a client's `traceparent` / `tracestate` make the
//!   request's span a child of the client's; the upstream request carries a `traceparent`
//!   whose parent is the attempt's span, so an engine that traces (vLLM, SGLang) continues
//!   the same trace. Sampling is parent-based: a client's sampled flag decides for its own
//!   trace, `sample_ratio` for new ones.
//! * **Export**: the SDK hands each ended, sampled span to [`QueueProcessor`], which only
//!   `try_send`s it into a bounded queue ([`QUEUE_CAPACITY`]); a full queue drops the span
//!   (counted). [`Otel::run`] (a background task) batches the queue (up to [`MAX_BATCH`]
//!   spans or every [`FLUSH_EVERY`]) and sends each batch with the OTLP exporter, bounded
//!   by `tracing.otlp.timeout`; a failed export drops its batch (counted). Nothing on the
//!   request path waits for the collector. `protocol: http` posts protobuf bodies with
//!   reqwest; `protocol: grpc` calls the collector's `TraceService/Export` over a tonic
//!   channel (HTTP/2, the headers as gRPC metadata), connected lazily by the sender (a
//!   tonic channel needs the runtime it runs on, so it is built in [`Otel::run`]).
//!
//! * **Reload**: a reload whose `tracing:` differs builds a new tracer and sender
//!   ([`crate::shared::Shared::set_tracing`]); requests admitted from then on use it (new
//!   endpoint, headers, `sample_ratio`); the old sender exports what its queue holds and
//!   stops ([`Otel::close`]). Removing `tracing:` turns tracing off.
//!
//! Metrics: `tokengate_trace_spans_total{outcome="exported"|"dropped_queue_full"|"dropped_export_failed"}`.

use crate::config::OtlpProtocol;
use crate::config::TracingSettings;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    SamplingDecision, SpanContext, SpanKind, TraceContextExt, TraceFlags, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkError;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, SpanExporter as _};
use opentelemetry_sdk::Resource;
use parking_lot::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

mod export;
mod propagation;
mod trace;

use export::{Exporter, QueueProcessor, Sender};
pub use export::{SpanCounters, FLUSH_EVERY, MAX_BATCH, QUEUE_CAPACITY};
use propagation::Headers;
pub use propagation::{TraceHeaders, TRACEPARENT, TRACESTATE};
use trace::wall_time;
pub use trace::{AttemptInfo, Finished, Planned, PrefillEnd, Trace};

/// The tracer of a process with `tracing:` configured.
pub struct Otel {
    tracer: SdkTracer,
    /// Kept for the tracer's lifetime (the tracer holds a weak reference).
    _provider: SdkTracerProvider,
    sender: Mutex<Option<Sender>>,
    /// Told when a reload replaced this tracer: the sender flushes and stops.
    closing: tokio::sync::Notify,
    counters: SpanCounters,
    /// Where the spans go (for the start-up log line).
    pub url: String,
    /// `http` or `grpc`.
    pub protocol: &'static str,
    /// `tracing.otlp.timeout`: an export that takes longer fails (its spans counted).
    timeout: Duration,
    /// The settings it was built from ([`settings_key`]): a reload that changes them warns.
    pub settings_key: String,
}

/// Tracing settings as one comparable string (header values masked, as printed).
pub fn settings_key(s: &TracingSettings) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

impl Otel {
    /// The tracer of validated settings, counting its spans in `counters`.
    pub fn new(s: &TracingSettings, counters: SpanCounters) -> Result<Otel, String> {
        let url = s.traces_url();
        let resource = Resource::builder_empty()
            .with_service_name(s.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let exporter = Exporter::new(s, &url, &resource)?;
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(QueueProcessor {
                tx,
                counters: counters.clone(),
            })
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                s.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("tokengate");
        Ok(Otel {
            tracer,
            _provider: provider,
            sender: Mutex::new(Some(Sender { rx, exporter })),
            closing: tokio::sync::Notify::new(),
            counters,
            url,
            protocol: match s.otlp.protocol {
                OtlpProtocol::Http => "http",
                OtlpProtocol::Grpc => "grpc",
            },
            timeout: s.otlp.timeout,
            settings_key: settings_key(s),
        })
    }

    /// The background sender: batches of the queue to the collector. Runs until the
    /// process ends (one at a time: a second call returns at once).
    pub async fn run(self: std::sync::Arc<Self>) {
        let Some(Sender { mut rx, exporter }) = self.sender.lock().take() else {
            return;
        };
        // Built on this runtime (gRPC); should that fail, every batch fails (counted).
        let exporter = match exporter.build() {
            Ok(e) => Some(e),
            Err(e) => {
                log::error!("tracing: no exporter to {}: {e}", self.url);
                None
            }
        };
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut closing = false;
        loop {
            if closing {
                // Replaced by a reload: what the queue holds now is the last of it.
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(s) => batch.push(s),
                        Err(_) => break,
                    }
                }
                if batch.is_empty() {
                    return;
                }
            } else {
                tokio::select! {
                    s = rx.recv() => match s {
                        Some(s) => batch.push(s),
                        None => return,
                    },
                    _ = self.closing.notified() => {
                        closing = true;
                        continue;
                    }
                }
                let deadline = tokio::time::Instant::now() + FLUSH_EVERY;
                while batch.len() < MAX_BATCH {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(s)) => batch.push(s),
                        Ok(None) | Err(_) => break,
                    }
                }
            }
            let n = batch.len() as u64;
            let spans = std::mem::take(&mut batch);
            // The exporters bound an export by the timeout themselves (reqwest's, tonic's
            // `grpc-timeout` and channel timeout); this bounds it whatever they do.
            let result = match &exporter {
                Some(x) => match tokio::time::timeout(self.timeout, x.export(spans)).await {
                    Ok(r) => r.map_err(|e| match e {
                        OTelSdkError::InternalFailure(m) => m,
                        other => other.to_string(),
                    }),
                    Err(_) => Err(format!("no answer within {:?}", self.timeout)),
                },
                None => Err("no exporter".to_string()),
            };
            match result {
                Ok(()) => self.counters.exported.inc_by(n),
                Err(e) => {
                    self.counters.export_failed.inc_by(n);
                    log::debug!(
                        "tracing: {n} spans not exported to {} ({}): {e}",
                        self.url,
                        self.protocol
                    );
                }
            }
        }
    }

    /// A reload replaced this tracer: its sender exports what is queued and stops.
    pub fn close(&self) {
        self.closing.notify_one();
    }

    /// Starts a request's span: a child of the client's trace when its headers carry one.
    /// The sampling decision comes first: an unsampled request gets ids only (no span object,
    /// no name or attribute formatted), enough for the `traceparent` the engines get.
    pub fn start(&self, headers: &http::HeaderMap, arrived: Instant, path: &str) -> Trace {
        let parent = if headers.contains_key(&TRACEPARENT) {
            TraceContextPropagator::new().extract_with_context(&Context::new(), &Headers(headers))
        } else {
            Context::new()
        };
        let ids = self.tracer.id_generator();
        let trace_id = if parent.has_active_span() {
            parent.span().span_context().trace_id()
        } else {
            ids.new_trace_id()
        };
        // The configured sampler (parent-based, then the ratio), as the SDK would ask it; its
        // result is handed to the span builder so that it is not asked twice.
        let sampling = self.tracer.should_sample().should_sample(
            Some(&parent),
            trace_id,
            "",
            &SpanKind::Server,
            &[],
            &[],
        );
        if sampling.decision == SamplingDecision::Drop {
            let context = SpanContext::new(
                trace_id,
                ids.new_span_id(),
                TraceFlags::default(),
                false,
                sampling.trace_state,
            );
            return Trace::unsampled(context);
        }
        let span = self
            .tracer
            .span_builder(format!("POST {path}"))
            .with_kind(SpanKind::Server)
            .with_start_time(wall_time(arrived))
            .with_trace_id(trace_id)
            .with_sampling_result(sampling)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("url.path", path.to_string()),
            ])
            .start_with_context(&self.tracer, &parent);
        Trace::sampled(self.tracer.clone(), span)
    }
}
