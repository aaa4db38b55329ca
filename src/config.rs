//! The YAML configuration: what `tokengate serve -c FILE` reads and `tokengate check` validates.
//!
//! Parsing is strict: unknown keys are errors, and every error names its YAML path
//! (`services[1].instances[0].addr: invalid socket address "x"`). Structural errors come from
//! serde (with the path tracked by `serde_path_to_error`); semantic checks are done in
//! [`Config::validate`], which collects every problem instead of stopping at the first.

use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use tokengate_plugins::LbPolicy;

/// Default `max_body_bytes`: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

#[derive(Debug, Clone, Deserialize)]
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
    /// Bearer keys clients must present. Empty: the gateway is open.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Largest request body accepted (bytes); larger requests get 413.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    #[serde(default)]
    pub routing: Routing,
    #[serde(default)]
    pub timeouts: Timeouts,
    /// The served models, each a pool of engine instances.
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
}

/// How a request's `model` is matched to a service.
#[derive(Debug, Clone, Deserialize)]
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

/// Upstream timeouts (humantime strings: `500ms`, `2s`, `10m`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to an engine.
    #[serde(default = "d_connect", with = "humantime_serde")]
    pub connect: Duration,
    /// From the request being sent to the response header (prefill + queueing).
    #[serde(default = "d_first_byte", with = "humantime_serde")]
    pub first_byte: Duration,
    /// Longest silence between two response chunks once the response has started.
    #[serde(default = "d_idle", with = "humantime_serde")]
    pub idle: Duration,
    /// Whole request, checked at every response chunk.
    #[serde(default = "d_total", with = "humantime_serde")]
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: d_connect(),
            first_byte: d_first_byte(),
            idle: d_idle(),
            total: d_total(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// The model name clients send (`"model": "qwen3-32b"`).
    pub name: String,
    /// `least-token` (default), `least-request` or `round-robin`.
    #[serde(default = "default_lb")]
    pub load_balancing: String,
    pub instances: Vec<InstanceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceConfig {
    /// Unique id, shown in `x-tokengate-instance`, metrics and logs.
    pub id: String,
    /// `host:port` of the engine's HTTP server (IP literal).
    pub addr: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
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
fn default_lb() -> String {
    "least-token".into()
}
fn d_connect() -> Duration {
    Duration::from_secs(3)
}
fn d_first_byte() -> Duration {
    Duration::from_secs(120)
}
fn d_idle() -> Duration {
    Duration::from_secs(60)
}
fn d_total() -> Duration {
    Duration::from_secs(1800)
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
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            if path == "." || path.is_empty() {
                ConfigErrors(vec![inner])
            } else {
                ConfigErrors(vec![format!("{path}: {inner}")])
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Semantic checks; collects every error.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut errs = Vec::new();
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
        let t = &self.timeouts;
        for (name, d) in [
            ("connect", t.connect),
            ("first_byte", t.first_byte),
            ("idle", t.idle),
            ("total", t.total),
        ] {
            if d.is_zero() {
                errs.push(format!("timeouts.{name}: must be greater than 0"));
            }
        }
        if self.services.is_empty() {
            errs.push("services: at least one service is required".into());
        }
        let mut names = HashSet::new();
        let mut ids = HashSet::new();
        for (si, s) in self.services.iter().enumerate() {
            if s.name.is_empty() {
                errs.push(format!("services[{si}].name: must not be empty"));
            }
            if !names.insert(s.name.as_str()) {
                errs.push(format!(
                    "services[{si}].name: duplicate service {:?}",
                    s.name
                ));
            }
            if LbPolicy::parse(&s.load_balancing).is_none() {
                errs.push(format!(
                    "services[{si}].load_balancing: unknown policy {:?} (expected least-token, least-request or round-robin)",
                    s.load_balancing
                ));
            }
            if s.instances.is_empty() {
                errs.push(format!(
                    "services[{si}].instances: at least one instance is required"
                ));
            }
            for (ii, inst) in s.instances.iter().enumerate() {
                let p = format!("services[{si}].instances[{ii}]");
                if inst.id.is_empty() {
                    errs.push(format!("{p}.id: must not be empty"));
                } else if !ids.insert(inst.id.as_str()) {
                    errs.push(format!("{p}.id: duplicate instance id {:?}", inst.id));
                }
                if inst.addr.parse::<SocketAddr>().is_err() {
                    errs.push(format!(
                        "{p}.addr: invalid socket address {:?} (expected ip:port, e.g. 10.0.0.5:8000)",
                        inst.addr
                    ));
                }
            }
        }
        match (&self.routing.strict, &self.routing.default_model) {
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
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errs))
        }
    }

    /// The load-balancing policy of service `i` (validated).
    pub fn lb_policy(s: &ServiceConfig) -> LbPolicy {
        LbPolicy::parse(&s.load_balancing).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str =
        "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_yaml(MIN).unwrap();
        assert_eq!(c.listen, vec!["127.0.0.1:8080"]);
        assert_eq!(c.admin_listen, "127.0.0.1:9090");
        assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
        assert!(c.routing.strict);
        assert_eq!(c.timeouts.connect, Duration::from_secs(3));
    }

    #[test]
    fn unknown_key_names_its_path() {
        let y = "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000, weight: 3}\n";
        let e = Config::from_yaml(y).unwrap_err().to_string();
        assert!(e.starts_with("services[0].instances[0]"), "{e}");
        assert!(e.contains("unknown field `weight`"), "{e}");
    }

    #[test]
    fn semantic_errors_are_all_reported_with_paths() {
        let y = "listen: [nope]\nservices:\n  - name: m\n    load_balancing: random\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n  - name: m\n    instances:\n      - {id: a, addr: localhost}\n";
        let e = Config::from_yaml(y).unwrap_err().0;
        let all = e.join("\n");
        assert!(all.contains("listen[0]: invalid socket address"), "{all}");
        assert!(
            all.contains("services[0].load_balancing: unknown policy"),
            "{all}"
        );
        assert!(all.contains("services[1].name: duplicate service"), "{all}");
        assert!(
            all.contains("services[1].instances[0].id: duplicate"),
            "{all}"
        );
        assert!(
            all.contains("services[1].instances[0].addr: invalid socket address"),
            "{all}"
        );
    }

    #[test]
    fn default_model_must_exist_and_needs_non_strict() {
        let y = format!("routing: {{strict: false, default_model: x}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(
            e.contains("routing.default_model: \"x\" is not the name"),
            "{e}"
        );
        let y = format!("routing: {{strict: false, default_model: m}}\n{MIN}");
        assert!(Config::from_yaml(&y).is_ok());
    }

    #[test]
    fn bad_duration_names_its_path() {
        let y = format!("timeouts: {{connect: fast}}\n{MIN}");
        let e = Config::from_yaml(&y).unwrap_err().to_string();
        assert!(e.starts_with("timeouts.connect:"), "{e}");
    }
}
