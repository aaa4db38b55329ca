//! The synthetic multi-turn chat workload.
//!
//! `sessions` conversations arrive as a Poisson process of `rate` sessions per second (all at
//! once when `rate` is 0). Session `s` uses system prompt `s mod system_prompts` (each
//! `system_tokens` long), then runs `turns` turns: the user message of turn `t` is
//! `user_tokens` of text deterministic in (seed, s, t); the request carries the system prompt
//! and the whole history (every earlier user message and the assistant's streamed answer),
//! so turn `t+1` extends turn `t`'s prompt — a prefix cache (and a sticky router) can reuse
//! it. The next turn is sent `think_time` after the previous answer finished (closed loop
//! within a session, open loop across sessions). Every request of session `s` carries the
//! session header with value `syn-<seed>-<s>` unless session headers are turned off.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::text::{self, ns, SplitMix64};

/// Parameters of the synthetic workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SynthConfig {
    /// Number of sessions (conversations).
    pub sessions: usize,
    /// Turns (requests) per session.
    pub turns: usize,
    /// Number of distinct system prompts shared among sessions.
    pub system_prompts: usize,
    /// Tokens per system prompt.
    pub system_tokens: usize,
    /// Tokens per user message.
    pub user_tokens: usize,
    /// Output tokens per answer (max_tokens).
    pub output_tokens: usize,
    /// Session arrivals per second (Poisson); 0 = all sessions start at once.
    pub rate: f64,
    /// Pause between an answer and the session's next turn.
    #[serde(with = "humantime_serde")]
    pub think_time: Duration,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            sessions: 100,
            turns: 5,
            system_prompts: 4,
            system_tokens: 1024,
            user_tokens: 128,
            output_tokens: 64,
            rate: 10.0,
            think_time: Duration::ZERO,
        }
    }
}

impl SynthConfig {
    /// Start offset of every session (seeded exponential inter-arrival times).
    pub fn arrivals(&self, seed: u64) -> Vec<Duration> {
        let mut g = SplitMix64::new(text::mix(seed, 0x5e55, 0));
        let mut t = 0.0f64;
        (0..self.sessions)
            .map(|i| {
                if self.rate > 0.0 && i > 0 {
                    // 1 − u ∈ (0, 1], so ln is finite.
                    t += -(1.0 - g.next_f64()).ln() / self.rate;
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }

    /// System prompt of session `s`.
    pub fn system_prompt(&self, seed: u64, s: usize) -> String {
        let k = s % self.system_prompts.max(1);
        text::text(seed, ns::SYSTEM_PROMPT, k as u64, self.system_tokens)
    }

    /// User message of turn `t` of session `s`.
    pub fn user_message(&self, seed: u64, s: usize, t: usize) -> String {
        let id = ((s as u64) << 20) | t as u64;
        text::text(seed, ns::USER_TURN, id, self.user_tokens)
    }

    /// Session header value of session `s`.
    pub fn session_id(seed: u64, s: usize) -> String {
        format!("syn-{seed}-{s}")
    }
}

/// The chat history of one session.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// (role, content) pairs, system prompt first.
    pub messages: Vec<(&'static str, String)>,
}

impl History {
    pub fn new(system: String) -> Self {
        let mut h = History::default();
        if !system.is_empty() {
            h.messages.push(("system", system));
        }
        h
    }

    /// The messages JSON array for the next request.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.messages
                .iter()
                .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_and_monotone() {
        let c = SynthConfig {
            sessions: 50,
            rate: 100.0,
            ..Default::default()
        };
        let a = c.arrivals(1);
        assert_eq!(a, c.arrivals(1));
        assert_ne!(a, c.arrivals(2));
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        let all_at_once = SynthConfig { rate: 0.0, ..c };
        assert!(all_at_once.arrivals(1).iter().all(|d| d.is_zero()));
    }

    #[test]
    fn sessions_share_system_prompts_and_differ_in_user_turns() {
        let c = SynthConfig {
            system_prompts: 2,
            system_tokens: 100,
            user_tokens: 10,
            ..Default::default()
        };
        assert_eq!(c.system_prompt(1, 0), c.system_prompt(1, 2));
        assert_ne!(c.system_prompt(1, 0), c.system_prompt(1, 1));
        assert_eq!(c.system_prompt(1, 0).len(), 400);
        assert_ne!(c.user_message(1, 0, 0), c.user_message(1, 0, 1));
        assert_ne!(c.user_message(1, 0, 0), c.user_message(1, 1, 0));
        assert_eq!(c.user_message(1, 3, 4), c.user_message(1, 3, 4));
    }
}
