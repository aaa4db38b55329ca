//! One request's trace: its server span, the upstream attempts' and prefill legs' child
//! spans, their attributes and events, and how the request ended.

use opentelemetry::trace::{SpanContext, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};
use std::time::{Duration, Instant, SystemTime};

use super::propagation::TraceHeaders;

/// The wall-clock time of a monotonic instant in the past.
pub(super) fn wall_time(at: Instant) -> SystemTime {
    SystemTime::now()
        .checked_sub(at.elapsed())
        .unwrap_or_else(SystemTime::now)
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
    /// An unsampled request's trace: its ids only.
    pub(super) fn unsampled(context: SpanContext) -> Trace {
        Trace { context, rec: None }
    }

    /// A sampled request's trace, its server span started.
    pub(super) fn sampled(tracer: SdkTracer, server: Span) -> Trace {
        let context = opentelemetry::trace::Span::span_context(&server).clone();
        Trace {
            context,
            rec: Some(Box::new(Recording {
                tracer,
                server,
                attempt: None,
                prefill: None,
                attempts: 0,
                operation: "chat",
            })),
        }
    }

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
