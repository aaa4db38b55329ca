//! `GET /admin/status` as typed views: [`StatusView`] and its parts, built from the runtime,
//! the metrics and the page's [`super::recent::Board`]. Every field name is part of the
//! admin API (the page's script, the tests and the docs read them); a field that is null
//! today stays null (an `Option`), one absent today stays absent (`skip_serializing_if`).

use super::families::{
    count, histograms_by, prefix_counters, rows, sum_all_by, sum_by, tokens_total, Rows,
};
use super::recent::{PrefixCounters, ReloadEvent, Slot, SAMPLE_EVERY};
use crate::clock::now_ms;
use crate::config::Priority;
use crate::metrics::Metrics;
use crate::mirror::MirrorSettingsView;
use crate::runtime::views::{IndexView, InstanceView, PdOutcomes};
use crate::runtime::{Runtime, Service};
use crate::shared::Shared;
use crate::split::SplitView;
use crate::upstream::Outcomes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tokengate_plugins::Role;

/// The JSON behind the status page; see the module docs of [`crate::status`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusView {
    pub version: String,
    pub now_ms: u64,
    pub uptime_ms: u64,
    pub cluster: ClusterStatus,
    pub interval_ms: u64,
    pub totals: Totals,
    pub instances: Vec<InstanceView>,
    pub services: Vec<ServiceStatus>,
    pub routes: Vec<RouteStatus>,
    pub reasons: Vec<ReasonCount>,
    pub decision_calls: Vec<DecisionCalls>,
    pub global: GlobalStatus,
    /// null without `split:`.
    pub split: Option<SplitView>,
    pub mirror: MirrorStatus,
    /// The tenants that used the most tokens (empty without `tenants:` / `api_keys`).
    pub top_tenants: Vec<TenantUsage>,
    pub tracing: TracingStatus,
    pub reload: ReloadStatus,
    pub protocol_errors: ProtocolErrors,
    pub recent: Vec<Slot>,
    pub history: Vec<super::recent::Point>,
}

/// The cluster's counters (`crate::cluster::ClusterMetrics::view`) with its state, summary
/// and replica name (`state: off` without `cluster:`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterStatus {
    #[serde(flatten)]
    pub counters: serde_json::Value,
    #[serde(flatten)]
    pub summary: serde_json::Value,
}

/// `/admin/instances` and `/admin/status` without `cluster:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterOffSummary {
    pub state: String,
    pub summary: String,
}

/// `/admin/cluster` without `cluster:`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterOff {
    pub enabled: bool,
    pub state: String,
    pub replicas: Vec<serde_json::Value>,
    pub note: String,
}

/// Requests answered to clients (local endpoints' successes left out) and tokens.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Totals {
    pub requests: f64,
    pub client_errors: f64,
    pub server_errors: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

/// A service: its scheduler, prefix index and hit ratios, throttle and prefill/decode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub instances: usize,
    pub available: usize,
    /// null when the service is not throttled.
    pub throttle: Option<ThrottleStatus>,
    /// null when the service is not disaggregated.
    pub pd: Option<PdStatus>,
    pub mode: Option<String>,
    pub pipeline: Option<String>,
    /// null when the scheduler binds no sessions.
    pub sessions: Option<u64>,
    pub index: Option<IndexView>,
    pub hit_ratio: HitRatio,
    pub tokens: ServiceTokens,
}

/// Prefix hit ratios since start (null before any prompt).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct HitRatio {
    pub ceiling: Option<f64>,
    pub predicted: Option<f64>,
    pub engine: Option<f64>,
    /// The index's prediction for the requests `engine` counts, in the engines' units:
    /// compare it with `engine`.
    pub engine_predicted: Option<f64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ServiceTokens {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

/// A disaggregated service: its protocol, nodes and prefill legs by outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PdStatus {
    pub mode: String,
    pub decode_policy: String,
    pub prefill_instances: usize,
    pub decode_instances: usize,
    pub prefill: PdOutcomes,
}

/// A service's throttle: settings, queue, slots in use against their limits (summed over
/// its instances, per phase), refusals by reason and the queue's waits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ThrottleStatus {
    pub overflow: String,
    pub scope: String,
    pub queued: usize,
    pub max_queue: usize,
    pub queue_timeout_ms: u64,
    /// By phase (`prefill`, `decode`, `total`).
    pub slots: BTreeMap<String, SlotUse>,
    pub rejections: Rejections,
    pub queue_wait: QueueWait,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SlotUse {
    pub in_use: u64,
    pub limit: u64,
}

/// Throttling refusals by reason.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Rejections {
    pub limit: u64,
    pub queue_full: u64,
    pub queue_timeout: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueWait {
    pub count: u64,
    pub mean_ms: Option<f64>,
    /// By tenant priority class (`interactive`, `default`, `batch`), over every throttled
    /// service (the metric has no service label).
    pub by_class: BTreeMap<String, Mean>,
}

/// A histogram's count and mean (null before a sample).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Mean {
    pub count: u64,
    pub mean_ms: Option<f64>,
}

impl Mean {
    /// From a histogram's sample count and sum (seconds).
    fn of((count, sum): (u64, f64)) -> Mean {
        Mean {
            count,
            mean_ms: (count > 0).then(|| sum * 1e3 / count as f64),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteStatus {
    pub name: String,
    pub mode: String,
    pub targets: Vec<String>,
    pub sessions: Option<u64>,
}

/// A routing reason by count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReasonCount {
    pub reason: String,
    pub count: f64,
}

/// Decision-service calls of a route by outcome, with the route's mean latency.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DecisionCalls {
    pub route: String,
    pub outcome: Option<String>,
    pub count: f64,
    pub mean_latency_ms: Option<f64>,
}

/// Global scheduling: this region's name and the member gateways.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GlobalStatus {
    pub name: String,
    pub members: Vec<MemberStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberStatus {
    pub name: String,
    pub url: String,
    pub available: bool,
    pub outcomes: Outcomes,
}

/// Traffic mirroring: the settings (never the token), the queue, copies by outcome and the
/// answered copies' latency by phase (`ttft`, `total`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MirrorStatus {
    /// null when no `mirror:` block is configured (the counters stay, after a reload).
    pub settings: Option<MirrorSettingsView>,
    pub queued: i64,
    pub inflight: i64,
    pub outcomes: MirrorOutcomes,
    pub latency: BTreeMap<String, Mean>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct MirrorOutcomes {
    pub sent: u64,
    pub ok: u64,
    pub http_error: u64,
    pub error: u64,
    pub timeout: u64,
    pub dropped: u64,
    pub expired: u64,
}

/// A tenant's usage since start, its requests in flight and its refusals.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantUsage {
    pub tenant: String,
    pub priority: Priority,
    /// Input + output.
    pub tokens: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub requests: u64,
    pub rejections: u64,
    pub inflight: u64,
}

/// OpenTelemetry traces: the collector's URL (null: tracing off), the OTLP transport
/// (`http`, `grpc`) and spans by outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TracingStatus {
    pub endpoint: Option<String>,
    pub protocol: Option<String>,
    pub spans: serde_json::Value,
}

/// Config reloads: counts, the last one, the runtime's generation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReloadStatus {
    pub ok: u64,
    pub errors: u64,
    pub last_ok: bool,
    pub last: Option<ReloadEvent>,
    pub generation: u64,
}

/// Connections closed at the protocol level, by reason.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ProtocolErrors {
    pub head_timeout: u64,
    pub head_too_large: u64,
    pub too_many_headers: u64,
    pub bad_request: u64,
}

/// The tenants [`StatusView::top_tenants`] lists at most.
pub const TOP_TENANTS: usize = 10;

/// The cluster's short summary (`/admin/instances`, the status page).
pub fn cluster_summary(shared: &Shared) -> serde_json::Value {
    match shared.cluster.as_ref() {
        Some(c) => c.summary(),
        None => serde_json::to_value(ClusterOffSummary {
            state: "off".into(),
            summary: "cluster: off".into(),
        })
        .unwrap_or_default(),
    }
}

/// `/admin/cluster` without `cluster:`.
pub fn cluster_off() -> ClusterOff {
    ClusterOff {
        enabled: false,
        state: "off".into(),
        replicas: Vec::new(),
        note: "no `cluster.redis` in the config: this replica shares no state (with `cluster.placement: rendezvous` it still agrees with the others where new sessions and prefixes go)".into(),
    }
}

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

fn pd_outcomes(found: &BTreeMap<String, f64>) -> PdOutcomes {
    PdOutcomes {
        ok: count(found, "ok"),
        error: count(found, "error"),
        aborted: count(found, "aborted"),
    }
}

fn outcomes(found: &BTreeMap<String, f64>) -> Outcomes {
    Outcomes {
        ok: count(found, "ok"),
        refused: count(found, "refused"),
        error: count(found, "error"),
        cancelled: count(found, "cancelled"),
    }
}

/// `GET /admin/status`.
pub fn status_view(shared: &Shared) -> StatusView {
    let rt = shared.runtime.load();
    let m = &shared.metrics;
    let now = now_ms();
    let table = rt.instances_view();
    let pd_rows = rows(&m.pd_prefill);
    let mut instances = table.instances;
    for i in instances.iter_mut().filter(|i| i.role == "prefill") {
        i.pd_prefill = Some(pd_outcomes(&sum_by(&pd_rows, "instance", &i.id, "outcome")));
    }
    let ctx = Services {
        shared,
        rejections: rows(&m.throttle_rejections),
        pd_rows,
        counters: prefix_counters(shared),
        schedulers: table.schedulers,
        indexes: table.prefix_indexes,
        now,
    };
    let (requests, client_errors, server_errors) = request_totals(m);
    let otel = shared.otel.load();
    StatusView {
        version: env!("CARGO_PKG_VERSION").into(),
        now_ms: now,
        uptime_ms: now.saturating_sub(shared.status.started_ms),
        cluster: ClusterStatus {
            counters: shared.cluster_metrics.view(),
            summary: cluster_summary(shared),
        },
        interval_ms: SAMPLE_EVERY.as_millis() as u64,
        totals: Totals {
            requests,
            client_errors,
            server_errors,
            prompt_tokens: tokens_total(shared, "prompt"),
            completion_tokens: tokens_total(shared, "completion"),
            cached_tokens: tokens_total(shared, "cached"),
        },
        instances,
        services: rt.ordered.iter().map(|s| ctx.service(s)).collect(),
        routes: routes(&rt),
        reasons: reasons(m),
        decision_calls: decision_calls(m),
        global: global_view(&rt, m, now),
        split: split_view(&rt, m, now),
        mirror: mirror_view(&rt, m),
        top_tenants: top_tenants(shared, &rt),
        tracing: TracingStatus {
            endpoint: otel.as_ref().map(|o| o.url.clone()),
            protocol: otel.as_ref().map(|o| o.protocol.to_string()),
            spans: shared.trace_spans.view(),
        },
        reload: reload_view(shared),
        protocol_errors: protocol_errors_view(m),
        recent: shared.status.recent(),
        history: shared.status.history(),
    }
}

/// What every service's view reads once.
struct Services<'a> {
    shared: &'a Shared,
    rejections: Rows,
    pd_rows: Rows,
    counters: Vec<(String, PrefixCounters)>,
    schedulers: Vec<crate::runtime::views::SchedulerView>,
    indexes: Vec<IndexView>,
    now: u64,
}

impl Services<'_> {
    fn service(&self, s: &Service) -> ServiceStatus {
        let m = &self.shared.metrics;
        let c = self
            .counters
            .iter()
            .find(|(n, _)| *n == s.name)
            .map_or([0; 6], |(_, c)| *c);
        let tok = |k| m.tokens.with_label_values(&[s.name.as_str(), k]).get();
        let sched = self.schedulers.iter().find(|x| x.name == s.name);
        ServiceStatus {
            name: s.name.clone(),
            instances: s.instances.len(),
            available: s
                .instances
                .iter()
                .filter(|i| i.health.available(self.now))
                .count(),
            throttle: s.throttle.as_ref().map(|t| self.throttle(s, t)),
            pd: s.pd.as_ref().map(|p| self.pd(s, p)),
            mode: sched.map(|x| x.mode.clone()),
            pipeline: sched.map(|x| x.pipeline.clone()),
            sessions: s.sched.sessions.as_ref().map(|t| t.gauges().entries),
            index: self.indexes.iter().find(|x| x.service == s.name).cloned(),
            hit_ratio: HitRatio {
                ceiling: ratio(c[1], c[0]),
                predicted: ratio(c[2], c[0]),
                engine: ratio(c[4], c[3]),
                engine_predicted: ratio(c[5], c[3]),
            },
            tokens: ServiceTokens {
                prompt: tok("prompt"),
                completion: tok("completion"),
                cached: tok("cached"),
            },
        }
    }

    fn pd(&self, s: &Service, p: &crate::runtime::Pd) -> PdStatus {
        let mut prefill = BTreeMap::new();
        for i in s.instances.iter().filter(|i| i.role == Role::Prefill) {
            for (o, v) in sum_by(&self.pd_rows, "instance", &i.id, "outcome") {
                *prefill.entry(o).or_insert(0.0) += v;
            }
        }
        let role = |r| s.instances.iter().filter(|i| i.role == r).count();
        PdStatus {
            mode: p.mode.as_str().into(),
            decode_policy: p.decode_policy.as_str().into(),
            prefill_instances: role(Role::Prefill),
            decode_instances: role(Role::Decode),
            prefill: pd_outcomes(&prefill),
        }
    }

    fn throttle(&self, s: &Service, t: &crate::throttle::Throttle) -> ThrottleStatus {
        let st = t.settings();
        let mut slots: BTreeMap<String, SlotUse> = BTreeMap::new();
        for i in &s.instances {
            for (phase, used, limit) in
                crate::throttle::slot_phases(i.role, &i.load.snapshot(), &st)
            {
                let e = slots.entry(phase.to_string()).or_insert(SlotUse {
                    in_use: 0,
                    limit: 0,
                });
                e.in_use += used;
                e.limit += limit;
            }
        }
        let m = &self.shared.metrics;
        let waits = histograms_by(&m.throttle_queue_wait, "service", |_| true);
        let refused = sum_by(&self.rejections, "service", &s.name, "reason");
        let wait = Mean::of(waits.get(&s.name).copied().unwrap_or_default());
        ThrottleStatus {
            overflow: format!("{:?}", st.overflow).to_lowercase(),
            scope: format!("{:?}", st.scope).to_lowercase(),
            queued: t.queued(),
            max_queue: st.max_queue,
            queue_timeout_ms: st.queue_timeout.as_millis() as u64,
            slots,
            rejections: Rejections {
                limit: count(&refused, "limit"),
                queue_full: count(&refused, "queue_full"),
                queue_timeout: count(&refused, "queue_timeout"),
            },
            queue_wait: QueueWait {
                count: wait.count,
                mean_ms: wait.mean_ms,
                by_class: queue_wait_by_class(m),
            },
        }
    }
}

/// `tokengate_queue_wait_by_class_seconds` per class, every class listed.
fn queue_wait_by_class(m: &Metrics) -> BTreeMap<String, Mean> {
    let mut by: BTreeMap<String, Mean> = ["interactive", "default", "batch"]
        .into_iter()
        .map(|c| (c.to_string(), Mean::of((0, 0.0))))
        .collect();
    let found = histograms_by(&m.tenants.queue_wait, "class", |ls| {
        ls.iter().any(|l| l.name() == "class")
    });
    for (c, x) in found {
        by.insert(c, Mean::of(x));
    }
    by
}

/// The tenants that used the most tokens since start (`tokengate_tenant_*` counters, over
/// every model), at most [`TOP_TENANTS`], with the requests in flight now (their
/// concurrency slots) and their refusals. Tenants of the current config only, in order of
/// tokens (input + output), then name.
fn top_tenants(shared: &Shared, rt: &Runtime) -> Vec<TenantUsage> {
    let t = &shared.metrics.tenants;
    let tokens = rows(&t.tokens);
    let requests = sum_all_by(&rows(&t.requests), "tenant");
    let refused = sum_all_by(&rows(&t.rejections), "tenant");
    let mut top: Vec<TenantUsage> = rt
        .tenants
        .list()
        .iter()
        .map(|x| {
            let kinds = sum_by(&tokens, "tenant", &x.name, "kind");
            let (input, output) = (count(&kinds, "input"), count(&kinds, "output"));
            TenantUsage {
                tenant: x.name.clone(),
                priority: x.priority,
                tokens: input + output,
                input_tokens: input,
                output_tokens: output,
                requests: count(&requests, &x.name),
                rejections: count(&refused, &x.name),
                inflight: x.state.inflight(),
            }
        })
        .collect();
    top.sort_by(|a, b| {
        b.tokens
            .cmp(&a.tokens)
            .then_with(|| a.tenant.cmp(&b.tenant))
    });
    top.truncate(TOP_TENANTS);
    top
}

fn routes(rt: &Runtime) -> Vec<RouteStatus> {
    rt.ordered_routes
        .iter()
        .map(|r| RouteStatus {
            name: r.name.clone(),
            mode: r.mode_name().into(),
            targets: r.targets.iter().map(|t| t.name.clone()).collect(),
            sessions: rt
                .schedulers()
                .into_iter()
                .find(|(n, _)| *n == r.name)
                .and_then(|(_, s)| s.sessions.as_ref().map(|t| t.gauges().entries)),
        })
        .collect()
}

/// Routing reasons by count, the most frequent first.
fn reasons(m: &Metrics) -> Vec<ReasonCount> {
    let mut reasons: Vec<ReasonCount> = rows(&m.decisions)
        .into_iter()
        .map(|(l, count)| ReasonCount {
            reason: l.get("reason").cloned().unwrap_or_default(),
            count,
        })
        .collect();
    reasons.sort_by(|a, b| {
        b.count
            .total_cmp(&a.count)
            .then_with(|| a.reason.cmp(&b.reason))
    });
    reasons
}

/// Decision-service calls by route and outcome, with the route's mean latency.
fn decision_calls(m: &Metrics) -> Vec<DecisionCalls> {
    let latency = histograms_by(&m.decision_latency, "route", |_| true);
    rows(&m.decision_total)
        .into_iter()
        .map(|(l, count)| {
            let route = l.get("route").cloned().unwrap_or_default();
            let mean_latency_ms = latency.get(&route).and_then(|x| Mean::of(*x).mean_ms);
            DecisionCalls {
                outcome: l.get("outcome").cloned(),
                route,
                count,
                mean_latency_ms,
            }
        })
        .collect()
}

/// Requests answered to clients (local endpoints' successes left out), client errors and
/// server errors.
fn request_totals(m: &Metrics) -> (f64, f64, f64) {
    let (mut requests, mut server_errors, mut client_errors) = (0.0, 0.0, 0.0);
    for (l, v) in rows(&m.requests) {
        let code: u16 = l.get("code").and_then(|c| c.parse().ok()).unwrap_or(0);
        if l.get("model").is_some_and(|x| x == "-") && code < 400 {
            continue; // local endpoints
        }
        requests += v;
        match code {
            400..=499 => client_errors += v,
            200..=399 => {}
            _ => server_errors += v,
        }
    }
    (requests, client_errors, server_errors)
}

/// Member gateways of other regions (global scheduling) with their answers by outcome.
fn global_view(rt: &Runtime, m: &Metrics, now: u64) -> GlobalStatus {
    let global_rows = rows(&m.global_requests);
    GlobalStatus {
        name: rt.hop_name.to_str().unwrap_or_default().into(),
        members: rt
            .members
            .iter()
            .map(|mb| {
                let e = &mb.endpoint;
                MemberStatus {
                    name: e.name.clone(),
                    url: format!("{}{}", e.origin(), e.base_path),
                    available: e.available(now),
                    outcomes: outcomes(&sum_by(&global_rows, "member", &e.name, "outcome")),
                }
            })
            .collect(),
    }
}

/// Split proxy: every entry (never its key) with its attempts by outcome.
fn split_view(rt: &Runtime, m: &Metrics, now: u64) -> Option<SplitView> {
    let sp = rt.split.as_ref()?;
    let split_rows = rows(&m.split_requests);
    let mut v = sp.view(now);
    for e in &mut v.proxies {
        e.outcomes = Some(outcomes(&sum_by(&split_rows, "entry", &e.name, "outcome")));
    }
    Some(v)
}

/// Traffic mirroring: the settings, the queue, copies by outcome and latency.
fn mirror_view(rt: &Runtime, m: &Metrics) -> MirrorStatus {
    let found = sum_all_by(&rows(&m.mirror_requests), "outcome");
    MirrorStatus {
        settings: rt.mirror.as_ref().map(|s| s.view()),
        queued: m.mirror_queue.get(),
        inflight: m.mirror_inflight.get(),
        outcomes: MirrorOutcomes {
            sent: count(&found, "sent"),
            ok: count(&found, "ok"),
            http_error: count(&found, "http_error"),
            error: count(&found, "error"),
            timeout: count(&found, "timeout"),
            dropped: count(&found, "dropped"),
            expired: count(&found, "expired"),
        },
        latency: histograms_by(&m.mirror_latency, "phase", |_| true)
            .into_iter()
            .map(|(p, x)| (p, Mean::of(x)))
            .collect(),
    }
}

fn reload_view(shared: &Shared) -> ReloadStatus {
    let m = &shared.metrics;
    ReloadStatus {
        ok: m.reloads.with_label_values(&["ok"]).get(),
        errors: m.reloads.with_label_values(&["error"]).get(),
        last_ok: m.reload_ok.get() == 1,
        last: shared.status.last_reload(),
        generation: *shared.generation.borrow(),
    }
}

fn protocol_errors_view(m: &Metrics) -> ProtocolErrors {
    let pe = |r: &str| m.protocol_errors.with_label_values(&[r]).get();
    ProtocolErrors {
        head_timeout: pe("head_timeout"),
        head_too_large: pe("head_too_large"),
        too_many_headers: pe("too_many_headers"),
        bad_request: pe("bad_request"),
    }
}
