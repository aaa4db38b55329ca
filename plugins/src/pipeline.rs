//! The picker pipeline: **filter → score → pick**, one trait per step, in the spirit of
//! Dynamo's KV router (`WorkerFilter` / `WorkerScorer` / `WorkerPicker`).
//!
//! ```text
//!   candidates ──▶ Filter ──▶ Filter ──▶ … ──▶ Picker ──▶ Decision
//!   (every instance   (drop: unavailable,        (layered: first hit of its stages;
//!    of the service,   tried, not the decision's   policy: Σ weight × normalised score
//!    with its load)    target, wrong role, …)      of its scorers; balance: one stage)
//! ```
//!
//! * A [`Filter`] drops candidates (health, a retry's tried instances, the decision service's
//!   target, a prefill/decode role, a throttling limit).
//! * A [`Picker`] chooses one of the survivors and says why ([`Decision`]). The built-in
//!   pickers are compositions: [`crate::layered::FirstHit`] runs [`crate::layered::Stage`]s in
//!   order and the first that routes wins (layered mode, and plain load balancing as a
//!   first-hit with no stage before the balancer); [`crate::policy::WeightedSum`] adds up its
//!   [`crate::scorer::Scorer`]s (policy mode).
//! * Every filter, stage and scorer declares the inputs it reads ([`Needs`]); a pipeline's
//!   needs are their union, and the gateway computes nothing else.
//! * A pair of pipelines picks a prefill and a decode instance ([`crate::pair::PairPicker`]).
//!
//! Everything here is pure and synchronous: no I/O, no clock (the caller passes `now_ms`), no
//! global RNG (the caller passes one, seeded in tests).

use rand::RngCore;

use crate::candidate::{Candidate, Needs, RequestView};
use crate::decision::{Decision, Dropped};

/// How a dispatched request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// The instance failed (connect, status >= 500, died mid-response, timed out).
    Failed,
    /// The client went away; not the instance's fault.
    Cancelled,
}

/// What the gateway learned when a request finished, for stages that learn from outcomes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Completion {
    pub outcome: Outcome,
    /// Dispatch to first token, milliseconds (when there was one).
    pub ttft_ms: Option<f64>,
    /// Prompt tokens as the engine reported them.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the engine served from its prefix cache.
    pub cached_tokens: Option<u64>,
}

impl Completion {
    pub fn of(outcome: Outcome) -> Self {
        Completion {
            outcome,
            ttft_ms: None,
            prompt_tokens: None,
            cached_tokens: None,
        }
    }
}

/// Drops candidates. `keep[i]` is true on entry for the candidates earlier filters kept; a
/// filter clears it for each candidate it drops (and leaves the others alone).
pub trait Filter: Send + Sync {
    /// Shown in explanations as the reason a candidate was dropped.
    fn name(&self) -> &'static str;
    fn needs(&self) -> Needs {
        Needs::NONE
    }
    fn apply(&self, req: &RequestView<'_>, cands: &[Candidate], keep: &mut [bool]);
}

/// Chooses one candidate. Gets only the candidates every filter kept (never an empty slice);
/// returns `None` only when it cannot choose.
pub trait Picker: Send + Sync {
    /// `layered`, `policy`, `balance`: the scheduler mode it implements.
    fn name(&self) -> &'static str;
    fn needs(&self) -> Needs;
    fn pick(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision>;
    /// The request was sent to `chosen` (bind a session, …).
    fn on_dispatch(&self, _req: &RequestView<'_>, _chosen: &Candidate) {}
    /// The request to `chosen` finished.
    fn on_complete(&self, _req: &RequestView<'_>, _chosen: &Candidate, _done: &Completion) {}
}

/// Filters, then a picker. See the module documentation.
pub struct Pipeline {
    filters: Vec<Box<dyn Filter>>,
    picker: Box<dyn Picker>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field(
                "filters",
                &self.filters.iter().map(|x| x.name()).collect::<Vec<_>>(),
            )
            .field("picker", &self.picker.name())
            .finish()
    }
}

impl Pipeline {
    /// A pipeline with no filter.
    pub fn new(picker: impl Picker + 'static) -> Self {
        Pipeline {
            filters: Vec::new(),
            picker: Box::new(picker),
        }
    }

    /// Adds a filter after the existing ones.
    pub fn filter(mut self, f: impl Filter + 'static) -> Self {
        self.filters.push(Box::new(f));
        self
    }

    /// The scheduler mode of the picker (`layered`, `policy`, `balance`).
    pub fn mode(&self) -> &'static str {
        self.picker.name()
    }

    pub fn picker(&self) -> &dyn Picker {
        self.picker.as_ref()
    }

    /// The union of what the filters and the picker read.
    pub fn needs(&self) -> Needs {
        self.filters
            .iter()
            .fold(self.picker.needs(), |n, f| n | f.needs())
    }

    /// Filters `cands`, then picks one of the survivors. `Decision::pos` is a position in
    /// `cands`. The prefix figures (prompt, chosen and best match over the survivors) come
    /// from `req.prefix`. `None` when no candidate survives.
    pub fn pick(
        &self,
        req: &RequestView<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        // The keep flags live on the stack for the usual fleet sizes (hot path: no allocation).
        let mut small = [true; 32];
        let mut big = Vec::new();
        let keep: &mut [bool] = if cands.len() <= small.len() {
            &mut small[..cands.len()]
        } else {
            big.resize(cands.len(), true);
            &mut big
        };
        let mut dropped: Vec<Dropped> = Vec::new();
        let mut kept = cands.len();
        for f in &self.filters {
            f.apply(req, cands, keep);
            let now_kept = keep.iter().filter(|k| **k).count();
            if now_kept == kept {
                continue;
            }
            kept = now_kept;
            // Name the filter of every candidate it dropped (not one an earlier filter did).
            for (c, k) in cands.iter().zip(keep.iter()) {
                if !*k && !dropped.iter().any(|d| d.idx == c.idx) {
                    dropped.push(Dropped {
                        idx: c.idx,
                        by: f.name(),
                    });
                }
            }
        }
        let mut d = if dropped.is_empty() {
            if cands.is_empty() {
                return None;
            }
            self.picker.pick(req, cands, rng)?
        } else {
            let map: Vec<usize> = (0..cands.len()).filter(|&i| keep[i]).collect();
            if map.is_empty() {
                return None;
            }
            let survivors: Vec<Candidate> = map.iter().map(|&i| cands[i]).collect();
            let mut d = self.picker.pick(req, &survivors, rng)?;
            d.pos = map[d.pos];
            d
        };
        d.idx = cands[d.pos].idx;
        d.key = cands[d.pos].key;
        d.prompt_blocks = req.prompt_blocks();
        d.matched_blocks = req.matched(&cands[d.pos]);
        d.best_matched_blocks = cands
            .iter()
            .zip(keep.iter())
            .filter(|(_, k)| **k)
            .map(|(c, _)| req.matched(c))
            .max()
            .unwrap_or(0);
        // The pipeline's filters first, then what the picker itself set aside (policy filters).
        dropped.append(&mut d.dropped);
        d.dropped = dropped;
        Some(d)
    }

    pub fn on_dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        self.picker.on_dispatch(req, chosen);
    }

    pub fn on_complete(&self, req: &RequestView<'_>, chosen: &Candidate, done: &Completion) {
        self.picker.on_complete(req, chosen, done);
    }
}
