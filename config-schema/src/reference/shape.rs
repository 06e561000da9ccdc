//! What one property's JSON Schema accepts, as the alternatives a user may write: `$ref`s
//! followed, `anyOf`/`oneOf` flattened, and `null` read as "may be left unset" rather than as a
//! value anyone would type.

use serde_json::Value;

use crate::error::LoadError;

/// Deeper `$ref` or combinator nesting than this is a cycle: schemars never nests more than a
/// few levels.
const MAX_DEPTH: usize = 64;

/// One kind of value a key accepts.
#[derive(Debug)]
pub(super) enum Alt<'a> {
    /// Exactly this value (an enum choice, `"auto"`), with the choice's own doc comment.
    Const {
        /// The value.
        value: &'a Value,
        /// Its description, if the schema has one.
        description: Option<&'a str>,
    },
    /// `integer`, `number`, `boolean` or `string`, with the schema holding its bounds.
    Scalar {
        /// The JSON type name.
        kind: &'a str,
        /// The schema the type came from (bounds, pattern, ...).
        schema: &'a Value,
    },
    /// An array; the schema holds `items` and the length bounds.
    Array(&'a Value),
    /// An object without listed properties (a free-form table).
    Map,
    /// Any value at all (`true` or `{}`).
    Any,
}

/// Everything one property accepts.
#[derive(Debug, Default)]
pub(super) struct Alternatives<'a> {
    /// Object schemas that list properties: these become tables of their own.
    pub objects: Vec<&'a Value>,
    /// Every other accepted shape, in schema order.
    pub values: Vec<Alt<'a>>,
    /// `null` is accepted: the key may be left unset.
    pub nullable: bool,
}

/// Resolves local `$ref`s against the root schema.
pub(super) struct Resolver<'a> {
    root: &'a Value,
}

/// The error for a schema the generator cannot document.
pub(super) fn schema_error(key_path: &str, reason: impl Into<String>) -> LoadError {
    LoadError::Schema {
        key_path: key_path.to_string(),
        reason: reason.into(),
    }
}

impl<'a> Resolver<'a> {
    /// A resolver for references into `root`.
    pub fn new(root: &'a Value) -> Self {
        Resolver { root }
    }

    /// The schema a `$ref` names; only document-local references (`#/...`) exist in generated
    /// schemas, so anything else is reported rather than fetched.
    fn lookup(&self, reference: &Value, at: &str) -> Result<&'a Value, LoadError> {
        let text = reference
            .as_str()
            .ok_or_else(|| schema_error(at, "`$ref` is not a string"))?;
        let pointer = text.strip_prefix('#').ok_or_else(|| {
            schema_error(
                at,
                format!("only local references (`#/...`) are supported, found `{text}`"),
            )
        })?;
        self.root
            .pointer(pointer)
            .ok_or_else(|| schema_error(at, format!("`$ref` `{text}` points at nothing")))
    }

    /// Follows a chain of `$ref`s to the schema that says what the value is.
    pub fn deref(&self, mut schema: &'a Value, at: &str) -> Result<&'a Value, LoadError> {
        for _ in 0..MAX_DEPTH {
            match schema.get("$ref") {
                Some(r) => schema = self.lookup(r, at)?,
                None => return Ok(schema),
            }
        }
        Err(schema_error(at, "`$ref`s form a cycle"))
    }

    /// Everything `schema` accepts.
    pub fn alternatives(&self, schema: &'a Value, at: &str) -> Result<Alternatives<'a>, LoadError> {
        let mut out = Alternatives::default();
        self.collect(schema, at, 0, &mut out)?;
        Ok(out)
    }

    fn collect(
        &self,
        schema: &'a Value,
        at: &str,
        depth: usize,
        out: &mut Alternatives<'a>,
    ) -> Result<(), LoadError> {
        if depth > MAX_DEPTH {
            return Err(schema_error(
                at,
                "`$ref`s or combinators nest too deep (a cycle?)",
            ));
        }
        let obj = match schema {
            Value::Bool(true) => {
                out.values.push(Alt::Any);
                return Ok(());
            }
            Value::Bool(false) => return Ok(()),
            Value::Object(obj) => obj,
            other => return Err(schema_error(at, format!("not a schema: `{other}`"))),
        };
        let mut branched = false;
        if let Some(r) = obj.get("$ref") {
            self.collect(self.lookup(r, at)?, at, depth + 1, out)?;
            branched = true;
        }
        for keyword in ["anyOf", "oneOf", "allOf"] {
            let Some(list) = obj.get(keyword) else {
                continue;
            };
            let list = list
                .as_array()
                .ok_or_else(|| schema_error(at, format!("`{keyword}` is not an array")))?;
            if keyword == "allOf" && list.len() != 1 {
                // An intersection cannot be shown as a list of alternatives.
                return Err(schema_error(
                    at,
                    "`allOf` with several schemas is not supported",
                ));
            }
            for s in list {
                self.collect(s, at, depth + 1, out)?;
            }
            branched = true;
        }
        if !branched {
            own_alternatives(schema, at, out)?;
        }
        Ok(())
    }
}

/// The alternatives a schema states itself (`const`, `enum`, `type`), without combinators.
fn own_alternatives<'a>(
    schema: &'a Value,
    at: &str,
    out: &mut Alternatives<'a>,
) -> Result<(), LoadError> {
    let description = schema.get("description").and_then(Value::as_str);
    if let Some(value) = schema.get("const") {
        out.values.push(Alt::Const { value, description });
        return Ok(());
    }
    if let Some(values) = schema.get("enum") {
        let values = values
            .as_array()
            .ok_or_else(|| schema_error(at, "`enum` is not an array"))?;
        for value in values {
            match value {
                Value::Null => out.nullable = true,
                value => out.values.push(Alt::Const {
                    value,
                    description: None,
                }),
            }
        }
        return Ok(());
    }
    let kinds: Vec<&str> = match schema.get("type") {
        None if schema.get("properties").is_some() => vec!["object"],
        None => {
            out.values.push(Alt::Any);
            return Ok(());
        }
        Some(Value::String(kind)) => vec![kind.as_str()],
        Some(Value::Array(kinds)) => kinds
            .iter()
            .map(|k| {
                k.as_str()
                    .ok_or_else(|| schema_error(at, "a `type` is not a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(schema_error(at, format!("`type` is `{other}`"))),
    };
    for kind in kinds {
        match kind {
            "null" => out.nullable = true,
            "object" if schema.get("properties").is_some() => out.objects.push(schema),
            "object" => out.values.push(Alt::Map),
            "array" => out.values.push(Alt::Array(schema)),
            "integer" | "number" | "boolean" | "string" => {
                out.values.push(Alt::Scalar { kind, schema })
            }
            other => return Err(schema_error(at, format!("unknown type `{other}`"))),
        }
    }
    Ok(())
}
