//! The committed JSON Schema and the loader must agree on key names: every key of every valid
//! preset and corpus config (canonical spellings only) must be a property in the schema, so
//! editors never flag a config that `ferrozero validate` accepts.

use std::path::Path;

use serde_json::Value;

fn schema() -> Value {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/ferrozero.schema.json"),
    )
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Follows `$ref` and `anyOf` to the object schema that lists properties, if any.
fn object_schema<'a>(root: &'a Value, s: &'a Value) -> Option<&'a Value> {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/$defs/");
        return object_schema(root, &root["$defs"][name]);
    }
    if s.get("properties").is_some() {
        return Some(s);
    }
    s.get("anyOf")?
        .as_array()?
        .iter()
        .find_map(|v| object_schema(root, v))
}

fn check(root: &Value, schema: &Value, value: &Value, path: &str, missing: &mut Vec<String>) {
    let Value::Object(map) = value else { return };
    let Some(obj) = object_schema(root, schema) else {
        return;
    };
    for (k, v) in map {
        let p = format!("{path}.{k}");
        match obj["properties"].get(k) {
            Some(sub) => check(root, sub, v, &p, missing),
            None => missing.push(p),
        }
    }
}

fn load_value(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    if path.extension().unwrap() == "json" {
        serde_json::from_str(&text).unwrap()
    } else {
        let t: toml::Table = toml::from_str(&text).unwrap();
        serde_json::to_value(t).unwrap()
    }
}

#[test]
fn every_canonical_key_in_valid_configs_is_in_the_schema() {
    let root = schema();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(dir.join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "toml"));
    files.extend(
        std::fs::read_dir(dir.join("tests/fixtures/configs/valid"))
            .unwrap()
            .map(|e| e.unwrap().path()),
    );
    // DeepSpeed's short names are properties too (marked `x-alias-of`), so the file that
    // spells them is checked like the others.
    assert!(files.len() >= 15);
    let mut missing = Vec::new();
    for f in &files {
        check(
            &root,
            &root,
            &load_value(f),
            &f.display().to_string(),
            &mut missing,
        );
    }
    assert!(
        missing.is_empty(),
        "keys the schema does not know: {missing:#?}"
    );
}
