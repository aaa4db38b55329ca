//! A served model: its instances, prefix index, scheduler and throttle, and how it is built
//! from `services[]` (the previous runtime's index, scheduler state, throttle queue and mean
//! output of the same service carried over).

use super::instance::{Instance, ServiceParts};
use crate::clock::now_ms;
use crate::config::{PrefixIndexSettings, ServiceConfig};
use crate::load::Limits;
use crate::metrics::{Metrics, ServiceCounters};
use crate::pipelines::{self, Scheduler};
use crate::throttle::{Scope, Settings as ThrottleSettings, Throttle};
use crate::tls::TlsPeer;
use log::info;
use std::sync::Arc;
use tokengate_plugins::{Candidate, CostModel, InstanceKey, PrefixIndex, PrefixIndexConfig, Role};

/// A served model: a pool of instances, the prefix index of what they hold, and how to
/// choose among them.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    /// The model name the engines serve (`model`, else `name`): what the body's `model` says
    /// going up.
    pub served: String,
    /// More names clients may send for it (`aliases`).
    pub aliases: Vec<String>,
    pub instances: Vec<Arc<Instance>>,
    pub sched: Scheduler,
    /// The gateway's model of the instances' KV caches: every prompt dispatched to one of
    /// them is inserted, whatever the scheduler (so the hit-rate ceiling is always known).
    pub index: Arc<PrefixIndex>,
    pub counters: ServiceCounters,
    /// The service's average answer length (kept across reloads): a request's expected
    /// output tokens (`max_tokens` capped by it, see [`crate::load::MeanOutput::expected`]).
    pub output: Arc<crate::load::MeanOutput>,
    /// Request throttling, when configured (kept across reloads: its queue survives).
    pub throttle: Option<Arc<Throttle>>,
    /// When a saturated instance's requests are held here (`engine_queue`).
    pub engine_queue: crate::engine_queue::Settings,
    /// Prefill/decode disaggregation: `sched` picks the prefill instance, this the decode one.
    pub pd: Option<Pd>,
    /// HTTP client towards the instances with the service's TLS settings (health checks,
    /// metric scrapes, prefill side requests).
    pub http: reqwest::Client,
}

/// A disaggregated service's protocol and decode picker.
#[derive(Debug)]
pub struct Pd {
    pub mode: crate::config::PdMode,
    /// `pd.decode_policy`.
    pub decode_policy: tokengate_plugins::LbPolicy,
    /// Balances the decode instances (`pd.decode_policy`).
    pub decode: tokengate_plugins::Pipeline,
    /// The decode picker's request counter (round-robin).
    pub turn: std::sync::atomic::AtomicU64,
}

impl Service {
    /// Whether clients call this service by `model` (its name or an alias): the answer then
    /// names the model as the client sent it, else (a route, the default model) the
    /// service's name.
    pub fn answers_to(&self, model: &str) -> bool {
        self.name == model || self.aliases.iter().any(|a| a == model)
    }

    /// The name the answer's `model` gives for a request that asked for `model`.
    pub fn reply_name<'a>(&'a self, model: &'a str) -> &'a str {
        if self.answers_to(model) {
            model
        } else {
            &self.name
        }
    }

    /// Every instance as a candidate at `now` (the pipeline's filters drop the unavailable
    /// ones).
    pub fn candidates(&self, now: u64) -> Vec<Candidate> {
        self.instances
            .iter()
            .map(|i| i.candidate(i.idx, 0, now, &self.index))
            .collect()
    }

    /// Whether an available instance not in `exclude` is left (a retry is possible); for a
    /// disaggregated service, a prefill and a decode instance.
    pub fn has_untried(&self, exclude: &[InstanceKey]) -> bool {
        let now = now_ms();
        let left = |role: Role| {
            self.instances
                .iter()
                .any(|i| i.role == role && !exclude.contains(&i.key) && i.health.available(now))
        };
        match self.pd {
            None => left(Role::Integrated),
            Some(_) => left(Role::Prefill) && left(Role::Decode),
        }
    }
}

/// What building a service needs besides its own config.
pub(super) struct Context<'a> {
    /// The previous runtime's instances, in its order (empty on the first build).
    pub(super) prev_instances: &'a [Arc<Instance>],
    pub(super) prefix_index: &'a PrefixIndexSettings,
    pub(super) cost: &'a Arc<CostModel>,
    pub(super) metrics: &'a Metrics,
    pub(super) now: u64,
    /// `cluster.placement: rendezvous`.
    pub(super) rendezvous: bool,
}

impl Service {
    /// The service `services[si]`, carrying over from `prev`, the same service in the
    /// previous runtime. `None` when it cannot be built; the errors are in `errs` (an
    /// instance's error leaves that instance out and the service standing).
    pub(super) fn from_config(
        si: usize,
        s: &ServiceConfig,
        prev: Option<&Service>,
        cx: &Context,
        errs: &mut Vec<String>,
    ) -> Option<Service> {
        let throttle = throttle(s, prev);
        let (limits, decode_limits) = instance_limits(throttle.as_deref());
        let (tls, http) = tls(si, s).map_err(|e| errs.push(e)).ok()?;
        let parts = ServiceParts {
            config: s,
            tls: &tls,
            throttle: throttle.clone(),
            limits,
            decode_limits,
        };
        let mut instances = Vec::with_capacity(s.instances.len());
        for (ci, i) in s.instances.iter().enumerate() {
            let path = format!("services[{si}].instances[{ci}]");
            Instance::build_into(&path, i, &parts, cx.prev_instances, &mut instances, errs);
        }
        let index = prefix_index(s, prev, cx.prefix_index);
        let sched = pipelines::service(
            si,
            s,
            prev.map(|p| &p.sched),
            cx.cost,
            cx.now,
            cx.rendezvous,
        )
        .map_err(|e| errs.push(e))
        .ok()?;
        Some(Service {
            name: s.name.clone(),
            served: s.served().to_string(),
            aliases: s.aliases.clone(),
            instances,
            sched,
            index,
            counters: cx.metrics.service_counters(&s.name),
            output: prev.map(|p| p.output.clone()).unwrap_or_default(),
            throttle,
            engine_queue: s.engine_queue(),
            pd: s.pd.as_ref().map(|pd| Pd {
                mode: pd.mode,
                decode_policy: pd.decode_policy,
                decode: pipelines::decode(pd.decode_policy),
                turn: std::sync::atomic::AtomicU64::new(0),
            }),
            http,
        })
    }
}

/// The service's throttle (`throttling:`): the previous one with the new settings (its queue
/// survives), else a new one.
fn throttle(s: &ServiceConfig, prev: Option<&Service>) -> Option<Arc<Throttle>> {
    let t = s.throttling.as_ref()?;
    let settings = ThrottleSettings {
        overflow: t.overflow,
        scope: t.scope,
        limits: Limits {
            prefill: t.prefill,
            total: t.total,
        },
        decode: t.decode,
        max_queue: t.max_queue,
        queue_timeout: t.queue_timeout,
        retry_after: t.retry_after,
    };
    Some(match prev.and_then(|p| p.throttle.clone()) {
        Some(old) => {
            old.set(settings);
            old
        }
        None => Arc::new(Throttle::new(settings)),
    })
}

/// The instance-scope slot limits of an integrated instance and of a decode node (none
/// without an instance-scope throttle).
fn instance_limits(throttle: Option<&Throttle>) -> (Limits, Limits) {
    match throttle {
        Some(t) if t.settings().scope == Scope::Instance => (
            t.settings().limits,
            Limits {
                prefill: 0,
                total: t.settings().decode,
            },
        ),
        _ => (Limits::default(), Limits::default()),
    }
}

/// TLS towards the service's https:// instances, and the client of its background loops and
/// side requests.
fn tls(si: usize, s: &ServiceConfig) -> Result<(TlsPeer, reqwest::Client), String> {
    let svc_tls =
        TlsPeer::new("", s.tls.as_ref()).map_err(|e| format!("services[{si}].tls.{e}"))?;
    if s.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
        log::warn!(
            "services[{si}] ({}): tls.insecure_skip_verify is on: the certificates of its https instances are NOT checked (tests only)",
            s.name
        );
    }
    let http = crate::tls::client(s.tls.as_ref()).map_err(|e| format!("services[{si}].tls.{e}"))?;
    Ok((svc_tls, http))
}

/// The service's prefix index: the previous one (a new TTL applies), else a new one.
fn prefix_index(
    s: &ServiceConfig,
    prev: Option<&Service>,
    cfg: &PrefixIndexSettings,
) -> Arc<PrefixIndex> {
    let ttl_ms = cfg.ttl.as_millis() as u64;
    match prev {
        Some(p) => {
            if p.index.ttl_ms()
                != ttl_ms.div_ceil(tokengate_plugins::prefix::TICK_MS)
                    * tokengate_plugins::prefix::TICK_MS
            {
                info!(
                    "service {}: prefix index ttl changed to {:?}",
                    s.name, cfg.ttl
                );
                p.index.set_ttl_ms(ttl_ms);
            }
            p.index.clone()
        }
        None => Arc::new(PrefixIndex::new(PrefixIndexConfig {
            ttl_ms,
            ..PrefixIndexConfig::default()
        })),
    }
}
