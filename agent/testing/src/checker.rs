//! A Jepsen-style checker over a tool's effect history: what the clients were told
//! against what the tool actually did.
//!
//! Each invocation of a key ends `Ok` (the client got a definite success), `Fail`
//! (a definite failure: the effect must not have happened) or `Info` (the outcome is
//! unknown to the client: the effect may or may not have happened). Retries of one
//! key merge: any `Ok` makes the key `Ok`, else any `Info` makes it `Info`.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    Fail,
    Info,
    Ok,
}

/// The checker's findings; a correct run has `lost == duplicated == unexpected == 0`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Keys acknowledged as done whose effect never happened.
    pub lost: Vec<String>,
    /// Keys whose effect happened more than once.
    pub duplicated: Vec<String>,
    /// Effects for a key that was never invoked, or that the client was told failed.
    pub unexpected: Vec<String>,
    /// Keys with an unknown outcome whose effect turned out to have happened once.
    pub recovered: usize,
    /// Keys checked.
    pub keys: usize,
}

impl Verdict {
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty() && self.duplicated.is_empty() && self.unexpected.is_empty()
    }
}

/// Checks `history` (key, outcome per invocation) against `effects` (effect count
/// per key).
pub fn check(history: &[(String, Outcome)], effects: &HashMap<Option<String>, usize>) -> Verdict {
    let mut merged: BTreeMap<&str, Outcome> = BTreeMap::new();
    for (key, outcome) in history {
        let e = merged.entry(key.as_str()).or_insert(*outcome);
        *e = (*e).max(*outcome);
    }
    let mut v = Verdict {
        keys: merged.len(),
        ..Verdict::default()
    };
    for (key, outcome) in &merged {
        let n = effects.get(&Some(key.to_string())).copied().unwrap_or(0);
        match (outcome, n) {
            (_, n) if n > 1 => v.duplicated.push(key.to_string()),
            (Outcome::Ok, 0) => v.lost.push(key.to_string()),
            (Outcome::Fail, 1) => v.unexpected.push(key.to_string()),
            (Outcome::Info, 1) => v.recovered += 1,
            _ => {}
        }
    }
    for (key, n) in effects {
        let invoked = key.as_deref().is_some_and(|k| merged.contains_key(k));
        if !invoked && *n > 0 {
            v.unexpected
                .push(key.clone().unwrap_or_else(|| "<no key>".into()));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effects(pairs: &[(&str, usize)]) -> HashMap<Option<String>, usize> {
        pairs
            .iter()
            .map(|(k, n)| (Some(k.to_string()), *n))
            .collect()
    }

    #[test]
    fn classifies_every_case() {
        let history = vec![
            ("ok1".to_string(), Outcome::Ok),
            ("lost".to_string(), Outcome::Ok),
            ("dup".to_string(), Outcome::Info),
            ("dup".to_string(), Outcome::Ok),
            ("info1".to_string(), Outcome::Info),
            ("info0".to_string(), Outcome::Info),
            ("failed".to_string(), Outcome::Fail),
        ];
        let v = check(
            &history,
            &effects(&[
                ("ok1", 1),
                ("dup", 2),
                ("info1", 1),
                ("failed", 1),
                ("stray", 1),
            ]),
        );
        assert_eq!(v.lost, ["lost"]);
        assert_eq!(v.duplicated, ["dup"]);
        let mut unexpected = v.unexpected.clone();
        unexpected.sort();
        assert_eq!(unexpected, ["failed", "stray"]);
        assert_eq!(v.recovered, 1);
        assert!(!v.is_clean());
    }

    #[test]
    fn clean_run() {
        let history = vec![
            ("a".to_string(), Outcome::Ok),
            ("b".to_string(), Outcome::Fail),
        ];
        assert!(check(&history, &effects(&[("a", 1)])).is_clean());
    }
}
