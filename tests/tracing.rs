//! OpenTelemetry traces through the real binary, exported to a test OTLP/HTTP receiver that
//! decodes `ExportTraceServiceRequest` with the official protobuf definitions (or, with
//! `protocol: grpc`, a tonic server of their generated `TraceService`): one server
//! span per request with the GenAI attributes and the engine's token counts, a client span
//! per upstream attempt (two when the first instance refuses the connection), the client's
//! `traceparent` continued, the engine's `traceparent` parented on the gateway's attempt
//! span, sampling at 0 exporting nothing, and a dead collector changing nothing for clients
//! (its spans counted as dropped), over either transport.

mod common;

use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the receiver got: every span (with its resource's `service.name`) and every export
/// request's path and headers.
#[derive(Default)]
struct Received {
    spans: Vec<(String, Span)>,
    requests: Vec<(String, Vec<(String, String)>)>,
}

/// A test OTLP/HTTP collector on 127.0.0.1:0.
struct Collector {
    addr: SocketAddr,
    got: Arc<Mutex<Received>>,
}

impl Collector {
    async fn start() -> Collector {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = Collector {
            addr: l.local_addr().unwrap(),
            got: Arc::default(),
        };
        let got = c.got.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    break;
                };
                let got = got.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        // One request: head, then a content-length body.
                        let (head_len, path, headers, len) = loop {
                            let mut hs = [httparse::EMPTY_HEADER; 64];
                            let mut req = httparse::Request::new(&mut hs);
                            if let Ok(httparse::Status::Complete(n)) = req.parse(&buf) {
                                let headers: Vec<(String, String)> = req
                                    .headers
                                    .iter()
                                    .map(|h| {
                                        (
                                            h.name.to_ascii_lowercase(),
                                            String::from_utf8_lossy(h.value).to_string(),
                                        )
                                    })
                                    .collect();
                                let len = headers
                                    .iter()
                                    .find(|(k, _)| k == "content-length")
                                    .and_then(|(_, v)| v.parse::<usize>().ok())
                                    .expect("the exporter sends a content-length");
                                break (n, req.path.unwrap_or("").to_string(), headers, len);
                            }
                            let mut tmp = [0u8; 65536];
                            match s.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&tmp[..k]),
                            }
                        };
                        while buf.len() < head_len + len {
                            let mut tmp = [0u8; 65536];
                            match s.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&tmp[..k]),
                            }
                        }
                        let body: Vec<u8> = buf.drain(..head_len + len).skip(head_len).collect();
                        let req = ExportTraceServiceRequest::decode(body.as_slice())
                            .expect("an ExportTraceServiceRequest");
                        record(&got, path, headers, req);
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        c
    }

    /// A test OTLP/gRPC collector on 127.0.0.1:0: tonic's server with the official
    /// `TraceService` (a call reaches [`GrpcReceiver::export`] only on its method's path).
    async fn start_grpc() -> Collector {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = Collector {
            addr: l.local_addr().unwrap(),
            got: Arc::default(),
        };
        let svc = TraceServiceServer::new(GrpcReceiver { got: c.got.clone() });
        tokio::spawn(
            tonic::transport::Server::builder()
                .serve_with_incoming(svc, tonic::transport::server::TcpIncoming::from(l)),
        );
        c
    }

    fn spans(&self) -> Vec<Span> {
        let g = self.got.lock().unwrap();
        g.spans.iter().map(|(_, s)| s.clone()).collect()
    }

    /// Waits until `n` spans of `trace` (hex) arrived; returns them.
    async fn wait_trace(&self, trace: &str, n: usize) -> Vec<Span> {
        let mut out = Vec::new();
        eventually(&format!("{n} spans of trace {trace}"), || {
            out = self
                .spans()
                .into_iter()
                .filter(|s| hex(&s.trace_id) == trace)
                .collect();
            let done = out.len() >= n;
            async move { done }
        })
        .await;
        out
    }
}

/// One export request: its path and headers, its spans with their `service.name`.
fn record(
    got: &Mutex<Received>,
    path: String,
    headers: Vec<(String, String)>,
    req: ExportTraceServiceRequest,
) {
    let mut g = got.lock().unwrap();
    g.requests.push((path, headers));
    for rs in req.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| str_attr(&r.attributes, "service.name"))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for sp in ss.spans {
                g.spans.push((service.clone(), sp));
            }
        }
    }
}

/// The gRPC collector's `TraceService`: records each export with its metadata.
struct GrpcReceiver {
    got: Arc<Mutex<Received>>,
}

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let headers = request
            .metadata()
            .clone()
            .into_headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).to_string(),
                )
            })
            .collect();
        record(
            &self.got,
            "TraceService/Export".to_string(),
            headers,
            request.into_inner(),
        );
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr<'a>(kv: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    kv.iter()
        .find(|k| k.key == key)
        .and_then(|k| k.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

/// Sends `n` streamed chats (each must complete) through a gateway whose collector cannot
/// take them: every span (two per request: the request, its attempt) ends counted as dropped
/// by a failed export, none as exported. Returns the metrics text at the end.
async fn streams_complete_and_every_span_drops(gw: &GatewayProc, n: u32, to: &str) -> String {
    for _ in 0..n {
        let r = stream_chat(gw, None).await;
        let body = r.text().await.unwrap();
        assert!(body.contains("[DONE]"), "{body}");
    }
    eventually(
        &format!("every span to {to} counted as dropped"),
        || async {
            let m = gw.metrics().await;
            metric(
                &m,
                "tokengate_trace_spans_total{outcome=\"dropped_export_failed\"}",
            ) == Some(f64::from(2 * n))
        },
    )
    .await;
    let m = gw.metrics().await;
    assert_eq!(
        metric(&m, "tokengate_trace_spans_total{outcome=\"exported\"}"),
        Some(0.0)
    );
    m
}

/// A streamed chat's two spans: the server span (named `chat m`) and its upstream attempt.
fn server_and_attempt(spans: &[Span]) -> (&Span, &Span) {
    let server = spans
        .iter()
        .find(|s| s.kind == SERVER)
        .expect("a server span");
    let attempt = spans
        .iter()
        .find(|s| s.kind == CLIENT)
        .expect("an attempt span");
    assert_eq!(server.name, "chat m");
    (server, attempt)
}

/// The GenAI attributes of a chat with model `m` against the mock upstream, whose usage chunk
/// says 7 prompt tokens (4 cached) and 5 completion tokens.
fn assert_mock_chat_attrs(a: &[KeyValue]) {
    assert_eq!(
        str_attr(a, "gen_ai.operation.name").as_deref(),
        Some("chat")
    );
    assert_eq!(
        str_attr(a, "gen_ai.provider.name").as_deref(),
        Some("openai")
    );
    assert_eq!(str_attr(a, "gen_ai.request.model").as_deref(), Some("m"));
    assert_eq!(str_attr(a, "gen_ai.response.model").as_deref(), Some("m"));
    assert_eq!(int_attr(a, "gen_ai.usage.input_tokens"), Some(7));
    assert_eq!(int_attr(a, "gen_ai.usage.output_tokens"), Some(5));
    assert_eq!(int_attr(a, "gen_ai.usage.cache_read.input_tokens"), Some(4));
}

fn str_attr(kv: &[KeyValue], key: &str) -> Option<String> {
    match attr(kv, key) {
        Some(Value::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn int_attr(kv: &[KeyValue], key: &str) -> Option<i64> {
    match attr(kv, key) {
        Some(Value::IntValue(i)) => Some(*i),
        _ => None,
    }
}

/// `tokengate_requests_total` of model `m` on `e1` with `code`, whatever its other labels.
fn requests(metrics: &str, code: u16) -> f64 {
    let prefix = format!("tokengate_requests_total{{code=\"{code}\",instance=\"e1\",model=\"m\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const SERVER: i32 = 2;
const CLIENT: i32 = 3;

fn tracing_block(collector: SocketAddr, ratio: f64) -> String {
    format!(
        "tracing:\n  otlp:\n    endpoint: http://{collector}\n    headers: {{x-collector-key: k-123}}\n    timeout: 2s\n  sample_ratio: {ratio}\n  service_name: gw-test\n"
    )
}

/// `tracing_block` over OTLP/gRPC, with `timeout`.
fn grpc_tracing_block(collector: SocketAddr, timeout: &str) -> String {
    format!(
        "tracing:\n  otlp:\n    protocol: grpc\n    endpoint: http://{collector}\n    headers: {{x-collector-key: k-123}}\n    timeout: {timeout}\n  sample_ratio: 1.0\n  service_name: gw-test\n"
    )
}

async fn stream_chat(gw: &GatewayProc, traceparent: Option<&str>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-mock", "sse")
        .body(chat_body("m", 200, true));
    if let Some(tp) = traceparent {
        req = req
            .header("traceparent", tp)
            .header("tracestate", "vendor=abc");
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r
}

/// The access line's `key=value` of the request with `id`.
fn access_field(log: &str, id: &str, key: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(&format!(" id={id}")))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_is_one_server_span_with_genai_attributes_and_an_attempt_child() {
    let col = Collector::start().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n{}",
        tracing_block(col.addr, 1.0),
        service("m", &[("e1", engine.addr)])
    ));

    // A new trace.
    let r = stream_chat(&gw, None).await;
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    r.bytes().await.unwrap();
    let seen = engine.seen();
    assert_eq!(seen.len(), 1);
    let tp = seen[0]
        .header("traceparent")
        .expect("the engine got a traceparent");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[3], "01", "sampled: {tp}");
    let spans = col.wait_trace(parts[1], 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let (server, attempt) = server_and_attempt(&spans);
    assert!(server.parent_span_id.is_empty(), "a root span");
    let a = &server.attributes;
    assert_mock_chat_attrs(a);
    assert_eq!(str_attr(a, "server.address").as_deref(), Some("127.0.0.1"));
    assert_eq!(
        int_attr(a, "server.port"),
        Some(i64::from(engine.addr.port()))
    );
    assert_eq!(int_attr(a, "http.response.status_code"), Some(200));
    assert_eq!(str_attr(a, "tokengate.service").as_deref(), Some("m"));
    assert_eq!(str_attr(a, "tokengate.instance").as_deref(), Some("e1"));
    assert!(str_attr(a, "tokengate.tenant").is_none(), "no tenants here");
    assert!(str_attr(a, "tokengate.reason").is_some_and(|r| !r.is_empty()));
    assert!(int_attr(a, "tokengate.prefix.predicted_tokens").is_some());
    assert!(attr(a, "tokengate.queue_wait_ms").is_some());
    assert!(str_attr(a, "error.type").is_none());
    assert!(
        server.events.iter().any(|e| e.name == "gen_ai.first_token"),
        "{:?}",
        server.events
    );
    // The attempt is the server span's child, and the engine's parent.
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(attempt.name, "upstream e1");
    assert_eq!(parts[2], hex(&attempt.span_id));
    assert_eq!(int_attr(&attempt.attributes, "tokengate.attempt"), Some(1));
    assert_eq!(
        int_attr(&attempt.attributes, "http.response.status_code"),
        Some(200)
    );
    // The resource, the configured headers and the path of the export.
    {
        let g = col.got.lock().unwrap();
        assert!(g.spans.iter().all(|(svc, _)| svc == "gw-test"));
        let (path, headers) = &g.requests[0];
        assert_eq!(path, "/v1/traces");
        assert!(headers
            .iter()
            .any(|(k, v)| k == "x-collector-key" && v == "k-123"));
    }
    // The access line names the trace and the request's span.
    eventually("the access line", || {
        let log = gw.log_text();
        let id = id.clone();
        async move { access_field(&log, &id, "trace_id").is_some() }
    })
    .await;
    let log = gw.log_text();
    assert_eq!(
        access_field(&log, &id, "trace_id").as_deref(),
        Some(parts[1]),
        "{log}"
    );
    assert_eq!(
        access_field(&log, &id, "span_id"),
        Some(hex(&server.span_id))
    );

    // A client's trace is continued: same trace id, the client's span as the parent, its
    // tracestate passed on to the engine.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    stream_chat(&gw, Some(&format!("00-{client_trace}-{client_span}-01")))
        .await
        .bytes()
        .await
        .unwrap();
    let spans = col.wait_trace(client_trace, 2).await;
    let server = spans.iter().find(|s| s.kind == SERVER).unwrap();
    let attempt = spans.iter().find(|s| s.kind == CLIENT).unwrap();
    assert_eq!(hex(&server.parent_span_id), client_span);
    assert_eq!(attempt.parent_span_id, server.span_id);
    let seen = engine.seen();
    let last = seen.last().unwrap();
    assert_eq!(
        last.header("traceparent"),
        Some(format!("00-{client_trace}-{}-01", hex(&attempt.span_id)).as_str())
    );
    assert_eq!(last.header("tracestate"), Some("vendor=abc"));
}

/// A request of a tenant's key names its tenant on its span (`tokengate.tenant`); one of
/// the global `api_keys` is the implicit tenant `default`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_request_span_names_its_tenant() {
    let col = Collector::start().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}api_keys: [sk-global]\ntenants:\n  - name: search-team\n    keys: [sk-search]\nservices:\n{}",
        tracing_block(col.addr, 1.0),
        service("m", &[("e1", engine.addr)])
    ));
    for (key, trace, tenant) in [
        (
            "sk-search",
            "4bf92f3577b34da6a3ce929d0e0e0001",
            "search-team",
        ),
        ("sk-global", "4bf92f3577b34da6a3ce929d0e0e0002", "default"),
    ] {
        let r = reqwest::Client::new()
            .post(gw.url("/v1/chat/completions"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .header("x-mock", "sse")
            .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
            .body(chat_body("m", 200, true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        let spans = col.wait_trace(trace, 2).await;
        let server = spans.iter().find(|s| s.kind == SERVER).unwrap();
        assert_eq!(
            str_attr(&server.attributes, "tokengate.tenant").as_deref(),
            Some(tenant),
            "{server:#?}"
        );
    }
}

/// A reload applies a changed `tracing:` block to the requests admitted after it: another
/// collector and `sample_ratio` 0 → 1, then no block (tracing off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_changed_tracing_settings() {
    let first = Collector::start().await;
    let second = Collector::start().await;
    let engine = Mock::recording().await;
    let services = format!("services:\n{}", service("m", &[("e1", engine.addr)]));
    let gw = GatewayProc::start(&format!("{}{services}", tracing_block(first.addr, 0.0)));
    let cfg = gw.config_path();
    let header = std::fs::read_to_string(&cfg)
        .unwrap()
        .split("tracing:")
        .next()
        .unwrap()
        .to_string();
    let last_traceparent = || {
        engine
            .seen()
            .last()
            .unwrap()
            .header("traceparent")
            .map(str::to_string)
    };
    let reloads = |n: u32| {
        let gw = &gw;
        async move {
            eventually(&format!("reload {n} applied"), || async {
                metric(
                    &gw.metrics().await,
                    "tokengate_config_reloads_total{result=\"ok\"}",
                ) == Some(f64::from(n))
            })
            .await
        }
    };
    // Ratio 0: the engine gets an unsampled traceparent.
    stream_chat(&gw, None).await.bytes().await.unwrap();
    assert!(last_traceparent().unwrap().ends_with("-00"));

    // To the second collector at ratio 1.
    std::fs::write(
        &cfg,
        format!("{header}{}{services}", tracing_block(second.addr, 1.0)),
    )
    .unwrap();
    reloads(1).await;
    stream_chat(&gw, None).await.bytes().await.unwrap();
    let tp = last_traceparent().unwrap();
    assert!(tp.ends_with("-01"), "sampled after the reload: {tp}");
    let trace = tp.split('-').nth(1).unwrap().to_string();
    let spans = second.wait_trace(&trace, 2).await;
    assert!(spans.iter().any(|s| s.kind == SERVER && s.name == "chat m"));
    assert!(
        first.spans().is_empty(),
        "nothing went to the old collector"
    );
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        status["tracing"]["endpoint"]
            .as_str()
            .is_some_and(|e| e.contains(&second.addr.to_string())),
        "{}",
        status["tracing"]
    );

    // No block: tracing off, no traceparent to the engine, nothing exported.
    std::fs::write(&cfg, format!("{header}{services}")).unwrap();
    reloads(2).await;
    stream_chat(&gw, None).await.bytes().await.unwrap();
    assert_eq!(last_traceparent(), None);
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        status["tracing"]["endpoint"].is_null(),
        "{}",
        status["tracing"]
    );
    assert_eq!(second.spans().len(), 2, "only the sampled request's spans");
}

/// A reload that changes `protocol` moves the spans from the OTLP/HTTP collector to the
/// gRPC one (the new sender's channel is built on the running gateway's runtime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_switches_the_transport_from_http_to_grpc() {
    let http_col = Collector::start().await;
    let grpc_col = Collector::start_grpc().await;
    let engine = Mock::recording().await;
    let services = format!("services:\n{}", service("m", &[("e1", engine.addr)]));
    let gw = GatewayProc::start(&format!("{}{services}", tracing_block(http_col.addr, 1.0)));
    let trace_of_last = || {
        let tp = engine
            .seen()
            .last()
            .unwrap()
            .header("traceparent")
            .unwrap()
            .to_string();
        tp.split('-').nth(1).unwrap().to_string()
    };
    stream_chat(&gw, None).await.bytes().await.unwrap();
    http_col.wait_trace(&trace_of_last(), 2).await;

    let cfg = gw.config_path();
    let header = std::fs::read_to_string(&cfg)
        .unwrap()
        .split("tracing:")
        .next()
        .unwrap()
        .to_string();
    std::fs::write(
        &cfg,
        format!(
            "{header}{}{services}",
            grpc_tracing_block(grpc_col.addr, "2s")
        ),
    )
    .unwrap();
    eventually("the reload applied", || async {
        metric(
            &gw.metrics().await,
            "tokengate_config_reloads_total{result=\"ok\"}",
        ) == Some(1.0)
    })
    .await;
    stream_chat(&gw, None).await.bytes().await.unwrap();
    let spans = grpc_col.wait_trace(&trace_of_last(), 2).await;
    assert!(spans.iter().any(|s| s.kind == SERVER && s.name == "chat m"));
    assert_eq!(http_col.spans().len(), 2, "only the first request's spans");
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        status["tracing"]["protocol"], "grpc",
        "{}",
        status["tracing"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_above_the_retry_buffer_is_traced_like_any_other() {
    // Bodies above 64 KiB are proxied by a subrequest: the trace goes with the plan.
    let col = Collector::start().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n{}",
        tracing_block(col.addr, 1.0),
        service("m", &[("e1", engine.addr)])
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-mock", "sse")
        .body(chat_body("m", 200 * 1024, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    let seen = engine.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].body.len() > 200 * 1024);
    let tp = seen[0]
        .header("traceparent")
        .expect("a traceparent")
        .to_string();
    let trace = tp.split('-').nth(1).unwrap();
    let spans = col.wait_trace(trace, 2).await;
    let server = spans.iter().find(|s| s.kind == SERVER).unwrap();
    let attempt = spans.iter().find(|s| s.kind == CLIENT).unwrap();
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(tp.split('-').nth(2).unwrap(), hex(&attempt.span_id));
    assert_eq!(
        int_attr(&server.attributes, "gen_ai.usage.output_tokens"),
        Some(5)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_request_has_a_throttled_event() {
    use futures_util::StreamExt;
    let col = Collector::start().await;
    let engine = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n  - name: m\n    throttling: {{overflow: reject, total: 1}}\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        tracing_block(col.addr, 1.0),
        engine.addr
    ));
    let c = reqwest::Client::new();
    // One stream holds the only slot…
    let held = c
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "sse")
        .header("x-mock-gate", "1")
        .body(chat_body("m", 200, true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let mut stream = held.bytes_stream();
    stream.next().await.unwrap().unwrap();
    // …so the next request is refused.
    let client_trace = "7bf92f3577b34da6a3ce929d0e0e4736";
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header(
            "traceparent",
            format!("00-{client_trace}-00f067aa0ba902b7-01"),
        )
        .body(chat_body("m", 200, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    r.bytes().await.unwrap();
    engine.release();
    while let Some(b) = stream.next().await {
        b.unwrap();
    }
    let spans = col.wait_trace(client_trace, 1).await;
    assert_eq!(spans.len(), 1, "no attempt: {spans:#?}");
    let server = &spans[0];
    assert_eq!(server.kind, SERVER);
    assert!(
        server.events.iter().any(|e| e.name == "throttled"),
        "{:?}",
        server.events
    );
    assert_eq!(
        int_attr(&server.attributes, "http.response.status_code"),
        Some(429)
    );
    assert!(str_attr(&server.attributes, "error.type").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_first_instance_makes_two_attempt_spans_and_a_retry_event() {
    let col = Collector::start().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}health_check: {{enabled: false}}\nservices:\n  - name: m\n    load_balancing: round-robin\n    instances:\n      - {{id: dead, addr: \"{}\"}}\n      - {{id: up, addr: \"{}\"}}\n",
        tracing_block(col.addr, 1.0),
        dead_addr(),
        engine.addr
    ));
    for _ in 0..2 {
        stream_chat(&gw, None).await.bytes().await.unwrap();
    }
    let seen = engine.seen();
    assert_eq!(seen.len(), 2);
    let mut retried = 0;
    for s in &seen {
        let tp = s.header("traceparent").unwrap().to_string();
        let trace = tp.split('-').nth(1).unwrap().to_string();
        // Wait for the server span (the last to end) of this trace.
        let mut spans = Vec::new();
        eventually("the trace's server span", || {
            spans = col
                .spans()
                .into_iter()
                .filter(|x| hex(&x.trace_id) == trace)
                .collect();
            let done = spans.iter().any(|x| x.kind == SERVER);
            async move { done }
        })
        .await;
        let server = spans.iter().find(|x| x.kind == SERVER).unwrap();
        let mut attempts: Vec<&Span> = spans.iter().filter(|x| x.kind == CLIENT).collect();
        attempts.sort_by_key(|x| int_attr(&x.attributes, "tokengate.attempt"));
        assert!(attempts.iter().all(|x| x.parent_span_id == server.span_id));
        let last = attempts.last().unwrap();
        assert_eq!(
            str_attr(&last.attributes, "tokengate.instance").as_deref(),
            Some("up")
        );
        // The engine's parent is the attempt that reached it.
        assert_eq!(tp.split('-').nth(2).unwrap(), hex(&last.span_id));
        if attempts.len() == 2 {
            retried += 1;
            let first = attempts[0];
            assert_eq!(
                str_attr(&first.attributes, "tokengate.instance").as_deref(),
                Some("dead")
            );
            assert_eq!(
                str_attr(&first.attributes, "error.type").as_deref(),
                Some("connect_error")
            );
            assert_eq!(
                first.status.as_ref().map(|s| s.code),
                Some(2),
                "error status"
            );
            assert!(server.events.iter().any(|e| e.name == "retry"));
            assert_eq!(int_attr(&server.attributes, "tokengate.attempts"), Some(2));
            // The request succeeded: no error on the request's span.
            assert!(str_attr(&server.attributes, "error.type").is_none());
        } else {
            assert_eq!(attempts.len(), 1, "{attempts:#?}");
        }
    }
    // Round-robin sends at least one of the two to the dead instance first.
    assert!(retried >= 1, "no request tried the dead instance first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_ratio_zero_exports_nothing_but_a_sampled_client_trace() {
    let col = Collector::start().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n{}",
        tracing_block(col.addr, 0.0),
        service("m", &[("e1", engine.addr)])
    ));
    for _ in 0..10 {
        stream_chat(&gw, None).await.bytes().await.unwrap();
    }
    // Unsampled: the engine still gets a traceparent, flagged not sampled, a new trace each.
    let seen = engine.seen();
    let mut traces = std::collections::HashSet::new();
    for s in &seen {
        let tp = s.header("traceparent").unwrap();
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "{tp}");
        assert_eq!((parts[0], parts[3]), ("00", "00"), "{tp}");
        assert!(parts[1].len() == 32 && parts[2].len() == 16, "{tp}");
        assert!(
            tp.bytes().all(|b| b == b'-' || b.is_ascii_hexdigit()),
            "{tp}"
        );
        assert_eq!(s.header("tracestate"), None, "no empty tracestate");
        traces.insert(parts[1].to_string());
    }
    assert_eq!(traces.len(), seen.len(), "one trace per request");
    // A client's unsampled trace is continued unsampled: its trace id, a span of the gateway's
    // own as the parent, its tracestate passed on.
    let unsampled = "4bf92f3577b34da6a3ce929d0e0e4736";
    stream_chat(&gw, Some(&format!("00-{unsampled}-00f067aa0ba902b7-00")))
        .await
        .bytes()
        .await
        .unwrap();
    let last = engine.seen().pop().unwrap();
    let tp = last.header("traceparent").unwrap().to_string();
    assert!(tp.starts_with(&format!("00-{unsampled}-")), "{tp}");
    assert!(
        tp.ends_with("-00") && !tp.contains("00f067aa0ba902b7"),
        "{tp}"
    );
    assert_eq!(last.header("tracestate"), Some("vendor=abc"));
    // A client's sampled trace is recorded (parent-based sampling); the queue is FIFO, so
    // once its spans arrived, any span of the 10 requests before it would have too.
    let client_trace = "0af7651916cd43dd8448eb211c80319c";
    stream_chat(&gw, Some(&format!("00-{client_trace}-b7ad6b7169203331-01")))
        .await
        .bytes()
        .await
        .unwrap();
    col.wait_trace(client_trace, 2).await;
    let all = col.spans();
    assert_eq!(all.len(), 2, "only the sampled client trace: {all:#?}");
    assert!(all.iter().all(|s| hex(&s.trace_id) == client_trace));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_changes_nothing_for_clients_and_drops_are_counted() {
    let engine = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n{}",
        tracing_block(dead_addr(), 1.0),
        service("m", &[("e1", engine.addr)])
    ));
    let n = 20;
    let m = streams_complete_and_every_span_drops(&gw, n, "the dead collector").await;
    // The status page shows the same.
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let t = &status["tracing"];
    assert!(
        t["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with("/v1/traces")),
        "{t}"
    );
    assert_eq!(t["spans"]["dropped_export_failed"], 2 * n);
    assert_eq!(t["spans"]["exported"], 0);
    assert_eq!(requests(&m, 200), f64::from(n));
}

/// `protocol: grpc`: the same spans reach a gRPC collector's `TraceService/Export`, the
/// configured headers as gRPC metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_a_streamed_chat_reaches_the_collector_with_its_headers_as_metadata() {
    let col = Collector::start_grpc().await;
    let engine = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n{}",
        grpc_tracing_block(col.addr, "2s"),
        service("m", &[("e1", engine.addr)])
    ));
    stream_chat(&gw, None).await.bytes().await.unwrap();
    let seen = engine.seen();
    assert_eq!(seen.len(), 1);
    let tp = seen[0]
        .header("traceparent")
        .expect("the engine got a traceparent");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    let spans = col.wait_trace(parts[1], 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let (server, attempt) = server_and_attempt(&spans);
    let a = &server.attributes;
    assert_mock_chat_attrs(a);
    assert_eq!(int_attr(a, "http.response.status_code"), Some(200));
    assert!(
        server.events.iter().any(|e| e.name == "gen_ai.first_token"),
        "{:?}",
        server.events
    );
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(parts[2], hex(&attempt.span_id));
    {
        let g = col.got.lock().unwrap();
        assert!(g.spans.iter().all(|(svc, _)| svc == "gw-test"));
        let (_, metadata) = &g.requests[0];
        assert!(
            metadata
                .iter()
                .any(|(k, v)| k == "x-collector-key" && v == "k-123"),
            "{metadata:?}"
        );
        assert!(
            metadata
                .iter()
                .any(|(k, v)| k == "content-type" && v == "application/grpc"),
            "{metadata:?}"
        );
    }
    eventually("the exported spans counted", || async {
        let m = gw.metrics().await;
        metric(&m, "tokengate_trace_spans_total{outcome=\"exported\"}") == Some(2.0)
    })
    .await;
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let t = &status["tracing"];
    assert_eq!(t["protocol"], "grpc", "{t}");
    assert_eq!(t["endpoint"], format!("http://{}", col.addr), "{t}");
}

/// A gRPC collector that refuses connections, and one that accepts them and never answers
/// (the export bounded by `timeout`): clients see nothing of it, every span is counted as
/// dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_a_dead_or_silent_collector_changes_nothing_for_clients() {
    // Accepts, reads and discards, never answers: no HTTP/2 settings, no response.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = silent.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    for (collector, timeout) in [(dead_addr(), "2s"), (silent_addr, "300ms")] {
        let engine = Mock::start().await;
        let gw = GatewayProc::start_with_env(
            &format!(
                "{}services:\n{}",
                grpc_tracing_block(collector, timeout),
                service("m", &[("e1", engine.addr)])
            ),
            &[("RUST_LOG", "info,tokengate::otel=debug")],
        );
        let n = 10;
        let m = streams_complete_and_every_span_drops(&gw, n, &collector.to_string()).await;
        assert_eq!(requests(&m, 200), f64::from(n));
        // Why each export failed: the silent one ended by `timeout`.
        eventually("the failed export logged", || {
            let log = gw.log_text();
            async move { log.contains("spans not exported to") }
        })
        .await;
        let log = gw.log_text();
        let failed = log
            .lines()
            .find(|l| l.contains("spans not exported to"))
            .unwrap_or_else(|| panic!("{log}"))
            .to_string();
        assert!(failed.contains("(grpc)"), "{failed}");
        if collector == silent_addr {
            // Ours ("no answer within") or tonic's channel timeout, whichever fires first.
            assert!(
                failed.contains("no answer within 300ms") || failed.contains("imeout"),
                "{failed}"
            );
        } else {
            assert!(failed.contains("Connection refused"), "{failed}");
        }
    }
}

/// An `https://` gRPC endpoint is spoken to in TLS, trusting the webpki roots: a collector
/// whose certificate a private CA signed is refused (its spans counted as dropped), the
/// log line saying why; the client's request is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_an_https_endpoint_is_tls_with_the_webpki_roots() {
    let col = Collector::start_grpc().await;
    let pki = common::tls::TestPki::new();
    let front = common::tls::tls_front(&pki, col.addr).await;
    let engine = Mock::start().await;
    let gw = GatewayProc::start_with_env(
        &format!(
            "tracing:\n  otlp: {{protocol: grpc, endpoint: \"https://localhost:{}\", timeout: 2s}}\nservices:\n{}",
            front.port(),
            service("m", &[("e1", engine.addr)])
        ),
        &[("RUST_LOG", "info,tokengate::otel=debug")],
    );
    let body = stream_chat(&gw, None).await.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    eventually("the spans counted as dropped", || async {
        let m = gw.metrics().await;
        metric(
            &m,
            "tokengate_trace_spans_total{outcome=\"dropped_export_failed\"}",
        ) == Some(2.0)
    })
    .await;
    eventually("the failed export logged", || {
        let log = gw.log_text();
        async move { log.contains("spans not exported to") }
    })
    .await;
    let log = gw.log_text();
    let failed = log
        .lines()
        .find(|l| l.contains("spans not exported to"))
        .unwrap()
        .to_string();
    assert!(failed.contains("UnknownIssuer"), "{failed}");
    assert!(col.spans().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_service_call_is_a_child_span_of_the_request() {
    let col = Collector::start().await;
    let jev = engine_sim::spawn_local(engine_sim::SimConfig {
        id: "jev".into(),
        model: "jev-latest".into(),
        time_scale: 200.0,
        decision_mode: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let small = sims(1, "qwen3-0.6b", "small", 200.0).await;
    let large = sims(1, "qwen3-32b", "large", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "{}services:\n  - name: qwen3-0.6b\n{}  - name: qwen3-32b\n{}providers:\n  - {{name: jev, base_url: \"{}/v1\", model: jev-latest}}\nroutes:\n  - name: qwen3\n    targets:\n      - {{service: qwen3-0.6b, criteria: \"greetings, small talk\"}}\n      - {{service: qwen3-32b, criteria: \"reasoning, math, proofs, prove, code\"}}\n    policy:\n      plugins:\n        - {{kind: decision-service}}\n        - {{kind: least-inflight}}\n    decision: {{provider: jev, timeout: 2s}}\n",
        tracing_block(col.addr, 1.0),
        sim_instances(&small),
        sim_instances(&large),
        jev.url(),
    ));
    let client_trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("traceparent", format!("00-{client_trace}-00f067aa0ba902b7-01"))
        .json(&serde_json::json!({"model": "qwen3", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Prove that there are infinitely many primes."}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    // The request, its decision call, its attempt.
    let spans = col.wait_trace(client_trace, 3).await;
    let server = spans.iter().find(|s| s.kind == SERVER).unwrap();
    assert_eq!(server.name, "chat qwen3");
    let decision = spans
        .iter()
        .find(|s| s.name == "chat jev-latest")
        .unwrap_or_else(|| panic!("no decision span: {spans:#?}"));
    assert_eq!(decision.kind, CLIENT);
    assert_eq!(decision.parent_span_id, server.span_id);
    assert_eq!(
        str_attr(&decision.attributes, "tokengate.decision.outcome").as_deref(),
        Some("target")
    );
    assert!(decision.end_time_unix_nano > decision.start_time_unix_nano);
    assert!(decision.start_time_unix_nano >= server.start_time_unix_nano);
    let attempt = spans
        .iter()
        .find(|s| s.name.starts_with("upstream "))
        .unwrap();
    assert_eq!(
        str_attr(&attempt.attributes, "tokengate.instance").as_deref(),
        Some("large1")
    );
    assert!(str_attr(&server.attributes, "tokengate.reason")
        .is_some_and(|r| r.starts_with("decision(qwen3-32b)")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_pair_has_a_prefill_span_under_its_attempt() {
    use engine_sim::{PdMode, Role, SimConfig};
    let col = Collector::start().await;
    let sim = |id: &str, role: Role| SimConfig {
        id: id.into(),
        model: "m".into(),
        time_scale: 20.0,
        role,
        pd_mode: PdMode::Sglang,
        bootstrap_port: (role == Role::Prefill).then_some(0),
        pd_timeout_ms: 30_000,
        ..Default::default()
    };
    let p = engine_sim::spawn_local(sim("p1", Role::Prefill))
        .await
        .unwrap();
    let d = engine_sim::spawn_local(sim("d1", Role::Decode))
        .await
        .unwrap();
    let gw = GatewayProc::start(&format!(
        "{}services:\n  - name: m\n    pd: {{mode: sglang-mooncake}}\n    instances:\n      - {{id: p1, addr: \"{}\", role: prefill, bootstrap_port: {}}}\n      - {{id: d1, addr: \"{}\", role: decode}}\n",
        tracing_block(col.addr, 1.0),
        p.addr,
        p.bootstrap_addr().unwrap().port(),
        d.addr,
    ));
    let client_trace = "6bf92f3577b34da6a3ce929d0e0e4736";
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header(
            "traceparent",
            format!("00-{client_trace}-00f067aa0ba902b7-01"),
        )
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 4,
            "messages": [{"role": "user", "content": "a prompt of a few words for the prefill"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-instance"], "p1+d1");
    r.bytes().await.unwrap();
    let spans = col.wait_trace(client_trace, 3).await;
    let server = spans.iter().find(|s| s.kind == SERVER).unwrap();
    let attempt = spans
        .iter()
        .find(|s| s.name == "upstream p1+d1")
        .unwrap_or_else(|| panic!("{spans:#?}"));
    let prefill = spans
        .iter()
        .find(|s| s.name == "prefill p1")
        .unwrap_or_else(|| panic!("{spans:#?}"));
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(prefill.parent_span_id, attempt.span_id);
    assert_eq!(prefill.kind, CLIENT);
    assert!(
        str_attr(&prefill.attributes, "error.type").is_none(),
        "{prefill:#?}"
    );
    assert_eq!(
        int_attr(&prefill.attributes, "server.port"),
        Some(i64::from(p.addr.port()))
    );
    assert!(prefill.end_time_unix_nano >= prefill.start_time_unix_nano);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genai_histograms_count_every_request_with_or_without_tracing() {
    let engine = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "services:\n{}",
        service("m", &[("e1", engine.addr)])
    ));
    for _ in 0..3 {
        stream_chat(&gw, None).await.bytes().await.unwrap();
    }
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-mock", "status")
        .header("x-mock-status", "500")
        .body(chat_body("m", 200, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    r.bytes().await.unwrap();
    // A request is counted when it completes (after its last byte reached the client).
    eventually("the four requests counted", || async {
        let m = gw.metrics().await;
        requests(&m, 500) == 1.0 && requests(&m, 200) == 3.0
    })
    .await;
    let m = gw.metrics().await;
    let l =
        "gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"m\"";
    // The mock's usage chunk: 7 input and 5 output tokens per stream.
    let tokens = |kind: &str, what: &str| {
        metric(
            &m,
            &format!("gen_ai_client_token_usage_{what}{{{l},gen_ai_token_type=\"{kind}\"}}"),
        )
    };
    assert_eq!(tokens("input", "sum"), Some(21.0), "{m}");
    assert_eq!(tokens("input", "count"), Some(3.0));
    assert_eq!(tokens("output", "sum"), Some(15.0));
    assert_eq!(
        metric(
            &m,
            &format!("gen_ai_server_time_to_first_token_seconds_count{{{l}}}")
        ),
        Some(3.0)
    );
    let duration = |error: &str| {
        metric(
            &m,
            &format!("gen_ai_server_request_duration_seconds_count{{error_type=\"{error}\",{l}}}"),
        )
    };
    assert_eq!(duration(""), Some(3.0), "{m}");
    assert_eq!(duration("500"), Some(1.0), "{m}");
    // Today's families are still there.
    assert!(metric(&m, "tokengate_ttft_seconds_count{model=\"m\"}").is_some());
}

#[test]
fn tracing_config_is_checked_and_printed_without_its_header_values() {
    let base = "services:\n  - name: m\n    instances:\n      - {id: a, addr: \"127.0.0.1:9\"}\n";
    let (ok, err) = check_yaml(&format!(
        "{base}tracing:\n  otlp: {{endpoint: \"localhost:4318\", protocol: grpc}}\n  sample_ratio: 1.5\n"
    ));
    assert!(!ok);
    assert!(
        err.contains("tracing.otlp.endpoint: \"localhost:4318\" is not an http:// or https:// URL (e.g. http://otel-collector:4317)"),
        "{err}"
    );
    assert!(!err.contains("tracing.otlp.protocol"), "{err}");
    assert!(err.contains("tracing.sample_ratio: 1.5"), "{err}");
    // gRPC takes the collector's address: an OTLP/HTTP traces URL is refused, saying why.
    let (ok, err) = check_yaml(&format!(
        "{base}tracing:\n  otlp: {{endpoint: \"http://collector:4318/v1/traces\", protocol: grpc}}\n"
    ));
    assert!(!ok);
    assert!(
        err.contains("tracing.otlp.endpoint: \"http://collector:4318/v1/traces\" has a path (/v1/traces); OTLP/gRPC takes the collector's address only"),
        "{err}"
    );
    for endpoint in ["http://collector:4317", "https://collector.example:443/"] {
        let (ok, err) = check_yaml(&format!(
            "{base}tracing:\n  otlp: {{endpoint: \"{endpoint}\", protocol: grpc, headers: {{x-key: v}}, timeout: 3s}}\n"
        ));
        assert!(ok, "{endpoint}: {err}");
    }
    // Printed: every key, the header's value masked; the output is itself valid.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.yaml");
    std::fs::write(
        &f,
        format!("{base}tracing:\n  otlp:\n    endpoint: http://collector:4318\n    headers: {{x-honeycomb-team: SECRET-KEY}}\n"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "--print", "-c"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!printed.contains("SECRET-KEY"), "{printed}");
    for key in [
        "x-honeycomb-team",
        "sample_ratio: 1.0",
        "service_name: tokengate",
        "protocol: http",
        "timeout: 10s",
    ] {
        assert!(printed.contains(key), "{key} missing: {printed}");
    }
    let (ok, err) = check_yaml(&printed);
    assert!(ok, "{err}");
}
