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
    /// The collector: a base URL (`http://collector:4318`, `/v1/traces` is appended) or the
    /// full traces URL (any other path is used as is).
    pub endpoint: String,
    /// `http` (OTLP/HTTP with protobuf bodies). `grpc` is not built in yet.
    #[serde(default)]
    pub protocol: OtlpProtocol,
    /// Sent with every export (e.g. a vendor's API key); never printed.
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
        match o.endpoint.parse::<http::Uri>() {
            Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {}
            _ => errs.push(format!(
                "tracing.otlp.endpoint: {:?} is not an http:// or https:// URL (e.g. http://otel-collector:4318)",
                o.endpoint
            )),
        }
        if o.protocol == OtlpProtocol::Grpc {
            errs.push(
                "tracing.otlp.protocol: grpc is not supported by this build; use http (OTLP/HTTP protobuf, the collector's port 4318)"
                    .into(),
            );
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

    /// The URL the spans are posted to.
    pub fn traces_url(&self) -> String {
        let e = self.otlp.endpoint.trim_end_matches('/');
        match e.parse::<http::Uri>() {
            Ok(u) if u.path().trim_matches('/').is_empty() => format!("{e}/v1/traces"),
            _ => e.to_string(),
        }
    }
}
