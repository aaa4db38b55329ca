//! The export side of tracing: the span counters, the bounded queue the SDK hands ended
//! spans to, and the OTLP exporter (HTTP/protobuf, or gRPC built on the sender's runtime).

use crate::config::OtlpProtocol;
use crate::config::TracingSettings;
use opentelemetry::Context;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter as _, SpanProcessor};
use opentelemetry_sdk::Resource;
use prometheus::{IntCounter, IntCounterVec, Opts};
use std::time::Duration;
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
    pub(super) exported: IntCounter,
    queue_full: IntCounter,
    pub(super) export_failed: IntCounter,
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
pub(super) struct QueueProcessor {
    pub(super) tx: mpsc::Sender<SpanData>,
    pub(super) counters: SpanCounters,
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

/// What the background sender needs (taken once by [`super::Otel::run`]).
pub(super) struct Sender {
    pub(super) rx: mpsc::Receiver<SpanData>,
    pub(super) exporter: Exporter,
}

/// The OTLP exporter, or what builds it on the sender's runtime (gRPC).
pub(super) enum Exporter {
    Ready(opentelemetry_otlp::SpanExporter),
    Grpc {
        endpoint: String,
        timeout: Duration,
        metadata: http::HeaderMap,
        resource: Resource,
    },
}

impl Exporter {
    /// The exporter `tracing.otlp` names: an HTTP one ready now, a gRPC one's parts (its
    /// channel is built on the sender's runtime by [`Exporter::build`]).
    pub(super) fn new(
        s: &TracingSettings,
        url: &str,
        resource: &Resource,
    ) -> Result<Exporter, String> {
        Ok(match s.otlp.protocol {
            OtlpProtocol::Http => {
                let client = reqwest::Client::builder()
                    .timeout(s.otlp.timeout)
                    .connect_timeout(s.otlp.timeout)
                    .build()
                    .map_err(|e| format!("tracing.otlp: {e}"))?;
                let mut exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_endpoint(url.to_string())
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_timeout(s.otlp.timeout)
                    .with_headers(s.otlp.headers.clone().into_iter().collect())
                    .build()
                    .map_err(|e| format!("tracing.otlp.endpoint: {e}"))?;
                exporter.set_resource(resource);
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
                    endpoint: url.to_string(),
                    timeout: s.otlp.timeout,
                    metadata,
                    resource: resource.clone(),
                }
            }
        })
    }

    /// The exporter; a gRPC one gets its (lazily connecting) channel here, which needs
    /// a tokio runtime.
    pub(super) fn build(self) -> Result<opentelemetry_otlp::SpanExporter, String> {
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
