//! `services[].pd:`: prefill/decode disaggregation, and the instances' roles.

use super::instance::{InstanceConfig, InstanceRole};
use serde::{Deserialize, Serialize};
use tokengate_plugins::LbPolicy;

/// Prefill/decode disaggregation of a service (see [`crate::request::pd`]).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PdSettings {
    /// The engines' KV hand-over protocol.
    pub mode: PdMode,
    /// How the decode instance is chosen (the service's scheduler chooses the prefill
    /// instance): `least-token`, `least-request` or `round-robin`.
    #[serde(default = "d_decode_policy")]
    pub decode_policy: LbPolicy,
}

fn d_decode_policy() -> LbPolicy {
    LbPolicy::LeastToken
}

/// The KV hand-over protocol of a prefill/decode-disaggregated service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdMode {
    /// SGLang with Mooncake: `bootstrap_host` / `bootstrap_port` / `bootstrap_room` in the
    /// body, sent to the prefill and the decode instance at once.
    SglangMooncake,
    /// vLLM with NIXL: the prefill first (`max_tokens: 1`, `kv_transfer_params`), then the
    /// decode with the `kv_transfer_params` the prefill returned.
    VllmNixl,
}

impl PdMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PdMode::SglangMooncake => "sglang-mooncake",
            PdMode::VllmNixl => "vllm-nixl",
        }
    }
}

/// Roles and bootstrap ports of a service's instances against its `pd` settings.
pub(super) fn validate_pd(
    si: usize,
    pd: Option<&PdSettings>,
    instances: &[InstanceConfig],
    errs: &mut Vec<String>,
) {
    let Some(pd) = pd else {
        for (ii, i) in instances.iter().enumerate() {
            let p = format!("services[{si}].instances[{ii}]");
            if i.role.is_some() {
                errs.push(format!(
                    "{p}.role: instances have roles only in a prefill/decode-disaggregated service; set services[{si}].pd (mode: sglang-mooncake or vllm-nixl)"
                ));
            }
            if i.bootstrap_port.is_some() {
                errs.push(format!(
                    "{p}.bootstrap_port: only used by prefill instances of services[{si}].pd.mode sglang-mooncake"
                ));
            }
        }
        return;
    };
    if !matches!(
        pd.decode_policy,
        LbPolicy::LeastToken | LbPolicy::LeastRequest | LbPolicy::RoundRobin
    ) {
        errs.push(format!(
            "services[{si}].pd.decode_policy: expected least-token, least-request or round-robin"
        ));
    }
    let (mut prefill, mut decode) = (0, 0);
    for (ii, i) in instances.iter().enumerate() {
        let p = format!("services[{si}].instances[{ii}]");
        match i.role {
            None => errs.push(format!(
                "{p}.role: required in a prefill/decode-disaggregated service (prefill or decode)"
            )),
            Some(InstanceRole::Prefill) => {
                prefill += 1;
                match (pd.mode, i.bootstrap_port) {
                    (PdMode::SglangMooncake, None) => errs.push(format!(
                        "{p}.bootstrap_port: required for a prefill instance in sglang-mooncake mode (the engine's --disaggregation-bootstrap-port; SGLang's default is 8998)"
                    )),
                    (PdMode::SglangMooncake, Some(0)) => {
                        errs.push(format!("{p}.bootstrap_port: must be a port (1-65535)"))
                    }
                    (PdMode::VllmNixl, Some(_)) => errs.push(format!(
                        "{p}.bootstrap_port: not used in vllm-nixl mode (the prefill returns where its KV is in kv_transfer_params)"
                    )),
                    _ => {}
                }
            }
            Some(InstanceRole::Decode) => {
                decode += 1;
                if i.bootstrap_port.is_some() {
                    errs.push(format!(
                        "{p}.bootstrap_port: only prefill instances have a bootstrap port"
                    ));
                }
            }
        }
    }
    if prefill == 0 || decode == 0 {
        errs.push(format!(
            "services[{si}].instances: a prefill/decode-disaggregated service needs at least one prefill and one decode instance ({prefill} prefill, {decode} decode)"
        ));
    }
}
