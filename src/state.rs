//! The gateway's runtime state built from a [`Config`]: services with their instances, each
//! instance's live load and each service's scheduler; routes over several services. Held
//! behind an `ArcSwap` so a config reload swaps it atomically.

use crate::api::RequestInfo;
use crate::config::{Config, PolicySettings, SchedulerConfig, Timeouts};
use crate::decision::{DecisionSpec, Provider, TargetCriteria};
use crate::load::{HasLoad, InstanceLoad, LoadSnapshot};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokengate_plugins::{
    AffinityConfig, AffinityMode, Candidate, InstanceKey, LayeredConfig, LayeredPicker, LbPolicy,
    PluginConfig, PluginKind, PolicyConfig, PolicyPicker, PrefixIndex, PrefixIndexConfig,
    PrefixLayerConfig, SessionConfig, SessionKey, SessionTable, WeightedTargets,
};

/// Milliseconds on the process's monotonic clock (the plugins' `now_ms`).
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// One engine instance.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    /// `id` as the `x-tokengate-instance` response header, built once.
    pub id_header: http::HeaderValue,
    pub addr: SocketAddr,
    pub service: String,
    pub labels: BTreeMap<String, String>,
    /// Position of the instance in its service.
    pub idx: usize,
    /// Stable key of the id for the routing plugins (session table, prefix index).
    pub key: InstanceKey,
    /// Shared with the same instance in the next config after a reload.
    pub load: Arc<InstanceLoad>,
    pub health: Arc<crate::health::Health>,
}

impl HasLoad for Instance {
    fn load(&self) -> &InstanceLoad {
        &self.load
    }
}

impl Instance {
    /// The instance as a scheduling candidate; `idx` and `target` are the caller's numbering.
    pub fn candidate(&self, idx: usize, target: u32) -> Candidate {
        let s = self.load.snapshot();
        Candidate {
            idx,
            inflight_requests: s.inflight_requests,
            inflight_tokens: s.inflight_tokens,
            waiting: s.waiting,
            key: self.key,
            target,
        }
    }
}

/// Where a session key is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Header(String),
    PromptCacheKey,
    User,
    MetadataUserId,
}

impl KeySource {
    fn parse(s: &str) -> Option<KeySource> {
        if let Some(h) = s.strip_prefix("header:") {
            return Some(KeySource::Header(h.to_ascii_lowercase()));
        }
        match s {
            "body:prompt_cache_key" => Some(KeySource::PromptCacheKey),
            "body:user" => Some(KeySource::User),
            "body:metadata.user_id" => Some(KeySource::MetadataUserId),
            _ => None,
        }
    }
}

/// The first session key found by `sources`. Body keys count only when `body_keys_allowed`
/// (the Responses and Messages APIs: a chat/completions `user` is not a session).
pub fn session_key(
    sources: &[KeySource],
    headers: &http::HeaderMap,
    info: &RequestInfo,
    body_keys_allowed: bool,
) -> Option<SessionKey> {
    for s in sources {
        let v: Option<&str> = match s {
            KeySource::Header(h) => headers.get(h.as_str()).and_then(|v| v.to_str().ok()),
            KeySource::PromptCacheKey if body_keys_allowed => info.prompt_cache_key.as_deref(),
            KeySource::User if body_keys_allowed => info.user.as_deref(),
            KeySource::MetadataUserId if body_keys_allowed => info.metadata_user_id.as_deref(),
            _ => None,
        };
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            return Some(SessionKey::of(v));
        }
    }
    None
}

/// How a set of candidates is narrowed to one.
pub enum Picker {
    /// Load balancing alone.
    Balance,
    Layered(LayeredPicker),
    Policy(PolicyPicker),
}

/// A picker plus where its session keys come from.
pub struct Scheduler {
    pub picker: Picker,
    pub session_sources: Vec<KeySource>,
    /// The picker reads the prompt's block hashes.
    pub uses_prefix: bool,
    pub sessions: Arc<SessionTable>,
    pub index: Arc<PrefixIndex>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.picker {
            Picker::Balance => "balance",
            Picker::Layered(_) => "layered",
            Picker::Policy(_) => "policy",
        };
        f.debug_struct("Scheduler").field("mode", &mode).finish()
    }
}

fn plugin_kind(name: &str) -> PluginKind {
    match name {
        "session-affinity" => PluginKind::SessionAffinity,
        "least-token" => PluginKind::LeastToken {
            token_scale: 1000.0,
        },
        "prefix-cache" => PluginKind::PrefixCache,
        "decision-service" => PluginKind::DecisionService,
        _ => PluginKind::LeastInflight,
    }
}

/// Routing state carried over a config reload: the session table and prefix index of the
/// scheduler of the same name and mode.
type Tables = Option<(Arc<SessionTable>, Arc<PrefixIndex>)>;

fn policy_scheduler(ps: &PolicySettings, index_cfg: PrefixIndexConfig, prev: Tables) -> Scheduler {
    let (sessions, index) = prev.unwrap_or_else(|| {
        (
            Arc::new(SessionTable::new(SessionConfig {
                ttl_ms: ps.session_ttl.as_millis() as u64,
                ..SessionConfig::default()
            })),
            Arc::new(PrefixIndex::new(index_cfg)),
        )
    });
    let cfg = PolicyConfig {
        plugins: ps
            .plugins
            .iter()
            .map(|p| PluginConfig {
                kind: plugin_kind(&p.kind),
                weight: p.weight,
            })
            .collect(),
    };
    let uses_prefix = cfg
        .plugins
        .iter()
        .any(|p| p.kind == PluginKind::PrefixCache);
    let picker =
        PolicyPicker::from_config(&cfg, sessions.clone(), index.clone()).expect("validated policy");
    Scheduler {
        picker: Picker::Policy(picker),
        session_sources: ps
            .session_keys
            .iter()
            .filter_map(|k| KeySource::parse(k))
            .collect(),
        uses_prefix,
        sessions,
        index,
    }
}

impl Scheduler {
    fn build(
        sc: Option<&SchedulerConfig>,
        policy: LbPolicy,
        index_cfg: PrefixIndexConfig,
        prev: Tables,
    ) -> Self {
        match sc {
            None => Scheduler {
                picker: Picker::Balance,
                session_sources: Vec::new(),
                uses_prefix: false,
                sessions: Arc::new(SessionTable::new(SessionConfig::default())),
                index: Arc::new(PrefixIndex::new(index_cfg)),
            },
            Some(SchedulerConfig::Layered { affinity, prefix }) => {
                let lc = LayeredConfig {
                    policy,
                    affinity: affinity.as_ref().map(|a| AffinityConfig {
                        mode: AffinityMode::parse(&a.mode).unwrap_or(AffinityMode::Soft),
                        soft_max_load_ratio: a.soft_max_load_ratio,
                        ttl_ms: a.ttl.as_millis() as u64,
                        max_entries: a.max_entries,
                    }),
                    prefix: prefix.as_ref().map(|p| PrefixLayerConfig {
                        min_hit_ratio: p.min_hit_ratio,
                        load_tolerance: p.load_tolerance,
                        waiting_threshold: p.waiting_threshold,
                        ttl_ms: index_cfg.ttl_ms,
                    }),
                };
                let (sessions, index) = prev.unwrap_or_else(|| {
                    (
                        Arc::new(SessionTable::new(
                            lc.affinity.clone().unwrap_or_default().table_config(),
                        )),
                        Arc::new(PrefixIndex::new(index_cfg)),
                    )
                });
                let session_sources = affinity
                    .as_ref()
                    .map(|a| {
                        a.headers
                            .iter()
                            .map(|h| KeySource::Header(h.to_ascii_lowercase()))
                            .collect()
                    })
                    .unwrap_or_default();
                let uses_prefix = lc.prefix.is_some();
                Scheduler {
                    picker: Picker::Layered(LayeredPicker::with_state(
                        lc,
                        sessions.clone(),
                        index.clone(),
                    )),
                    session_sources,
                    uses_prefix,
                    sessions,
                    index,
                }
            }
            Some(SchedulerConfig::Policy(ps)) => policy_scheduler(ps, index_cfg, prev),
        }
    }

    pub fn mode(&self) -> &'static str {
        match self.picker {
            Picker::Balance => "balance",
            Picker::Layered(_) => "layered",
            Picker::Policy(_) => "policy",
        }
    }

    pub fn sweep(&self, now: u64) {
        self.sessions.sweep_expired(now);
        self.index.sweep_expired(now);
    }
}

/// A served model: a pool of instances and how to choose among them.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub policy: LbPolicy,
    pub instances: Vec<Arc<Instance>>,
    pub sched: Scheduler,
    turn: AtomicU64,
}

impl Service {
    /// The next value of this service's request counter (round-robin and tie rotation).
    pub fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Relaxed)
    }

    /// Load snapshots of the available (healthy, not ejected) instances not in `exclude`.
    pub fn candidates(&self, exclude: &[InstanceKey]) -> Vec<Candidate> {
        let now = now_ms();
        self.instances
            .iter()
            .filter(|i| !exclude.contains(&i.key) && i.health.available(now))
            .map(|i| i.candidate(i.idx, 0))
            .collect()
    }

    pub fn has_untried(&self, exclude: &[InstanceKey]) -> bool {
        let now = now_ms();
        self.instances
            .iter()
            .any(|i| !exclude.contains(&i.key) && i.health.available(now))
    }
}

/// How a route spreads over its targets.
pub enum RouteMode {
    RoundRobin,
    Weight(WeightedTargets),
    Policy(Scheduler),
}

/// A model name over several services.
pub struct Route {
    pub name: String,
    pub targets: Vec<Arc<Service>>,
    pub criteria: Vec<Option<String>>,
    pub mode: RouteMode,
    /// The decision service: who to ask and what (targets in route order).
    pub decision: Option<(Provider, DecisionSpec)>,
    turn: AtomicU64,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("name", &self.name).finish()
    }
}

impl Route {
    pub fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Relaxed)
    }

    /// Every untried instance of every target, numbered in target order (`idx` = position
    /// in [`Route::flat`], `target` = target number).
    pub fn candidates(&self, exclude: &[InstanceKey]) -> Vec<Candidate> {
        let mut out = Vec::new();
        let mut flat = 0;
        let now = now_ms();
        for (t, s) in self.targets.iter().enumerate() {
            for i in &s.instances {
                if !exclude.contains(&i.key) && i.health.available(now) {
                    out.push(i.candidate(flat, t as u32));
                }
                flat += 1;
            }
        }
        out
    }

    /// The instance at a flat index (see [`Route::candidates`]) and its target number.
    pub fn flat(&self, mut idx: usize) -> Option<(usize, &Arc<Instance>)> {
        for (t, s) in self.targets.iter().enumerate() {
            if idx < s.instances.len() {
                return Some((t, &s.instances[idx]));
            }
            idx -= s.instances.len();
        }
        None
    }

    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            RouteMode::RoundRobin => "round-robin",
            RouteMode::Weight(_) => "weight",
            RouteMode::Policy(_) => "policy",
        }
    }
}

/// What a request's `model` resolves to.
#[derive(Debug, Clone)]
pub enum Dest {
    Service(Arc<Service>),
    Route(Arc<Route>),
}

impl Dest {
    pub fn name(&self) -> &str {
        match self {
            Dest::Service(s) => &s.name,
            Dest::Route(r) => &r.name,
        }
    }
}

/// Everything a request needs from the config, swapped as a whole on reload.
#[derive(Debug)]
pub struct Runtime {
    pub services: HashMap<String, Arc<Service>>,
    /// Services in config order (for `/v1/models` and `/admin/instances`).
    pub ordered: Vec<Arc<Service>>,
    pub routes: HashMap<String, Arc<Route>>,
    pub ordered_routes: Vec<Arc<Route>>,
    pub strict: bool,
    pub default_model: Option<String>,
    pub api_keys: Vec<Vec<u8>>,
    pub admin_token: Option<Vec<u8>>,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
    /// Bytes per prefix block: `prefix_index.block_size` tokens × 4 bytes.
    pub block_bytes: usize,
    /// Tokens per prefix block.
    pub block_tokens: usize,
    pub memory: crate::maintenance::MemoryPolicy,
    pub health_check: crate::config::HealthCheckSettings,
    pub passive: crate::config::PassiveHealthSettings,
    pub maintenance_interval: std::time::Duration,
}

impl Runtime {
    /// Builds the runtime state of a validated config.
    pub fn from_config(cfg: &Config) -> Runtime {
        Runtime::reloaded(cfg, None)
    }

    /// Builds the runtime state of a validated config, carrying over from `prev` the load
    /// counters of instances that still exist (same id and address) and the session tables
    /// and prefix indexes of schedulers that still exist (same name and mode).
    pub fn reloaded(cfg: &Config, prev: Option<&Runtime>) -> Runtime {
        let prev_sched = |name: &str, mode: &str| -> Tables {
            let p = prev?;
            let s = p
                .schedulers()
                .into_iter()
                .find(|(n, s)| n == name && s.mode() == mode)?
                .1;
            Some((s.sessions.clone(), s.index.clone()))
        };
        let prev_inst = |id: &str, addr: &str| -> Option<Arc<Instance>> {
            let p = prev?;
            p.ordered
                .iter()
                .flat_map(|s| s.instances.iter())
                .find(|i| i.id == id && i.addr.to_string() == addr)
                .cloned()
        };
        let index_cfg = PrefixIndexConfig {
            ttl_ms: cfg.prefix_index.ttl.as_millis() as u64,
            ..PrefixIndexConfig::default()
        };
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
                        id_header: http::HeaderValue::from_str(&i.id)
                            .unwrap_or_else(|_| http::HeaderValue::from_static("-")),
                        addr: i.addr.parse().expect("validated address"),
                        service: s.name.clone(),
                        labels: i.labels.clone(),
                        idx,
                        key: InstanceKey::of(&i.id),
                        load: prev_inst(&i.id, &i.addr)
                            .map(|p| p.load.clone())
                            .unwrap_or_default(),
                        health: prev_inst(&i.id, &i.addr)
                            .map(|p| p.health.clone())
                            .unwrap_or_default(),
                    })
                })
                .collect();
            let policy = Config::lb_policy(s);
            let svc = Arc::new(Service {
                name: s.name.clone(),
                policy,
                instances,
                sched: Scheduler::build(
                    s.scheduler.as_ref(),
                    policy,
                    index_cfg.clone(),
                    prev_sched(
                        &s.name,
                        match &s.scheduler {
                            None => "balance",
                            Some(SchedulerConfig::Layered { .. }) => "layered",
                            Some(SchedulerConfig::Policy(_)) => "policy",
                        },
                    ),
                ),
                turn: AtomicU64::new(0),
            });
            services.insert(s.name.clone(), svc.clone());
            ordered.push(svc);
        }
        let mut routes = HashMap::new();
        let mut ordered_routes = Vec::new();
        for r in &cfg.routes {
            let targets: Vec<Arc<Service>> = r
                .targets
                .iter()
                .map(|t| services[&t.service].clone())
                .collect();
            let mode = match r.route_by() {
                Some("weight") => RouteMode::Weight(WeightedTargets::new(
                    &r.targets
                        .iter()
                        .map(|t| t.weight.unwrap_or(0))
                        .collect::<Vec<_>>(),
                )),
                Some("policy") => RouteMode::Policy(policy_scheduler(
                    r.policy.as_ref().expect("validated"),
                    index_cfg.clone(),
                    prev_sched(&r.name, "policy"),
                )),
                _ => RouteMode::RoundRobin,
            };
            let decision = r.decision.as_ref().and_then(|d| {
                let p = cfg.providers.iter().find(|p| p.name == d.provider)?;
                let provider = Provider {
                    name: p.name.clone(),
                    base_url: p.base_url.clone(),
                    api_key: p.api_key.clone(),
                    model: p.model.clone(),
                };
                let mut spec = DecisionSpec::new(
                    d.instructions.clone(),
                    r.targets
                        .iter()
                        .map(|t| TargetCriteria {
                            name: t.service.clone(),
                            criteria: t.criteria.clone(),
                        })
                        .collect(),
                );
                spec.timeout = d.timeout;
                Some((provider, spec))
            });
            let route = Arc::new(Route {
                name: r.name.clone(),
                targets,
                criteria: r.targets.iter().map(|t| t.criteria.clone()).collect(),
                mode,
                decision,
                turn: AtomicU64::new(0),
            });
            routes.insert(r.name.clone(), route.clone());
            ordered_routes.push(route);
        }
        let block_tokens = cfg.prefix_index.block_size.max(1);
        Runtime {
            services,
            ordered,
            routes,
            ordered_routes,
            strict: cfg.routing.strict,
            default_model: cfg.routing.default_model.clone(),
            api_keys: cfg.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            admin_token: cfg.admin_token.as_ref().map(|t| t.as_bytes().to_vec()),
            max_body_bytes: cfg.max_body_bytes,
            timeouts: cfg.timeouts.clone(),
            block_bytes: block_tokens * crate::api::BYTES_PER_TOKEN,
            block_tokens,
            memory: crate::maintenance::MemoryPolicy::new(
                cfg.prefix_index.memory_threshold_ratio,
                cfg.prefix_index.reserved_memory_gib,
                cfg.prefix_index.memory_limit_bytes,
            ),
            maintenance_interval: cfg.prefix_index.maintenance_interval,
            health_check: cfg.health_check.clone(),
            passive: cfg.passive_health.clone(),
        }
    }

    /// The destination of a request's `model`: a service or route by name, else the default
    /// model when routing is not strict.
    pub fn resolve(&self, model: &str) -> Option<Dest> {
        if let Some(s) = self.services.get(model) {
            return Some(Dest::Service(s.clone()));
        }
        if let Some(r) = self.routes.get(model) {
            return Some(Dest::Route(r.clone()));
        }
        if self.strict {
            return None;
        }
        let d = self.default_model.as_deref()?;
        self.services.get(d).map(|s| Dest::Service(s.clone()))
    }

    /// Every scheduler (services', then routes' policy schedulers), for maintenance and gauges.
    pub fn schedulers(&self) -> Vec<(String, &Scheduler)> {
        let mut v: Vec<(String, &Scheduler)> = self
            .ordered
            .iter()
            .map(|s| (s.name.clone(), &s.sched))
            .collect();
        for r in &self.ordered_routes {
            if let RouteMode::Policy(s) = &r.mode {
                v.push((r.name.clone(), s));
            }
        }
        v
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
                    "health": i.health.view(now_ms()),
                })
            })
            .collect();
        let schedulers: Vec<serde_json::Value> = self
            .schedulers()
            .into_iter()
            .map(|(name, s)| {
                let ig = s.index.gauges();
                let sg = s.sessions.gauges();
                serde_json::json!({
                    "name": name,
                    "mode": s.mode(),
                    "sessions": sg.entries,
                    "index_nodes": ig.nodes,
                    "index_blocks": ig.blocks,
                    "index_bytes": ig.bytes,
                })
            })
            .collect();
        serde_json::json!({ "instances": list, "schedulers": schedulers })
    }

    /// OpenAI-shaped model list for `GET /v1/models`: services, then routes.
    pub fn models_json(&self) -> serde_json::Value {
        let data: Vec<serde_json::Value> = self
            .ordered
            .iter()
            .map(|s| s.name.as_str())
            .chain(self.ordered_routes.iter().map(|r| r.name.as_str()))
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
