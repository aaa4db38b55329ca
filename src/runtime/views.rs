//! The runtime as typed, serializable views: the load table and schedulers of
//! `/admin/instances` (also the instances of `/admin/status`), the model list of
//! `GET /v1/models`. Every field name here is part of the admin API (the status page's
//! script, the tests, the docs read them).

use super::instance::Instance;
use super::service::Service;
use super::state::Runtime;
use crate::clock::now_ms;
use crate::engine_metrics::EngineView;
use crate::health::HealthView;
use crate::load::LoadSnapshot;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use tokengate_plugins::{CostModel, InstanceKey, Role};

/// `/admin/instances` (the gateway adds the mirror, split proxy and cluster to it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstancesView {
    pub instances: Vec<InstanceView>,
    pub services: Vec<ServiceOutputView>,
    pub schedulers: Vec<SchedulerView>,
    pub prefix_indexes: Vec<IndexView>,
    pub throttles: Vec<ThrottleView>,
    /// What the cost model learned of the whole fleet.
    #[serde(default)]
    pub cost_model: FleetCostView,
}

/// The cost model's fleet-wide figures ([`tokengate_plugins::Follow`]): how many requests
/// follow a cold prompt's placement (a session's next turns, the tenant's next sessions),
/// which the least-cached layer and `predicted-ttft` price at each instance's rate.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct FleetCostView {
    /// Routing decisions learned from.
    pub decisions: u64,
    /// The share of recent decisions that sent a request where at least half of its prompt
    /// was cached.
    pub warm_share: f64,
    /// Their mean uncached tokens.
    pub warm_uncached_tokens: f64,
    /// Requests following a cold placement: `warm_share / (1 − warm_share)` (capped), 0 for
    /// the first 16 decisions.
    pub followers: f64,
}

/// One instance: its load (and the other replicas' here), cache, slots, health, engine
/// figures and what the cost model learned of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstanceView {
    pub id: String,
    pub service: String,
    pub addr: String,
    pub url: String,
    pub labels: BTreeMap<String, String>,
    /// `integrated`, `prefill` or `decode`.
    pub role: String,
    pub bootstrap_port: Option<u16>,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub waiting: u64,
    pub queued_prefill_tokens: u64,
    /// Requests held at the gateway for this instance while it is saturated
    /// (`services[].engine_queue`; they count in `inflight_requests` and `waiting` too).
    pub held: u64,
    pub other_replicas: OtherReplicas,
    pub cached_blocks: u64,
    pub placed_blocks: u64,
    pub cache_blocks: Option<u64>,
    pub cache_tokens: Option<u64>,
    pub engine_cache_tokens: Option<u64>,
    pub tokens_per_estimate: Option<f64>,
    pub cache_block_tokens: u64,
    /// null when the instance is not throttled.
    pub slots: Option<SlotsView>,
    pub decoding: u64,
    pub completed: u64,
    pub errors: u64,
    pub cancelled: u64,
    pub health: HealthView,
    /// null without `engine_metrics`.
    pub engine: Option<EngineView>,
    pub learned: LearnedView,
    /// `/admin/status` only, prefill nodes only: their prefill legs by outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd_prefill: Option<PdOutcomes>,
}

/// The load other replicas of the fleet (`cluster:`) put on the instance.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct OtherReplicas {
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub waiting: u64,
    pub queued_prefill_tokens: u64,
}

/// An instance's throttling slots in use and their limits; the phases its role has only
/// (a decode node: `decode`; a prefill node: `prefill`; integrated: `prefill`, `decode`
/// and `total`, with `prefill` and `total` limits).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SlotsView {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    pub limits: SlotLimits,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SlotLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
}

/// What the cost model learned of an instance (null before its first sample).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LearnedView {
    pub prefill_tokens_per_second: Option<f64>,
    pub decode_step_ms: Option<f64>,
}

/// A prefill node's prefill legs (or a disaggregated service's) by outcome.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PdOutcomes {
    pub ok: u64,
    pub error: u64,
    pub aborted: u64,
}

/// A scheduler: its mode, pipeline, inputs and session bindings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SchedulerView {
    pub name: String,
    pub mode: String,
    pub pipeline: String,
    pub needs: String,
    pub sessions: u64,
}

/// A throttled service: its settings, queue and service-wide slots in use.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ThrottleView {
    pub service: String,
    pub overflow: String,
    pub scope: String,
    pub limits: ThrottleLimits,
    pub queued: usize,
    pub max_queue: usize,
    pub service_slots_in_use: ThrottleLimits,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ThrottleLimits {
    pub prefill: u64,
    pub total: u64,
    pub decode: u64,
}

/// A service's prefix index: its size and what left it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IndexView {
    pub service: String,
    pub nodes: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub evicted_bytes: u64,
    pub trims: u64,
    pub trimmed_blocks: u64,
    pub capacity_evicted_blocks: u64,
}

/// A service's mean answer length.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServiceOutputView {
    pub service: String,
    pub mean_output_tokens: u64,
}

/// `GET /v1/models`, OpenAI's shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelEntry {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

fn fleet_cost(c: &CostModel) -> FleetCostView {
    let f = c.follow();
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    FleetCostView {
        decisions: f.decisions,
        warm_share: r2(f.warm_share),
        warm_uncached_tokens: f.warm_uncached.round(),
        followers: r2(f.followers()),
    }
}

fn learned(c: &CostModel, k: InstanceKey) -> LearnedView {
    let l = c.learned(k);
    LearnedView {
        prefill_tokens_per_second: (l.prefill_samples > 0)
            .then_some((l.prefill_tps * 10.0).round() / 10.0),
        decode_step_ms: (l.step_samples > 0).then_some((l.step_ms * 100.0).round() / 100.0),
    }
}

/// An instance's throttling slots in use and their limits, by its role.
fn slots(i: &Instance, l: &LoadSnapshot) -> SlotsView {
    match i.role {
        // A decode node's slots: its requests from dispatch to completion.
        Role::Decode => SlotsView {
            prefill: None,
            decode: Some(l.inflight_requests),
            total: None,
            limits: SlotLimits {
                prefill: None,
                decode: Some(i.limits.total),
                total: None,
            },
        },
        Role::Prefill => SlotsView {
            prefill: Some(l.waiting),
            decode: None,
            total: None,
            limits: SlotLimits {
                prefill: Some(i.limits.prefill),
                decode: None,
                total: None,
            },
        },
        Role::Integrated => SlotsView {
            prefill: Some(l.waiting),
            decode: Some(l.inflight_requests.saturating_sub(l.waiting)),
            total: Some(l.inflight_requests),
            limits: SlotLimits {
                prefill: Some(i.limits.prefill),
                decode: None,
                total: Some(i.limits.total),
            },
        },
    }
}

impl Runtime {
    /// The load table for `/admin/instances`.
    pub fn instances_view(&self) -> InstancesView {
        let now = now_ms();
        InstancesView {
            instances: self
                .ordered
                .iter()
                .flat_map(|s| s.instances.iter().map(move |i| (s, i)))
                .map(|(s, i)| self.instance_view(s, i, now))
                .collect(),
            services: self.service_views(),
            schedulers: self.scheduler_views(),
            prefix_indexes: self.index_views(),
            throttles: self.throttle_views(),
            cost_model: fleet_cost(&self.cost),
        }
    }

    fn instance_view(&self, s: &Service, i: &Instance, now: u64) -> InstanceView {
        let l: LoadSnapshot = i.load.snapshot();
        let remote = i.remote.get();
        InstanceView {
            id: i.id.clone(),
            service: i.service.clone(),
            addr: i.addr.to_string(),
            url: i.origin.clone(),
            labels: i.labels.clone(),
            role: i.role.as_str().to_string(),
            bootstrap_port: i.bootstrap_port,
            inflight_requests: l.inflight_requests,
            inflight_tokens: l.inflight_tokens,
            waiting: l.waiting,
            queued_prefill_tokens: l.prefill_tokens,
            held: i.queue.held() as u64,
            other_replicas: OtherReplicas {
                inflight_requests: remote[0],
                inflight_tokens: remote[1],
                waiting: remote[2],
                queued_prefill_tokens: remote[3],
            },
            cached_blocks: s.index.held_blocks(i.key),
            placed_blocks: s.index.placed_blocks(i.key),
            cache_blocks: i.cache_blocks(self.block_tokens),
            cache_tokens: i.cache_tokens(),
            engine_cache_tokens: i.engine_cache_tokens(),
            tokens_per_estimate: i.engine.tokens_per_estimate(),
            cache_block_tokens: i.engine_block_tokens(),
            slots: i.throttle.as_ref().map(|_| slots(i, &l)),
            decoding: l.inflight_requests.saturating_sub(l.waiting),
            completed: l.completed,
            errors: l.errors,
            cancelled: l.cancelled,
            health: i.health.view(now),
            engine: i.engine_max_age_ms.map(|_| i.engine.view(now)),
            learned: learned(&self.cost, i.key),
            pd_prefill: None,
        }
    }

    fn scheduler_views(&self) -> Vec<SchedulerView> {
        self.schedulers()
            .into_iter()
            .map(|(name, s)| SchedulerView {
                name: name.to_string(),
                mode: s.mode().to_string(),
                pipeline: s.describe.clone(),
                needs: s.needs.names(),
                sessions: s.sessions.as_ref().map_or(0, |t| t.gauges().entries),
            })
            .collect()
    }

    fn throttle_views(&self) -> Vec<ThrottleView> {
        self.ordered
            .iter()
            .filter_map(|s| {
                let t = s.throttle.as_ref()?;
                let st = t.settings();
                Some(ThrottleView {
                    service: s.name.clone(),
                    overflow: format!("{:?}", st.overflow).to_lowercase(),
                    scope: format!("{:?}", st.scope).to_lowercase(),
                    limits: ThrottleLimits {
                        prefill: st.limits.prefill,
                        total: st.limits.total,
                        decode: st.decode,
                    },
                    queued: t.queued(),
                    max_queue: st.max_queue,
                    service_slots_in_use: ThrottleLimits {
                        prefill: t.pool.prefill.load(Relaxed),
                        total: t.pool.total.load(Relaxed),
                        decode: t.decode_pool.total.load(Relaxed),
                    },
                })
            })
            .collect()
    }

    fn index_views(&self) -> Vec<IndexView> {
        self.ordered
            .iter()
            .map(|s| {
                let g = s.index.gauges();
                IndexView {
                    service: s.name.clone(),
                    nodes: g.nodes,
                    blocks: g.blocks,
                    bytes: g.bytes,
                    evicted_bytes: g.evicted_bytes,
                    trims: g.trims,
                    trimmed_blocks: g.trimmed_blocks,
                    capacity_evicted_blocks: g.capacity_evicted_blocks,
                }
            })
            .collect()
    }

    fn service_views(&self) -> Vec<ServiceOutputView> {
        self.ordered
            .iter()
            .map(|s| ServiceOutputView {
                service: s.name.clone(),
                mean_output_tokens: s.output.get(),
            })
            .collect()
    }

    /// `GET /v1/models`: the names clients send (never the engines' served names): every
    /// service, then every route, each followed by its aliases — for a tenant, those it may
    /// call (a name it allows, or the alias of one).
    pub fn models(&self, tenant: Option<&crate::tenants::Tenant>) -> ModelList {
        let allowed = |canonical: &str, name: &str| {
            tenant.is_none_or(|t| t.allows(name) || t.allows(canonical))
        };
        let data = self
            .ordered
            .iter()
            .flat_map(|s| {
                std::iter::once(&s.name)
                    .chain(&s.aliases)
                    .filter(|n| allowed(&s.name, n))
            })
            .chain(self.ordered_routes.iter().flat_map(|r| {
                std::iter::once(&r.name)
                    .chain(&r.aliases)
                    .filter(|n| allowed(&r.name, n))
            }))
            .map(|name| ModelEntry {
                id: name.clone(),
                object: "model".into(),
                created: 0,
                owned_by: "tokengate".into(),
            })
            .collect();
        ModelList {
            object: "list".into(),
            data,
        }
    }
}
