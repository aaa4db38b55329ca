//! W3C trace context: reading a client's `traceparent` / `tracestate`, writing an upstream
//! request's.

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::{SpanContext, TraceFlags};

/// A request's headers as the propagator reads them.
pub(super) struct Headers<'a>(pub(super) &'a http::HeaderMap);

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
    pub(super) fn of(sc: &SpanContext) -> TraceHeaders {
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
