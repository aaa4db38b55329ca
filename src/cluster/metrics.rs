//! The cluster's metric families (`tokengate_cluster_*`) and their summary in `/admin/status`.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};

/// The cluster's metric families, registered with or without `cluster:` (zero without it, so
/// dashboards and the status page show them either way).
#[derive(Clone)]
pub struct ClusterMetrics {
    /// Redis calls by operation and result.
    pub(super) calls: IntCounterVec,
    /// Routing decisions made on local state because Redis was not there (by what was
    /// skipped).
    pub(super) fallbacks: IntCounterVec,
    pub(super) degraded: IntGauge,
    /// Events received from other replicas and applied, by kind.
    pub(super) applied: IntCounterVec,
    /// Writes dropped (degraded, or the writer behind).
    pub(super) dropped: prometheus::IntCounter,
    /// Round trips on the routing path (session read, lease script).
    pub(super) rtt: Histogram,
}

impl ClusterMetrics {
    pub fn new(r: &Registry) -> ClusterMetrics {
        let calls = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_redis_calls_total",
                "Redis calls of the cluster state, by operation and result (ok, error, timeout)",
            ),
            &["op", "result"],
        )
        .expect("metric");
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_local_fallbacks_total",
                "Requests routed on local state only because Redis was unreachable or slow, by what was skipped",
            ),
            &["what"],
        )
        .expect("metric");
        let degraded = IntGauge::new(
            "tokengate_cluster_degraded",
            "1 while this replica cannot reach Redis and routes on local state",
        )
        .expect("metric");
        let applied = IntCounterVec::new(
            Opts::new(
                "tokengate_cluster_events_applied_total",
                "Events of other replicas applied to this one's state, by kind",
            ),
            &["kind"],
        )
        .expect("metric");
        let dropped = prometheus::IntCounter::new(
            "tokengate_cluster_writes_dropped_total",
            "Shared-state writes not sent (Redis unreachable, or the writer behind)",
        )
        .expect("metric");
        let rtt = Histogram::with_opts(
            HistogramOpts::new(
                "tokengate_cluster_redis_rtt_seconds",
                "Redis round trips on the routing path (session read, slot lease)",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
            ]),
        )
        .expect("metric");
        for c in [
            Box::new(calls.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(fallbacks.clone()),
            Box::new(degraded.clone()),
            Box::new(applied.clone()),
            Box::new(dropped.clone()),
            Box::new(rtt.clone()),
        ] {
            let _ = r.register(c);
        }
        for op in OPS {
            for result in ["ok", "error", "timeout"] {
                calls.with_label_values(&[op, result]);
            }
        }
        for what in ["session", "lease", "tenant", "fairness"] {
            fallbacks.with_label_values(&[what]);
        }
        for kind in ["placed", "trimmed", "released"] {
            applied.with_label_values(&[kind]);
        }
        ClusterMetrics {
            calls,
            fallbacks,
            degraded,
            applied,
            dropped,
            rtt,
        }
    }
}

/// The Redis operations counted in `tokengate_cluster_redis_calls_total{op}`.
const OPS: [&str; 7] = [
    "session_get",
    "lease",
    "tenant",
    "write",
    "heartbeat",
    "members",
    "load",
];

impl ClusterMetrics {
    /// The counters for `/admin/status`.
    pub fn view(&self) -> serde_json::Value {
        let calls = |result: &str| -> u64 {
            OPS.iter()
                .map(|op| self.calls.with_label_values(&[op, result]).get())
                .sum()
        };
        let applied = |k: &str| self.applied.with_label_values(&[k]).get();
        let fallback = |w: &str| self.fallbacks.with_label_values(&[w]).get();
        serde_json::json!({
            "degraded": self.degraded.get(),
            "redis_calls": {"ok": calls("ok"), "error": calls("error"), "timeout": calls("timeout")},
            "rtt": {
                "count": self.rtt.get_sample_count(),
                "mean_ms": if self.rtt.get_sample_count() > 0 {
                    self.rtt.get_sample_sum() * 1000.0 / self.rtt.get_sample_count() as f64
                } else {
                    0.0
                },
            },
            "events_applied": {"placed": applied("placed"), "trimmed": applied("trimmed"), "released": applied("released")},
            "local_fallbacks": {"session": fallback("session"), "lease": fallback("lease"), "tenant": fallback("tenant"), "fairness": fallback("fairness")},
            "writes_dropped": self.dropped.get(),
        })
    }
}
