//! A model name over several services (`routes[]`): its targets, how it spreads over them
//! (weighted round-robin, or one policy scheduler across every target's instances), the
//! decision service it may ask, and how it is built from the config.

use super::instance::Instance;
use super::service::Service;
use crate::config::{ProviderConfig, RouteBy, RouteConfig};
use crate::decision::{DecisionSpec, Provider, TargetCriteria};
use crate::pipelines::{self, Scheduler};
use std::collections::HashMap;
use std::sync::Arc;
use tokengate_plugins::{Candidate, CostModel, PrefixMatch, WeightedTargets};

/// How a route spreads over its targets.
pub enum RouteMode {
    /// A target by (smooth) weighted round-robin, then the target's own scheduler:
    /// `route_by: weight`, and `round-robin` (equal weights).
    Targets { by: RouteBy, wrr: WeightedTargets },
    /// One scheduler across every target's instances.
    Policy(Scheduler),
}

/// A model name over several services.
pub struct Route {
    pub name: String,
    /// More names clients may send for it (`aliases`).
    pub aliases: Vec<String>,
    pub targets: Vec<Arc<Service>>,
    pub mode: RouteMode,
    /// The decision service: who to ask and what (targets in route order). Asked only when
    /// the route's pipeline has the decision filter.
    pub decision: Option<(Provider, DecisionSpec)>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("name", &self.name).finish()
    }
}

impl Route {
    /// Every instance of every target at `now`, numbered in target order (`idx` = position
    /// in [`Route::flat`], `target` = target number).
    pub fn candidates(&self, now: u64) -> Vec<Candidate> {
        let mut out = Vec::new();
        for (t, s) in self.targets.iter().enumerate() {
            for i in &s.instances {
                out.push(i.candidate(out.len(), t as u32, now, &s.index));
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

    /// The prompt matched against every target's index (instance keys are unique across
    /// services, so the per-instance matches do not collide).
    pub fn match_prefix(&self, blocks: &[u64], now: u64) -> PrefixMatch {
        let mut m = PrefixMatch {
            prompt_blocks: blocks.len() as u32,
            ..PrefixMatch::default()
        };
        for s in &self.targets {
            let t = s.index.match_prefix(blocks, now);
            m.best = m.best.max(t.best);
            m.per_instance.extend(t.per_instance);
        }
        m
    }

    pub fn mode_name(&self) -> &'static str {
        match &self.mode {
            RouteMode::Targets { by, .. } => by.as_str(),
            RouteMode::Policy(_) => "policy",
        }
    }

    /// The route's scheduler when it schedules across targets.
    pub fn scheduler(&self) -> Option<&Scheduler> {
        match &self.mode {
            RouteMode::Policy(s) => Some(s),
            RouteMode::Targets { .. } => None,
        }
    }

    /// Whether a request to this route asks the decision service.
    pub fn asks_decision(&self) -> bool {
        self.decision.is_some()
            && self
                .scheduler()
                .is_some_and(|s| s.needs.contains(tokengate_plugins::Needs::DECISION))
    }
}

impl Route {
    /// The route `routes[ri]` over the services built (`services`), carrying over the
    /// session bindings of `prev`, the same route in the previous runtime. Errors name the
    /// YAML path.
    pub(super) fn from_config(
        ri: usize,
        r: &RouteConfig,
        services: &HashMap<String, Arc<Service>>,
        prev: Option<&Route>,
        providers: &[ProviderConfig],
        cost: &Arc<CostModel>,
        now: u64,
    ) -> Result<Route, String> {
        let Some(targets) = r
            .targets
            .iter()
            .map(|t| services.get(&t.service).cloned())
            .collect::<Option<Vec<Arc<Service>>>>()
        else {
            return Err(format!("routes[{ri}].targets: a target is not a service"));
        };
        Ok(Route {
            name: r.name.clone(),
            aliases: r.aliases.clone(),
            targets,
            mode: mode(ri, r, prev.and_then(Route::scheduler), cost, now)?,
            decision: decision(r, providers),
        })
    }
}

/// How the route spreads over its targets (`route_by`, `policy`).
fn mode(
    ri: usize,
    r: &RouteConfig,
    prev_sched: Option<&Scheduler>,
    cost: &Arc<CostModel>,
    now: u64,
) -> Result<RouteMode, String> {
    match (r.route_by(), &r.policy) {
        (RouteBy::Policy, Some(ps)) => pipelines::policy(
            &format!("route {}", r.name),
            &format!("routes[{ri}].policy.plugins"),
            ps,
            prev_sched,
            cost,
            now,
            None,
        )
        .map(RouteMode::Policy),
        (RouteBy::Policy, None) => Err(format!(
            "routes[{ri}].policy: required when route_by is policy"
        )),
        (by, _) => {
            let weights: Vec<u32> = match by {
                RouteBy::Weight => r.targets.iter().map(|t| t.weight.unwrap_or(0)).collect(),
                _ => vec![1; r.targets.len()],
            };
            Ok(RouteMode::Targets {
                by,
                wrr: WeightedTargets::new(&weights),
            })
        }
    }
}

/// The decision service the route asks (`decision:`): its provider, and what is asked about
/// the targets, in route order. `None` without one (or without a model to ask).
fn decision(r: &RouteConfig, providers: &[ProviderConfig]) -> Option<(Provider, DecisionSpec)> {
    let d = r.decision.as_ref()?;
    let p = providers.iter().find(|p| p.name == d.provider)?;
    let provider = Provider {
        name: p.name.clone(),
        base_url: p.base_url.clone(),
        api_key: p.api_key.clone(),
        model: d.model.clone().or_else(|| p.model.clone())?,
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
}
