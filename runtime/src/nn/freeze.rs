//! Freezing parameters by name: glob patterns on Hugging Face parameter names, read in order
//! as `.gitignore` reads its lines, so the last pattern that matches a name decides and a
//! leading `!` thaws. `["*", "!model.layers.31.*"]` trains only the last of 32 Llama blocks;
//! `["*embed*", "lm_head.*"]` freezes the embeddings and the head.

use glob::{MatchOptions, Pattern};

use crate::{Error, Result};

/// `*` and `?` cross dots: a Hugging Face name has no path separator to respect.
const OPTIONS: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: false,
    require_literal_leading_dot: false,
};

/// Which parameters are frozen: an ordered list of glob rules.
#[derive(Debug, Clone, Default)]
pub struct Freeze {
    /// (the rule as written, its glob, whether a match freezes (`false`: a `!` rule thaws)).
    rules: Vec<(String, Pattern, bool)>,
}

impl Freeze {
    /// Nothing frozen.
    pub fn none() -> Self {
        Self::default()
    }

    /// Rules from `patterns`, in order; a pattern that is not a glob is an error naming it.
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Self> {
        let rules = patterns
            .iter()
            .map(|p| {
                let text = p.as_ref();
                let (glob, freezes) = match text.strip_prefix('!') {
                    Some(rest) => (rest, false),
                    None => (text, true),
                };
                let pat = Pattern::new(glob).map_err(|e| {
                    Error::Invalid(format!("freeze pattern \"{text}\" is not a glob: {e}"))
                })?;
                Ok((text.to_string(), pat, freezes))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { rules })
    }

    /// These rules followed by `later`'s (which therefore win where both match).
    pub fn then(mut self, later: Freeze) -> Self {
        self.rules.extend(later.rules);
        self
    }

    /// The rules as written, in order.
    pub fn rules(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|(t, _, _)| t.as_str())
    }

    /// Whether no rule is set.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether the parameter `name` is frozen: the last rule matching it decides.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.rules
            .iter()
            .rev()
            .find(|(_, p, _)| p.matches_with(name, OPTIONS))
            .is_some_and(|(_, _, freezes)| *freezes)
    }

    /// Checks the rules against a model's parameter `names`: a rule that matches no name is a
    /// typo (an error naming it and a few names), and freezing every parameter leaves nothing
    /// to train.
    pub fn check<S: AsRef<str>>(&self, names: &[S]) -> Result<()> {
        for (text, pat, _) in &self.rules {
            if !names.iter().any(|n| pat.matches_with(n.as_ref(), OPTIONS)) {
                let some: Vec<&str> = names.iter().take(4).map(|n| n.as_ref()).collect();
                return Err(Error::Invalid(format!(
                    "freeze pattern \"{text}\" matches no parameter of this model (its names \
                     look like: {})",
                    some.join(", ")
                )));
            }
        }
        if !names.is_empty() && names.iter().all(|n| self.is_frozen(n.as_ref())) {
            return Err(Error::Invalid(format!(
                "the freeze patterns [{}] freeze all {} parameters: nothing would train",
                self.rules
                    .iter()
                    .map(|(t, _, _)| format!("\"{t}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
                names.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: &[&str] = &[
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ];

    #[test]
    fn the_last_matching_rule_decides() {
        let f = Freeze::new(&["*", "!model.layers.1.*"]).unwrap();
        let frozen: Vec<bool> = NAMES.iter().map(|n| f.is_frozen(n)).collect();
        assert_eq!(frozen, [true, true, false, false, true, true]);
        f.check(NAMES).unwrap();
    }

    #[test]
    fn no_rule_freezes_nothing() {
        assert!(NAMES.iter().all(|n| !Freeze::none().is_frozen(n)));
    }

    #[test]
    fn a_rule_matching_nothing_and_freezing_all_are_errors() {
        let e = Freeze::new(&["transformer.h.*"])
            .unwrap()
            .check(NAMES)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("\"transformer.h.*\" matches no parameter"),
            "{e}"
        );
        let e = Freeze::new(&["*"]).unwrap().check(NAMES).unwrap_err();
        assert!(e.to_string().contains("freeze all 6 parameters"), "{e}");
        let e = Freeze::new(&["model.[layers"]).unwrap_err();
        assert!(e.to_string().contains("is not a glob"), "{e}");
    }

    #[test]
    fn classes_pick_blocks() {
        let f = Freeze::new(&["model.layers.[0-0].*", "*embed*"]).unwrap();
        assert!(f.is_frozen(NAMES[0]) && f.is_frozen(NAMES[1]) && !f.is_frozen(NAMES[2]));
    }
}
