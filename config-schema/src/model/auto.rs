//! `"auto"`: a value Hugging Face and DeepSpeed fill in at start-up; ferrozero resolves it in
//! [`crate::Config::resolve`] from the model and world size.

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Serialize, Serializer};

/// Either `"auto"` or a concrete value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AutoOr<T> {
    /// Decided at resolution time.
    Auto,
    /// Given explicitly.
    Value(T),
}

impl<T: Copy> AutoOr<T> {
    /// The explicit value, if any.
    pub fn value(&self) -> Option<T> {
        match self {
            AutoOr::Auto => None,
            AutoOr::Value(v) => Some(*v),
        }
    }
}

impl<T: Serialize> Serialize for AutoOr<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AutoOr::Auto => s.serialize_str("auto"),
            AutoOr::Value(v) => v.serialize(s),
        }
    }
}

impl<T: JsonSchema> JsonSchema for AutoOr<T> {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        format!("AutoOr_{}", T::schema_name()).into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "anyOf": [generator.subschema_for::<T>(), { "const": "auto" }]
        })
    }
}
