//! State shared by every request and background loop: the runtime (swapped on reload), the
//! metrics, the decision-service client and the traffic mirror.

use crate::config::{Config, ConfigErrors};
use crate::decision::DecisionClient;
use crate::metrics::Metrics;
use crate::mirror::Mirror;
use crate::runtime::Runtime;
use arc_swap::ArcSwap;
use std::sync::Arc;

pub struct Shared {
    pub runtime: ArcSwap<Runtime>,
    pub metrics: Metrics,
    /// Client of the routes' decision services (pooled).
    pub decision: DecisionClient,
    /// Client of the prefill instances of disaggregated services, and of the engines'
    /// abort endpoints (pooled, no timeout of its own: each call sets its own).
    pub pd_http: reqwest::Client,
    /// Bumped each time a reload swaps the runtime in (background loops that wait for a
    /// configured interval re-read it at once).
    pub generation: tokio::sync::watch::Sender<u64>,
    /// What the status page remembers: recent requests, sampled history, last reload.
    pub status: crate::status::recent::Board,
    /// Traffic mirroring: the sampler and the queue of copies (its settings are the
    /// runtime's, so a reload applies them).
    pub mirror: Arc<Mirror>,
    /// OpenTelemetry traces (`tracing:`; a reload that changes it swaps it, [`Self::set_tracing`]);
    /// `None`: off.
    pub otel: arc_swap::ArcSwapOption<crate::otel::Otel>,
    /// Trace spans by outcome (registered with or without tracing).
    pub trace_spans: crate::otel::SpanCounters,
    /// The OpenTelemetry GenAI histograms (`gen_ai_*`), next to the `tokengate_*` families.
    pub genai: crate::genai_metrics::GenAiMetrics,
    /// The replicas' shared state on Redis (`cluster:`, read at start); `None`: this
    /// replica routes on its own.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// The cluster's metric families (registered with or without `cluster:`).
    pub cluster_metrics: crate::cluster::ClusterMetrics,
}

impl Shared {
    /// The shared state of a validated config.
    pub fn new(cfg: &Config) -> Result<Arc<Shared>, ConfigErrors> {
        let metrics = Metrics::new();
        let rt = Runtime::build(cfg, None, &metrics)?;
        let mirror = Arc::new(Mirror::new(&metrics));
        let trace_spans = crate::otel::SpanCounters::new(metrics.registry());
        let otel = match cfg.tracing.as_ref() {
            Some(t) => Some(Arc::new(
                crate::otel::Otel::new(t, trace_spans.clone())
                    .map_err(|e| ConfigErrors(vec![e]))?,
            )),
            None => None,
        };
        let cluster_metrics = crate::cluster::ClusterMetrics::new(metrics.registry());
        // Without `redis` nothing is shared (`placement: rendezvous` is the schedulers').
        let cluster = match cfg.cluster.as_ref().filter(|c| c.redis.is_some()) {
            Some(c) => Some(
                crate::cluster::Cluster::new(c, cluster_metrics.clone())
                    .map_err(|e| ConfigErrors(vec![e]))?,
            ),
            None => None,
        };
        Ok(Arc::new(Shared {
            cluster,
            cluster_metrics,
            otel: arc_swap::ArcSwapOption::new(otel),
            trace_spans,
            genai: crate::genai_metrics::GenAiMetrics::new(metrics.registry()),
            mirror,
            runtime: ArcSwap::from_pointee(rt),
            metrics,
            decision: DecisionClient::new(),
            pd_http: reqwest::Client::builder()
                .tcp_nodelay(true)
                .pool_idle_timeout(std::time::Duration::from_secs(60))
                .build()
                .unwrap_or_default(),
            generation: tokio::sync::watch::Sender::new(0),
            status: crate::status::recent::Board::new(),
        }))
    }

    /// Applies a reloaded `tracing:` block when it differs from the running one: a new
    /// tracer and sender (spawned on the current runtime), the old sender flushed and
    /// stopped; `None` turns tracing off. Requests already admitted keep their spans.
    pub fn set_tracing(&self, s: Option<&crate::config::TracingSettings>) -> Result<bool, String> {
        let key = s.map(crate::otel::settings_key);
        if key == self.otel.load().as_ref().map(|o| o.settings_key.clone()) {
            return Ok(false);
        }
        let new = match s {
            Some(s) => {
                let o = Arc::new(crate::otel::Otel::new(s, self.trace_spans.clone())?);
                let handle = tokio::runtime::Handle::try_current()
                    .map_err(|_| "tracing: no runtime to run the span sender on".to_string())?;
                handle.spawn(o.clone().run());
                Some(o)
            }
            None => None,
        };
        if let Some(old) = self.otel.swap(new) {
            old.close();
        }
        Ok(true)
    }

    /// Swaps in a reloaded runtime and tells the background loops.
    pub fn install(&self, rt: Runtime) {
        let old = self.runtime.swap(Arc::new(rt));
        forget_removed_instances(&old, &self.runtime.load());
        self.generation.send_modify(|g| *g += 1);
    }
}

/// An instance that left a service whose prefix index the new runtime keeps, or now has
/// another address (a restarted pod), leaves the index too: nothing routes to the old one
/// any more, and an engine that comes back under the same id starts with an empty KV cache.
fn forget_removed_instances(old: &Runtime, new: &Runtime) {
    for s in &old.ordered {
        let Some(n) = new.services.get(&s.name) else {
            continue; // the service is gone, and its index with it
        };
        if !Arc::ptr_eq(&s.index, &n.index) {
            continue;
        }
        for i in &s.instances {
            if !n
                .instances
                .iter()
                .any(|x| x.key == i.key && x.addr == i.addr)
            {
                let nodes = n.index.remove_instance(i.key);
                log::info!(
                    "service {}: instance {} left (or moved from {}); its prefix index entries removed ({nodes} nodes it alone held)",
                    s.name,
                    i.id,
                    i.addr
                );
            }
        }
    }
}
