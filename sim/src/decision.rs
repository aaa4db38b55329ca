//! Decision mode: a rule-based stand-in for the chat model behind tokengate's
//! decision service.
//!
//! With [`crate::SimConfig::decision_mode`] set, chat requests whose system
//! text carries a target list are answered with the name of one target (and
//! nothing else) instead of filler text. The list is read from the system
//! text (system/developer messages, Anthropic `system`, Responses
//! `instructions`) in the format tokengate's decision client sends:
//!
//! ```text
//! <instructions>
//!
//! Targets:
//! 1. qwen3-0.6b: short factual questions, greetings, small talk
//! 2. qwen3-32b: reasoning, math, proofs, code
//!
//! Answer with exactly one target name from the list and nothing else.
//! ```
//!
//! A target line is `N. name: criteria`, `N) name: criteria`,
//! `- name: criteria` or `* name: criteria`; the name ends at the first
//! `": "` (or a colon ending the line). Only lines after the last line that
//! reads `Targets:` (case-insensitive) count when there is such a line, so
//! numbered lists inside the instructions are not mistaken for targets.
//!
//! The rule: criteria and the last user message are split into lowercase
//! alphanumeric words, minus a few stop words ([`STOP_WORDS`]). A user word
//! *matches* a criteria word when they are equal or share their first four
//! characters (a crude stem: "greeting" ~ "greetings", "writing" ~ "write",
//! "proof" ~ "proofs"; note "prove" ~ "proof" do not, so list both). A
//! target's score is the number of user words (with repeats) that match any
//! of its criteria words; the highest score wins, ties (including all-zero)
//! go to the first target.

/// Words ignored on both sides: too common to say anything about a request.
pub const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "is", "it", "of", "on",
    "or", "that", "the", "then", "there", "this", "to", "use", "with", "model",
];

/// Minimum shared prefix (in characters) for two different words to match.
pub const STEM_CHARS: usize = 4;

/// One entry of the target list: `(name, criteria)`.
pub type Target = (String, String);

fn list_item(line: &str) -> Option<&str> {
    let l = line.trim_start();
    if let Some(rest) = l.strip_prefix("- ").or_else(|| l.strip_prefix("* ")) {
        return Some(rest);
    }
    let digits = l.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let rest = &l[digits..];
    rest.strip_prefix(". ").or_else(|| rest.strip_prefix(") "))
}

/// The target list in a system text (see the module docs for the format).
pub fn parse_targets(system: &str) -> Vec<Target> {
    let lines: Vec<&str> = system.lines().collect();
    let start = lines
        .iter()
        .rposition(|l| l.trim().eq_ignore_ascii_case("targets:"))
        .map_or(0, |i| i + 1);
    let mut out = Vec::new();
    for line in &lines[start..] {
        let Some(item) = list_item(line) else {
            continue;
        };
        let item = item.trim_end();
        let (name, criteria) = match item.find(": ") {
            Some(i) => (&item[..i], &item[i + 2..]),
            None => match item.strip_suffix(':') {
                Some(n) => (n, ""),
                None => continue,
            },
        };
        let name = name.trim();
        if !name.is_empty() {
            out.push((name.to_string(), criteria.trim().to_string()));
        }
    }
    out
}

/// Lowercase alphanumeric words of `text`, stop words removed.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .filter(|w| !STOP_WORDS.contains(&w.as_str()))
        .collect()
}

fn stem_match(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let mut ai = a.chars();
    let mut bi = b.chars();
    for _ in 0..STEM_CHARS {
        match (ai.next(), bi.next()) {
            (Some(x), Some(y)) if x == y => {}
            _ => return false,
        }
    }
    true
}

/// Score of each target for `user` (see the module docs).
pub fn scores(targets: &[Target], user: &str) -> Vec<usize> {
    let user = words(user);
    targets
        .iter()
        .map(|(_, criteria)| {
            let cw = words(criteria);
            user.iter()
                .filter(|u| cw.iter().any(|c| stem_match(u, c)))
                .count()
        })
        .collect()
}

/// The chosen target's name, or `None` when `system` has no target list.
pub fn choose(system: &str, user: &str) -> Option<String> {
    let targets = parse_targets(system);
    let scores = scores(&targets, user);
    let mut best: Option<(usize, usize)> = None;
    for (i, s) in scores.into_iter().enumerate() {
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((i, s));
        }
    }
    best.map(|(i, _)| targets[i].0.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSTEM: &str = "Pick the model.\n1. Note: not a target\n\nTargets:\n1. qwen3-0.6b: short factual questions, greetings\n2) qwen3-32b: reasoning, math, proofs\n- other:\n* x: \n3. no colon here\n\nAnswer with exactly one target name from the list and nothing else.";

    #[test]
    fn parses_the_list_after_the_marker() {
        let t = parse_targets(SYSTEM);
        let names: Vec<&str> = t.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["qwen3-0.6b", "qwen3-32b", "other", "x"]);
        assert_eq!(t[1].1, "reasoning, math, proofs");
        assert_eq!(t[2].1, "");
        // without a marker, every list line counts
        assert_eq!(parse_targets("1. a: b\n- c: d").len(), 2);
        assert!(parse_targets("no list at all").is_empty());
    }

    #[test]
    fn stems() {
        assert!(stem_match("greeting", "greetings"));
        assert!(stem_match("one", "one"));
        assert!(!stem_match("one", "ones"));
        assert!(!stem_match("prove", "proof"));
        assert!(stem_match("proof", "proofs"));
        assert_eq!(words("The One-line GREETING!"), ["one", "line", "greeting"]);
    }

    #[test]
    fn ties_go_to_the_first() {
        assert_eq!(
            choose(SYSTEM, "nothing relevant"),
            Some("qwen3-0.6b".into())
        );
        assert_eq!(choose(SYSTEM, "math proofs"), Some("qwen3-32b".into()));
        assert_eq!(choose("no targets", "math"), None);
    }
}
