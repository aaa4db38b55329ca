//! The agentic multi-tenant workload.
//!
//! A busy fleet serving many tenants' agents: `tenants` tenants, each with its own long
//! system prompt (`system_tokens`, drawn once per tenant, text deterministic in seed and
//! tenant). Sessions arrive as a Poisson process of `rate` per second until the horizon
//! (`--duration`); each belongs to a tenant drawn from a Zipf(`zipf`) popularity law
//! (tenant 0 the most popular: P(k) ∝ 1 / (k+1)^zipf). A fraction `one_shot` of the sessions
//! are single requests (system prompt + one user message); the others run a number of turns
//! drawn uniformly from `turns`. Every turn sends the whole history — system prompt, every
//! earlier user message and the streamed assistant answers — plus a new user message
//! (`user_tokens`, tool-result sized) with `max_tokens` drawn from `output_tokens`, and the
//! next turn follows `think_time` after the answer (closed loop within a session, open loop
//! across sessions). So prompts grow turn after turn on top of a prefix shared by all the
//! tenant's sessions.
//!
//! The plan (arrival times, tenants, one-shots, turn counts and sizes) is a pure function of
//! the seed: session `s` draws from its own generator, so a longer horizon adds sessions
//! without changing the earlier ones.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::text::{self, ns, SplitMix64};

/// An inclusive range of counts (tokens, turns), written `N` or `MIN-MAX`; draws are uniform.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SizeRange {
    pub min: usize,
    pub max: usize,
}

impl SizeRange {
    pub const fn fixed(n: usize) -> Self {
        SizeRange { min: n, max: n }
    }

    pub const fn new(min: usize, max: usize) -> Self {
        SizeRange { min, max }
    }

    pub fn is_fixed(&self) -> bool {
        self.min == self.max
    }

    pub fn mean(&self) -> f64 {
        (self.min + self.max) as f64 / 2.0
    }

    /// A uniform draw in `min..=max`.
    pub fn draw(&self, g: &mut SplitMix64) -> usize {
        let span = (self.max - self.min) as u64 + 1;
        self.min + (g.next_u64() % span) as usize
    }
}

impl fmt::Display for SizeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_fixed() {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

impl FromStr for SizeRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let num = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|e| format!("`{s}`: {e} (expected N or MIN-MAX)"))
        };
        let r = match s.split_once('-') {
            Some((a, b)) => SizeRange::new(num(a)?, num(b)?),
            None => SizeRange::fixed(num(s)?),
        };
        if r.min > r.max {
            return Err(format!("`{s}`: MIN is above MAX"));
        }
        Ok(r)
    }
}

/// Zipf popularity over `n` items: P(k) ∝ 1 / (k+1)^s, item 0 the most popular.
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// `n` ≥ 1 items, exponent `s` ≥ 0 (0 = uniform).
    pub fn new(n: usize, s: f64) -> Self {
        let w: Vec<f64> = (1..=n.max(1)).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = w
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        *cdf.last_mut().expect("n ≥ 1") = 1.0;
        Zipf { cdf }
    }

    pub fn probability(&self, k: usize) -> f64 {
        match k {
            0 => self.cdf[0],
            _ => self.cdf.get(k).map_or(0.0, |c| c - self.cdf[k - 1]),
        }
    }

    /// The item for a uniform `u` in [0, 1).
    pub fn sample(&self, u: f64) -> usize {
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

/// Parameters of the agentic workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgenticConfig {
    /// Number of tenants, each with its own system prompt.
    pub tenants: usize,
    /// Zipf exponent of tenant popularity.
    pub zipf: f64,
    /// System prompt length per tenant (drawn once per tenant).
    pub system_tokens: SizeRange,
    /// User message (tool result) length per turn.
    pub user_tokens: SizeRange,
    /// Output tokens (max_tokens) per turn.
    pub output_tokens: SizeRange,
    /// Fraction of sessions that are a single request.
    pub one_shot: f64,
    /// Turns of a multi-turn session.
    pub turns: SizeRange,
    /// Session arrivals per second (Poisson).
    pub rate: f64,
    /// Pause between an answer and the session's next turn (with `think_time_max`: the
    /// shortest pause).
    #[serde(with = "humantime_serde")]
    pub think_time: Duration,
    /// When set (and above `think_time`), every pause is drawn uniformly in
    /// `think_time..=think_time_max` (people who read before they answer).
    #[serde(default, with = "humantime_serde")]
    pub think_time_max: Option<Duration>,
    /// Fraction of the sessions that send the session header; the others send none, so a
    /// router must find their prefix by content alone.
    #[serde(default = "all_sessions")]
    pub header_share: f64,
}

fn all_sessions() -> f64 {
    1.0
}

impl Default for AgenticConfig {
    fn default() -> Self {
        AgenticConfig {
            tenants: 32,
            zipf: 1.1,
            system_tokens: SizeRange::new(2048, 4096),
            user_tokens: SizeRange::new(64, 512),
            output_tokens: SizeRange::new(32, 128),
            one_shot: 0.2,
            turns: SizeRange::new(2, 10),
            rate: 2.0,
            think_time: Duration::from_millis(200),
            think_time_max: None,
            header_share: 1.0,
        }
    }
}

/// One planned session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionPlan {
    /// Arrival (first request) since the start of the run.
    pub at: Duration,
    pub tenant: usize,
    pub one_shot: bool,
    /// Per turn: (user message tokens, output tokens).
    pub turns: Vec<(usize, usize)>,
    /// The session sends the session header ([`AgenticConfig::header_share`]).
    pub header: bool,
    /// Per turn: the pause after its answer.
    pub think: Vec<Duration>,
}

/// What a plan holds (recorded in the report).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanSummary {
    pub sessions: usize,
    pub one_shot_sessions: usize,
    /// Requests if every turn is sent (the horizon may cut late sessions short).
    pub requests: usize,
    /// Tenants with at least one session.
    pub tenants_used: usize,
    /// Share of the sessions that belong to the most popular tenant.
    pub top_tenant_share: f64,
    /// Mean turns of the multi-turn sessions.
    pub mean_turns: f64,
    /// Sessions that send the session header.
    #[serde(default)]
    pub header_sessions: usize,
}

/// Most sessions one plan may hold (a guard against a mistyped rate).
pub const MAX_SESSIONS: usize = 1_000_000;

impl AgenticConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.tenants == 0 {
            return Err("tenants must be at least 1".into());
        }
        if !(self.zipf >= 0.0 && self.zipf.is_finite()) {
            return Err("zipf must be ≥ 0".into());
        }
        if !(0.0..=1.0).contains(&self.one_shot) {
            return Err("one-shot must be a fraction in [0, 1]".into());
        }
        if self.turns.min == 0 {
            return Err("turns must be at least 1".into());
        }
        if self.output_tokens.min == 0 {
            return Err("output tokens must be at least 1".into());
        }
        if !(self.rate > 0.0 && self.rate.is_finite()) {
            return Err("rate must be > 0 sessions/s".into());
        }
        if !(0.0..=1.0).contains(&self.header_share) {
            return Err("the session-header share must be a fraction in [0, 1]".into());
        }
        if self.think_time_max.is_some_and(|m| m < self.think_time) {
            return Err("the longest think time is below the shortest".into());
        }
        Ok(())
    }

    /// Every session arriving before `horizon`. Session `s` draws its tenant, kind, turn count
    /// and sizes from its own generator (seed, s); arrivals come from one seeded stream of
    /// exponential gaps (the first session at 0).
    pub fn plan(&self, seed: u64, horizon: Duration) -> Vec<SessionPlan> {
        let zipf = Zipf::new(self.tenants, self.zipf);
        let mut arrivals = SplitMix64::new(text::mix(seed, ns::AGENTIC_ARRIVAL, 0));
        let mut t = 0.0f64;
        let mut out = Vec::new();
        for s in 0..MAX_SESSIONS {
            if s > 0 {
                // 1 − u ∈ (0, 1], so ln is finite.
                t += -(1.0 - arrivals.next_f64()).ln() / self.rate;
            }
            let at = Duration::from_secs_f64(t);
            if at >= horizon {
                break;
            }
            let mut g = SplitMix64::new(text::mix(seed, ns::AGENTIC_SESSION, s as u64));
            let tenant = zipf.sample(g.next_f64());
            let one_shot = g.next_f64() < self.one_shot;
            let n = if one_shot { 1 } else { self.turns.draw(&mut g) };
            let turns = (0..n)
                .map(|_| {
                    (
                        self.user_tokens.draw(&mut g),
                        self.output_tokens.draw(&mut g),
                    )
                })
                .collect();
            // Drawn after everything above, so that plans without these options keep the
            // sessions they always had.
            let header = self.header_share >= 1.0 || g.next_f64() < self.header_share;
            let think = (0..n).map(|_| self.draw_think(&mut g)).collect();
            out.push(SessionPlan {
                at,
                tenant,
                one_shot,
                turns,
                header,
                think,
            });
        }
        out
    }

    /// One pause: `think_time`, or uniform up to `think_time_max`.
    fn draw_think(&self, g: &mut SplitMix64) -> Duration {
        match self.think_time_max {
            Some(max) if max > self.think_time => {
                self.think_time + (max - self.think_time).mul_f64(g.next_f64())
            }
            _ => self.think_time,
        }
    }

    /// Mean pause after an answer.
    pub fn mean_think_time(&self) -> Duration {
        match self.think_time_max {
            Some(max) if max > self.think_time => (self.think_time + max) / 2,
            _ => self.think_time,
        }
    }

    /// System prompt length of `tenant`.
    pub fn system_tokens_of(&self, seed: u64, tenant: usize) -> usize {
        let mut g = SplitMix64::new(text::mix(seed, ns::TENANT_SIZE, tenant as u64));
        self.system_tokens.draw(&mut g)
    }

    /// System prompt of `tenant` (the same text for all its sessions).
    pub fn system_prompt(&self, seed: u64, tenant: usize) -> String {
        let n = self.system_tokens_of(seed, tenant);
        text::text(seed, ns::TENANT_SYSTEM, tenant as u64, n)
    }

    /// User message of turn `t` of session `s`, `tokens` long.
    pub fn user_message(seed: u64, s: usize, t: usize, tokens: usize) -> String {
        let id = ((s as u64) << 20) | t as u64;
        text::text(seed, ns::AGENTIC_TURN, id, tokens)
    }

    /// Session header value of session `s`.
    pub fn session_id(seed: u64, s: usize) -> String {
        format!("agt-{seed}-{s}")
    }

    pub fn summary(&self, plan: &[SessionPlan]) -> PlanSummary {
        let mut per_tenant = vec![0usize; self.tenants.max(1)];
        for p in plan {
            per_tenant[p.tenant] += 1;
        }
        let multi: Vec<_> = plan.iter().filter(|p| !p.one_shot).collect();
        PlanSummary {
            sessions: plan.len(),
            one_shot_sessions: plan.len() - multi.len(),
            requests: plan.iter().map(|p| p.turns.len()).sum(),
            tenants_used: per_tenant.iter().filter(|&&n| n > 0).count(),
            top_tenant_share: if plan.is_empty() {
                0.0
            } else {
                *per_tenant.iter().max().unwrap_or(&0) as f64 / plan.len() as f64
            },
            header_sessions: plan.iter().filter(|p| p.header).count(),
            mean_turns: if multi.is_empty() {
                0.0
            } else {
                multi.iter().map(|p| p.turns.len()).sum::<usize>() as f64 / multi.len() as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ideal::{render_chat, IdealCache};
    use super::*;

    fn cfg() -> AgenticConfig {
        AgenticConfig {
            rate: 50.0,
            ..Default::default()
        }
    }

    #[test]
    fn size_ranges_parse_and_draw_within_bounds() {
        assert_eq!("300".parse::<SizeRange>(), Ok(SizeRange::fixed(300)));
        assert_eq!("2-10".parse::<SizeRange>(), Ok(SizeRange::new(2, 10)));
        assert!("10-2".parse::<SizeRange>().is_err());
        assert!("x".parse::<SizeRange>().is_err());
        assert_eq!(SizeRange::new(2, 10).to_string(), "2-10");
        assert_eq!(SizeRange::fixed(7).to_string(), "7");
        let mut g = SplitMix64::new(1);
        let r = SizeRange::new(3, 5);
        let draws: Vec<usize> = (0..300).map(|_| r.draw(&mut g)).collect();
        assert!(draws.iter().all(|d| (3..=5).contains(d)));
        for v in 3..=5 {
            assert!(draws.contains(&v));
        }
        assert_eq!(SizeRange::fixed(4).draw(&mut g), 4);
    }

    #[test]
    fn plan_is_deterministic_in_the_seed_and_prefix_stable() {
        let c = cfg();
        let a = c.plan(7, Duration::from_secs(20));
        assert_eq!(a, c.plan(7, Duration::from_secs(20)));
        assert_ne!(a, c.plan(8, Duration::from_secs(20)));
        // A longer horizon only appends sessions.
        let longer = c.plan(7, Duration::from_secs(40));
        assert!(longer.len() > a.len());
        assert_eq!(longer[..a.len()], a[..]);
        assert_eq!(a[0].at, Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(a.iter().all(|p| p.at < Duration::from_secs(20)));
        // Poisson at 50/s for 20 s: about 1000 sessions.
        assert!((900..1100).contains(&a.len()), "{}", a.len());
        // Texts too.
        assert_eq!(c.system_prompt(7, 3), c.system_prompt(7, 3));
        assert_ne!(c.system_prompt(7, 3), c.system_prompt(8, 3));
        assert_ne!(c.system_prompt(7, 3), c.system_prompt(7, 4));
        assert_eq!(
            AgenticConfig::user_message(7, 5, 1, 100),
            AgenticConfig::user_message(7, 5, 1, 100)
        );
        assert_ne!(
            AgenticConfig::user_message(7, 5, 1, 100),
            AgenticConfig::user_message(7, 5, 2, 100)
        );
    }

    #[test]
    fn plan_respects_one_shots_turns_and_sizes() {
        let c = AgenticConfig {
            one_shot: 0.25,
            turns: SizeRange::new(3, 6),
            user_tokens: SizeRange::new(10, 20),
            output_tokens: SizeRange::fixed(9),
            system_tokens: SizeRange::new(100, 200),
            ..cfg()
        };
        let p = c.plan(1, Duration::from_secs(40));
        let s = c.summary(&p);
        assert_eq!(s.sessions, p.len());
        let share = s.one_shot_sessions as f64 / s.sessions as f64;
        assert!((share - 0.25).abs() < 0.04, "{share}");
        for x in &p {
            if x.one_shot {
                assert_eq!(x.turns.len(), 1);
            } else {
                assert!((3..=6).contains(&x.turns.len()), "{x:?}");
            }
            assert!(x
                .turns
                .iter()
                .all(|&(u, o)| (10..=20).contains(&u) && o == 9));
        }
        assert!((s.mean_turns - 4.5).abs() < 0.15, "{}", s.mean_turns);
        for t in 0..c.tenants {
            let n = c.system_tokens_of(1, t);
            assert!((100..=200).contains(&n));
            assert_eq!(c.system_prompt(1, t).len(), n * 4);
        }
        assert!(c.validate().is_ok());
        assert!(AgenticConfig { rate: 0.0, ..cfg() }.validate().is_err());
        assert!(AgenticConfig {
            one_shot: 1.5,
            ..cfg()
        }
        .validate()
        .is_err());
    }

    /// A share of the sessions without the header and a range of think times change only
    /// those: the arrivals, tenants and turns stay the plan's.
    #[test]
    fn header_share_and_think_range_keep_the_plan() {
        let base = cfg();
        let c = AgenticConfig {
            header_share: 0.5,
            think_time: Duration::from_millis(100),
            think_time_max: Some(Duration::from_millis(500)),
            ..cfg()
        };
        let (a, b) = (
            base.plan(4, Duration::from_secs(20)),
            c.plan(4, Duration::from_secs(20)),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.at, x.tenant, x.one_shot, &x.turns),
                (y.at, y.tenant, y.one_shot, &y.turns)
            );
            assert!(x.header);
            assert_eq!(x.think, vec![base.think_time; x.turns.len()]);
            assert_eq!(y.think.len(), y.turns.len());
            assert!(y.think.iter().all(|t| (100..=500).contains(&t.as_millis())));
        }
        let share = c.summary(&b).header_sessions as f64 / b.len() as f64;
        assert!((share - 0.5).abs() < 0.06, "{share}");
        let mean = b
            .iter()
            .flat_map(|p| &p.think)
            .sum::<Duration>()
            .as_secs_f64()
            / b.iter().map(|p| p.think.len()).sum::<usize>() as f64;
        assert!((mean - 0.3).abs() < 0.03, "{mean}");
        assert_eq!(c.mean_think_time(), Duration::from_millis(300));
        assert_eq!(base.summary(&a).header_sessions, a.len());
        assert!(AgenticConfig {
            header_share: 1.5,
            ..cfg()
        }
        .validate()
        .is_err());
        assert!(AgenticConfig {
            think_time_max: Some(Duration::from_millis(50)),
            ..c.clone()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn tenant_popularity_is_zipf_skewed() {
        let z = Zipf::new(32, 1.1);
        let total: f64 = (0..32).map(|k| z.probability(k)).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!((z.probability(0) / z.probability(1) - 2f64.powf(1.1)).abs() < 1e-9);
        assert_eq!(z.sample(0.0), 0);
        assert_eq!(z.sample(0.999_999_999), 31);
        let uniform = Zipf::new(4, 0.0);
        assert!((uniform.probability(3) - 0.25).abs() < 1e-12);

        // The sessions of a plan follow it.
        let c = AgenticConfig {
            rate: 500.0,
            ..cfg()
        };
        let p = c.plan(3, Duration::from_secs(40)); // ~20,000 sessions
        let mut n = vec![0usize; c.tenants];
        for x in &p {
            n[x.tenant] += 1;
        }
        let share = |k: usize| n[k] as f64 / p.len() as f64;
        for k in [0, 1, 3, 10] {
            let want = z.probability(k);
            assert!(
                (share(k) - want).abs() < 0.1 * want + 0.003,
                "tenant {k}: {} vs {want}",
                share(k)
            );
        }
        assert!(n[0] > n[1] && n[1] > n[3] && n[3] > n[20]);
        let s = c.summary(&p);
        assert_eq!(s.tenants_used, 32);
        assert!((s.top_tenant_share - z.probability(0)).abs() < 0.02);
    }

    /// The prompts of a session grow: each turn's rendered prompt starts with the previous
    /// turn's prompt plus its answer, and all sessions of a tenant share the system prompt.
    #[test]
    fn sessions_grow_on_a_shared_tenant_prefix() {
        let c = AgenticConfig {
            system_tokens: SizeRange::fixed(64),
            user_tokens: SizeRange::fixed(16),
            ..cfg()
        };
        let plan = c.plan(2, Duration::from_secs(5));
        let s = plan.iter().position(|p| p.turns.len() >= 3).unwrap();
        let mut hist: Vec<(&str, String)> = vec![("system", c.system_prompt(2, plan[s].tenant))];
        let mut last: Vec<u8> = Vec::new(); // the previous request's prompt
        let mut ideal = IdealCache::new(16);
        for (t, &(u, _)) in plan[s].turns.iter().enumerate() {
            hist.push(("user", AgenticConfig::user_message(2, s, t, u)));
            let p = render_chat(&hist);
            assert!(p.starts_with(&last) && p.len() > last.len());
            // Hits: the previous prompt's blocks whose 64 bytes are all there (its partial
            // tail was never cached); the first turn finds nothing.
            assert_eq!(ideal.observe(&p) as usize, last.len() / 64 * 16, "turn {t}");
            hist.push(("assistant", "answer ".repeat(t + 1)));
            last = p;
        }
        // Another session of the same tenant starts with the same system prompt.
        let other = plan
            .iter()
            .enumerate()
            .find(|(i, p)| *i != s && p.tenant == plan[s].tenant)
            .map(|(i, _)| i);
        if let Some(o) = other {
            let p = render_chat(&[
                ("system", c.system_prompt(2, plan[o].tenant)),
                ("user", AgenticConfig::user_message(2, o, 0, 16)),
            ]);
            // "<|system|>\n" + 256 bytes + "\n" = 268 bytes: 4 full blocks of 64 bytes.
            assert_eq!(ideal.observe(&p), 4 * 16);
        }
    }
}
