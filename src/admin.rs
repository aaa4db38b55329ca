//! The admin listener (default 127.0.0.1 only): `GET /health`, `GET /metrics` (Prometheus
//! text), `GET /admin/instances` (JSON snapshot of the load table), `GET /admin/cluster` (the
//! replicas sharing state on Redis, [`crate::cluster`]), and the live status page
//! (`GET /`, its `/assets/*` and `GET /admin/status`, see [`crate::status`]).
//!
//! With `admin_token` set, every path but `/health` and the page's static assets needs the
//! token: `Authorization: Bearer <token>`, or the page's cookie (set by `/?token=<token>`).

use crate::clock::now_ms;
use crate::request::admit::ct_eq;
use crate::shared::Shared;
use async_trait::async_trait;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

pub struct Admin {
    pub shared: Arc<Shared>,
}

/// An answer of the admin API: never stored by a browser or a proxy (it carries the load
/// table, the metrics, the page's data).
fn resp(status: u16, ctype: &str, body: Vec<u8>) -> http::Response<Vec<u8>> {
    http::Response::builder()
        .status(status)
        .header("content-type", ctype)
        .header("cache-control", "no-store")
        .header("content-length", body.len())
        .body(body)
        .expect("valid response")
}

/// `/admin/instances`: the runtime's load table, with the mirror (its settings and queue),
/// the split proxy and the cluster's summary when configured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstancesDoc {
    #[serde(flatten)]
    pub table: crate::runtime::views::InstancesView,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<crate::mirror::MirrorSettingsView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<crate::split::SplitView>,
    /// The cluster's summary (`state: off` without `cluster:`).
    pub cluster: serde_json::Value,
}

impl Admin {
    /// `/admin/instances`.
    pub fn instances(&self) -> InstancesDoc {
        let rt = self.shared.runtime.load();
        InstancesDoc {
            table: rt.instances_view(),
            mirror: rt
                .mirror
                .as_ref()
                .map(|m| crate::mirror::MirrorSettingsView {
                    queued: Some(self.shared.mirror.queued()),
                    ..m.view()
                }),
            split: rt.split.as_ref().map(|sp| sp.view(now_ms())),
            cluster: crate::status::cluster_summary(&self.shared),
        }
    }

    /// Copies the load table into the in-flight gauges, then renders every metric.
    pub fn render_metrics(&self) -> Vec<u8> {
        let rt = self.shared.runtime.load();
        let m = &self.shared.metrics;
        for s in &rt.ordered {
            for i in &s.instances {
                let l = i.load.snapshot();
                let id = [i.id.as_str()];
                m.inflight_requests
                    .with_label_values(&id)
                    .set(l.inflight_requests as i64);
                m.inflight_tokens
                    .with_label_values(&id)
                    .set(l.inflight_tokens as i64);
                m.waiting.with_label_values(&id).set(l.waiting as i64);
                m.queued_prefill_tokens
                    .with_label_values(&id)
                    .set(l.prefill_tokens as i64);
                m.held.with_label_values(&id).set(i.queue.held() as i64);
                let learned = rt.cost.learned(i.key);
                if learned.prefill_samples > 0 {
                    m.learned_prefill_tps
                        .with_label_values(&id)
                        .set(learned.prefill_tps);
                }
                if learned.step_samples > 0 {
                    m.learned_decode_step
                        .with_label_values(&id)
                        .set(learned.step_ms / 1000.0);
                }
                let h = i.health.view(now_ms());
                m.available
                    .with_label_values(&id)
                    .set(i64::from(h.healthy && !h.ejected));
                m.ejections.with_label_values(&id).set(h.ejections as i64);
            }
        }
        for s in &rt.ordered {
            if let Some(t) = &s.throttle {
                m.throttle_queue
                    .with_label_values(&[s.name.as_str()])
                    .set(t.queued() as i64);
                let st = t.settings();
                for i in &s.instances {
                    let id = i.id.as_str();
                    let phases = crate::throttle::slot_phases(i.role, &i.load.snapshot(), &st);
                    for (phase, used, limit) in phases {
                        m.slots_in_use
                            .with_label_values(&[id, phase])
                            .set(used as i64);
                        m.slot_limit
                            .with_label_values(&[id, phase])
                            .set(limit as i64);
                    }
                }
            }
            let n = [s.name.as_str()];
            let g = s.index.gauges();
            m.index_nodes.with_label_values(&n).set(g.nodes as i64);
            m.index_bytes.with_label_values(&n).set(g.bytes as i64);
            m.index_evicted_bytes
                .with_label_values(&n)
                .set(g.evicted_bytes as i64);
            m.index_trimmed_blocks
                .with_label_values(&n)
                .set(g.trimmed_blocks as i64);
            m.index_capacity_evicted_blocks
                .with_label_values(&n)
                .set(g.capacity_evicted_blocks as i64);
        }
        for (name, s) in rt.schedulers() {
            if let Some(t) = &s.sessions {
                m.sessions
                    .with_label_values(&[name])
                    .set(t.gauges().entries as i64);
            }
        }
        m.update_ratios(rt.ordered.iter().map(|s| s.name.as_str()));
        m.render()
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> http::Response<Vec<u8>> {
        let req = session.req_header();
        // Tests only (`TOKENGATE_TEST_CLOCK=1`): `POST /admin/clock?advance_ms=N`.
        let clock_hook = req.method == http::Method::POST
            && req.uri.path() == "/admin/clock"
            && crate::clock::adjustable();
        if req.method != http::Method::GET && !clock_hook {
            return resp(
                405,
                "application/json",
                br#"{"error":{"message":"the admin API only answers GET","type":"invalid_request_error","code":"method_not_allowed"}}"#.to_vec(),
            );
        }
        let path = req.uri.path();
        if let Some((ctype, body)) = crate::status::asset(path) {
            // Code, no data: cacheable.
            return http::Response::builder()
                .status(200)
                .header("content-type", ctype)
                .header("content-length", body.len())
                .body(body.as_bytes().to_vec())
                .expect("valid response");
        }
        if path != "/health" {
            if let Some(token) = self.shared.runtime.load().admin_token.as_deref() {
                let presented = req
                    .headers
                    .get("authorization")
                    .map(|v| v.as_bytes())
                    .and_then(|v| {
                        (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
                            .then(|| v[7..].trim_ascii())
                    });
                let cookie = crate::status::cookie_token(&req.headers);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                // `/?token=…` (the page opened by hand): open a session in a cookie (an
                // HMAC of the token with an expiry, never the token) and take the token
                // out of the address bar.
                if path == "/" {
                    if let Some(t) = crate::status::query_param(req.uri.query(), "token") {
                        if ct_eq(&t, token) {
                            return http::Response::builder()
                                .status(303)
                                .header("location", "./")
                                .header("set-cookie", crate::status::set_cookie(token, now))
                                .header("cache-control", "no-store")
                                .header("content-length", 0)
                                .body(Vec::new())
                                .expect("valid response");
                        }
                    }
                }
                let ok = presented.is_some_and(|p| ct_eq(p, token))
                    || cookie.is_some_and(|c| crate::status::session_ok(&c, token, now));
                if !ok && path == "/" {
                    return resp(
                        401,
                        "text/html; charset=utf-8",
                        crate::status::login_html().into_bytes(),
                    );
                }
                if !ok {
                    return resp(
                        401,
                        "application/json",
                        br#"{"error":{"message":"the admin API needs `Authorization: Bearer <admin_token>`","type":"authentication_error","code":"invalid_admin_token"}}"#.to_vec(),
                    );
                }
            }
        }
        match path {
            "/health" => resp(200, "text/plain", b"ok\n".to_vec()),
            "/" => http::Response::builder()
                .status(200)
                .header("content-type", "text/html; charset=utf-8")
                .header("content-security-policy", crate::status::CSP)
                .header("x-content-type-options", "nosniff")
                .header("cache-control", "no-store")
                .header("content-length", crate::status::index_html().len())
                .body(crate::status::index_html().as_bytes().to_vec())
                .expect("valid response"),
            "/admin/status" => {
                let body = serde_json::to_vec(&crate::status::status_view(&self.shared))
                    .unwrap_or_default();
                resp(200, "application/json", body)
            }
            "/metrics" => resp(200, "text/plain; version=0.0.4", self.render_metrics()),
            "/admin/clock" if clock_hook => {
                let ms = crate::status::query_param(req.uri.query(), "advance_ms")
                    .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u64>().ok());
                match ms {
                    Some(ms) => {
                        let now = crate::clock::advance(ms);
                        resp(200, "application/json", format!("{{\"now_ms\":{now}}}").into_bytes())
                    }
                    None => resp(400, "application/json", br#"{"error":{"message":"advance_ms=<milliseconds> is required","type":"invalid_request_error","code":"bad_query"}}"#.to_vec()),
                }
            }
            "/admin/instances" => {
                let body = serde_json::to_vec_pretty(&self.instances()).unwrap_or_default();
                resp(200, "application/json", body)
            }
            "/admin/cluster" => {
                let v = match self.shared.cluster.as_ref() {
                    Some(c) => c.view().await,
                    None => serde_json::to_value(crate::status::cluster_off()).unwrap_or_default(),
                };
                resp(200, "application/json", serde_json::to_vec_pretty(&v).unwrap_or_default())
            }
            other => resp(
                404,
                "application/json",
                crate::error::GatewayError::NotFound(format!(
                    "unknown admin path {other}; try / (the status page), /health, /metrics, /admin/instances, /admin/cluster or /admin/status"
                ))
                .body(false),
            ),
        }
    }
}
