//! `tracing:`: OpenTelemetry traces exported over OTLP (see [`crate::otel`]).

use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;
use std::time::Duration;

/// OpenTelemetry traces (`tracing:`). Absent: off, and nothing of it runs on the request
/// path. Read at start (a reload that changes it is logged and applies at the next start).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSettings {
    /// Where the spans go.
    pub otlp: OtlpSettings,
    /// Share of new traces recorded, 0.0–1.0 (a client's `traceparent` decides for its
    /// own trace: parent-based sampling).
    #[serde(default = "d_ratio")]
    pub sample_ratio: f64,
    /// The `service.name` resource attribute.
    #[serde(default = "d_service_name")]
    pub service_name: String,
}

/// The OTLP exporter.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpSettings {
    /// The collector. `http`: a base URL (`http://collector:4318`, `/v1/traces` is appended)
    /// or the full traces URL (any other path is used as is). `grpc`: the collector's address
    /// only (`http://collector:4317`; `https://` for TLS with the webpki roots), no path.
    pub endpoint: String,
    /// `http` (OTLP/HTTP with protobuf bodies, the collector's port 4318) or `grpc`
    /// (OTLP/gRPC, port 4317).
    #[serde(default)]
    pub protocol: OtlpProtocol,
    /// Sent with every export (e.g. a vendor's API key): HTTP headers, or gRPC metadata;
    /// never printed.
    #[serde(default, serialize_with = "masked_values")]
    pub headers: BTreeMap<String, String>,
    /// Longest one export may take.
    #[serde(default = "d_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OtlpProtocol {
    #[default]
    Http,
    Grpc,
}

fn d_ratio() -> f64 {
    1.0
}
fn d_service_name() -> String {
    "tokengate".into()
}
fn d_timeout() -> Duration {
    Duration::from_secs(10)
}

/// The header names with their values masked (`tokengate check --print`).
fn masked_values<S: Serializer>(v: &BTreeMap<String, String>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(v.keys().map(|k| (k, super::secret::MASK)))
}

impl TracingSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        if !(self.sample_ratio.is_finite() && (0.0..=1.0).contains(&self.sample_ratio)) {
            errs.push(format!(
                "tracing.sample_ratio: {} is not a ratio (expected 0.0 to 1.0; 1.0 records every trace)",
                self.sample_ratio
            ));
        }
        if self.service_name.trim().is_empty() {
            errs.push("tracing.service_name: must not be empty".into());
        }
        let o = &self.otlp;
        let example = match o.protocol {
            OtlpProtocol::Http => "http://otel-collector:4318",
            OtlpProtocol::Grpc => "http://otel-collector:4317",
        };
        match o.endpoint.parse::<http::Uri>() {
            Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {
                let path = u.path_and_query().map_or("", |p| p.as_str());
                if o.protocol == OtlpProtocol::Grpc && !path.trim_matches('/').is_empty() {
                    errs.push(format!(
                        "tracing.otlp.endpoint: {:?} has a path ({path}); OTLP/gRPC takes the collector's address only (e.g. {example}; /v1/traces is OTLP/HTTP's, on port 4318)",
                        o.endpoint
                    ));
                }
            }
            _ => errs.push(format!(
                "tracing.otlp.endpoint: {:?} is not an http:// or https:// URL (e.g. {example})",
                o.endpoint
            )),
        }
        for (k, v) in &o.headers {
            if http::HeaderName::from_bytes(k.as_bytes()).is_err() {
                errs.push(format!("tracing.otlp.headers.{k}: not a valid header name"));
            } else if http::HeaderValue::from_str(v).is_err() {
                errs.push(format!(
                    "tracing.otlp.headers.{k}: the value is not a valid header value"
                ));
            }
        }
        if o.timeout.is_zero() {
            errs.push("tracing.otlp.timeout: must be greater than 0".into());
        }
    }

    /// The URL the spans are posted to (`http`), or the collector's address (`grpc`).
    pub fn traces_url(&self) -> String {
        let e = self.otlp.endpoint.trim_end_matches('/');
        if self.otlp.protocol == OtlpProtocol::Grpc {
            return e.to_string();
        }
        match e.parse::<http::Uri>() {
            Ok(u) if u.path().trim_matches('/').is_empty() => format!("{e}/v1/traces"),
            _ => e.to_string(),
        }
    }
}
