//! `docs/deepspeed-keys.md` is a specification, not prose: every row's example, loaded on top
//! of a minimal config, must end as the row says (implemented or accepted: no error and no
//! "not supported" warning on the key; ignored: that warning; refused: an error on the key),
//! and every key of the committed schema must have a row, so nothing is accepted that the
//! table does not account for.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use ferrozero::config::{parse, Diagnostic, DiagnosticKind, Format, LoadError, Severity};
use serde_json::{json, Value};

const TABLE: &str = "docs/deepspeed-keys.md";

struct Row {
    key: String,
    status: String,
    example: Value,
    line: usize,
}

fn rows() -> Vec<Row> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(TABLE)).unwrap();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let cells: Vec<&str> = line.split(" | ").collect();
        if !line.starts_with("| `") || cells.len() < 4 {
            continue;
        }
        let unquote = |c: &str| {
            c.trim()
                .trim_start_matches('|')
                .trim()
                .trim_matches('`')
                .to_string()
        };
        out.push(Row {
            key: unquote(cells[0]),
            status: cells[1].trim().to_string(),
            example: serde_json::from_str(&unquote(cells[2]))
                .unwrap_or_else(|e| panic!("{TABLE}:{}: example is not JSON: {e}", i + 1)),
            line: i + 1,
        });
    }
    out
}

fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        a.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

/// The committed schema's alias properties: (parent path, alias) -> canonical key.
fn schema() -> Value {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/ferrozero.schema.json"),
    )
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn objects<'a>(root: &'a Value, s: &'a Value, out: &mut Vec<&'a Value>) {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        return objects(root, &root["$defs"][r.trim_start_matches("#/$defs/")], out);
    }
    if s.get("properties").is_some() {
        out.push(s);
    }
    for alt in s
        .get("anyOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        objects(root, alt, out);
    }
}

/// Every key path of the schema, and every alias path with its canonical path.
fn walk(
    root: &Value,
    object: &Value,
    prefix: &str,
    keys: &mut BTreeSet<String>,
    aliases: &mut HashMap<String, String>,
) {
    for (k, site) in object["properties"].as_object().unwrap() {
        let path = format!("{prefix}{k}");
        keys.insert(path.clone());
        if let Some(canon) = site.get("x-alias-of").and_then(Value::as_str) {
            aliases.insert(path, format!("{prefix}{canon}"));
            continue;
        }
        let mut inner = Vec::new();
        objects(root, site, &mut inner);
        for o in inner {
            walk(root, o, &format!("{path}."), keys, aliases);
        }
    }
}

fn unsupported_on<'a>(ds: &'a [Diagnostic], paths: &[&str]) -> Option<&'a Diagnostic> {
    ds.iter()
        .find(|d| d.kind == DiagnosticKind::Unsupported && paths.contains(&d.path.as_str()))
}

#[test]
fn every_row_of_the_deepspeed_table_behaves_as_written() {
    let root = schema();
    let (mut keys, mut aliases) = (BTreeSet::new(), HashMap::new());
    walk(&root, &root, "", &mut keys, &mut aliases);
    let rows = rows();
    assert!(
        rows.len() > 250,
        "only {} rows read from {TABLE}",
        rows.len()
    );
    let mut wrong = Vec::new();
    for r in &rows {
        let mut config = json!({
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}
        });
        merge(&mut config, &r.example);
        let text = serde_json::to_string_pretty(&config).unwrap();
        let canonical = aliases
            .get(&r.key)
            .cloned()
            .unwrap_or_else(|| r.key.clone());
        let paths = [r.key.as_str(), canonical.as_str()];
        let outcome = parse(&text, Format::Json, "row.json");
        let ok = match (r.status.as_str(), &outcome) {
            ("implemented" | "accepted", Ok(l)) => unsupported_on(&l.warnings, &paths).is_none(),
            ("ignored", Ok(l)) => {
                unsupported_on(&l.warnings, &paths).is_some_and(|w| w.severity == Severity::Warning)
            }
            ("refused", Err(LoadError::Invalid { diagnostics, .. })) => diagnostics
                .iter()
                .any(|d| d.is_error() && paths.contains(&d.path.as_str())),
            _ => false,
        };
        if !ok {
            let got = match &outcome {
                Ok(l) => format!(
                    "loaded, warnings: {:?}",
                    l.warnings
                        .iter()
                        .map(|w| (&w.path, &w.message))
                        .collect::<Vec<_>>()
                ),
                Err(e) => format!("refused: {e}"),
            };
            wrong.push(format!(
                "{TABLE}:{} `{}` is {} but {got}",
                r.line, r.key, r.status
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let listed: BTreeSet<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !listed.contains(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "schema keys without a row in {TABLE}: {missing:#?}"
    );
}
