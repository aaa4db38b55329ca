//! Layered mode: session affinity → prefix cache → load balancing. The layers run in order;
//! the first that matches routes; otherwise the request falls through. Affinity and prefix
//! are optional, load balancing always runs last.
//!
//! 1. **Session affinity** (optional): the [`SessionTable`] maps the session key to an
//!    instance.
//!    * `strict`: always the bound instance. If it is not among the candidates (gone,
//!      unhealthy, already tried), the lower layers choose and the session rebinds
//!      (`affinity-rebind`).
//!    * `soft`: the bound instance unless its load > average load over the candidates ×
//!      `soft_max_load_ratio` (default 1.5); then the lower layers choose and the session
//!      rebinds (`affinity-escape`). "Load" is the service's balancing figure
//!      ([`LbPolicy::load_of`]: in-flight tokens or requests).
//!    * `ttl` (default 1800 s, refreshed on use), `max_entries` (default 100 000, least
//!      recently used evicted).
//! 2. **Prefix cache** (optional): the prompt's block hashes are matched against the
//!    [`PrefixIndex`]; hit ratio = matched blocks / prompt blocks, per candidate. A candidate
//!    is eligible when load ≤ average × (1 + `load_tolerance`, default 0.3) and waiting ≤
//!    `waiting_threshold` (default 2). The eligible candidate with the longest match wins
//!    (ties: lower load, then a rotation by `turn`) if its ratio ≥ `min_hit_ratio` (default
//!    0.50); otherwise it is a miss. Reason `prefix(0.83)`.
//! 3. **Load balancing**: [`balance::pick`] with the service's policy.
//!
//! The decision is read-only; the gateway reports the dispatch with
//! [`LayeredPicker::on_dispatch`] (binds the session, inserts the prompt into the index) and
//! the completion with [`LayeredPicker::on_complete`] (refreshes both).

use std::borrow::Cow;
use std::sync::Arc;

use crate::balance::{self, Candidate, LbPolicy};
use crate::decision::{AffinityOutcome, Decision, Layer, LayeredRow, LayeredTrace, Trace};
use crate::prefix::{PrefixIndex, PrefixIndexConfig};
use crate::scorer::RequestView;
use crate::session::{SessionConfig, SessionTable};

/// Strict or soft session affinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AffinityMode {
    #[default]
    Soft,
    Strict,
}

impl AffinityMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Soft => "soft",
            AffinityMode::Strict => "strict",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "soft" => Some(AffinityMode::Soft),
            "strict" => Some(AffinityMode::Strict),
            _ => None,
        }
    }
}

/// Layer 1 settings.
#[derive(Clone, Debug, PartialEq)]
pub struct AffinityConfig {
    pub mode: AffinityMode,
    /// Soft mode escapes when the bound load > average × this. Default 1.5.
    pub soft_max_load_ratio: f64,
    /// Binding lifetime, refreshed on use. Default 1 800 000 ms.
    pub ttl_ms: u64,
    /// Most bindings kept (least recently used evicted). Default 100 000.
    pub max_entries: usize,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            mode: AffinityMode::Soft,
            soft_max_load_ratio: 1.5,
            ttl_ms: 1_800_000,
            max_entries: 100_000,
        }
    }
}

impl AffinityConfig {
    /// The session table these settings describe.
    pub fn table_config(&self) -> SessionConfig {
        SessionConfig {
            ttl_ms: self.ttl_ms,
            max_entries: self.max_entries,
            ..SessionConfig::default()
        }
    }
}

/// Layer 2 settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixLayerConfig {
    /// Below this hit ratio it is a miss. Default 0.50.
    pub min_hit_ratio: f64,
    /// Eligible when load ≤ average × (1 + this). Default 0.3.
    pub load_tolerance: f64,
    /// Eligible when waiting ≤ this. Default 2.
    pub waiting_threshold: u64,
    /// Index entry lifetime. Default 259 200 000 ms (72 h).
    pub ttl_ms: u64,
}

impl Default for PrefixLayerConfig {
    fn default() -> Self {
        PrefixLayerConfig {
            min_hit_ratio: 0.50,
            load_tolerance: 0.3,
            waiting_threshold: 2,
            ttl_ms: 259_200_000,
        }
    }
}

impl PrefixLayerConfig {
    /// The prefix index these settings describe.
    pub fn index_config(&self) -> PrefixIndexConfig {
        PrefixIndexConfig {
            ttl_ms: self.ttl_ms,
            ..PrefixIndexConfig::default()
        }
    }
}

/// A service's layered scheduler settings. `None` disables a layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayeredConfig {
    pub policy: LbPolicy,
    pub affinity: Option<AffinityConfig>,
    pub prefix: Option<PrefixLayerConfig>,
}

/// The layered scheduler of one service. Cheap to share (`Arc`); all methods take `&self`.
#[derive(Debug)]
pub struct LayeredPicker {
    cfg: LayeredConfig,
    sessions: Arc<SessionTable>,
    index: Arc<PrefixIndex>,
}

impl LayeredPicker {
    /// A picker with fresh state sized from `cfg`.
    pub fn new(cfg: LayeredConfig) -> Self {
        let sessions = Arc::new(SessionTable::new(
            cfg.affinity.clone().unwrap_or_default().table_config(),
        ));
        let index = Arc::new(PrefixIndex::new(
            cfg.prefix.clone().unwrap_or_default().index_config(),
        ));
        LayeredPicker::with_state(cfg, sessions, index)
    }

    /// A picker over existing state (keep the tables across a config reload, or share them
    /// with a policy picker).
    pub fn with_state(
        cfg: LayeredConfig,
        sessions: Arc<SessionTable>,
        index: Arc<PrefixIndex>,
    ) -> Self {
        LayeredPicker {
            cfg,
            sessions,
            index,
        }
    }

    pub fn config(&self) -> &LayeredConfig {
        &self.cfg
    }
    pub fn sessions(&self) -> &Arc<SessionTable> {
        &self.sessions
    }
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// Chooses one of `cands`. `None` only when `cands` is empty.
    pub fn decide(&self, req: &RequestView<'_>, cands: &[Candidate]) -> Option<Decision> {
        if cands.is_empty() {
            return None;
        }
        let cfg = &self.cfg;
        let policy = cfg.policy;
        let n = cands.len();
        let loads: Vec<u64> = cands.iter().map(|c| policy.load_of(c)).collect();
        let avg = loads.iter().map(|&l| l as f64).sum::<f64>() / n as f64;

        // The match is computed whenever the prefix layer is on, even if affinity routes:
        // the predicted hit and the ceiling are reported for every request.
        let prompt_blocks = req.blocks.len() as u32;
        let matched: Vec<u32> = match (&cfg.prefix, req.blocks.is_empty()) {
            (Some(_), false) => {
                let m = self.index.match_prefix(req.blocks, req.now_ms);
                cands.iter().map(|c| m.matched(c.key)).collect()
            }
            _ => vec![0; n],
        };
        let prefix_limit = cfg.prefix.as_ref().map(|p| avg * (1.0 + p.load_tolerance));
        let eligible = |i: usize| match (&cfg.prefix, prefix_limit) {
            (Some(p), Some(limit)) => {
                loads[i] as f64 <= limit && cands[i].waiting <= p.waiting_threshold
            }
            _ => false,
        };

        // Layer 1: session affinity.
        let mut affinity = AffinityOutcome::Off;
        let mut soft_limit = None;
        let mut chosen: Option<(usize, Layer, Cow<'static, str>)> = None;
        if let Some(a) = &cfg.affinity {
            affinity = match req.session {
                None => AffinityOutcome::NoSession,
                Some(s) => match self.sessions.get(s, req.now_ms) {
                    None => AffinityOutcome::Unbound,
                    Some(bound) => match cands.iter().position(|c| c.key == bound) {
                        None => AffinityOutcome::Rebind,
                        Some(p) => {
                            let ok = match a.mode {
                                AffinityMode::Strict => true,
                                AffinityMode::Soft => {
                                    let limit = avg * a.soft_max_load_ratio;
                                    soft_limit = Some(limit);
                                    loads[p] as f64 <= limit
                                }
                            };
                            if ok {
                                chosen = Some((p, Layer::Affinity, Cow::Borrowed("affinity")));
                                AffinityOutcome::Hit
                            } else {
                                AffinityOutcome::Escape
                            }
                        }
                    },
                },
            };
        }

        // Layer 2: prefix cache.
        if chosen.is_none() && prompt_blocks > 0 {
            if let Some(p) = &cfg.prefix {
                let start = (req.turn % n as u64) as usize;
                let mut best: Option<usize> = None;
                for step in 0..n {
                    let i = (start + step) % n;
                    if !eligible(i) {
                        continue;
                    }
                    let better = match best {
                        None => true,
                        Some(b) => {
                            (matched[i], std::cmp::Reverse(loads[i]))
                                > (matched[b], std::cmp::Reverse(loads[b]))
                        }
                    };
                    if better {
                        best = Some(i);
                    }
                }
                if let Some(b) = best {
                    let ratio = f64::from(matched[b]) / f64::from(prompt_blocks);
                    if matched[b] > 0 && ratio >= p.min_hit_ratio {
                        chosen =
                            Some((b, Layer::Prefix, Cow::Owned(format!("prefix({ratio:.2})"))));
                    }
                }
            }
        }

        // Layer 3: load balancing.
        let (pos, layer, layer_reason) = match chosen {
            Some(c) => c,
            None => {
                let p = balance::pick(policy, cands, req.turn)?;
                (p.pos, Layer::Balance, Cow::Borrowed(p.reason.as_str()))
            }
        };
        let (reason, fallback) = match affinity {
            AffinityOutcome::Escape | AffinityOutcome::Rebind => {
                (Cow::Borrowed(affinity.as_str()), Some(layer_reason))
            }
            _ => (layer_reason, None),
        };
        let rows = (0..n)
            .map(|i| LayeredRow {
                idx: cands[i].idx,
                load: loads[i],
                waiting: cands[i].waiting,
                matched: matched[i],
                eligible: cfg.prefix.is_none() || eligible(i),
            })
            .collect();
        Some(Decision {
            pos,
            idx: cands[pos].idx,
            key: cands[pos].key,
            layer,
            reason,
            affinity,
            prompt_blocks,
            matched_blocks: matched[pos],
            best_matched_blocks: matched.iter().copied().max().unwrap_or(0),
            trace: Trace::Layered(LayeredTrace {
                policy,
                avg_load: avg,
                soft_limit,
                prefix_load_limit: prefix_limit,
                waiting_threshold: cfg.prefix.as_ref().map_or(0, |p| p.waiting_threshold),
                min_hit_ratio: cfg.prefix.as_ref().map_or(0.0, |p| p.min_hit_ratio),
                fallback,
                rows,
            }),
        })
    }

    /// The request was sent to `chosen`: bind the session, insert the prompt for it.
    pub fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        if let (Some(_), Some(s)) = (&self.cfg.affinity, req.session) {
            self.sessions.bind(s, chosen.key, req.now_ms);
        }
        if self.cfg.prefix.is_some() {
            self.index.insert(req.blocks, chosen.key, req.now_ms);
        }
    }

    /// The request to `chosen` completed: refresh the binding and the cached prefix.
    pub fn on_complete(&self, req: &RequestView<'_>, chosen: &Candidate) {
        if let (Some(_), Some(s)) = (&self.cfg.affinity, req.session) {
            self.sessions.touch(s, req.now_ms);
        }
        if self.cfg.prefix.is_some() {
            self.index.touch(req.blocks, chosen.key, req.now_ms);
        }
    }

    /// Periodic maintenance: frees expired bindings and index entries.
    pub fn sweep_expired(&self, now_ms: u64) {
        self.sessions.sweep_expired(now_ms);
        self.index.sweep_expired(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{InstanceKey, SessionKey};

    fn cand(i: usize, req: u64, tok: u64, waiting: u64) -> Candidate {
        Candidate {
            idx: i,
            inflight_requests: req,
            inflight_tokens: tok,
            waiting,
            key: InstanceKey::of(&format!("inst-{i}")),
            target: 0,
        }
    }

    fn idle(n: usize) -> Vec<Candidate> {
        (0..n).map(|i| cand(i, 0, 0, 0)).collect()
    }

    fn picker(mode: AffinityMode) -> LayeredPicker {
        LayeredPicker::new(LayeredConfig {
            policy: LbPolicy::LeastRequest,
            affinity: Some(AffinityConfig {
                mode,
                ..AffinityConfig::default()
            }),
            prefix: Some(PrefixLayerConfig::default()),
        })
    }

    fn req<'a>(session: &str, blocks: &'a [u64], now_ms: u64, turn: u64) -> RequestView<'a> {
        RequestView {
            session: Some(SessionKey::of(session)),
            blocks,
            now_ms,
            turn,
            ..Default::default()
        }
    }

    #[test]
    fn empty_candidates_is_none() {
        assert!(picker(AffinityMode::Soft)
            .decide(&RequestView::default(), &[])
            .is_none());
    }

    #[test]
    fn only_load_balancing_when_no_layer_is_configured() {
        let p = LayeredPicker::new(LayeredConfig::default());
        let mut cs = idle(3);
        cs[0].inflight_tokens = 50;
        let d = p.decide(&req("s", &[1, 2], 0, 0), &cs).unwrap();
        assert_eq!(
            (d.pos, d.layer, d.reason.as_ref()),
            (1, Layer::Balance, "least-token")
        );
        assert_eq!(d.affinity, AffinityOutcome::Off);
        assert_eq!(
            (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
            (2, 0, 0)
        );
    }

    #[test]
    fn a_new_session_falls_through_then_sticks() {
        let p = picker(AffinityMode::Soft);
        let cs = idle(3);
        let r = req("conv", &[], 0, 1);
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Unbound);
        assert_eq!(d.reason, "least-request");
        p.on_dispatch(&r, &cs[d.pos]);
        for turn in 2..10 {
            let d2 = p.decide(&req("conv", &[], 1000, turn), &cs).unwrap();
            assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
        }
    }

    #[test]
    fn soft_affinity_escapes_an_overloaded_instance_and_rebinds() {
        let p = picker(AffinityMode::Soft);
        let mut cs = idle(3);
        let r = req("conv", &[], 0, 0);
        p.on_dispatch(&r, &cs[0]);
        // avg = 4/3, limit 2.0: 2 in flight stays …
        cs[0].inflight_requests = 2;
        cs[1].inflight_requests = 2;
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
        // … 3 in flight (avg 1, limit 1.5) escapes to the least loaded.
        cs[0].inflight_requests = 3;
        cs[1].inflight_requests = 0;
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Escape);
        assert_eq!(d.reason, "affinity-escape");
        assert_ne!(d.pos, 0);
        assert!(
            d.explain().contains("then=least-request"),
            "{}",
            d.explain()
        );
        p.on_dispatch(&r, &cs[d.pos]);
        assert_eq!(
            p.sessions().get(SessionKey::of("conv"), 0),
            Some(cs[d.pos].key)
        );
    }

    #[test]
    fn strict_affinity_ignores_load_and_rebinds_when_the_instance_is_gone() {
        let p = picker(AffinityMode::Strict);
        let mut cs = idle(3);
        let r = req("conv", &[], 0, 0);
        p.on_dispatch(&r, &cs[2]);
        cs[2].inflight_requests = 100;
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (2, "affinity"));
        // Instance 2 failed / left: it is not a candidate any more.
        let d = p.decide(&r, &cs[..2]).unwrap();
        assert_eq!(
            (d.reason.as_ref(), d.affinity),
            ("affinity-rebind", AffinityOutcome::Rebind)
        );
        p.on_dispatch(&r, &cs[d.pos]);
        let d2 = p.decide(&r, &cs).unwrap();
        assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
    }

    #[test]
    fn affinity_expires_after_the_ttl() {
        let p = picker(AffinityMode::Strict);
        let cs = idle(2);
        p.on_dispatch(&req("c", &[], 0, 0), &cs[1]);
        let d = p.decide(&req("c", &[], 1_800_000, 0), &cs).unwrap();
        assert_eq!(d.reason, "affinity");
        p.on_complete(&req("c", &[], 1_800_000, 0), &cs[1]); // refreshed
        let d = p.decide(&req("c", &[], 3_600_000, 0), &cs).unwrap();
        assert_eq!(d.reason, "affinity");
        let d = p.decide(&req("c", &[], 5_400_001, 0), &cs).unwrap();
        assert_eq!(d.affinity, AffinityOutcome::Unbound);
    }

    #[test]
    fn prefix_routes_to_the_longest_eligible_match() {
        let p = LayeredPicker::new(LayeredConfig {
            policy: LbPolicy::LeastRequest,
            affinity: None,
            prefix: Some(PrefixLayerConfig::default()),
        });
        let mut cs = idle(4);
        let prompt: Vec<u64> = (1..=12).collect();
        // inst 1 holds 10/12, inst 2 holds 12/12 but is overloaded, inst 3 holds 5/12.
        p.on_dispatch(
            &RequestView {
                blocks: &prompt[..10],
                ..Default::default()
            },
            &cs[1],
        );
        p.on_dispatch(
            &RequestView {
                blocks: &prompt,
                ..Default::default()
            },
            &cs[2],
        );
        p.on_dispatch(
            &RequestView {
                blocks: &prompt[..5],
                ..Default::default()
            },
            &cs[3],
        );
        for (i, l) in [1, 2, 9, 0].iter().enumerate() {
            cs[i].inflight_requests = *l; // avg 3, limit 3.9
        }
        let r = RequestView {
            blocks: &prompt,
            ..Default::default()
        };
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!(
            (d.pos, d.layer, d.reason.as_ref()),
            (1, Layer::Prefix, "prefix(0.83)")
        );
        assert_eq!(
            (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
            (12, 10, 12)
        );
        let e = d.explain();
        eprintln!("{e}");
        assert!(
            e.contains("#2:load=9,wait=0,match=12(1.00),ineligible"),
            "{e}"
        );
        assert!(e.contains("*#1:load=2"), "{e}");
        // Too many waiting also makes it ineligible.
        cs[1].waiting = 3;
        let d = p.decide(&r, &cs).unwrap();
        assert_eq!(d.reason, "least-request"); // inst 3's 5/12 < 0.50 → miss
        assert_eq!(d.pos, 3);
        assert_eq!(d.best_matched_blocks, 12);
    }

    #[test]
    fn equal_matches_go_to_the_lower_load() {
        let p = LayeredPicker::new(LayeredConfig {
            policy: LbPolicy::LeastToken,
            affinity: None,
            prefix: Some(PrefixLayerConfig::default()),
        });
        let mut cs = idle(3);
        let prompt = [7u64, 8, 9, 10];
        for c in &cs {
            p.on_dispatch(
                &RequestView {
                    blocks: &prompt,
                    ..Default::default()
                },
                c,
            );
        }
        cs[0].inflight_tokens = 300;
        cs[1].inflight_tokens = 100;
        cs[2].inflight_tokens = 200;
        for turn in 0..3 {
            let d = p
                .decide(
                    &RequestView {
                        blocks: &prompt,
                        turn,
                        ..Default::default()
                    },
                    &cs,
                )
                .unwrap();
            assert_eq!((d.pos, d.reason.as_ref()), (1, "prefix(1.00)"));
        }
    }

    #[test]
    fn affinity_wins_over_prefix_but_reports_the_prefix_numbers() {
        let p = picker(AffinityMode::Soft);
        let cs = idle(2);
        let prompt = [1u64, 2, 3, 4];
        p.on_dispatch(&req("x", &prompt, 0, 0), &cs[1]);
        p.on_dispatch(&req("y", &prompt[..1], 0, 0), &cs[0]);
        let d = p.decide(&req("y", &prompt, 0, 0), &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
        assert_eq!(
            (d.matched_blocks, d.best_matched_blocks, d.prompt_blocks),
            (1, 4, 4)
        );
    }
}
