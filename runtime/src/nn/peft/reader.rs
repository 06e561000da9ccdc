//! Reading one JSON object key by key for PEFT's files, remembering which keys were looked at
//! so an unknown one (a typo, or a feature of a newer PEFT) is refused by name.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::config::{LoraInit, TargetModules};
use crate::{Error, Result};

/// An object from file `origin`, being read.
pub(super) struct Reader<'a> {
    origin: &'a str,
    map: &'a Map<String, Value>,
    seen: BTreeSet<&'a str>,
}

impl<'a> Reader<'a> {
    pub(super) fn new(origin: &'a str, map: &'a Map<String, Value>) -> Self {
        Self {
            origin,
            map,
            seen: BTreeSet::new(),
        }
    }

    /// An error naming the file.
    pub(super) fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::Config(format!("{}: {msg}", self.origin))
    }

    /// `key`'s value, when present and not `null`.
    pub(super) fn raw(&mut self, key: &'a str) -> Option<&'a Value> {
        self.seen.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// Marks `keys` as read whatever their values.
    pub(super) fn accept(&mut self, keys: &[&'a str]) {
        self.seen.extend(keys.iter().copied());
    }

    /// Requires a string key to be `want` when present.
    pub(super) fn require_str(&mut self, key: &'a str, want: &str, why: &str) -> Result<()> {
        match self.raw(key) {
            None => Ok(()),
            Some(Value::String(s)) if s == want => Ok(()),
            Some(v) => Err(self.err(format!(
                "key `{key}` = {v} is not supported ({why}; supported: \"{want}\")"
            ))),
        }
    }

    /// A positive integer, or `default`.
    pub(super) fn positive_or(&mut self, key: &'a str, default: usize) -> Result<usize> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => Err(self.err(format!("key `{key}` = {v} is not a positive integer"))),
            },
        }
    }

    /// A number, or `default`.
    pub(super) fn f32_or(&mut self, key: &'a str, default: f32) -> Result<f32> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| self.err(format!("key `{key}` = {v} is not a number"))),
        }
    }

    /// A probability in [0, 1), zero when absent.
    pub(super) fn probability(&mut self, key: &'a str) -> Result<f32> {
        let p = self.f32_or(key, 0.0)?;
        if (0.0..1.0).contains(&p) {
            return Ok(p);
        }
        Err(self.err(format!("key `{key}` = {p} is not a probability in [0, 1)")))
    }

    /// A boolean, or `default`.
    pub(super) fn bool_or(&mut self, key: &'a str, default: bool) -> Result<bool> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("key `{key}` = {v} is not true or false"))),
        }
    }

    /// A string, when present.
    pub(super) fn string_opt(&mut self, key: &'a str) -> Result<Option<String>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(format!("key `{key}` = {v} is not a string"))),
        }
    }

    /// A string or a list of strings (PEFT takes both), empty when absent.
    pub(super) fn strings(&mut self, key: &'a str) -> Result<Vec<String>> {
        match self.raw(key) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| self.err(format!("key `{key}`: {x} is not a string")))
                })
                .collect(),
            Some(v) => Err(self.err(format!(
                "key `{key}` = {v} is not a string or a list of strings"
            ))),
        }
    }

    /// `target_modules` or `exclude_modules`: a regular expression, `"all-linear"`, or names.
    pub(super) fn targets(&mut self, key: &'a str) -> Result<Option<TargetModules>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) if s.eq_ignore_ascii_case("all-linear") => {
                if key == "target_modules" {
                    Ok(Some(TargetModules::AllLinear))
                } else {
                    Err(self.err(format!(
                        "key `{key}` = \"{s}\" is only meaningful for `target_modules`"
                    )))
                }
            }
            Some(Value::String(s)) => {
                super::target::compile(&format!("^(?:{s})$"))
                    .map_err(|e| self.err(format!("key `{key}` = \"{s}\": {e}")))?;
                Ok(Some(TargetModules::Regex(s.clone())))
            }
            Some(_) => Ok(Some(TargetModules::Names(self.strings(key)?))),
        }
    }

    /// `layers_to_transform`: one index or a list of them.
    pub(super) fn indices(&mut self, key: &'a str) -> Result<Option<Vec<usize>>> {
        let one = |v: &Value| v.as_u64().map(|n| n as usize);
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Array(a)) if a.is_empty() => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    one(x).ok_or_else(|| self.err(format!("key `{key}`: {x} is not a layer index")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => one(v).map(|n| Some(vec![n])).ok_or_else(|| {
                self.err(format!(
                    "key `{key}` = {v} is not a layer index or a list of them"
                ))
            }),
        }
    }

    /// `rank_pattern` or `alpha_pattern`: an object from pattern to a value `parse` accepts.
    pub(super) fn pattern_map<T>(
        &mut self,
        key: &'a str,
        parse: impl Fn(&Value) -> Option<T>,
    ) -> Result<Vec<(String, T)>> {
        let Some(v) = self.raw(key) else {
            return Ok(Vec::new());
        };
        let Value::Object(m) = v else {
            return Err(self.err(format!("key `{key}` = {v} is not an object")));
        };
        m.iter()
            .map(|(p, x)| {
                super::target::compile(&format!("^(.*\\.)?(?:{p})$"))
                    .map_err(|e| self.err(format!("key `{key}`: pattern \"{p}\": {e}")))?;
                let val = parse(x).ok_or_else(|| {
                    self.err(format!("key `{key}`: \"{p}\" = {x} is not a valid value"))
                })?;
                Ok((p.clone(), val))
            })
            .collect()
    }

    /// `init_lora_weights`: `true` or `"gaussian"`.
    pub(super) fn init(&mut self, key: &'a str) -> Result<LoraInit> {
        match self.raw(key) {
            None | Some(Value::Bool(true)) => Ok(LoraInit::Kaiming),
            Some(Value::String(s)) if s.eq_ignore_ascii_case("gaussian") => Ok(LoraInit::Gaussian),
            Some(v) => Err(self.err(format!(
                "key `{key}` = {v} is not supported (supported: true, \"gaussian\")"
            ))),
        }
    }

    /// Refuses any key not read or accepted, naming the nearest known one.
    pub(super) fn finish(self) -> Result<()> {
        let Some(first) = self.map.keys().find(|k| !self.seen.contains(k.as_str())) else {
            return Ok(());
        };
        let near = self
            .seen
            .iter()
            .map(|s| (strsim::levenshtein(first, s), *s))
            .min()
            .filter(|(d, _)| *d <= 3)
            .map(|(_, s)| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        Err(self.err(format!(
            "key `{first}` is not a LoRA setting ferrozero knows{near}: it may come from a newer \
             PEFT and change what the adapter computes"
        )))
    }
}
