//! The gateway's runtime state built from a [`Config`]: services, their instances and each
//! instance's live load. Held behind an `ArcSwap` so a config reload swaps it atomically.

use crate::config::{Config, Timeouts};
use crate::load::{HasLoad, InstanceLoad, LoadSnapshot};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokengate_plugins::{Candidate, InstanceKey, LbPolicy};

/// One engine instance.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    pub addr: SocketAddr,
    pub service: String,
    pub labels: BTreeMap<String, String>,
    /// Position of the instance in its service.
    pub idx: usize,
    /// Stable key of the id for the routing plugins (session table, prefix index).
    pub key: InstanceKey,
    pub load: InstanceLoad,
}

impl HasLoad for Instance {
    fn load(&self) -> &InstanceLoad {
        &self.load
    }
}

/// A served model: a pool of instances and how to balance over them.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub policy: LbPolicy,
    pub instances: Vec<Arc<Instance>>,
    turn: AtomicU64,
}

impl Service {
    /// The next value of this service's request counter (round-robin and tie rotation).
    pub fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Relaxed)
    }

    /// Load snapshots of the instances not in `exclude`.
    pub fn candidates(&self, exclude: &[usize]) -> Vec<Candidate> {
        self.instances
            .iter()
            .filter(|i| !exclude.contains(&i.idx))
            .map(|i| {
                let s = i.load.snapshot();
                Candidate {
                    idx: i.idx,
                    inflight_requests: s.inflight_requests,
                    inflight_tokens: s.inflight_tokens,
                    waiting: s.waiting,
                    key: i.key,
                    target: 0,
                }
            })
            .collect()
    }
}

/// Everything a request needs from the config, swapped as a whole on reload.
#[derive(Debug)]
pub struct Runtime {
    pub services: HashMap<String, Arc<Service>>,
    /// Services in config order (for `/v1/models` and `/admin/instances`).
    pub ordered: Vec<Arc<Service>>,
    pub strict: bool,
    pub default_model: Option<String>,
    pub api_keys: Vec<Vec<u8>>,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
}

impl Runtime {
    /// Builds the runtime state of a validated config.
    pub fn from_config(cfg: &Config) -> Runtime {
        let mut services = HashMap::new();
        let mut ordered = Vec::new();
        for s in &cfg.services {
            let instances = s
                .instances
                .iter()
                .enumerate()
                .map(|(idx, i)| {
                    Arc::new(Instance {
                        id: i.id.clone(),
                        addr: i.addr.parse().expect("validated address"),
                        service: s.name.clone(),
                        labels: i.labels.clone(),
                        idx,
                        key: InstanceKey::of(&i.id),
                        load: InstanceLoad::default(),
                    })
                })
                .collect();
            let svc = Arc::new(Service {
                name: s.name.clone(),
                policy: Config::lb_policy(s),
                instances,
                turn: AtomicU64::new(0),
            });
            services.insert(s.name.clone(), svc.clone());
            ordered.push(svc);
        }
        Runtime {
            services,
            ordered,
            strict: cfg.routing.strict,
            default_model: cfg.routing.default_model.clone(),
            api_keys: cfg.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            max_body_bytes: cfg.max_body_bytes,
            timeouts: cfg.timeouts.clone(),
        }
    }

    /// The service for a request's `model`: exact match, else the default model when routing
    /// is not strict. The bool says whether the fallback was used (the body must be rewritten).
    pub fn resolve(&self, model: &str) -> Option<(Arc<Service>, bool)> {
        if let Some(s) = self.services.get(model) {
            return Some((s.clone(), false));
        }
        if self.strict {
            return None;
        }
        let d = self.default_model.as_deref()?;
        self.services.get(d).map(|s| (s.clone(), true))
    }

    /// JSON snapshot of the load table for `/admin/instances`.
    pub fn instances_json(&self) -> serde_json::Value {
        let list: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .flat_map(|s| s.instances.iter())
            .map(|i| {
                let l: LoadSnapshot = i.load.snapshot();
                serde_json::json!({
                    "id": i.id,
                    "service": i.service,
                    "addr": i.addr.to_string(),
                    "labels": i.labels,
                    "inflight_requests": l.inflight_requests,
                    "inflight_tokens": l.inflight_tokens,
                    "waiting": l.waiting,
                    "completed": l.completed,
                    "errors": l.errors,
                    "cancelled": l.cancelled,
                })
            })
            .collect();
        serde_json::json!({ "instances": list })
    }

    /// OpenAI-shaped model list for `GET /v1/models`.
    pub fn models_json(&self) -> serde_json::Value {
        let data: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .map(|s| {
                serde_json::json!({
                    "id": s.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokengate",
                })
            })
            .collect();
        serde_json::json!({ "object": "list", "data": data })
    }
}
