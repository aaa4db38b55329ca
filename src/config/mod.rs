//! The YAML configuration: what `tokengate serve -c FILE` reads and `tokengate check` validates.
//!
//! Parsing is strict: unknown keys are errors, and every error names its YAML path
//! (`services[1].instances[0].addr: invalid socket address "x"`). Structural errors come from
//! serde (with the path tracked by `serde_path_to_error`); semantic checks are done in
//! [`Config::validate`], which collects every problem instead of stopping at the first.

//!
//! One file per feature holds that feature's schema (its YAML keys and defaults) and its
//! validation; this file holds the root [`Config`], loading, and [`Config::validate`], which
//! calls each feature's checks in the order of the file.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

mod cluster;
mod decision;
mod global;
mod health;
mod instance;
mod mirror;
mod pd;
mod policy;
mod prefix_index;
mod reload;
mod response;
mod routes;
mod scheduler;
mod secret;
mod services;
mod split;
mod tenants;
mod throttling;
mod timeouts;
mod tracing;

pub use crate::tls::TlsSettings;
pub use cluster::{masked_url, ClusterSettings, Placement, RedisSettings};
pub use decision::{DecisionSettings, ProviderConfig};
pub use global::{EndpointUrl, GlobalSettings, MemberConfig};
pub use health::{HealthCheckSettings, PassiveHealthSettings};
pub use instance::{InstanceAddr, InstanceConfig, InstanceRole};
pub use mirror::MirrorSettings;
pub use pd::{PdMode, PdSettings};
pub use policy::{KeySource, PluginSettings, PolicySettings, UnboundSessions};
pub use prefix_index::{CostModelSettings, PrefixIndexSettings};
pub use reload::ReloadSettings;
pub use response::ResponseHeaders;
pub use routes::{RouteBy, RouteConfig, Routing, TargetConfig};
pub use scheduler::{
    AffinitySettings, LeastCachedSettings, PrefixSettings, SchedulerConfig,
    DEFAULT_AFFINITY_TTFT_SLACK, DEFAULT_AFFINITY_TTFT_TOLERANCE, DEFAULT_COST_MIN_HIT,
    DEFAULT_LEAST_CACHED, DEFAULT_PREFIX_LOAD_TOLERANCE, DEFAULT_PREFIX_MIN_HIT,
    DEFAULT_PREFIX_PLACEMENT, DEFAULT_PREFIX_WAITING_CAP, DEFAULT_PREFIX_WAITING_THRESHOLD,
    DEFAULT_TTFT_SLACK, DEFAULT_TTFT_TOLERANCE,
};
pub use secret::Secret;
pub use services::{EngineMetricsSettings, ServiceConfig};
pub use split::{SplitFailover, SplitProxy, SplitSettings, SplitStrategy};
pub use tenants::{Priority, TenantConfig, TenantLimits, IMPLICIT as IMPLICIT_TENANT};
pub use throttling::ThrottlingSettings;
pub use timeouts::Timeouts;
pub use tracing::{OtlpProtocol, OtlpSettings, TracingSettings};

/// Default `max_body_bytes`: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Addresses the proxy listens on (OpenAI / Anthropic APIs). `127.0.0.1:0` picks a free port.
    #[serde(default = "default_listen")]
    pub listen: Vec<String>,
    /// Address of the admin listener (`/health`, `/metrics`, `/admin/instances`).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// Worker threads of the proxy runtime (default: the number of CPUs).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Bearer token the admin listener requires for `/metrics` and `/admin/*` (`/health`
    /// stays open for probes). Absent: the admin listener is open (keep it on loopback).
    #[serde(default, serialize_with = "secret::masked")]
    pub admin_token: Option<String>,
    /// Bearer keys clients must present. Empty: the gateway is open.
    #[serde(default, serialize_with = "secret::masked_all")]
    pub api_keys: Vec<String>,
    /// Named groups of client keys: the models each may call, its priority, its limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantConfig>,
    /// Largest request body accepted (bytes); larger requests get 413.
    #[serde(
        default = "default_max_body",
        deserialize_with = "crate::config_source::bytes"
    )]
    pub max_body_bytes: usize,
    /// Active health checks of every instance.
    #[serde(default)]
    pub health_check: HealthCheckSettings,
    /// Passive ejection of instances whose requests fail.
    #[serde(default)]
    pub passive_health: PassiveHealthSettings,
    /// On SIGTERM: stop accepting, then wait this long for in-flight requests.
    #[serde(default = "d_grace", with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Hot reload of this file: watching it, and how long a change must settle first.
    #[serde(default)]
    pub reload: ReloadSettings,
    /// Log lines as `text` (default) or `json` (one object per line; `TOKENGATE_LOG_FORMAT`
    /// overrides). Read at start.
    #[serde(default)]
    pub log_format: crate::logging::LogFormat,
    #[serde(default)]
    pub routing: Routing,
    #[serde(default)]
    pub timeouts: Timeouts,
    /// The routing headers (`x-tokengate-instance`, `x-tokengate-reason`) and which of the
    /// engines' own `x-*` headers reach clients.
    #[serde(default)]
    pub response_headers: ResponseHeaders,
    /// The served models, each a pool of engine instances.
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
    /// Routes: a model name clients send that spreads over several services (targets).
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// OpenAI-compatible chat models the decision service can ask.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// The prefix index of every service.
    #[serde(default)]
    pub prefix_index: PrefixIndexSettings,
    /// The predicted-TTFT model (its priors; the rates are learned per instance).
    #[serde(default)]
    pub cost_model: CostModelSettings,
    /// Gateways in other regions that take the requests this one cannot.
    #[serde(default)]
    pub global: GlobalSettings,
    /// Traffic mirroring: a sampled copy of requests sent to another endpoint, off the
    /// client's path. Absent: off.
    #[serde(default)]
    pub mirror: Option<MirrorSettings>,
    /// Split proxy: a share of requests (by weight, or by model prefix) goes to external
    /// OpenAI- or Anthropic-compatible APIs instead of our own services, with failover
    /// between them. Absent: every request is ours.
    #[serde(default)]
    pub split: Option<SplitSettings>,
    /// OpenTelemetry traces exported over OTLP. Absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingSettings>,
    /// Several replicas sharing their routing state on Redis. Absent: one replica on its own.
    /// Read at start (a change needs a restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterSettings>,
}

fn default_listen() -> Vec<String> {
    vec!["127.0.0.1:8080".into()]
}
fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}
fn default_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}
fn d_grace() -> Duration {
    Duration::from_secs(30)
}

/// Every problem found in a config file, each `path: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<String>);

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors(vec![format!("{}: cannot read: {e}", path.display())]))?;
        Config::from_yaml(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        crate::config_report::parse(text, |c: &Config| c.validate().map_err(|e| e.0))
            .map_err(ConfigErrors)
    }

    /// This config as it runs, each service's scheduling sections a default decides filled
    /// in ([`ServiceConfig::fill_defaults`]); what `tokengate check --print` prints.
    pub fn with_defaults(&self) -> Config {
        let mut c = self.clone();
        c.services.iter_mut().for_each(ServiceConfig::fill_defaults);
        c
    }

    /// The effective config as YAML: every default filled in, every credential
    /// [`secret::MASK`] (`tokengate check --print`). The output is itself a valid config.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self)
            .unwrap_or_else(|e| format!("# the config cannot be printed: {e}\n"))
    }

    /// Semantic checks; collects every error.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut errs = Vec::new();
        self.validate_listeners(&mut errs);
        tenants::validate(&self.tenants, &self.api_keys, &mut errs);
        self.timeouts.validate(&mut errs);
        self.response_headers.validate(&mut errs);
        let names = services::validate(&self.services, self.prefix_index.block_size, &mut errs);
        self.health_check.validate(&mut errs);
        self.passive_health.validate(&mut errs);
        self.prefix_index.validate(&mut errs);
        self.global.validate(&mut errs);
        if let Some(m) = &self.mirror {
            m.validate(&mut errs);
        }
        if let Some(sp) = &self.split {
            sp.validate(&mut errs);
        }
        if let Some(t) = &self.tracing {
            t.validate(&mut errs);
        }
        if let Some(c) = &self.cluster {
            c.validate(&mut errs);
        }
        self.cost_model.validate(&mut errs);
        routes::validate(
            &self.services,
            &self.routes,
            &self.providers,
            &names,
            &mut errs,
        );
        self.routing.validate(&names, &mut errs);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errs))
        }
    }

    /// Things that are valid but probably not what was meant; logged at start and reload,
    /// printed by `tokengate check`.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if let Some(m) = &self.mirror {
            m.warnings(&mut w);
        }
        if self.split.is_none() {
            tenants::warnings(&self.tenants, &self.services, &self.routes, &mut w);
        }
        if self.cluster.as_ref().is_some_and(|c| c.rendezvous()) {
            for (si, s) in self.services.iter().enumerate() {
                if s.engine_metrics.is_none() && s.instances.len() > 1 {
                    w.push(format!(
                        "services[{si}].engine_metrics: not set, so `cluster.placement: rendezvous` places new sessions and prefixes by the hash alone, blind to the engines' load (set `engine_metrics: {{}}` to weigh it)"
                    ));
                }
            }
        }
        for (ri, r) in self.routes.iter().enumerate() {
            if r.decision.is_some() && !r.uses_decision() {
                w.push(format!(
                    "routes[{ri}].decision: set, but no decision-service plugin in routes[{ri}].policy.plugins uses it; the decision model is never asked"
                ));
            }
        }
        w
    }

    /// Listeners, threads, body size and client keys.
    fn validate_listeners(&self, errs: &mut Vec<String>) {
        if self.listen.is_empty() {
            errs.push("listen: at least one address is required".to_string());
        }
        for (i, l) in self.listen.iter().enumerate() {
            if l.parse::<SocketAddr>().is_err() {
                errs.push(format!(
                "listen[{i}]: invalid socket address {l:?} (expected ip:port, e.g. 0.0.0.0:8080)"
            ));
            }
        }
        if self.admin_listen.parse::<SocketAddr>().is_err() {
            errs.push(format!(
                "admin_listen: invalid socket address {:?} (expected ip:port, e.g. 127.0.0.1:9090)",
                self.admin_listen
            ));
        }
        if self.threads == Some(0) {
            errs.push("threads: must be at least 1".into());
        }
        self.reload.validate(errs);
        if self.max_body_bytes == 0 {
            errs.push("max_body_bytes: must be greater than 0".into());
        }
        for (i, k) in self.api_keys.iter().enumerate() {
            if k.trim().is_empty() || k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errs.push(format!(
                    "api_keys[{i}]: must be non-empty and contain no whitespace"
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests;
