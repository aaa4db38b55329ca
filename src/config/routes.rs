//! `routes:` (a model name spread over several services) and `routing:` (how a request's
//! model finds its service).

use super::decision::validate_providers;
use super::decision::{DecisionSettings, ProviderConfig};
use super::policy::validate_policy;
use super::policy::{PluginSettings, PolicySettings};
use super::services::ServiceConfig;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// A model name that spreads over several services.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The `model` clients send, e.g. `qwen3`.
    pub name: String,
    /// More names clients may send for this route (listed by `/v1/models`).
    #[serde(default)]
    pub aliases: Vec<String>,
    pub targets: Vec<TargetConfig>,
    /// `round-robin` (the targets in turn), `weight` (each target's weight is its share of
    /// traffic), or `policy` (scoring across every target's instances). Default: `policy`
    /// when `policy` is set, else `weight` when any target has a weight, else `round-robin`.
    #[serde(default)]
    pub route_by: Option<RouteBy>,
    #[serde(default)]
    pub policy: Option<PolicySettings>,
    /// The decision service, used by a `decision-service` plugin.
    #[serde(default)]
    pub decision: Option<DecisionSettings>,
}

/// How a route spreads over its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouteBy {
    RoundRobin,
    Weight,
    Policy,
}

impl RouteBy {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteBy::RoundRobin => "round-robin",
            RouteBy::Weight => "weight",
            RouteBy::Policy => "policy",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// A service name.
    pub service: String,
    /// Share of the route's traffic in `weight` mode.
    #[serde(default)]
    pub weight: Option<u32>,
    /// What requests fit this target, for the decision service (generated when absent).
    #[serde(default)]
    pub criteria: Option<String>,
}

/// How a request's `model` is matched to a service.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Routing {
    /// `true`: a model that matches no service is a 404. `false`: it goes to `default_model`.
    #[serde(default = "yes")]
    pub strict: bool,
    /// The service used for unknown models when `strict` is false; the request's `model` is
    /// rewritten to this name before it is forwarded.
    #[serde(default)]
    pub default_model: Option<String>,
}

impl Default for Routing {
    fn default() -> Self {
        Routing {
            strict: true,
            default_model: None,
        }
    }
}

impl RouteConfig {
    /// The effective `route_by`.
    pub fn route_by(&self) -> RouteBy {
        match self.route_by {
            Some(m) => m,
            None if self.policy.is_some() => RouteBy::Policy,
            None if self.targets.iter().any(|t| t.weight.is_some()) => RouteBy::Weight,
            None => RouteBy::RoundRobin,
        }
    }

    /// Whether the route's policy has a decision-service plugin (and so asks its decision
    /// model).
    pub fn uses_decision(&self) -> bool {
        self.route_by() == RouteBy::Policy
            && self.policy.as_ref().is_some_and(|ps| {
                ps.plugins
                    .iter()
                    .any(|x| matches!(x, PluginSettings::DecisionService { .. }))
            })
    }
}

/// Providers and routes (`names`: the service names).
pub(super) fn validate(
    services: &[ServiceConfig],
    routes: &[RouteConfig],
    providers: &[ProviderConfig],
    names: &HashSet<&str>,
    errs: &mut Vec<String>,
) {
    let pnames = validate_providers(providers, errs);
    let pd_services: HashSet<&str> = services
        .iter()
        .filter(|s| s.pd.is_some())
        .map(|s| s.name.as_str())
        .collect();
    let known = Known {
        services: names,
        pd_services: &pd_services,
        providers,
        provider_names: &pnames,
    };
    let mut rnames = HashSet::new();
    for (ri, r) in routes.iter().enumerate() {
        r.validate(ri, &known, &mut rnames, errs);
    }
    validate_aliases(services, routes, errs);
}

/// Every alias names one service or route: not empty, not another service's or route's name,
/// not another alias. Each error names the alias's YAML path and what it collides with.
fn validate_aliases(services: &[ServiceConfig], routes: &[RouteConfig], errs: &mut Vec<String>) {
    // Every client-facing name with the path that first claimed it.
    let mut claimed: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
    for (si, s) in services.iter().enumerate() {
        claimed
            .entry(s.name.as_str())
            .or_insert_with(|| format!("services[{si}].name"));
    }
    for (ri, r) in routes.iter().enumerate() {
        claimed
            .entry(r.name.as_str())
            .or_insert_with(|| format!("routes[{ri}].name"));
    }
    let lists = services
        .iter()
        .enumerate()
        .map(|(si, s)| (format!("services[{si}]"), &s.aliases))
        .chain(
            routes
                .iter()
                .enumerate()
                .map(|(ri, r)| (format!("routes[{ri}]"), &r.aliases)),
        );
    for (p, aliases) in lists {
        for (ai, a) in aliases.iter().enumerate() {
            let at = format!("{p}.aliases[{ai}]");
            if a.is_empty() {
                errs.push(format!("{at}: must not be empty"));
                continue;
            }
            match claimed.get(a.as_str()) {
                Some(other) => errs.push(format!(
                    "{at}: {a:?} is also {other}; a model name clients send names one service or route"
                )),
                None => {
                    claimed.insert(a.as_str(), at);
                }
            }
        }
    }
}

/// What a route's names are checked against.
struct Known<'a> {
    services: &'a HashSet<&'a str>,
    pd_services: &'a HashSet<&'a str>,
    providers: &'a [ProviderConfig],
    provider_names: &'a HashSet<&'a str>,
}

impl RouteConfig {
    fn validate<'a>(
        &'a self,
        ri: usize,
        known: &Known<'_>,
        rnames: &mut HashSet<&'a str>,
        errs: &mut Vec<String>,
    ) {
        let r = self;
        let (names, pd_services) = (known.services, known.pd_services);
        let p = format!("routes[{ri}]");
        if r.name.is_empty() {
            errs.push(format!("{p}.name: must not be empty"));
        } else if names.contains(r.name.as_str()) {
            errs.push(format!(
                "{p}.name: {:?} is already a service name; a model name is either a service or a route",
                r.name
            ));
        } else if !rnames.insert(r.name.as_str()) {
            errs.push(format!("{p}.name: duplicate route {:?}", r.name));
        }
        if r.targets.is_empty() {
            errs.push(format!("{p}.targets: at least one target is required"));
        }
        let mut seen = HashSet::new();
        for (ti, t) in r.targets.iter().enumerate() {
            if !names.contains(t.service.as_str()) {
                errs.push(format!(
                    "{p}.targets[{ti}].service: {:?} is not the name of a service",
                    t.service
                ));
            } else if !seen.insert(t.service.as_str()) {
                errs.push(format!(
                    "{p}.targets[{ti}].service: {:?} is listed twice",
                    t.service
                ));
            }
        }
        match r.route_by() {
            RouteBy::Weight => {
                for (ti, t) in r.targets.iter().enumerate() {
                    if t.weight.is_none() {
                        errs.push(format!(
                            "{p}.targets[{ti}].weight: required when route_by is weight"
                        ));
                    }
                }
                if r.targets.iter().all(|t| t.weight.unwrap_or(0) == 0) {
                    errs.push(format!("{p}.targets: at least one weight must be positive"));
                }
            }
            RouteBy::Policy
                if r.targets
                    .iter()
                    .any(|t| pd_services.contains(t.service.as_str())) =>
            {
                errs.push(format!(
                    "{p}.route_by: policy schedules across the targets' instances, which cannot include a prefill/decode-disaggregated service (use weight or round-robin: the target's own scheduler then picks the pair)"
                ));
            }
            RouteBy::Policy => match &r.policy {
                None => errs.push(format!("{p}.policy: required when route_by is policy")),
                Some(ps) => {
                    validate_policy(ps, &format!("{p}.policy"), errs);
                    if r.uses_decision() && r.decision.is_none() {
                        errs.push(format!(
                            "{p}.decision: required by the decision-service plugin"
                        ));
                    }
                }
            },
            RouteBy::RoundRobin => {}
        }
        if r.policy.is_some() && r.route_by() != RouteBy::Policy {
            errs.push(format!(
                "{p}.policy: only used when route_by is policy (it is {})",
                r.route_by().as_str()
            ));
        }
        if let Some(d) = &r.decision {
            d.validate(&p, known.providers, known.provider_names, errs);
        }
    }
}

impl Routing {
    pub(super) fn validate(&self, names: &HashSet<&str>, errs: &mut Vec<String>) {
        match (&self.strict, &self.default_model) {
        (true, Some(_)) => errs.push(
            "routing.default_model: only used when routing.strict is false; set strict: false or remove it"
                .into(),
        ),
        (false, None) => errs.push(
            "routing.default_model: required when routing.strict is false".into(),
        ),
        (false, Some(m)) if !names.contains(m.as_str()) => errs.push(format!(
            "routing.default_model: {m:?} is not the name of a service"
        )),
        _ => {}
    }
    }
}

fn yes() -> bool {
    true
}
