//! The runtime as JSON: the load table and schedulers of `/admin/instances`, the model list
//! of `GET /v1/models`.

use super::instance::Instance;
use super::service::Service;
use super::state::Runtime;
use crate::clock::now_ms;
use crate::load::LoadSnapshot;
use tokengate_plugins::{CostModel, InstanceKey, Role};

fn learned_tps(c: &CostModel, k: InstanceKey) -> Option<f64> {
    let l = c.learned(k);
    (l.prefill_samples > 0).then_some((l.prefill_tps * 10.0).round() / 10.0)
}

fn learned_step(c: &CostModel, k: InstanceKey) -> Option<f64> {
    let l = c.learned(k);
    (l.step_samples > 0).then_some((l.step_ms * 100.0).round() / 100.0)
}

/// An instance's throttling slots in use and their limits, by its role.
fn slots(i: &Instance, l: &LoadSnapshot) -> serde_json::Value {
    match i.role {
        // A decode node's slots: its requests from dispatch to completion.
        Role::Decode => serde_json::json!({
            "decode": l.inflight_requests,
            "limits": {"decode": i.limits.total},
        }),
        Role::Prefill => serde_json::json!({
            "prefill": l.waiting,
            "limits": {"prefill": i.limits.prefill},
        }),
        Role::Integrated => serde_json::json!({
            "prefill": l.waiting,
            "decode": l.inflight_requests.saturating_sub(l.waiting),
            "total": l.inflight_requests,
            "limits": {"prefill": i.limits.prefill, "total": i.limits.total},
        }),
    }
}

impl Runtime {
    /// JSON snapshot of the load table for `/admin/instances`.
    pub fn instances_json(&self) -> serde_json::Value {
        let now = now_ms();
        let list: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .flat_map(|s| s.instances.iter().map(move |i| (s, i)))
            .map(|(s, i)| self.instance_view(s, i, now))
            .collect();
        serde_json::json!({
            "instances": list,
            "services": self.service_views(),
            "schedulers": self.scheduler_views(),
            "prefix_indexes": self.index_views(),
            "throttles": self.throttle_views(),
        })
    }

    /// One instance of `/admin/instances`: its load (and the other replicas' here), cache,
    /// slots, health, engine figures and what the cost model learned of it.
    fn instance_view(&self, s: &Service, i: &Instance, now: u64) -> serde_json::Value {
        let l: LoadSnapshot = i.load.snapshot();
        let remote = i.remote.get();
        serde_json::json!({
            "id": i.id,
            "service": i.service,
            "addr": i.addr.to_string(),
            "url": i.origin,
            "labels": i.labels,
            "role": i.role.as_str(),
            "bootstrap_port": i.bootstrap_port,
            "inflight_requests": l.inflight_requests,
            "inflight_tokens": l.inflight_tokens,
            "waiting": l.waiting,
            "queued_prefill_tokens": l.prefill_tokens,
            "other_replicas": {"inflight_requests": remote[0], "inflight_tokens": remote[1],
                "waiting": remote[2], "queued_prefill_tokens": remote[3]},
            "recent_tokens": i.load.recent_tokens(crate::clock::now_ms()),
            "cached_blocks": s.index.held_blocks(i.key),
            "placed_blocks": s.index.placed_blocks(i.key),
            "cache_blocks": i.cache_blocks(self.block_tokens),
            "cache_tokens": i.cache_tokens(),
            "engine_cache_tokens": i.engine_cache_tokens(),
            "tokens_per_estimate": i.engine.tokens_per_estimate(),
            "cache_block_tokens": i.engine_block_tokens(),
            "slots": i.throttle.as_ref().map(|_| slots(i, &l)),
            "decoding": l.inflight_requests.saturating_sub(l.waiting),
            "completed": l.completed,
            "errors": l.errors,
            "cancelled": l.cancelled,
            "health": i.health.view(now),
            "engine": i.engine_max_age_ms.map(|_| i.engine.view(now)),
            "learned": {
                "prefill_tokens_per_second": learned_tps(&self.cost, i.key),
                "decode_step_ms": learned_step(&self.cost, i.key),
            },
        })
    }

    /// Every scheduler: its mode, pipeline, inputs and session bindings.
    fn scheduler_views(&self) -> Vec<serde_json::Value> {
        self.schedulers()
            .into_iter()
            .map(|(name, s)| {
                serde_json::json!({
                    "name": name,
                    "mode": s.mode(),
                    "pipeline": s.describe,
                    "needs": s.needs.names(),
                    "sessions": s.sessions.as_ref().map_or(0, |t| t.gauges().entries),
                })
            })
            .collect()
    }

    /// Every throttled service: its settings, queue and service-wide slots in use.
    fn throttle_views(&self) -> Vec<serde_json::Value> {
        self.ordered
            .iter()
            .filter_map(|s| {
                let t = s.throttle.as_ref()?;
                let st = t.settings();
                Some(serde_json::json!({
                    "service": s.name,
                    "overflow": format!("{:?}", st.overflow).to_lowercase(),
                    "scope": format!("{:?}", st.scope).to_lowercase(),
                    "limits": {"prefill": st.limits.prefill, "total": st.limits.total, "decode": st.decode},
                    "queued": t.queued(),
                    "max_queue": st.max_queue,
                    "service_slots_in_use": {
                        "prefill": t.pool.prefill.load(std::sync::atomic::Ordering::Relaxed),
                        "total": t.pool.total.load(std::sync::atomic::Ordering::Relaxed),
                        "decode": t.decode_pool.total.load(std::sync::atomic::Ordering::Relaxed),
                    },
                }))
            })
            .collect()
    }

    /// Every service's prefix index: its size and what left it.
    fn index_views(&self) -> Vec<serde_json::Value> {
        self.ordered
            .iter()
            .map(|s| {
                let g = s.index.gauges();
                serde_json::json!({
                    "service": s.name,
                    "nodes": g.nodes,
                    "blocks": g.blocks,
                    "bytes": g.bytes,
                    "evicted_bytes": g.evicted_bytes,
                    "trims": g.trims,
                    "trimmed_blocks": g.trimmed_blocks,
                    "capacity_evicted_blocks": g.capacity_evicted_blocks,
                })
            })
            .collect()
    }

    /// Every service's mean answer length.
    fn service_views(&self) -> Vec<serde_json::Value> {
        self.ordered
            .iter()
            .map(|s| {
                serde_json::json!({
                    "service": s.name,
                    "mean_output_tokens": s.output.get(),
                })
            })
            .collect()
    }

    /// OpenAI-shaped model list for `GET /v1/models`: the names clients send (never the
    /// engines' served names): services, then routes, each followed by its aliases.
    /// `GET /v1/models`: every service and route by name and alias — for a tenant, those
    /// it may call (a name it allows, or the alias of one).
    pub fn models_json(&self, tenant: Option<&crate::tenants::Tenant>) -> serde_json::Value {
        let allowed = |canonical: &str, name: &str| {
            tenant.is_none_or(|t| t.allows(name) || t.allows(canonical))
        };
        let data: Vec<serde_json::Value> = self
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
            .map(|name| {
                serde_json::json!({
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokengate",
                })
            })
            .collect();
        serde_json::json!({ "object": "list", "data": data })
    }
}
