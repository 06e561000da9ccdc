//! ferrozero's configuration: DeepSpeed's config surface as typed, documented structs, loaded
//! from TOML (native) or DeepSpeed JSON, validated completely at load time.
//!
//! ```
//! use ferrozero_config::{parse, Format, ResolveContext};
//! let loaded = parse("train_micro_batch_size_per_gpu = 2\n[optimizer]\ntype = \"AdamW\"\n", Format::Toml, "inline")?;
//! let resolved = loaded.config.resolve(&ResolveContext::new(4))?;
//! assert_eq!(resolved.train_batch_size, 8);
//! # Ok::<(), ferrozero_config::LoadError>(())
//! ```
//!
//! Invariant: this crate knows nothing about tensors, models or communicators. The engine
//! consumes only [`resolved::ResolvedConfig`], in which every `"auto"` and every default has
//! been decided.

mod diagnostic;
mod error;
mod model;
mod parse;
mod reader;
pub mod reference;
mod resolve;
pub mod resolved;
mod rules;

use std::path::Path;
use std::sync::Arc;

pub use diagnostic::{Diagnostic, DiagnosticKind, Location, RenderStyle, Severity};
pub use error::{render_all, LoadError};
pub use model::*;
pub use resolve::{Decision, Resolution, ResolveContext};
pub use resolved::ResolvedConfig;

/// Input format of a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// TOML (ferrozero's native format).
    Toml,
    /// JSON (DeepSpeed's format).
    Json,
}

impl Format {
    /// The format a file name implies, by extension.
    pub fn from_path(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "toml" => Some(Format::Toml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// A valid config and the warnings it produced (deprecated keys mapped, ignored sections, ...).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The typed config, `"auto"` still unresolved.
    pub config: Config,
    /// Warnings; errors would have made loading fail.
    pub warnings: Vec<Diagnostic>,
}

/// Loads a config file, choosing the format by extension.
pub fn load(path: &Path) -> Result<Loaded, LoadError> {
    let format = Format::from_path(path).ok_or_else(|| LoadError::UnknownFormat {
        path: path.to_path_buf(),
    })?;
    let src = std::fs::read_to_string(path).map_err(|source| LoadError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&src, format, &path.display().to_string())
}

/// Parses and validates config text; `origin` names it in diagnostics (usually the file name).
pub fn parse(src: &str, format: Format, origin: &str) -> Result<Loaded, LoadError> {
    let mut cx = reader::Cx::new(src, origin);
    let tree = match format {
        Format::Toml => parse::parse_toml(src),
        Format::Json => parse::parse_json(src),
    };
    let config = match tree {
        Ok(root) => model::read_config(&mut cx, &root),
        Err(e) => {
            cx.error(reader::Report {
                kind: DiagnosticKind::Syntax,
                path: "",
                span: &e.span,
                message: format!("invalid {}: {}", format_name(format), e.message.trim_end()),
                help: None,
            });
            None
        }
    };
    if let Some(c) = &config {
        rules::check(&mut cx, c);
    }
    // Source order reads best; rule findings are discovered after the walk.
    cx.diags
        .sort_by_key(|d| d.location.as_ref().map(|l| (l.line, l.column)));
    match config {
        Some(mut c) if !cx.diags.iter().any(Diagnostic::is_error) => {
            c.source = Arc::new(model::SourceMap {
                origin: origin.to_string(),
                text: src.to_string(),
                spans: std::mem::take(&mut cx.spans),
            });
            Ok(Loaded {
                config: c,
                warnings: cx.diags,
            })
        }
        _ => Err(LoadError::Invalid {
            origin: origin.to_string(),
            diagnostics: cx.diags,
        }),
    }
}

fn format_name(format: Format) -> &'static str {
    match format {
        Format::Toml => "TOML",
        Format::Json => "JSON",
    }
}

/// The JSON Schema (2020-12) of the config format, pretty-printed, as committed in
/// `configs/ferrozero.schema.json`.
///
/// DeepSpeed's other spellings of a key (its short pydantic names such as
/// `max_live_parameters`, and deprecated names) are properties too, so that editors complete
/// and accept them; each is marked `x-alias-of` (and `deprecated` where it is) and carries the
/// canonical key's schema.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(Config);
    let mut value = serde_json::to_value(&schema).expect("a schema always serializes");
    add_alias_properties(&mut value);
    // Back into a Schema, whose serialization orders keywords as schemars does.
    let schema = schemars::Schema::try_from(value).expect("still an object schema");
    let mut s = serde_json::to_string_pretty(&schema).expect("a schema always serializes");
    s.push('\n');
    s
}

/// Adds a property for every `x-aliases` / `x-deprecated-aliases` name of every object schema
/// (the root and `$defs`).
fn add_alias_properties(schema: &mut serde_json::Value) {
    use serde_json::{json, Value};
    fn add(props: &mut serde_json::Map<String, Value>) {
        let mut extra = Vec::new();
        for (key, site) in props.iter() {
            for (keyword, deprecated) in [("x-aliases", false), ("x-deprecated-aliases", true)] {
                let names = site.get(keyword).and_then(Value::as_array);
                for alias in names.into_iter().flatten().filter_map(Value::as_str) {
                    let mut copy = site.clone();
                    if let Value::Object(m) = &mut copy {
                        m.remove("x-aliases");
                        m.remove("x-deprecated-aliases");
                        let what = if deprecated {
                            "Deprecated name"
                        } else {
                            "DeepSpeed's other name"
                        };
                        m.insert(
                            "description".into(),
                            json!(format!(
                                "{what} of `{key}` (the same setting; give only one)."
                            )),
                        );
                        m.insert("x-alias-of".into(), json!(key));
                        if deprecated {
                            m.insert("deprecated".into(), json!(true));
                        }
                    }
                    extra.push((alias.to_string(), copy));
                }
            }
        }
        for (k, v) in extra {
            props.entry(k).or_insert(v);
        }
    }
    if let Some(Value::Object(defs)) = schema.get_mut("$defs") {
        for d in defs.values_mut() {
            if let Some(Value::Object(p)) = d.get_mut("properties") {
                add(p);
            }
        }
    }
    if let Some(Value::Object(p)) = schema.get_mut("properties") {
        add(p);
    }
}
