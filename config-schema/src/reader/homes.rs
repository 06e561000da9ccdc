//! Where each key belongs: an index of every key path in the JSON Schema, so that a key written
//! in the wrong table (`stage` at the top level) is answered with the table it belongs in.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde_json::Value;

/// Every full key path, by its last segment.
fn index() -> &'static HashMap<String, Vec<String>> {
    static INDEX: OnceLock<HashMap<String, Vec<String>>> = OnceLock::new();
    INDEX.get_or_init(|| {
        let schema = serde_json::to_value(schemars::schema_for!(crate::model::Config))
            .unwrap_or(Value::Null);
        let mut index = HashMap::new();
        walk(&schema, &schema, "", &mut index, 0);
        index
    })
}

fn walk(
    root: &Value,
    s: &Value,
    path: &str,
    index: &mut HashMap<String, Vec<String>>,
    depth: usize,
) {
    if depth > 8 {
        return;
    }
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let def = &root["$defs"][r.trim_start_matches("#/$defs/")];
        return walk(root, def, path, index, depth + 1);
    }
    for alt in s
        .get("anyOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        walk(root, alt, path, index, depth + 1);
    }
    let Some(props) = s.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (key, sub) in props {
        let full = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        index.entry(key.clone()).or_default().push(full.clone());
        walk(root, sub, &full, index, depth + 1);
    }
}

/// The full paths at which `key` is valid, other than `current` (the path it was found at).
pub(crate) fn homes_of(key: &str, current: &str) -> Vec<&'static str> {
    index()
        .get(key)
        .map(|paths| {
            paths
                .iter()
                .map(String::as_str)
                .filter(|p| *p != current)
                .collect()
        })
        .unwrap_or_default()
}
