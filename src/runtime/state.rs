//! [`Runtime`]: everything a request needs from the config, swapped as a whole on reload, and
//! [`Runtime::build`], which composes it from its parts (services with their instances,
//! routes, member gateways, split proxy, mirror) carrying over the previous runtime's state.

use super::dest::Dest;
use super::instance::Instance;
use super::route::Route;
use super::service::{self, Service};
use crate::clock::now_ms;
use crate::config::{Config, ConfigErrors, Timeouts};
use crate::metrics::Metrics;
use crate::pipelines::Scheduler;
use log::info;
use std::collections::HashMap;
use std::sync::Arc;
use tokengate_plugins::{CostConfig, CostModel};

/// Everything a request needs from the config, swapped as a whole on reload.
#[derive(Debug)]
pub struct Runtime {
    pub services: HashMap<String, Arc<Service>>,
    /// Services in config order (for `/v1/models` and `/admin/instances`).
    pub ordered: Vec<Arc<Service>>,
    pub routes: HashMap<String, Arc<Route>>,
    pub ordered_routes: Vec<Arc<Route>>,
    /// Every alias of a service or route, and what it names.
    pub aliases: HashMap<String, Dest>,
    pub strict: bool,
    pub default_model: Option<String>,
    /// Client keys and their tenants (the global `api_keys`: the implicit tenant); empty:
    /// the gateway is open. Counters kept across reloads by tenant name.
    pub tenants: crate::tenants::Tenants,
    pub admin_token: Option<Vec<u8>>,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
    /// Routing headers on or off, the engines' headers that pass (`response_headers:`).
    pub response_headers: crate::config::ResponseHeaders,
    /// Bytes per prefix block: `prefix_index.block_size` tokens × 4 bytes.
    pub block_bytes: usize,
    /// Tokens per prefix block.
    pub block_tokens: usize,
    pub memory: crate::memory::MemoryPolicy,
    pub health_check: crate::config::HealthCheckSettings,
    pub passive: crate::config::PassiveHealthSettings,
    pub maintenance_interval: std::time::Duration,
    /// The config file watcher's settings (`reload:`).
    pub reload: crate::config::ReloadSettings,
    /// Services that scrape their engines' metrics: (service, settings).
    pub engine_metrics: Vec<(Arc<Service>, crate::config::EngineMetricsSettings)>,
    /// The predicted-TTFT model: what every instance's completed requests taught it (kept
    /// across reloads).
    pub cost: Arc<CostModel>,
    /// Global scheduling: this gateway's name (the hop header) and the member gateways.
    pub hop_name: http::HeaderValue,
    pub members: Vec<Member>,
    /// Traffic mirroring (`mirror:`), when configured.
    pub mirror: Option<Arc<crate::mirror::Settings>>,
    /// Split proxy (`split:`), when configured.
    pub split: Option<Arc<crate::split::Split>>,
}

/// Another region's gateway (`global.members[]`).
#[derive(Debug, Clone)]
pub struct Member {
    pub endpoint: Arc<crate::upstream::Endpoint>,
    /// `Bearer <token>` (sensitive: never logged).
    pub auth: Option<http::HeaderValue>,
}

impl Runtime {
    /// Builds the runtime state of a validated config, carrying over from `prev` (a reload):
    /// the load counters and health of instances that still exist (same id and address),
    /// the prefix index of services that still exist (same name; a new TTL applies), and
    /// the session bindings of schedulers that still exist and still bind sessions (same
    /// service or route name; a new TTL or size applies). Errors name the YAML path.
    pub fn build(
        cfg: &Config,
        prev: Option<&Runtime>,
        metrics: &Metrics,
    ) -> Result<Runtime, ConfigErrors> {
        let now = now_ms();
        let mut errs = Vec::new();
        let cost = cost_model(cfg, prev);
        let (services, ordered) = services(cfg, prev, metrics, &cost, now, &mut errs);
        let (routes, ordered_routes) = routes(cfg, prev, &services, &cost, now, &mut errs);
        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        if prev.is_some_and(|p| p.maintenance_interval != cfg.prefix_index.maintenance_interval) {
            info!(
                "prefix_index.maintenance_interval changed to {:?}",
                cfg.prefix_index.maintenance_interval
            );
        }
        let members = members(cfg, prev)?;
        let split = split(cfg, prev)?;
        let mirror = mirror(cfg, prev)?;
        let engine_metrics = cfg
            .services
            .iter()
            .filter_map(|s| Some((services.get(&s.name)?.clone(), s.engine_metrics.clone()?)))
            .collect();
        let aliases = aliases(&ordered, &ordered_routes);
        let block_tokens = cfg.prefix_index.block_size.max(1);
        Ok(Runtime {
            services,
            ordered,
            routes,
            ordered_routes,
            aliases,
            strict: cfg.routing.strict,
            default_model: cfg.routing.default_model.clone(),
            tenants: crate::tenants::Tenants::build(
                &cfg.api_keys,
                &cfg.tenants,
                prev.map(|p| &p.tenants),
            ),
            admin_token: cfg.admin_token.as_ref().map(|t| t.as_bytes().to_vec()),
            max_body_bytes: cfg.max_body_bytes,
            timeouts: cfg.timeouts.clone(),
            response_headers: cfg.response_headers.clone(),
            block_bytes: block_tokens * crate::api::BYTES_PER_TOKEN,
            block_tokens,
            memory: crate::memory::MemoryPolicy::new(
                cfg.prefix_index.memory_threshold_ratio,
                cfg.prefix_index.reserved_memory_gib,
                cfg.prefix_index.memory_limit_bytes,
            ),
            maintenance_interval: cfg.prefix_index.maintenance_interval,
            reload: cfg.reload.clone(),
            health_check: cfg.health_check.clone(),
            passive: cfg.passive_health.clone(),
            engine_metrics,
            cost,
            hop_name: http::HeaderValue::from_str(&cfg.global.name)
                .unwrap_or_else(|_| http::HeaderValue::from_static("tokengate")),
            members,
            mirror,
            split,
        })
    }

    /// The destination of a request's `model`: a service or route by name or alias, else the
    /// default model when routing is not strict.
    pub fn resolve(&self, model: &str) -> Option<Dest> {
        if let Some(s) = self.services.get(model) {
            return Some(Dest::Service(s.clone()));
        }
        if let Some(r) = self.routes.get(model) {
            return Some(Dest::Route(r.clone()));
        }
        if let Some(d) = self.aliases.get(model) {
            return Some(d.clone());
        }
        if self.strict {
            return None;
        }
        let d = self.default_model.as_deref()?;
        self.services.get(d).map(|s| Dest::Service(s.clone()))
    }

    /// Every scheduler (services', then routes' policy schedulers), for maintenance, gauges
    /// and `/admin/instances`.
    pub fn schedulers(&self) -> Vec<(&str, &Scheduler)> {
        let mut v: Vec<(&str, &Scheduler)> = self
            .ordered
            .iter()
            .map(|s| (s.name.as_str(), &s.sched))
            .collect();
        for r in &self.ordered_routes {
            if let Some(s) = r.scheduler() {
                v.push((r.name.as_str(), s));
            }
        }
        v
    }
}

/// The predicted-TTFT model (`cost_model:`): the previous one with the new settings (what it
/// learned stays), else a new one.
fn cost_model(cfg: &Config, prev: Option<&Runtime>) -> Arc<CostModel> {
    let cm = &cfg.cost_model;
    let cost_cfg = CostConfig {
        prior_prefill_tps: cm.prior_prefill_tokens_per_second,
        prior_step_ms: cm.prior_decode_step.as_secs_f64() * 1000.0,
        alpha: cm.learning_rate,
        miss_penalty: cm.miss_penalty,
        ..CostConfig::default()
    };
    match prev {
        Some(p) => {
            p.cost.set_config(cost_cfg);
            p.cost.clone()
        }
        None => Arc::new(CostModel::new(cost_cfg)),
    }
}

/// Services by name, and in config order.
type Services = (HashMap<String, Arc<Service>>, Vec<Arc<Service>>);

/// Every service that builds (see [`Service::from_config`]); the errors of the others in
/// `errs`.
fn services(
    cfg: &Config,
    prev: Option<&Runtime>,
    metrics: &Metrics,
    cost: &Arc<CostModel>,
    now: u64,
    errs: &mut Vec<String>,
) -> Services {
    let prev_instances: Vec<Arc<Instance>> = prev
        .into_iter()
        .flat_map(|p| p.ordered.iter().flat_map(|s| s.instances.iter().cloned()))
        .collect();
    let cx = service::Context {
        prev_instances: &prev_instances,
        prefix_index: &cfg.prefix_index,
        cost,
        metrics,
        now,
        rendezvous: cfg.cluster.as_ref().is_some_and(|c| c.rendezvous()),
    };
    let mut services = HashMap::new();
    let mut ordered = Vec::new();
    for (si, s) in cfg.services.iter().enumerate() {
        let prev_svc = prev.and_then(|p| p.services.get(&s.name)).map(|s| &**s);
        if let Some(svc) = Service::from_config(si, s, prev_svc, &cx, errs) {
            let svc = Arc::new(svc);
            services.insert(s.name.clone(), svc.clone());
            ordered.push(svc);
        }
    }
    (services, ordered)
}

/// Routes by name, and in config order.
type Routes = (HashMap<String, Arc<Route>>, Vec<Arc<Route>>);

/// Every route that builds over the services built; the errors of the others in `errs`.
fn routes(
    cfg: &Config,
    prev: Option<&Runtime>,
    services: &HashMap<String, Arc<Service>>,
    cost: &Arc<CostModel>,
    now: u64,
    errs: &mut Vec<String>,
) -> Routes {
    let mut routes = HashMap::new();
    let mut ordered = Vec::new();
    for (ri, r) in cfg.routes.iter().enumerate() {
        let prev_route = prev.and_then(|p| p.routes.get(&r.name)).map(|r| &**r);
        match Route::from_config(ri, r, services, prev_route, &cfg.providers, cost, now) {
            Ok(route) => {
                let route = Arc::new(route);
                routes.insert(r.name.clone(), route.clone());
                ordered.push(route);
            }
            Err(e) => errs.push(e),
        }
    }
    (routes, ordered)
}

/// The member gateways of global scheduling (`global.members`), their endpoints carried over
/// from `prev` (names re-resolved by the reloader).
fn members(cfg: &Config, prev: Option<&Runtime>) -> Result<Vec<Member>, ConfigErrors> {
    let mut errs = Vec::new();
    let mut members = Vec::new();
    for (i, m) in cfg.global.members.iter().enumerate() {
        let prev_eps = prev
            .into_iter()
            .flat_map(|p| p.members.iter().map(|m| m.endpoint.clone()));
        match crate::upstream::carried(prev_eps, &m.name, &m.url, None) {
            Ok(endpoint) => {
                let auth = m.token.as_ref().and_then(|t| {
                    let mut v = http::HeaderValue::from_str(&format!("Bearer {t}")).ok()?;
                    v.set_sensitive(true);
                    Some(v)
                });
                members.push(Member { endpoint, auth });
            }
            Err(e) => errs.push(format!("global.members[{i}].url: {e}")),
        }
    }
    if errs.is_empty() {
        Ok(members)
    } else {
        Err(ConfigErrors(errs))
    }
}

/// The split proxy (`split:`), when configured, carrying over the previous one's entries.
fn split(
    cfg: &Config,
    prev: Option<&Runtime>,
) -> Result<Option<Arc<crate::split::Split>>, ConfigErrors> {
    let Some(sp) = cfg.split.as_ref() else {
        return Ok(None);
    };
    crate::split::Split::build(sp, prev.and_then(|p| p.split.as_deref()))
        .map(|s| Some(Arc::new(s)))
        .map_err(ConfigErrors)
}

/// Traffic mirroring (`mirror:`), when configured; a change from `prev` is logged.
fn mirror(
    cfg: &Config,
    prev: Option<&Runtime>,
) -> Result<Option<Arc<crate::mirror::Settings>>, ConfigErrors> {
    let mirror = match cfg.mirror.as_ref().map(crate::mirror::Settings::new) {
        None => None,
        Some(Ok(s)) => Some(Arc::new(s)),
        Some(Err(e)) => return Err(ConfigErrors(vec![format!("mirror.{e}")])),
    };
    if let Some(p) = prev {
        let was = p.mirror.as_ref().map(|m| m.describe());
        let now = mirror.as_ref().map(|m| m.describe());
        if was != now {
            info!(
                "mirror: {}",
                now.as_deref()
                    .unwrap_or("off (copies in flight finish or time out)")
            );
        }
    }
    Ok(mirror)
}

/// Every alias of a service or route, and what it names (a route's alias wins over a
/// service's of the same name).
fn aliases(services: &[Arc<Service>], routes: &[Arc<Route>]) -> HashMap<String, Dest> {
    let mut aliases = HashMap::new();
    for s in services {
        for a in &s.aliases {
            aliases.insert(a.clone(), Dest::Service(s.clone()));
        }
    }
    for r in routes {
        for a in &r.aliases {
            aliases.insert(a.clone(), Dest::Route(r.clone()));
        }
    }
    aliases
}
