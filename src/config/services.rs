//! `services:`: the served models, each a pool of engine instances.

use super::instance::InstanceConfig;
use super::pd::PdSettings;
use super::scheduler::SchedulerConfig;
use super::secret::Secret;
use super::throttling::ThrottlingSettings;
use crate::tls::TlsSettings;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::time::Duration;
use tokengate_plugins::LbPolicy;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// The model name clients send (`"model": "qwen3-32b"`).
    pub name: String,
    /// The model name the engines serve (vLLM's and SGLang's `--served-model-name`) when it
    /// is not `name`: the body's `model` is rewritten to it going up, and back to the
    /// client's name in the answer (every SSE event too). Absent: `name`.
    #[serde(default)]
    pub model: Option<String>,
    /// More names clients may send for this service (listed by `/v1/models`); the answer
    /// names the alias the client sent.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// `least-token` (default), `least-request`, `round-robin` or `predicted-ttft`: the
    /// balancer (the last layer of a layered scheduler). Set without `scheduler`: plain
    /// balancing, nothing else.
    #[serde(default)]
    pub load_balancing: Option<LbPolicy>,
    /// Layered or policy scheduling; absent = layered with its defaults when the service has
    /// several instances and no `load_balancing`, else `load_balancing` alone.
    #[serde(default)]
    pub scheduler: Option<SchedulerConfig>,
    /// Scrape the engines' own load figures from their Prometheus metrics (vLLM or SGLang
    /// names); absent = off.
    #[serde(default)]
    pub engine_metrics: Option<EngineMetricsSettings>,
    /// Slot limits per instance or per service, and what happens beyond them; absent = off.
    #[serde(default)]
    pub throttling: Option<ThrottlingSettings>,
    /// The queue of a saturated instance, held at the gateway and sent shortest predicted
    /// work first ([`crate::engine_queue`]); absent = held while every instance of the
    /// service is saturated (`hold: true, scope: service`).
    #[serde(default)]
    pub engine_queue: Option<EngineQueueSettings>,
    /// Prefill/decode disaggregation: the instances have roles (`prefill` / `decode`);
    /// absent = integrated engines.
    #[serde(default)]
    pub pd: Option<PdSettings>,
    /// The engines' API key (their `--api-key`), sent as `Authorization: Bearer` to every
    /// instance without its own.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// TLS towards the instances addressed by `https://` URLs.
    #[serde(default)]
    pub tls: Option<TlsSettings>,
    pub instances: Vec<InstanceConfig>,
}

/// `services[].engine_queue`: when the gateway holds an instance's requests and sends them
/// in order of predicted work ([`crate::engine_queue`]).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EngineQueueSettings {
    /// `true` (default): hold a saturated instance's requests here (while `scope` says);
    /// `false`: every request goes to its instance at once (the engine's own order, FIFO).
    #[serde(default)]
    pub hold: Option<bool>,
    /// `service` (default): hold only while every instance of the service is saturated (an
    /// overloaded fleet); `instance`: whenever the request's own instance is.
    #[serde(default)]
    pub scope: Option<crate::throttle::Scope>,
    /// Requests sent to an instance and waiting for their first token before the next is
    /// held (default 1: the one prefilling).
    #[serde(default = "d_eq_depth")]
    pub depth: u32,
    /// ... and their predicted prefill (default 250ms: an engine that batches prefills keeps
    /// a batch's worth).
    #[serde(default = "d_eq_min_queued", with = "humantime_serde")]
    pub min_queued: Duration,
}

fn d_eq_depth() -> u32 {
    crate::engine_queue::DEFAULT_DEPTH
}

fn d_eq_min_queued() -> Duration {
    crate::engine_queue::DEFAULT_MIN_QUEUED
}

impl ServiceConfig {
    /// The scheduler this service runs: its `scheduler`; when it sets neither `scheduler`
    /// nor `load_balancing` and can have more than one instance (two entries, or one name
    /// with `expand: true`: one instance per address), the layered scheduler with every
    /// default ([`SchedulerConfig::default_layered`]); `None`: plain `load_balancing`.
    pub fn effective_scheduler(&self) -> Option<std::borrow::Cow<'_, SchedulerConfig>> {
        let several = self.instances.len() > 1 || self.instances.iter().any(|i| i.expand);
        match &self.scheduler {
            None if self.load_balancing.is_none() && several => {
                Some(std::borrow::Cow::Owned(SchedulerConfig::default_layered()))
            }
            sc => sc.as_ref().map(std::borrow::Cow::Borrowed),
        }
    }

    /// Fills in every optional scheduling section a default decides, as the service runs
    /// (`tokengate check --print`): the scheduler ([`Self::effective_scheduler`]), its
    /// balancer (`least-token`) and the engine queue ([`Self::engine_queue`]). The result
    /// means the same as before when read back. A one-instance service that says nothing
    /// keeps `load_balancing` unset: set, it would choose plain balancing for good, and the
    /// printed form, given a second instance, would not get the layered scheduler.
    pub fn fill_defaults(&mut self) {
        let eq = self.engine_queue();
        self.scheduler = self.effective_scheduler().map(|s| s.into_owned());
        if self.scheduler.is_some() {
            self.load_balancing.get_or_insert(LbPolicy::LeastToken);
        }
        self.engine_queue = Some(EngineQueueSettings {
            hold: Some(eq.hold),
            scope: Some(eq.scope),
            depth: eq.depth,
            min_queued: Duration::from_secs_f64(eq.min_queued_ms / 1000.0),
        });
    }

    /// The resolved `engine_queue` settings: held unless `hold: false`, by default only
    /// while every instance of the service is saturated (`scope: service`; the workload
    /// matrix, `docs/scheduling.md`), never for a prefill/decode pair.
    pub fn engine_queue(&self) -> crate::engine_queue::Settings {
        let d = crate::engine_queue::Settings::default();
        let Some(eq) = self.engine_queue.as_ref() else {
            return crate::engine_queue::Settings {
                hold: d.hold && self.pd.is_none(),
                ..d
            };
        };
        crate::engine_queue::Settings {
            hold: self.pd.is_none() && eq.hold.unwrap_or(d.hold),
            scope: eq.scope.unwrap_or(d.scope),
            depth: eq.depth,
            min_queued_ms: eq.min_queued.as_secs_f64() * 1000.0,
        }
    }
}

/// `GET path` on every instance of the service every `interval`: running and queued
/// requests and KV usage, shown in `/admin/instances` and read by the predicted-TTFT model.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EngineMetricsSettings {
    #[serde(default = "d_em_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default = "d_em_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(default = "d_em_path")]
    pub path: String,
    /// `true`: an instance without `cache_tokens` takes the KV cache size its engine reports
    /// (`vllm:cache_config_info`, `sglang:max_total_num_tokens`) as its `cache_tokens`.
    #[serde(default)]
    pub cache_size: bool,
}

fn d_em_interval() -> Duration {
    Duration::from_secs(1)
}
fn d_em_timeout() -> Duration {
    Duration::from_millis(500)
}
fn d_em_path() -> String {
    "/metrics".into()
}

impl EngineMetricsSettings {
    fn validate(&self, si: usize, errs: &mut Vec<String>) {
        let em = self;
        if em.interval.is_zero() || em.timeout.is_zero() {
            errs.push(format!(
                "services[{si}].engine_metrics.interval / timeout: must be greater than 0"
            ));
        }
        if !em.path.starts_with('/') {
            errs.push(format!(
                "services[{si}].engine_metrics.path: {:?} must start with /",
                em.path
            ));
        }
    }
}

/// Every service and its instances; returns the service names. Errors come in the order of
/// the file: first every service's name and instances, then every service's features.
pub(super) fn validate<'a>(
    services: &'a [ServiceConfig],
    block_size: usize,
    errs: &mut Vec<String>,
) -> HashSet<&'a str> {
    if services.is_empty() {
        errs.push("services: at least one service is required".into());
    }
    let mut names = HashSet::new();
    let mut ids = HashSet::new();
    for (si, s) in services.iter().enumerate() {
        if s.name.is_empty() {
            errs.push(format!("services[{si}].name: must not be empty"));
        }
        if !names.insert(s.name.as_str()) {
            errs.push(format!(
                "services[{si}].name: duplicate service {:?}",
                s.name
            ));
        }
        if s.model.as_deref().is_some_and(str::is_empty) {
            errs.push(format!(
                "services[{si}].model: must not be empty (leave it out to use the name)"
            ));
        }
        if s.instances.is_empty() {
            errs.push(format!(
                "services[{si}].instances: at least one instance is required"
            ));
        }
        for (ii, inst) in s.instances.iter().enumerate() {
            inst.validate(
                &format!("services[{si}].instances[{ii}]"),
                &mut ids,
                block_size,
                errs,
            );
        }
    }
    for (si, s) in services.iter().enumerate() {
        s.validate_features(si, errs);
    }
    names
}

impl ServiceConfig {
    /// The model name the engines serve: `model`, else `name`.
    pub fn served(&self) -> &str {
        self.model.as_deref().unwrap_or(&self.name)
    }

    /// Scheduler, throttling, roles, key, TLS and engine metrics of `services[si]`.
    fn validate_features(&self, si: usize, errs: &mut Vec<String>) {
        let s = self;
        if let Some(sc) = &s.scheduler {
            super::scheduler::validate_scheduler(sc, &format!("services[{si}].scheduler"), errs);
        }
        if let Some(t) = &s.throttling {
            t.validate(si, s.pd.is_some(), errs);
        }
        if let Some(eq) = &s.engine_queue {
            if eq.depth == 0 {
                errs.push(format!(
                    "services[{si}].engine_queue.depth: must be at least 1"
                ));
            }
            if eq.hold == Some(true) && s.pd.is_some() {
                errs.push(format!(
                    "services[{si}].engine_queue.hold: not with pd (a prefill/decode pair is sent as one); remove it"
                ));
            }
        }
        super::pd::validate_pd(si, s.pd.as_ref(), &s.instances, errs);
        if let Some(k) = &s.api_key {
            if let Err(e) = k.check() {
                errs.push(format!("services[{si}].api_key: {e}"));
            }
        }
        if let Some(t) = &s.tls {
            if let Err(e) = crate::tls::check(t) {
                errs.push(format!("services[{si}].tls.{e}"));
            }
        }
        if let Some(em) = &s.engine_metrics {
            em.validate(si, errs);
        }
    }
}
