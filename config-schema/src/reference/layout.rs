//! The walk from the root schema to the reference's sections: one per table (the root, then
//! each table depth-first, keys in sorted order), each with one row per key that holds a value.

use serde_json::Value;

use super::shape::{schema_error, Alt, Alternatives, Resolver};
use super::words::{default_text, type_text, value_text};
use crate::error::LoadError;

/// Other names the loader accepts for a key, from the schema's `x-aliases` and
/// `x-deprecated-aliases` extensions.
#[derive(Debug, Default)]
pub(super) struct Names {
    /// Read silently (DeepSpeed's alternative spellings).
    pub aliases: Vec<String>,
    /// Read with a deprecation warning.
    pub deprecated: Vec<String>,
}

/// What a key is when the config leaves it out.
#[derive(Debug)]
pub(super) enum Fallback {
    /// The schema's default, as written in a config.
    Default(String),
    /// The key must be given (when its table is).
    Required,
    /// The key may be left unset; the description says what that means.
    Unset,
    /// The schema says nothing.
    Unknown,
}

/// One key holding a value.
#[derive(Debug)]
pub(super) struct Row {
    /// Full dotted key path.
    pub path: String,
    /// What it accepts, in words.
    pub type_text: String,
    /// What it is when left out.
    pub fallback: Fallback,
    /// Its doc comment, whitespace collapsed (empty when undocumented).
    pub description: String,
    /// Documented choices: the value as written and its doc comment.
    pub choices: Vec<(String, String)>,
    /// Other accepted names.
    pub names: Names,
}

/// One table: its description and its keys.
#[derive(Debug)]
pub(super) struct Section {
    /// Full dotted path; empty for the root.
    pub path: String,
    /// The doc comment where the table is used, then the table type's own if it differs.
    pub paragraphs: Vec<String>,
    /// The table must be present.
    pub required: bool,
    /// Other accepted names for the table.
    pub names: Names,
    /// Keys holding values, in sorted order.
    pub rows: Vec<Row>,
}

/// Every section of the reference, the root first.
pub(super) fn sections(root: &Value) -> Result<Vec<Section>, LoadError> {
    let r = Resolver::new(root);
    let alts = r.alternatives(root, "")?;
    let [object] = alts.objects[..] else {
        return Err(schema_error(
            "",
            "the root is not one object schema listing properties",
        ));
    };
    let head = Section {
        path: String::new(),
        paragraphs: description(root).into_iter().collect(),
        required: false,
        names: Names::default(),
        rows: Vec::new(),
    };
    let mut out = Vec::new();
    table(&r, head, object, &mut Vec::new(), &mut out)?;
    Ok(out)
}

/// Appends `head` with its rows, then its nested tables depth-first.
fn table<'a>(
    r: &Resolver<'a>,
    mut head: Section,
    object: &'a Value,
    open: &mut Vec<&'a Value>,
    out: &mut Vec<Section>,
) -> Result<(), LoadError> {
    if open.iter().any(|o| std::ptr::eq(*o, object)) {
        return Err(schema_error(&head.path, "the table contains itself"));
    }
    let props = object
        .get("properties")
        .and_then(Value::as_object)
        .ok_or_else(|| schema_error(&head.path, "`properties` is not an object"))?;
    let required = required_keys(object, &head.path)?;
    let mut keys: Vec<&String> = props.keys().collect();
    keys.sort();
    let mut nested = Vec::new();
    for key in keys {
        let site = &props[key.as_str()];
        if site.get("x-alias-of").is_some() {
            // Listed with its canonical key (its `Names`), not as a row of its own.
            continue;
        }
        let path = join(&head.path, key);
        let alts = r.alternatives(site, &path)?;
        let needed = required.contains(&key.as_str());
        match alts.objects[..] {
            [] => {}
            [inner] => nested.push((path.clone(), site, inner, needed)),
            _ => return Err(schema_error(&path, "several table shapes for one key")),
        }
        if !alts.values.is_empty() || alts.objects.is_empty() {
            head.rows.push(row(r, path, site, &alts, needed)?);
        }
    }
    out.push(head);
    open.push(object);
    for (path, site, inner, needed) in nested {
        let mut paragraphs: Vec<String> = description(site).into_iter().collect();
        if let Some(own) = description(inner).filter(|d| !paragraphs.contains(d)) {
            paragraphs.push(own);
        }
        let names = names(site, &path)?;
        let head = Section {
            path,
            paragraphs,
            required: needed,
            names,
            rows: Vec::new(),
        };
        table(r, head, inner, open, out)?;
    }
    open.pop();
    Ok(())
}

/// The keys an object schema requires.
fn required_keys<'a>(object: &'a Value, path: &str) -> Result<Vec<&'a str>, LoadError> {
    match object.get("required") {
        None => Ok(Vec::new()),
        Some(list) => list
            .as_array()
            .and_then(|l| l.iter().map(Value::as_str).collect())
            .ok_or_else(|| schema_error(path, "`required` is not a list of names")),
    }
}

fn row(
    r: &Resolver<'_>,
    path: String,
    site: &Value,
    alts: &Alternatives<'_>,
    needed: bool,
) -> Result<Row, LoadError> {
    let target = r.deref(site, &path)?;
    let default = site.get("default").or_else(|| target.get("default"));
    let fallback = match default {
        Some(v) => Fallback::Default(default_text(v)),
        None if needed => Fallback::Required,
        None if alts.nullable => Fallback::Unset,
        None => Fallback::Unknown,
    };
    let choices = alts
        .values
        .iter()
        .filter_map(|a| match a {
            Alt::Const {
                value,
                description: Some(d),
            } => Some((value_text(value), collapse(d))),
            _ => None,
        })
        .collect();
    Ok(Row {
        type_text: type_text(alts),
        fallback,
        description: description(site)
            .or_else(|| description(target))
            .unwrap_or_default(),
        choices,
        names: names(site, &path)?,
        path,
    })
}

/// A schema's non-blank description, whitespace collapsed (doc comments wrap lines).
fn description(schema: &Value) -> Option<String> {
    let d = collapse(schema.get("description")?.as_str()?);
    (!d.is_empty()).then_some(d)
}

fn collapse(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn names(site: &Value, path: &str) -> Result<Names, LoadError> {
    let list = |keyword: &str| -> Result<Vec<String>, LoadError> {
        let Some(v) = site.get(keyword) else {
            return Ok(Vec::new());
        };
        v.as_array()
            .and_then(|l| l.iter().map(|s| s.as_str().map(str::to_string)).collect())
            .ok_or_else(|| schema_error(path, format!("`{keyword}` is not a list of names")))
    };
    Ok(Names {
        aliases: list("x-aliases")?,
        deprecated: list("x-deprecated-aliases")?,
    })
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}
