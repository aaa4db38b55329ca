//! `services[].instances[]`: one engine's address, key, role and cache size.

use super::secret::Secret;
pub use crate::resolve::InstanceAddr;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceConfig {
    /// Unique id, shown in `x-tokengate-instance`, metrics and logs.
    pub id: String,
    /// The engine's HTTP server: `ip:port`, or `host:port` resolved at load (see
    /// [`crate::resolve`]).
    pub addr: InstanceAddr,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `prefill` or `decode` in a prefill/decode-disaggregated service (`services[].pd`).
    #[serde(default)]
    pub role: Option<InstanceRole>,
    /// SGLang prefill instances: the engine's `--disaggregation-bootstrap-port`, sent to the
    /// decode instance as `bootstrap_port` (`pd.mode: sglang-mooncake`).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// The engine's API key (its `--api-key`), sent as `Authorization: Bearer`; overrides
    /// the service's.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// The engine's KV cache size in tokens (vLLM: `num_gpu_blocks` × `block_size` in its
    /// startup log or `vllm:cache_config_info`; SGLang: `max_total_num_tokens`). When given, the
    /// prefix index never believes this instance holds more than that: once it does, the
    /// instance's least recently used entries leave the index, as the engine evicts them.
    #[serde(default)]
    pub cache_tokens: Option<u64>,
    /// The tokens per block the engine caches in (vLLM's `--block-size`: 16 on GPU, 128 on
    /// CPU; SGLang's `--page-size`). Absent: read from `vllm:cache_config_info` when the
    /// service scrapes `engine_metrics`, else learned from the cached-token counts the engine
    /// reports. The prefix index's self-correction allows for this rounding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_block_tokens: Option<u64>,
    /// `addr` is a name with one engine per address (a Kubernetes headless Service, DNS
    /// round-robin): one instance per address, id `<id>/<ip>`, added and removed as the
    /// name's answer changes (re-resolved every `reload.resolve_every`). Off: the name stands
    /// for one engine (its lowest address).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expand: bool,
}

/// An instance's part in a prefill/decode-disaggregated service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceRole {
    Prefill,
    Decode,
}

impl InstanceRole {
    pub fn plugin_role(self) -> tokengate_plugins::Role {
        match self {
            InstanceRole::Prefill => tokengate_plugins::Role::Prefill,
            InstanceRole::Decode => tokengate_plugins::Role::Decode,
        }
    }
}

impl InstanceConfig {
    pub(super) fn validate<'a>(
        &'a self,
        p: &str,
        ids: &mut HashSet<&'a str>,
        block_size: usize,
        errs: &mut Vec<String>,
    ) {
        let inst = self;
        if inst.id.is_empty() {
            errs.push(format!("{p}.id: must not be empty"));
        } else if !ids.insert(inst.id.as_str()) {
            errs.push(format!("{p}.id: duplicate instance id {:?}", inst.id));
        } else if http::HeaderValue::from_str(&inst.id).is_err() {
            errs.push(format!(
            "{p}.id: {:?} cannot be sent in the x-tokengate-instance header (use visible ASCII)",
            inst.id
        ));
        }
        if let Err(e) = inst.addr.target() {
            errs.push(format!("{p}.addr: {e}"));
        } else if inst.expand && !crate::resolve::is_name(&inst.addr) {
            errs.push(format!(
                "{p}.expand: {} is an address, not a name: there is nothing to expand (remove expand, or give a name with several addresses)",
                inst.addr
            ));
        }
        if inst.expand && inst.id.contains('/') {
            errs.push(format!(
                "{p}.id: {:?} must not contain '/' with expand (the instances are named <id>/<ip>)",
                inst.id
            ));
        }
        if let Some(k) = &inst.api_key {
            if let Err(e) = k.check() {
                errs.push(format!("{p}.api_key: {e}"));
            }
        }
        if inst.cache_block_tokens == Some(0) {
            errs.push(format!(
                "{p}.cache_block_tokens: must be at least 1 (the engine's KV block size in tokens, e.g. 16)"
            ));
        }
        if let Some(t) = inst.cache_tokens {
            let block = block_size.max(1) as u64;
            if t < block {
                errs.push(format!(
                "{p}.cache_tokens: {t} is less than one prefix block (prefix_index.block_size: {block}); give the engine's KV cache size in tokens"
            ));
            }
        }
    }
}
