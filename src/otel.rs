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
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    SamplingDecision, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracer, SdkTracerProvider, Span, SpanData, SpanExporter as _, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use parking_lot::Mutex;
use prometheus::{IntCounter, IntCounterVec, Opts};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;

/// Ended spans waiting for export; beyond this they are dropped (counted).
pub const QUEUE_CAPACITY: usize = 4096;
/// Spans per export request.
pub const MAX_BATCH: usize = 512;
/// A partial batch is sent after this long.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// `tokengate_trace_spans_total{outcome}`, registered whether tracing is configured or not
/// (the dashboard and the status page show it), resolved once.
#[derive(Clone, Debug)]
pub struct SpanCounters {
    exported: IntCounter,
    queue_full: IntCounter,
    export_failed: IntCounter,
}

impl SpanCounters {
    /// The family, registered in `registry` (a second registration, in tests, is ignored).
    pub fn new(registry: &prometheus::Registry) -> SpanCounters {
        let spans = IntCounterVec::new(
            Opts::new(
                "tokengate_trace_spans_total",
                "Trace spans by outcome: exported, dropped_queue_full, dropped_export_failed",
            ),
            &["outcome"],
        )
        .expect("metric");
        let _ = registry.register(Box::new(spans.clone()));
        SpanCounters {
            exported: spans.with_label_values(&["exported"]),
            queue_full: spans.with_label_values(&["dropped_queue_full"]),
            export_failed: spans.with_label_values(&["dropped_export_failed"]),
        }
    }

    /// What `/admin/status` shows.
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "exported": self.exported.get(),
            "dropped_queue_full": self.queue_full.get(),
            "dropped_export_failed": self.export_failed.get(),
        })
    }
}

/// The SDK's span processor: ended spans into the bounded queue, never waiting.
#[derive(Debug)]
struct QueueProcessor {
    tx: mpsc::Sender<SpanData>,
    counters: SpanCounters,
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.tx.try_send(span).is_err() {
            self.counters.queue_full.inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// What the background sender needs (taken once by [`Otel::run`]).
struct Sender {
    rx: mpsc::Receiver<SpanData>,
    exporter: Exporter,
}

/// The OTLP exporter, or what builds it on the sender's runtime (gRPC).
enum Exporter {
    Ready(opentelemetry_otlp::SpanExporter),
    Grpc {
        endpoint: String,
        timeout: Duration,
        metadata: http::HeaderMap,
        resource: Resource,
    },
}

impl Exporter {
    /// The exporter; a gRPC one gets its (lazily connecting) channel here, which needs
    /// a tokio runtime.
    fn build(self) -> Result<opentelemetry_otlp::SpanExporter, String> {
        match self {
            Exporter::Ready(e) => Ok(e),
            Exporter::Grpc {
                endpoint,
                timeout,
                metadata,
                resource,
            } => {
                let https = endpoint
                    .parse::<http::Uri>()
                    .is_ok_and(|u| u.scheme() == Some(&http::uri::Scheme::HTTPS));
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                    .with_timeout(timeout)
                    .with_metadata(
                        opentelemetry_otlp::tonic_types::metadata::MetadataMap::from_headers(
                            metadata,
                        ),
                    );
                if https {
                    // The exporter's channel speaks TLS only when told (an https:// URI
                    // alone is refused: "Connecting to HTTPS without TLS enabled").
                    b = b.with_tls_config(
                        opentelemetry_otlp::tonic_types::transport::ClientTlsConfig::new()
                            .with_enabled_roots(),
                    );
                }
                let mut e = b
                    .build()
                    .map_err(|e| format!("tracing.otlp.endpoint: {e}"))?;
                e.set_resource(&resource);
                Ok(e)
            }
        }
    }
}

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
        let exporter = match s.otlp.protocol {
            OtlpProtocol::Http => {
                let client = reqwest::Client::builder()
                    .timeout(s.otlp.timeout)
                    .connect_timeout(s.otlp.timeout)
                    .build()
                    .map_err(|e| format!("tracing.otlp: {e}"))?;
                let mut exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_endpoint(url.clone())
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_timeout(s.otlp.timeout)
                    .with_headers(s.otlp.headers.clone().into_iter().collect())
                    .build()
                    .map_err(|e| format!("tracing.otlp.endpoint: {e}"))?;
                exporter.set_resource(&resource);
                Exporter::Ready(exporter)
            }
            OtlpProtocol::Grpc => {
                let uri = url
                    .parse::<http::Uri>()
                    .map_err(|e| format!("tracing.otlp.endpoint: {url:?}: {e}"))?;
                if uri.host().is_none() {
                    return Err(format!("tracing.otlp.endpoint: {url:?} names no host"));
                }
                let mut metadata = http::HeaderMap::new();
                for (k, v) in &s.otlp.headers {
                    let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                        format!("tracing.otlp.headers.{k}: not a valid header name")
                    })?;
                    let value = http::HeaderValue::from_str(v).map_err(|_| {
                        format!("tracing.otlp.headers.{k}: the value is not a valid header value")
                    })?;
                    metadata.append(name, value);
                }
                Exporter::Grpc {
                    endpoint: url.clone(),
                    timeout: s.otlp.timeout,
                    metadata,
                    resource: resource.clone(),
                }
            }
        };
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
            return Trace { context, rec: None };
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
        let context = opentelemetry::trace::Span::span_context(&span).clone();
        Trace {
            context,
            rec: Some(Box::new(Recording {
                tracer: self.tracer.clone(),
                server: span,
                attempt: None,
                prefill: None,
                attempts: 0,
                operation: "chat",
            })),
        }
    }
}

/// The wall-clock time of a monotonic instant in the past.
fn wall_time(at: Instant) -> SystemTime {
    SystemTime::now()
        .checked_sub(at.elapsed())
        .unwrap_or_else(SystemTime::now)
}

/// A request's headers as the propagator reads them.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The W3C trace context headers (static names: looking one up parses nothing).
pub static TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
pub static TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// The trace context headers of a span, for an upstream request: `traceparent` (version 00,
/// the sampled flag only) and `tracestate` when there is one (what the SDK's propagator
/// writes, without its formatting machinery: one 55-byte value).
pub struct TraceHeaders {
    traceparent: http::HeaderValue,
    tracestate: Option<http::HeaderValue>,
}

impl TraceHeaders {
    fn of(sc: &SpanContext) -> TraceHeaders {
        let mut v = *b"00-00000000000000000000000000000000-0000000000000000-00";
        hex_into(&mut v[3..35], &sc.trace_id().to_bytes());
        hex_into(&mut v[36..52], &sc.span_id().to_bytes());
        hex_into(
            &mut v[53..55],
            &[(sc.trace_flags() & TraceFlags::SAMPLED).to_u8()],
        );
        let state = sc.trace_state().header();
        TraceHeaders {
            traceparent: http::HeaderValue::from_bytes(&v).expect("hex digits and dashes"),
            tracestate: (!state.is_empty())
                .then(|| http::HeaderValue::try_from(state).ok())
                .flatten(),
        }
    }
}

/// The headers, by name.
impl IntoIterator for TraceHeaders {
    type Item = (&'static str, http::HeaderValue);
    type IntoIter =
        std::iter::Chain<std::iter::Once<Self::Item>, std::option::IntoIter<Self::Item>>;

    fn into_iter(self) -> Self::IntoIter {
        std::iter::once(("traceparent", self.traceparent))
            .chain(self.tracestate.map(|v| ("tracestate", v)))
    }
}

/// Lowercase hex digits of `bytes` into `out` (two per byte).
fn hex_into(out: &mut [u8], bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (o, b) in out.chunks_exact_mut(2).zip(bytes) {
        o[0] = HEX[usize::from(b >> 4)];
        o[1] = HEX[usize::from(b & 15)];
    }
}

/// One request's trace ([`crate::request::Ctx::trace`]): its span's context, and for a sampled
/// request its spans.
pub struct Trace {
    /// The request span's context (sampled or not): the access log's ids, and the parent an
    /// engine's span gets before any attempt.
    context: SpanContext,
    /// `None` for an unsampled request: no span object, attribute, event or child span (its
    /// context is still propagated, flagged not sampled).
    rec: Option<Box<Recording>>,
}

/// The spans of a sampled request.
struct Recording {
    tracer: SdkTracer,
    server: Span,
    /// The current upstream attempt's span.
    attempt: Option<Span>,
    /// A disaggregated pair's prefill leg (a child of its attempt) and when it was sent.
    prefill: Option<(Span, SystemTime)>,
    attempts: u32,
    operation: &'static str,
}

/// What a planned request is, for its span.
pub struct Planned<'a> {
    /// `gen_ai.operation.name`: `chat`, `text_completion`.
    pub operation: &'static str,
    /// `gen_ai.provider.name`: the API's shape (`openai`, `anthropic`).
    pub provider: &'static str,
    /// The model the client asked for.
    pub model: &'a str,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// The service or route it resolved to.
    pub dest: &'a str,
    /// The tenant of the client's key (`tokengate.tenant`), when there is one.
    pub tenant: Option<&'a str>,
}

/// What an upstream attempt is, for its span.
pub struct AttemptInfo<'a> {
    pub instance: &'a str,
    /// `host:port` of the upstream.
    pub address: Option<String>,
    pub reason: &'a str,
    /// Prompt tokens the prefix index predicted cached there.
    pub predicted_tokens: Option<u64>,
}

impl Trace {
    /// The request is sampled: its spans are recorded (callers skip what only a span uses).
    pub fn recording(&self) -> bool {
        self.rec.is_some()
    }

    /// The request's trace id (32 hex digits) and span id (16), for the access log.
    pub fn ids(&self) -> (String, String) {
        (
            self.context.trace_id().to_string(),
            self.context.span_id().to_string(),
        )
    }

    /// The request was planned: the GenAI request attributes, the span's final name.
    pub fn planned(&mut self, p: Planned<'_>) {
        if let Some(r) = self.rec.as_mut() {
            r.planned(p);
        }
    }

    /// Admission to an instance took `wait` (a throttling queue), or was refused with
    /// `denied` (the answer's status).
    pub fn admitted(&mut self, wait: Duration, denied: Option<u16>) {
        if let Some(r) = self.rec.as_mut() {
            r.admitted(wait, denied);
        }
    }

    /// An event on the request's span.
    pub fn event(&mut self, name: &'static str, attrs: Vec<KeyValue>) {
        if let Some(r) = self.rec.as_mut() {
            r.event(name, attrs);
        }
    }

    /// An attribute on the request's span.
    pub fn attr(&mut self, kv: KeyValue) {
        if let Some(r) = self.rec.as_mut() {
            r.attr(kv);
        }
    }

    /// The route's decision-service call (made while planning): a child span of its own.
    pub fn decision(
        &mut self,
        started: Instant,
        latency: Duration,
        outcome: &'static str,
        model: &str,
        route: &str,
    ) {
        if let Some(r) = self.rec.as_mut() {
            r.decision(started, latency, outcome, model, route);
        }
    }

    /// The first token reached the gateway.
    pub fn first_token(&mut self, ttft: Duration) {
        if let Some(r) = self.rec.as_mut() {
            r.first_token(ttft);
        }
    }

    /// An upstream attempt starts: its child span.
    pub fn attempt_start(&mut self, a: &AttemptInfo<'_>) {
        if let Some(r) = self.rec.as_mut() {
            r.attempt_start(a);
        }
    }

    /// A disaggregated pair's prefill leg is sent: its span (a child of the attempt), and
    /// the trace headers its request carries.
    pub fn prefill_start(&mut self, instance: &str, address: &str) -> TraceHeaders {
        match self.rec.as_mut() {
            Some(r) => r.prefill_start(instance, address),
            None => self.outgoing(),
        }
    }

    /// The prefill leg's span ends: done (after `ms`), failed, or given up on.
    pub fn prefill_end(&mut self, end: PrefillEnd<'_>) {
        if let Some(r) = self.rec.as_mut() {
            r.prefill_end(end);
        }
    }

    /// Ends the current attempt's span: the engine's status, or why it failed.
    pub fn end_attempt(&mut self, status: Option<u16>, error: Option<&str>) {
        if let Some(r) = self.rec.as_mut() {
            r.end_attempt(status, error);
        }
    }

    /// The current attempt failed before answering and the request goes on (a retry on
    /// another instance, or a failover to an external API or another gateway).
    pub fn attempt_failed(&mut self, error: &str, status: Option<u16>, failover: bool) {
        if let Some(r) = self.rec.as_mut() {
            r.attempt_failed(error, status, failover);
        }
    }

    /// The `traceparent` (and `tracestate`) the upstream request carries: the attempt's
    /// span as the parent (the request's span before any attempt, and always for an
    /// unsampled request).
    pub fn outgoing(&self) -> TraceHeaders {
        let sc = match self.rec.as_ref().and_then(|r| r.attempt.as_ref()) {
            Some(a) => opentelemetry::trace::Span::span_context(a),
            None => &self.context,
        };
        TraceHeaders::of(sc)
    }

    /// The request ended: the last attempt and the request's span end.
    pub fn finish(self, end: &Finished<'_>) {
        if let Some(r) = self.rec {
            r.finish(end);
        }
    }
}

impl Recording {
    /// The request was planned: the GenAI request attributes, the span's final name.
    fn planned(&mut self, p: Planned<'_>) {
        use opentelemetry::trace::Span as _;
        self.operation = p.operation;
        let s = &mut self.server;
        s.update_name(format!("{} {}", p.operation, p.model));
        s.set_attribute(KeyValue::new("gen_ai.operation.name", p.operation));
        s.set_attribute(KeyValue::new("gen_ai.provider.name", p.provider));
        s.set_attribute(KeyValue::new("gen_ai.request.model", p.model.to_string()));
        if let Some(m) = p.max_tokens {
            s.set_attribute(KeyValue::new("gen_ai.request.max_tokens", m as i64));
        }
        s.set_attribute(KeyValue::new("tokengate.stream", p.stream));
        s.set_attribute(KeyValue::new("tokengate.service", p.dest.to_string()));
        if let Some(t) = p.tenant {
            s.set_attribute(KeyValue::new("tokengate.tenant", t.to_string()));
        }
    }

    /// Admission to an instance took `wait` (a throttling queue), or was refused with
    /// `denied` (the answer's status).
    fn admitted(&mut self, wait: Duration, denied: Option<u16>) {
        use opentelemetry::trace::Span as _;
        self.server.set_attribute(KeyValue::new(
            "tokengate.queue_wait_ms",
            wait.as_secs_f64() * 1e3,
        ));
        if let Some(status) = denied {
            self.server.add_event(
                "throttled",
                vec![KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                )],
            );
        }
    }

    /// An event on the request's span.
    fn event(&mut self, name: &'static str, attrs: Vec<KeyValue>) {
        use opentelemetry::trace::Span as _;
        self.server.add_event(name, attrs);
    }

    /// An attribute on the request's span.
    fn attr(&mut self, kv: KeyValue) {
        use opentelemetry::trace::Span as _;
        self.server.set_attribute(kv);
    }

    /// The route's decision-service call (made while planning): a child span of its own,
    /// `chat {model}` (kind client), with its outcome.
    fn decision(
        &mut self,
        started: Instant,
        latency: Duration,
        outcome: &'static str,
        model: &str,
        route: &str,
    ) {
        use opentelemetry::trace::Span as _;
        let parent = Context::new().with_remote_span_context(self.server.span_context().clone());
        let start = wall_time(started);
        let mut span = self
            .tracer
            .span_builder(format!("chat {model}"))
            .with_kind(SpanKind::Client)
            .with_start_time(start)
            .with_attributes([
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.request.model", model.to_string()),
                KeyValue::new("tokengate.decision.route", route.to_string()),
                KeyValue::new("tokengate.decision.outcome", outcome),
            ])
            .start_with_context(&self.tracer, &parent);
        if outcome == "timeout" || outcome == "error" {
            span.set_attribute(KeyValue::new("error.type", outcome));
            span.set_status(Status::error(outcome));
        }
        span.end_with_timestamp(start + latency);
    }

    /// The first token reached the gateway.
    fn first_token(&mut self, ttft: Duration) {
        use opentelemetry::trace::Span as _;
        self.server.add_event(
            "gen_ai.first_token",
            vec![KeyValue::new("tokengate.ttft_ms", ttft.as_secs_f64() * 1e3)],
        );
    }

    /// An upstream attempt starts: its child span.
    fn attempt_start(&mut self, a: &AttemptInfo<'_>) {
        use opentelemetry::trace::Span as _;
        self.end_attempt(None, None);
        self.attempts += 1;
        let parent = Context::new().with_remote_span_context(self.server.span_context().clone());
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", self.operation),
            KeyValue::new("tokengate.attempt", i64::from(self.attempts)),
            KeyValue::new("tokengate.instance", a.instance.to_string()),
            KeyValue::new("tokengate.reason", a.reason.to_string()),
        ];
        if let Some(addr) = &a.address {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr.as_str(), ""));
            attrs.push(KeyValue::new("server.address", host.to_string()));
            if let Ok(p) = port.parse::<i64>() {
                attrs.push(KeyValue::new("server.port", p));
            }
        }
        if let Some(p) = a.predicted_tokens {
            attrs.push(KeyValue::new("tokengate.prefix.predicted_tokens", p as i64));
        }
        let span = self
            .tracer
            .span_builder(format!("upstream {}", a.instance))
            .with_kind(SpanKind::Client)
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &parent);
        self.attempt = Some(span);
    }

    /// A disaggregated pair's prefill leg is sent: its span (a child of the attempt), and
    /// the trace headers its request carries.
    fn prefill_start(&mut self, instance: &str, address: &str) -> TraceHeaders {
        use opentelemetry::trace::Span as _;
        self.prefill_end(PrefillEnd::Aborted);
        let parent_sc = match &self.attempt {
            Some(a) => a.span_context().clone(),
            None => self.server.span_context().clone(),
        };
        let parent = Context::new().with_remote_span_context(parent_sc);
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", self.operation),
            KeyValue::new("tokengate.instance", instance.to_string()),
            KeyValue::new("tokengate.pd.role", "prefill"),
        ];
        let (host, port) = address.rsplit_once(':').unwrap_or((address, ""));
        attrs.push(KeyValue::new("server.address", host.to_string()));
        if let Ok(p) = port.parse::<i64>() {
            attrs.push(KeyValue::new("server.port", p));
        }
        let now = SystemTime::now();
        let span = self
            .tracer
            .span_builder(format!("prefill {instance}"))
            .with_kind(SpanKind::Client)
            .with_start_time(now)
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &parent);
        let headers = TraceHeaders::of(span.span_context());
        self.prefill = Some((span, now));
        headers
    }

    /// The prefill leg's span ends: done (after `ms`), failed, or given up on.
    fn prefill_end(&mut self, end: PrefillEnd<'_>) {
        use opentelemetry::trace::Span as _;
        let Some((mut s, started)) = self.prefill.take() else {
            return;
        };
        match end {
            PrefillEnd::Done { ms, input_tokens } => {
                if let Some(n) = input_tokens {
                    s.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", n as i64));
                }
                s.end_with_timestamp(started + Duration::from_secs_f64(ms.max(0.0) / 1e3));
            }
            PrefillEnd::Failed(e) => {
                s.set_attribute(KeyValue::new("error.type", e.to_string()));
                s.set_status(Status::error(e.to_string()));
                s.end();
            }
            PrefillEnd::Aborted => {
                s.set_attribute(KeyValue::new("tokengate.pd.aborted", true));
                s.end();
            }
            PrefillEnd::Running => s.end(),
        }
    }

    /// Ends the current attempt's span: the engine's status, or why it failed.
    fn end_attempt(&mut self, status: Option<u16>, error: Option<&str>) {
        use opentelemetry::trace::Span as _;
        let Some(mut s) = self.attempt.take() else {
            return;
        };
        if let Some(st) = status {
            s.set_attribute(KeyValue::new("http.response.status_code", i64::from(st)));
        }
        if let Some(e) = error {
            s.set_attribute(KeyValue::new("error.type", e.to_string()));
            s.set_status(Status::error(e.to_string()));
        }
        s.end();
    }

    /// The current attempt failed before answering and the request goes on (`next`: a retry
    /// on another instance, or a failover to an external API or another gateway).
    fn attempt_failed(&mut self, error: &str, status: Option<u16>, failover: bool) {
        self.end_attempt(status, Some(error));
        let n = i64::from(self.attempts);
        self.event(
            if failover { "failover" } else { "retry" },
            vec![
                KeyValue::new("tokengate.attempt", n),
                KeyValue::new("error.type", error.to_string()),
            ],
        );
    }

    /// The request ended: the last attempt and the request's span end.
    fn finish(mut self: Box<Self>, end: &Finished<'_>) {
        use opentelemetry::trace::Span as _;
        let err = end.error_type.clone();
        self.end_attempt(
            end.upstream_status,
            if end.upstream_failed {
                err.as_deref()
            } else {
                None
            },
        );
        let s = &mut self.server;
        s.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(end.status),
        ));
        if let Some(m) = end.response_model {
            s.set_attribute(KeyValue::new("gen_ai.response.model", m.to_string()));
        }
        if let Some(v) = end.input_tokens {
            s.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", v as i64));
        }
        if let Some(v) = end.output_tokens {
            s.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", v as i64));
        }
        if let Some(v) = end.cached_tokens {
            s.set_attribute(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                v as i64,
            ));
            s.set_attribute(KeyValue::new("tokengate.prefix.engine_tokens", v as i64));
        }
        if let Some(i) = end.instance {
            s.set_attribute(KeyValue::new("tokengate.instance", i.to_string()));
        }
        if let Some(a) = end.address.as_deref() {
            let (host, port) = a.rsplit_once(':').unwrap_or((a, ""));
            s.set_attribute(KeyValue::new("server.address", host.to_string()));
            if let Ok(p) = port.parse::<i64>() {
                s.set_attribute(KeyValue::new("server.port", p));
            }
        }
        if !end.reason.is_empty() {
            s.set_attribute(KeyValue::new("tokengate.reason", end.reason.to_string()));
        }
        if let Some(p) = end.predicted_tokens {
            s.set_attribute(KeyValue::new("tokengate.prefix.predicted_tokens", p as i64));
        }
        if let Some(t) = end.ttft {
            s.set_attribute(KeyValue::new("tokengate.ttft_ms", t.as_secs_f64() * 1e3));
        }
        s.set_attribute(KeyValue::new(
            "tokengate.attempts",
            i64::from(self.attempts),
        ));
        if let Some(e) = err {
            s.set_attribute(KeyValue::new("error.type", e.clone()));
            s.set_status(Status::error(e));
        }
        s.end();
    }
}

/// How a prefill leg ended, for its span.
pub enum PrefillEnd<'a> {
    Done {
        ms: f64,
        input_tokens: Option<u64>,
    },
    Failed(&'a str),
    Aborted,
    /// Still running when the request ended.
    Running,
}

/// How a request ended, for its span.
pub struct Finished<'a> {
    pub status: u16,
    pub upstream_status: Option<u16>,
    /// The last attempt failed (its span gets `error.type` too).
    pub upstream_failed: bool,
    /// Set when the request failed: the status code or the error's kind.
    pub error_type: Option<String>,
    pub response_model: Option<&'a str>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub instance: Option<&'a str>,
    pub address: Option<String>,
    pub reason: &'a str,
    pub predicted_tokens: Option<u64>,
    pub ttft: Option<Duration>,
}
