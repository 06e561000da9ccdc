//! Which linear layers a [`LoraConfig`] adapts, with which rank and scale: PEFT's own rules
//! (`check_target_module_exists`, `get_pattern_key`), on Hugging Face module names.

use regex::Regex;

use super::config::{LoraConfig, TargetModules};
use crate::{Error, Result};

/// A linear layer of the base model, by its Hugging Face module name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearSite {
    /// Module name, e.g. `model.layers.0.self_attn.q_proj` (its weight's name less `.weight`).
    pub name: String,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Whether it is the output head, which `"all-linear"` leaves alone as PEFT does.
    pub output_head: bool,
}

impl LinearSite {
    /// The layer `name` from `in_features` to `out_features`; `output_head` for the LM head.
    pub fn new(
        name: String,
        (in_features, out_features): (usize, usize),
        output_head: bool,
    ) -> Self {
        Self {
            name,
            in_features,
            out_features,
            output_head,
        }
    }
}

/// One adapter to create: `y += scaling * B (A x)` with `A: [r, in]`, `B: [out, r]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    /// The adapted layer.
    pub site: LinearSite,
    /// Rank.
    pub r: usize,
    /// Alpha.
    pub alpha: f32,
    /// The factor on `B (A x)`.
    pub scaling: f32,
}

/// A Python regular expression as Rust's `regex` compiles it (the subset PEFT users write:
/// alternations, classes, repetition; no look-around or back-references).
pub(super) fn compile(pattern: &str) -> std::result::Result<Regex, String> {
    Regex::new(pattern).map_err(|e| format!("not a regular expression ferrozero can read: {e}"))
}

fn regex(cfg: &LoraConfig, pattern: &str) -> Result<Regex> {
    compile(pattern).map_err(|e| Error::Config(format!("{}: \"{pattern}\": {e}", cfg.origin)))
}

/// Whether module `key` is named by `t`: a full match of the expression, or a name that is the
/// key or ends it after a dot.
fn named(cfg: &LoraConfig, t: &TargetModules, key: &str) -> Result<bool> {
    Ok(match t {
        TargetModules::Regex(p) => regex(cfg, &format!("^(?:{p})$"))?.is_match(key),
        TargetModules::Names(names) => names
            .iter()
            .any(|n| key == n || key.ends_with(&format!(".{n}"))),
        TargetModules::AllLinear => true,
    })
}

/// The first layer index in `key` (`layers.3.` and the like), as PEFT reads it.
fn layer_index(cfg: &LoraConfig, key: &str) -> Result<Option<usize>> {
    let patterns: Vec<String> = if cfg.layers_pattern.is_empty() {
        vec![r"^.*?\.[^.]*\.(\d+)\.".to_string()]
    } else {
        cfg.layers_pattern
            .iter()
            .map(|p| format!(r"^(?:.*?\.)?{p}\.(\d+)\."))
            .collect()
    };
    for p in &patterns {
        if let Some(c) = regex(cfg, p)?.captures(key) {
            return Ok(c[1].parse().ok());
        }
    }
    Ok(None)
}

/// Whether PEFT would put an adapter on `site`.
fn targeted(cfg: &LoraConfig, site: &LinearSite) -> Result<bool> {
    let key = site.name.as_str();
    if let Some(ex) = &cfg.exclude {
        if named(cfg, ex, key)? {
            return Ok(false);
        }
    }
    for m in &cfg.modules_to_save {
        if regex(cfg, &format!(r"(^|.*\.){m}($|\..*)"))?.is_match(key) {
            return Ok(false);
        }
    }
    match &cfg.targets {
        TargetModules::AllLinear => Ok(!site.output_head),
        t @ TargetModules::Regex(_) => named(cfg, t, key),
        t @ TargetModules::Names(names) => {
            if names.iter().any(|n| n == key) {
                return Ok(true);
            }
            if !named(cfg, t, key)? {
                return Ok(false);
            }
            let Some(only) = &cfg.layers_to_transform else {
                return Ok(true);
            };
            Ok(layer_index(cfg, key)?.is_some_and(|i| only.contains(&i)))
        }
    }
}

/// The first pattern of `patterns` that ends `key` after a dot (PEFT's `get_pattern_key`).
fn pattern_value<T: Copy>(
    cfg: &LoraConfig,
    patterns: &[(String, T)],
    key: &str,
) -> Result<Option<T>> {
    for (p, v) in patterns {
        if regex(cfg, &format!(r"^(.*\.)?(?:{p})$"))?.is_match(key) {
            return Ok(Some(*v));
        }
    }
    Ok(None)
}

impl LoraConfig {
    /// Whether parameter `name` belongs to a module of `modules_to_save` (trained in full): PEFT
    /// takes any module whose name ends in one of the strings, so `"norm"` names every norm.
    pub fn saves(&self, name: &str) -> bool {
        let mut module = name;
        while let Some((parent, _)) = module.rsplit_once('.') {
            if self
                .modules_to_save
                .iter()
                .any(|m| parent.ends_with(m.as_str()))
            {
                return true;
            }
            module = parent;
        }
        false
    }

    /// The adapters this config puts on a model whose linear layers are `sites` (a model of
    /// architecture `arch`, for errors). No match at all is an error: an adapter that trains
    /// nothing is a mistake in `target_modules`, not a run.
    pub fn adapters(&self, sites: &[LinearSite], arch: &str) -> Result<Vec<Adapter>> {
        let mut out = Vec::new();
        for site in sites {
            if !targeted(self, site)? {
                continue;
            }
            let r = pattern_value(self, &self.rank_pattern, &site.name)?.unwrap_or(self.r);
            let alpha = pattern_value(self, &self.alpha_pattern, &site.name)?.unwrap_or(self.alpha);
            out.push(Adapter {
                site: site.clone(),
                r,
                alpha,
                scaling: self.scaling(r, alpha),
            });
        }
        if out.is_empty() {
            let names: Vec<&str> = sites.iter().take(8).map(|s| s.name.as_str()).collect();
            return Err(Error::Config(format!(
                "{}: key `target_modules` = {:?} matches no linear layer of this {arch} (its \
                 linear layers include: {}{})",
                self.origin,
                self.targets,
                names.join(", "),
                if sites.len() > names.len() {
                    ", ..."
                } else {
                    ""
                }
            )));
        }
        Ok(out)
    }
}
