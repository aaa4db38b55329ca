//! Split proxy (`split:`): before model routing, each request is given to one entry of
//! `split.proxies` — the local entry (our own services: model routing and scheduling as
//! usual) or an external OpenAI- or Anthropic-compatible API.
//!
//! - `strategy: weight`: smooth weighted round-robin over the enabled entries (exact shares,
//!   no randomness); `strategy: prefix`: the enabled entry whose `prefix` is the longest
//!   match of the request's model (`gpt*` matches `gpt-4o`; without `*` the model must be
//!   equal; `*` alone matches every model); no match goes to the local entry.
//! - An external leg goes to `address` + the client's path after `/v1`
//!   (`/v1/chat/completions` → `https://api.example.com/v1/chat/completions`), with `model`
//!   replacing the request's model when set and `api_key` replacing the client's
//!   credentials. It is not throttled and not in the load table, prefix index or session
//!   table.
//! - Failover: an entry with `failover: participate` that is unavailable (its name does not
//!   resolve) or fails before the first response byte (connect error, timeout, 5xx, 429)
//!   passes the request to the first participating external entry not tried yet, in list
//!   order. The local entry is never a failover target; with `failover: participate` it
//!   sends what our services cannot take (no instance available, throttling rejects, the
//!   queue is full) or what failed on every attempt on our instances before the first
//!   response byte (5xx, 429, connect error, timeout) to the external entries. Once bytes
//!   reached the client there is no failover: the response ends where the upstream stopped.
//!   Where a failed attempt goes next: [`crate::request::attempt`].
//!
//! Reasons: `split(<entry>)` for the chosen external entry, `failover(<entry>)` for one that
//! took another's request.

use crate::config::{SplitFailover, SplitSettings, SplitStrategy};
use crate::upstream::Endpoint;
use http::HeaderValue;
use std::sync::Arc;
use tokengate_plugins::WeightedTargets;

/// One entry of `split.proxies`.
#[derive(Debug)]
pub struct Entry {
    /// `local` for the local entry.
    pub name: String,
    pub local: bool,
    pub enabled: bool,
    /// External entries only.
    pub endpoint: Option<Arc<Endpoint>>,
    /// Replaces the request's `model`.
    pub model: Option<String>,
    /// `Bearer <key>` and the bare key (`x-api-key` of Anthropic requests); sensitive.
    pub bearer: Option<HeaderValue>,
    pub x_api_key: Option<HeaderValue>,
    pub prefix: Option<String>,
    pub failover: bool,
}

impl Entry {
    /// Whether it may take a request now (an external entry whose name resolves).
    pub fn available(&self, now_ms: u64) -> bool {
        self.enabled && self.endpoint.as_ref().is_none_or(|e| e.available(now_ms))
    }

    /// How well `prefix` matches `model`: `None` no match, else (length matched, exact).
    fn matches(&self, model: &str) -> Option<(usize, bool)> {
        let p = self.prefix.as_deref()?;
        match p.strip_suffix('*') {
            Some(head) => model.starts_with(head).then_some((head.len(), false)),
            None => (model == p).then_some((p.len(), true)),
        }
    }
}

/// The split proxy as `/admin/instances` shows it (every entry, never its key);
/// `/admin/status` adds each entry's attempts by outcome.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SplitView {
    /// `weight` or `prefix`.
    pub strategy: String,
    pub proxies: Vec<SplitEntryView>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SplitEntryView {
    pub name: String,
    pub local: bool,
    pub enabled: bool,
    /// The external API's URL (null: the local entry).
    pub address: Option<String>,
    pub model: Option<String>,
    /// Whether a key is configured.
    pub api_key: bool,
    pub weight: Option<u32>,
    pub prefix: Option<String>,
    /// `participate` or `none`.
    pub failover: String,
    pub available: bool,
    /// `/admin/status` only: attempts by outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcomes: Option<crate::upstream::Outcomes>,
}

/// The runtime form of `split:`.
#[derive(Debug)]
pub struct Split {
    pub strategy: SplitStrategy,
    /// In config order.
    pub entries: Vec<Arc<Entry>>,
    local: usize,
    wrr: WeightedTargets,
}

impl Split {
    /// Builds it from validated settings; endpoints (addresses, health) carry over from the
    /// previous runtime's split when name, URL and TLS settings are unchanged. Errors name
    /// the YAML path.
    pub fn build(cfg: &SplitSettings, prev: Option<&Split>) -> Result<Split, Vec<String>> {
        let mut errs = Vec::new();
        let mut entries = Vec::new();
        let mut local = 0;
        for (i, p) in cfg.proxies.iter().enumerate() {
            if p.local {
                local = i;
                entries.push(Arc::new(Entry {
                    name: "local".into(),
                    local: true,
                    enabled: p.enabled,
                    endpoint: None,
                    model: None,
                    bearer: None,
                    x_api_key: None,
                    prefix: p.prefix.clone(),
                    failover: p.failover == Some(SplitFailover::Participate),
                }));
                continue;
            }
            let name = p.name.clone().unwrap_or_default();
            let prev_eps = prev
                .into_iter()
                .flat_map(|s| s.entries.iter().filter_map(|e| e.endpoint.clone()));
            let no_address = crate::upstream::EndpointUrl::new("");
            let url = p.address.as_ref().unwrap_or(&no_address);
            let endpoint = match crate::upstream::carried(prev_eps, &name, url, p.tls.as_ref()) {
                Ok(e) => e,
                Err(e) => {
                    errs.push(format!("split.proxies[{i}].address: {e}"));
                    continue;
                }
            };
            if endpoint.tls_peer.as_ref().is_some_and(|t| !t.verify) {
                log::warn!(
                    "split.proxies[{i}].tls.insecure_skip_verify: certificates of {} are NOT checked (tests only)",
                    endpoint.origin()
                );
            }
            let key = p.api_key.as_ref();
            entries.push(Arc::new(Entry {
                name,
                local: false,
                enabled: p.enabled,
                endpoint: Some(endpoint),
                model: (!p.model.is_empty()).then(|| p.model.clone()),
                bearer: key.and_then(|k| k.bearer()),
                x_api_key: key.and_then(|k| {
                    let mut v = HeaderValue::from_str(&k.0).ok()?;
                    v.set_sensitive(true);
                    Some(v)
                }),
                prefix: p.prefix.clone(),
                failover: p.failover != Some(SplitFailover::None),
            }));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let weights: Vec<u32> = cfg
            .proxies
            .iter()
            .map(|p| if p.enabled { p.weight } else { 0 })
            .collect();
        Ok(Split {
            strategy: cfg.strategy,
            entries,
            local,
            wrr: WeightedTargets::new(&weights),
        })
    }

    /// For `/admin/instances`: every entry without its key.
    pub fn view(&self, now_ms: u64) -> SplitView {
        let weights = self.wrr.weights();
        SplitView {
            strategy: match self.strategy {
                SplitStrategy::Weight => "weight",
                SplitStrategy::Prefix => "prefix",
            }
            .into(),
            proxies: self
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| SplitEntryView {
                    name: e.name.clone(),
                    local: e.local,
                    enabled: e.enabled,
                    address: e
                        .endpoint
                        .as_ref()
                        .map(|x| format!("{}{}", x.origin(), x.base_path)),
                    model: e.model.clone(),
                    api_key: e.bearer.is_some(),
                    weight: weights.get(i).copied(),
                    prefix: e.prefix.clone(),
                    failover: if e.failover { "participate" } else { "none" }.into(),
                    available: e.available(now_ms),
                    outcomes: None,
                })
                .collect(),
        }
    }

    /// The local entry.
    pub fn local(&self) -> &Arc<Entry> {
        &self.entries[self.local]
    }

    /// The entry a request for `model` goes to (see the module documentation).
    pub fn choose(&self, model: &str) -> &Arc<Entry> {
        match self.strategy {
            SplitStrategy::Weight => {
                let i = self.wrr.pick(|_| true).unwrap_or(self.local);
                &self.entries[i]
            }
            SplitStrategy::Prefix => self
                .entries
                .iter()
                .filter(|e| e.enabled)
                .filter_map(|e| e.matches(model).map(|m| (m, e)))
                .max_by_key(|(m, _)| *m)
                .map_or(self.local(), |(_, e)| e),
        }
    }

    /// The first participating external entry, in list order, that is available and not
    /// in `tried` (entry names).
    pub fn failover(&self, tried: &[String], now_ms: u64) -> Option<&Arc<Entry>> {
        self.entries
            .iter()
            .find(|e| !e.local && e.failover && e.available(now_ms) && !tried.contains(&e.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(yaml: &str) -> Split {
        let cfg: SplitSettings = serde_yaml_ng::from_str(yaml).unwrap();
        Split::build(&cfg, None).unwrap()
    }

    #[test]
    fn weights_are_exact_shares_over_enabled_entries() {
        let s = split(
            "proxies:\n  - {local: true, weight: 3}\n  - {name: a, address: 'http://127.0.0.1:1/v1', weight: 1}\n  - {name: b, address: 'http://127.0.0.1:2/v1', weight: 5, enabled: false}\n",
        );
        let mut n = [0; 2];
        for _ in 0..400 {
            n[usize::from(!s.choose("m").local)] += 1;
        }
        assert_eq!(n, [300, 100]);
    }

    #[test]
    fn the_longest_prefix_wins_and_no_match_is_local() {
        let s = split(
            "strategy: prefix\nproxies:\n  - {local: true, prefix: 'qwen*'}\n  - {name: g, address: 'http://127.0.0.1:1/v1', prefix: 'gpt*'}\n  - {name: g4, address: 'http://127.0.0.1:2/v1', prefix: 'gpt-4*'}\n  - {name: exact, address: 'http://127.0.0.1:3/v1', prefix: 'gpt-4'}\n  - {name: off, address: 'http://127.0.0.1:4/v1', prefix: 'gpt-4o*', enabled: false}\n",
        );
        for (model, want) in [
            ("qwen3-8b", "local"),
            ("gpt-3.5", "g"),
            ("gpt-4o", "g4"),
            ("gpt-4", "exact"),
            ("llama", "local"),
        ] {
            assert_eq!(s.choose(model).name, want, "{model}");
        }
        let c = split(
            "strategy: prefix\nproxies:\n  - {local: true, prefix: 'qwen*'}\n  - {name: all, address: 'http://127.0.0.1:1/v1', prefix: '*'}\n",
        );
        assert_eq!(c.choose("llama").name, "all");
        assert_eq!(c.choose("qwen3").name, "local");
    }

    #[test]
    fn failover_goes_in_list_order_over_participants_never_to_local() {
        let s = split(
            "proxies:\n  - {local: true, failover: participate}\n  - {name: a, address: 'http://127.0.0.1:1/v1'}\n  - {name: n, address: 'http://127.0.0.1:2/v1', failover: none}\n  - {name: b, address: 'http://127.0.0.1:3/v1'}\n  - {name: gone, address: 'http://name.invalid:80/v1'}\n",
        );
        assert_eq!(s.failover(&[], 0).unwrap().name, "a");
        assert_eq!(s.failover(&["a".into()], 0).unwrap().name, "b");
        assert!(s.failover(&["a".into(), "b".into()], 0).is_none());
    }
}
