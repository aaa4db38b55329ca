//! What a picker hands back: the chosen candidate, why, the prefix-cache figures the gateway
//! accumulates, and enough of the inputs to explain the choice in one log line.

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::balance::LbPolicy;
use crate::hash::InstanceKey;

/// Which layer (or the policy picker) made the choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layer {
    Affinity,
    Prefix,
    Balance,
    Policy,
}

/// What the affinity layer found (layered mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AffinityOutcome {
    /// Affinity is not configured (or policy mode).
    #[default]
    Off,
    /// The request carries no session key.
    NoSession,
    /// The session is new (or its binding expired): the lower layers choose, then it binds.
    Unbound,
    /// Routed to the bound instance.
    Hit,
    /// Soft mode: the bound instance was over `avg × soft_max_load_ratio`; the lower layers
    /// chose and the session rebinds.
    Escape,
    /// The bound instance is not among the candidates (gone, unhealthy, already tried).
    Rebind,
}

impl AffinityOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityOutcome::Off => "off",
            AffinityOutcome::NoSession => "no-session",
            AffinityOutcome::Unbound => "unbound",
            AffinityOutcome::Hit => "affinity",
            AffinityOutcome::Escape => "affinity-escape",
            AffinityOutcome::Rebind => "affinity-rebind",
        }
    }
}

/// One candidate as the layered picker saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayeredRow {
    pub idx: usize,
    pub load: u64,
    pub waiting: u64,
    pub matched: u32,
    /// Passed every layer's eligibility test (e.g. the prefix layer's load / waiting limits).
    pub eligible: bool,
    /// Its predicted TTFT, when the layers used one.
    pub est: Option<crate::cost::Estimate>,
}

/// The layered picker's inputs, for [`Decision::explain`].
#[derive(Clone, Debug, PartialEq)]
pub struct LayeredTrace {
    /// The load figure the layers compare (and the final balancing policy).
    pub policy: LbPolicy,
    pub avg_load: f64,
    /// The lowest predicted TTFT, ms, when the layers used predictions.
    pub min_est: Option<f64>,
    /// One line per layer that ran and has something to say (its formula and limits).
    pub notes: Vec<String>,
    /// The lower layer's own reason when a layer that heads the reason (affinity escaped or
    /// rebound) let the request fall through.
    pub fallback: Option<Cow<'static, str>>,
    /// Every candidate's figures; empty unless the request asked for an explanation.
    pub rows: Vec<LayeredRow>,
}

/// The policy picker's inputs, for [`Decision::explain`].
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyTrace {
    pub names: Vec<&'static str>,
    pub weights: Vec<f64>,
    /// Normalised scores, plugin-major: `norm[j * n + i]` for plugin `j`, candidate `i`.
    pub norm: Vec<f64>,
    pub totals: Vec<f64>,
    pub idxs: Vec<usize>,
    /// How many candidates shared the top total (1 = no tie).
    pub tied: usize,
    /// The `predicted-ttft` plugin's estimates of every candidate before any filter (`idx`,
    /// estimate), when the decision is explained; `cold`: the prompt is held nowhere, so they
    /// are compared with their harm and follow (see [`crate::cost::Estimate::cold_cost_ms`]).
    pub estimates: Vec<(usize, crate::cost::Estimate)>,
    pub cold: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Trace {
    Layered(LayeredTrace),
    Policy(PolicyTrace),
}

/// A candidate a filter removed before the picker ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    pub idx: usize,
    /// The filter's name: `unavailable`, `tried`, `decision`, `role`, …
    pub by: &'static str,
}

/// The outcome of one scheduling decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Position of the chosen candidate in the slice passed in.
    pub pos: usize,
    /// The chosen candidate's `idx` and `key`, copied for convenience.
    pub idx: usize,
    pub key: InstanceKey,
    pub layer: Layer,
    /// Short reason for the `x-tokengate-reason` header and the access log:
    /// `affinity`, `affinity-escape`, `affinity-rebind`, `prefix(0.83)`, `least-token`,
    /// `policy(affinity=1.0*0.50,inflight=1.0*0.20)`.
    pub reason: Cow<'static, str>,
    pub affinity: AffinityOutcome,
    /// Full blocks in the prompt.
    pub prompt_blocks: u32,
    /// Blocks the chosen instance is predicted to hold (the predicted cache hit).
    pub matched_blocks: u32,
    /// The best match over all candidates, eligible or not: the hit-rate ceiling.
    pub best_matched_blocks: u32,
    pub trace: Trace,
    /// Candidates the pipeline's filters removed.
    pub dropped: Vec<Dropped>,
}

impl Decision {
    /// One line with every candidate's numbers and the formula; candidates are named `#idx`.
    pub fn explain(&self) -> String {
        self.explain_with(|idx| format!("#{idx}"))
    }

    /// Like [`explain`](Self::explain), naming candidates by `name(idx)` (e.g. instance ids).
    pub fn explain_with(&self, name: impl Fn(usize) -> String) -> String {
        let mut s = String::with_capacity(256);
        let _ = write!(
            s,
            "chose {} by {} blocks={}/{} ceiling={}",
            name(self.idx),
            self.reason,
            self.matched_blocks,
            self.prompt_blocks,
            self.best_matched_blocks
        );
        match &self.trace {
            Trace::Layered(t) => {
                if self.affinity != AffinityOutcome::Off {
                    let _ = write!(s, " affinity={}", self.affinity.as_str());
                }
                if let Some(f) = &t.fallback {
                    let _ = write!(s, " then={f}");
                }
                let _ = write!(s, " | load={} avg={:.1}", t.policy, t.avg_load);
                if let Some(m) = t.min_est {
                    let _ = write!(s, " best_est={m:.0}ms");
                }
                for n in &t.notes {
                    let _ = write!(s, " {n}");
                }
                s.push_str(" |");
                for r in &t.rows {
                    let ratio = if self.prompt_blocks == 0 {
                        0.0
                    } else {
                        f64::from(r.matched) / f64::from(self.prompt_blocks)
                    };
                    let _ = write!(
                        s,
                        " {}{}:load={},wait={},match={}({:.2})",
                        if r.idx == self.idx { "*" } else { "" },
                        name(r.idx),
                        r.load,
                        r.waiting,
                        r.matched,
                        ratio,
                    );
                    if let Some(e) = &r.est {
                        s.push(',');
                        e.describe(&mut s);
                    }
                    if !r.eligible {
                        s.push_str(",ineligible");
                    }
                }
            }
            Trace::Policy(t) => {
                let n = t.idxs.len();
                s.push_str(" | total = ");
                for (j, (nm, w)) in t.names.iter().zip(&t.weights).enumerate() {
                    if j > 0 {
                        s.push_str(" + ");
                    }
                    let _ = write!(s, "{w}*{nm}");
                }
                s.push_str(" (scores normalised per plugin to sum 1)");
                if t.tied > 1 {
                    let _ = write!(s, " tie of {} broken at random", t.tied);
                }
                s.push_str(" |");
                for (i, idx) in t.idxs.iter().enumerate() {
                    let _ = write!(
                        s,
                        " {}{}:total={:.4}",
                        if *idx == self.idx { "*" } else { "" },
                        name(*idx),
                        t.totals[i]
                    );
                    for (j, nm) in t.names.iter().enumerate() {
                        let _ = write!(s, ",{nm}={:.3}", t.norm[j * n + i]);
                    }
                }
                if !t.estimates.is_empty() {
                    s.push_str(if t.cold {
                        " | ttft (cold prompt: est + harm + follow):"
                    } else {
                        " | ttft:"
                    });
                    for (idx, e) in &t.estimates {
                        let _ = write!(s, " {}:", name(*idx));
                        e.describe(&mut s);
                        if t.cold {
                            let _ = write!(s, "={:.0}ms", e.cold_cost_ms());
                        }
                    }
                }
            }
        }
        if !self.dropped.is_empty() {
            s.push_str(" | filtered out:");
            for d in &self.dropped {
                let _ = write!(s, " {}({})", name(d.idx), d.by);
            }
        }
        s
    }
}
