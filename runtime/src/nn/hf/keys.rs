//! Reading a `config.json` object key by key: every key is either read (and its value
//! checked), known to leave training's math alone, or refused, so nothing a model would
//! compute differently passes unnoticed.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::{Error, Result};

/// Keys of transformers' `PretrainedConfig` (and generation settings older files carry) that
/// do not change what a causal LM computes in training: token ids, dtypes, bookkeeping.
const HARMLESS: &[&str] = &[
    "_name_or_path",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "is_decoder",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "tie_encoder_decoder",
    "pruned_heads",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "diversity_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "encoder_no_repeat_ngram_size",
    "output_scores",
    "return_dict_in_generate",
    "tf_legacy_loss",
    "use_bfloat16",
    "cross_attention_hidden_size",
    "initializer_range",
];

/// A `config.json` object being read for `arch`, remembering which keys were looked at.
pub(super) struct Keys<'a> {
    origin: &'a str,
    arch: &'a str,
    map: &'a Map<String, Value>,
    seen: BTreeSet<&'static str>,
}

impl<'a> Keys<'a> {
    /// Reads `map` (from file `origin`) as architecture `arch`.
    pub(super) fn new(origin: &'a str, arch: &'a str, map: &'a Map<String, Value>) -> Self {
        Self {
            origin,
            arch,
            map,
            seen: BTreeSet::new(),
        }
    }

    /// A configuration error naming the file and architecture.
    pub(super) fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::Config(format!("{}: {} config: {msg}", self.origin, self.arch))
    }

    /// The value of `key`, if present and not `null`.
    pub(super) fn raw(&mut self, key: &'static str) -> Option<&'a Value> {
        self.seen.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// Whether `key` is in the file at all (even as `null`).
    pub(super) fn has(&mut self, key: &'static str) -> bool {
        self.seen.insert(key);
        self.map.contains_key(key)
    }

    /// A non-negative integer, if present.
    pub(super) fn usize_opt(&mut self, key: &'static str) -> Result<Option<usize>> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => Err(self.err(format!("key `{key}` = {v} is not a non-negative integer"))),
            },
        }
    }

    /// A required non-negative integer.
    pub(super) fn usize(&mut self, key: &'static str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| self.err(format!("required key `{key}` is missing")))
    }

    /// A number, or `default` when absent.
    pub(super) fn f32_or(&mut self, key: &'static str, default: f32) -> Result<f32> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(x as f32),
                None => Err(self.err(format!("key `{key}` = {v} is not a number"))),
            },
        }
    }

    /// A boolean, or `default` when absent.
    pub(super) fn bool_or(&mut self, key: &'static str, default: bool) -> Result<bool> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("key `{key}` = {v} is not true or false"))),
        }
    }

    /// A string, or `default` when absent.
    pub(super) fn str_or(&mut self, key: &'static str, default: &'a str) -> Result<&'a str> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(format!("key `{key}` = {v} is not a string"))),
        }
    }

    /// Requires `key`'s value (default `default`) to be one of `allowed`: its meaning is
    /// implemented only for those.
    pub(super) fn one_of(
        &mut self,
        key: &'static str,
        default: &'a str,
        allowed: &[&str],
    ) -> Result<&'a str> {
        let v = self.str_or(key, default)?;
        if allowed.contains(&v) {
            return Ok(v);
        }
        Err(self.err(format!(
            "key `{key}` = \"{v}\" is not supported (supported: {})",
            allowed.join(", ")
        )))
    }

    /// Requires a boolean key to be `want` (absent counts as `default`), naming what the other
    /// value would need.
    pub(super) fn require_bool(
        &mut self,
        key: &'static str,
        default: bool,
        want: bool,
        why: &str,
    ) -> Result<()> {
        let v = self.bool_or(key, default)?;
        if v == want {
            return Ok(());
        }
        Err(self.err(format!(
            "key `{key}` = {v} is not supported ({why}; supported: {want})"
        )))
    }

    /// Marks `keys` as read: they are accepted whatever their value (the caller checked them,
    /// or they leave training's math alone for this architecture).
    pub(super) fn accept(&mut self, keys: &[&'static str]) {
        self.seen.extend(keys.iter().copied());
    }

    /// Refuses any key neither read nor harmless, listing the keys this architecture reads.
    pub(super) fn finish(self) -> Result<()> {
        let unknown: Vec<&String> = self
            .map
            .keys()
            .filter(|k| !self.seen.contains(k.as_str()) && !HARMLESS.contains(&k.as_str()))
            .collect();
        let Some(first) = unknown.first() else {
            return Ok(());
        };
        let known: Vec<&str> = self.seen.iter().copied().collect();
        Err(self.err(format!(
            "key `{first}` is not supported: it may change the model's math and ferrozero does \
             not implement it{} (keys read: {}; ignored as harmless: token ids, dtypes, \
             generation settings)",
            if unknown.len() > 1 {
                format!(" ({} such keys in all)", unknown.len())
            } else {
                String::new()
            },
            known.join(", ")
        )))
    }
}
