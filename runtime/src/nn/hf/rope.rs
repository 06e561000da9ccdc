//! RoPE settings from a `config.json`: `rope_theta` + `rope_scaling` (transformers 4), or
//! `rope_parameters` (transformers 5: `{"rope_type": ..., "rope_theta": ..., ...}`).

use serde_json::{Map, Value};

use super::keys::Keys;
use crate::backend::{Rope, RopeScaling};
use crate::Result;

/// The `rope_type`s implemented: those whose attention scaling is 1 and whose frequencies
/// do not depend on the sequence length.
const SUPPORTED: &str = "default, linear, llama3";

/// Reads the rotary settings (default base `default_theta`).
pub(super) fn read(k: &mut Keys<'_>, default_theta: f32) -> Result<Rope> {
    if let Some(params) = k.raw("rope_parameters") {
        k.accept(&["rope_theta", "rope_scaling"]);
        let obj = object(k, "rope_parameters", params)?;
        let theta = number(k, "rope_parameters", obj, "rope_theta")?.unwrap_or(default_theta);
        return scaled(k, "rope_parameters", obj, theta);
    }
    let theta = k.f32_or("rope_theta", default_theta)?;
    let rope = match k.raw("rope_scaling") {
        None => Rope::plain(theta),
        Some(v) => {
            let obj = object(k, "rope_scaling", v)?;
            scaled(k, "rope_scaling", obj, theta)?
        }
    };
    Ok(rope)
}

fn object<'a>(k: &Keys<'_>, key: &str, v: &'a Value) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| k.err(format!("key `{key}` = {v} is not an object")))
}

fn number(k: &Keys<'_>, key: &str, obj: &Map<String, Value>, field: &str) -> Result<Option<f32>> {
    match obj.get(field).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| k.err(format!("key `{key}.{field}` = {v} is not a number"))),
    }
}

fn required(k: &Keys<'_>, key: &str, obj: &Map<String, Value>, field: &str) -> Result<f32> {
    number(k, key, obj, field)?.ok_or_else(|| {
        k.err(format!(
            "key `{key}` lacks `{field}`, which its rope_type needs"
        ))
    })
}

/// The scaling an object names by `rope_type` (or the older `type`).
fn scaled(k: &Keys<'_>, key: &str, obj: &Map<String, Value>, theta: f32) -> Result<Rope> {
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: required(k, key, obj, "factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: required(k, key, obj, "factor")?,
            low_freq_factor: required(k, key, obj, "low_freq_factor")?,
            high_freq_factor: required(k, key, obj, "high_freq_factor")?,
            original_max_position_embeddings: required(
                k,
                key,
                obj,
                "original_max_position_embeddings",
            )? as usize,
        },
        other => {
            return Err(k.err(format!(
                "key `{key}` has rope_type \"{other}\", which is not supported \
                 (supported: {SUPPORTED})"
            )))
        }
    };
    let rope = Rope { theta, scaling };
    rope.validate()
        .map_err(|m| k.err(format!("key `{key}`: {m}")))?;
    Ok(rope)
}
