//! `docs/config-reference.md` must be what the generator prints today, must list every key the
//! schema accepts, and every key must be documented; the aliases the schema advertises must be
//! ones the loader really accepts. The schema walk here is deliberately independent of the
//! generator's, so a generator bug that drops keys cannot hide itself.

use std::path::Path;
use std::process::Command;

use ferrozero_config::{parse, reference, DiagnosticKind, Format, Loaded};
use serde_json::{json, Map, Value};

const REFERENCE: &str = "docs/config-reference.md";

fn committed() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCE);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; generate it with `{}`",
            path.display(),
            reference::REGENERATE
        )
    })
}

fn schema() -> Value {
    serde_json::from_str(&ferrozero_config::json_schema()).unwrap()
}

/// The first line where two texts differ (1-based), with both versions of it.
fn first_difference(a: &str, b: &str) -> Option<(usize, String, String)> {
    let (mut la, mut lb) = (a.lines(), b.lines());
    let mut n = 0;
    loop {
        n += 1;
        match (la.next(), lb.next()) {
            (None, None) => {
                let why = "(only line endings or the final newline differ)";
                return (a != b).then(|| (n, why.into(), why.into()));
            }
            (x, y) if x != y => {
                let show = |l: Option<&str>| l.unwrap_or("<end of file>").to_string();
                return Some((n, show(x), show(y)));
            }
            _ => {}
        }
    }
}

#[test]
fn committed_reference_is_current() {
    let generated = reference::markdown().unwrap_or_else(|e| panic!("{e}"));
    if let Some((line, old, new)) = first_difference(&committed(), &generated) {
        panic!(
            "{REFERENCE} is stale: regenerate it with `{}`\n\
             first difference at line {line}:\n  committed: {old}\n  generated: {new}",
            reference::REGENERATE
        );
    }
}

#[test]
fn first_difference_finds_the_line() {
    assert_eq!(first_difference("a\nb\n", "a\nb\n"), None);
    assert_eq!(
        first_difference("a\nb\nc\n", "a\nx\nc\n"),
        Some((2, "b".into(), "x".into()))
    );
    assert_eq!(
        first_difference("a\n", "a\nb\n"),
        Some((2, "<end of file>".into(), "b".into()))
    );
    assert!(
        first_difference("a\n", "a").is_some(),
        "a lost final newline"
    );
}

#[test]
fn schema_subcommand_prints_the_reference_and_still_the_schema() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ferrozero"))
            .args(args)
            .output()
            .unwrap()
    };
    let md = run(&["schema", "--format", "markdown"]);
    assert!(
        md.status.success(),
        "{}",
        String::from_utf8_lossy(&md.stderr)
    );
    assert_eq!(
        String::from_utf8(md.stdout).unwrap(),
        reference::markdown().unwrap()
    );
    let json = run(&["schema"]);
    assert_eq!(
        String::from_utf8(json.stdout).unwrap(),
        ferrozero_config::json_schema()
    );
    let bad = run(&["schema", "--format", "yaml"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("markdown"));
}

/// A key found by walking the schema.
struct Key {
    path: String,
    /// Holds a value (not only nested keys).
    leaf: bool,
    description: Option<String>,
    /// Choices (`const` values other than `"auto"`) without a doc comment of their own.
    undocumented_choices: Vec<String>,
    aliases: Vec<String>,
    deprecated: Vec<String>,
}

fn deref<'a>(root: &'a Value, mut s: &'a Value) -> &'a Value {
    while let Some(r) = s.get("$ref").and_then(Value::as_str) {
        s = root
            .pointer(r.trim_start_matches('#'))
            .expect("a resolvable $ref");
    }
    s
}

/// Every schema a value of `s` may match: `$ref`s followed, `anyOf`/`oneOf` flattened.
fn branches<'a>(root: &'a Value, s: &'a Value, out: &mut Vec<&'a Value>) {
    let s = deref(root, s);
    let mut split = false;
    for k in ["anyOf", "oneOf"] {
        for b in s.get(k).and_then(Value::as_array).into_iter().flatten() {
            branches(root, b, out);
            split = true;
        }
    }
    if !split {
        out.push(s);
    }
}

fn names(site: &Value, keyword: &str) -> Vec<String> {
    site.get(keyword)
        .and_then(Value::as_array)
        .map(|l| {
            l.iter()
                .filter_map(|v| Some(v.as_str()?.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

fn walk(root: &Value, object: &Value, prefix: &str, out: &mut Vec<Key>) {
    let props = object["properties"].as_object().expect("properties");
    for (k, site) in props {
        if site.get("x-alias-of").is_some() {
            continue;
        }
        let path = format!("{prefix}{k}");
        let mut all = Vec::new();
        branches(root, site, &mut all);
        let tables: Vec<&Value> = all
            .iter()
            .copied()
            .filter(|b| b.get("properties").is_some())
            .collect();
        let values = all
            .iter()
            .filter(|b| b.get("properties").is_none() && b.get("type") != Some(&json!("null")));
        let description = [site, deref(root, site)]
            .iter()
            .find_map(|s| s.get("description").and_then(Value::as_str))
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::to_string);
        let undocumented_choices = values
            .clone()
            .filter(|b| b.get("const").is_some() && b.get("description").is_none())
            .map(|b| b["const"].to_string())
            .filter(|c| c != "\"auto\"")
            .collect();
        out.push(Key {
            leaf: values.count() > 0,
            path: path.clone(),
            description,
            undocumented_choices,
            aliases: names(site, "x-aliases"),
            deprecated: names(site, "x-deprecated-aliases"),
        });
        for t in tables {
            walk(root, t, &format!("{path}."), out);
        }
    }
}

fn keys() -> Vec<Key> {
    let root = schema();
    let mut out = Vec::new();
    walk(&root, &root, "", &mut out);
    out
}

#[test]
fn every_key_is_in_the_reference_and_documented() {
    let keys = keys();
    let leaves: Vec<&Key> = keys.iter().filter(|k| k.leaf).collect();
    assert!(leaves.len() >= 90, "only {} leaf keys found", leaves.len());
    for known in [
        "zero_optimization.offload_optimizer.device",
        "optimizer.params.betas",
        "scheduler.params.warmup_type",
        "aio.queue_depth",
    ] {
        assert!(leaves.iter().any(|k| k.path == known), "{known} not walked");
    }
    let doc = committed();
    let missing: Vec<&str> = leaves
        .iter()
        .filter(|k| !doc.contains(&format!("\n| `{}` |", k.path)))
        .map(|k| k.path.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from {REFERENCE}: {missing:?}"
    );
    let tables = keys.iter().filter(|k| !k.leaf);
    for t in tables {
        assert!(
            doc.contains(&format!("\n## `[{}]`", t.path))
                || doc.contains(&format!("\n### `[{}]`", t.path)),
            "table {} has no section",
            t.path
        );
    }
    let undocumented: Vec<String> = keys
        .iter()
        .filter(|k| k.description.is_none())
        .map(|k| k.path.clone())
        .chain(keys.iter().flat_map(|k| {
            k.undocumented_choices
                .iter()
                .map(|c| format!("{} = {c}", k.path))
        }))
        .collect();
    assert!(
        undocumented.is_empty(),
        "keys and choices without a doc comment: {undocumented:?}"
    );
    assert!(!doc.contains("(undocumented)"));
}

/// A config setting `path` (whose last segment may be an alias) to `value`, with stage 3 so
/// that no stage-3 key draws a "has no effect" warning.
fn config_with(path: &[&str], value: Value) -> String {
    let mut v = value;
    for seg in path.iter().rev() {
        let mut m = Map::new();
        m.insert(seg.to_string(), v);
        v = Value::Object(m);
    }
    let mut root = json!({"zero_optimization": {"stage": 3}});
    merge(&mut root, v);
    root.to_string()
}

fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// A value that differs from the key's default, so that reading the alias as the wrong key
/// (or dropping it) shows.
fn probe(path: &str) -> Value {
    let root = schema();
    let mut object = &root;
    let segs: Vec<&str> = path.split('.').collect();
    for seg in &segs[..segs.len() - 1] {
        let mut b = Vec::new();
        branches(&root, &object["properties"][*seg], &mut b);
        object = b
            .into_iter()
            .find(|s| s.get("properties").is_some())
            .unwrap();
    }
    let site = &object["properties"][*segs.last().unwrap()];
    let mut b = Vec::new();
    branches(&root, site, &mut b);
    if let Some(table) = b.iter().find(|s| s.get("properties").is_some()) {
        // A table alias: flip its `enabled` switch, else its first boolean key (other keys of
        // a switched section may be valid only with the switch on).
        let props = table["properties"].as_object().unwrap();
        let (k, _) = props
            .get_key_value("enabled")
            .filter(|(_, p)| p.get("default") == Some(&json!(false)))
            .or_else(|| {
                props
                    .iter()
                    .find(|(_, p)| p.get("default") == Some(&json!(false)))
            })
            .expect("a boolean key to probe the table alias with");
        return json!({ k: true });
    }
    match site.get("default") {
        Some(Value::Bool(d)) => json!(!d),
        _ => json!(12345),
    }
}

fn load(text: &str) -> Loaded {
    parse(text, Format::Json, "alias.json").unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn aliases_in_the_schema_are_accepted_by_the_loader() {
    let keys = keys();
    let mut checked = 0;
    let aliased = keys
        .iter()
        .filter(|k| !k.aliases.is_empty() || !k.deprecated.is_empty());
    for k in aliased {
        let segs: Vec<&str> = k.path.split('.').collect();
        let value = probe(&k.path);
        let canonical = load(&config_with(&segs, value.clone()));
        assert_ne!(
            canonical.config,
            load("{\"zero_optimization\": {\"stage\": 3}}").config
        );
        for (alias, deprecated) in k
            .aliases
            .iter()
            .map(|a| (a, false))
            .chain(k.deprecated.iter().map(|a| (a, true)))
        {
            let mut alias_path = segs.clone();
            *alias_path.last_mut().unwrap() = alias;
            let read = load(&config_with(&alias_path, value.clone()));
            assert_eq!(
                read.config, canonical.config,
                "{alias} is not read as {}",
                k.path
            );
            let warned = read.warnings.iter().any(|w| {
                w.kind == DiagnosticKind::Deprecated && w.message.contains(alias.as_str())
            });
            assert_eq!(
                warned, deprecated,
                "{alias}: deprecation warning expected: {deprecated}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} aliases checked");
}
