//! The walker on small hand-written schemas: references, nullable unions, choices, bounds,
//! ordering, aliases, and the errors for schemas it cannot document.

use serde_json::{json, Value};

use super::render;
use crate::error::LoadError;

/// The table row of `key` (its first line), or a panic naming what was rendered.
fn row<'a>(md: &'a str, key: &str) -> &'a str {
    let start = format!("| `{key}` |");
    md.lines()
        .find(|l| l.starts_with(&start))
        .unwrap_or_else(|| panic!("no row for {key} in:\n{md}"))
}

fn failure(schema: Value) -> (String, String) {
    match render(&schema) {
        Err(LoadError::Schema { key_path, reason }) => (key_path, reason),
        other => panic!("expected a schema error, got {other:?}"),
    }
}

fn nested() -> Value {
    json!({
        "type": "object",
        "description": "Root.",
        "properties": {
            "zeta": {"description": "Last.", "type": "boolean", "default": false},
            "alpha": {"description": "First.", "type": "integer", "minimum": 0, "maximum": 3},
            "section": {
                "description": "A section.",
                "anyOf": [{"$ref": "#/$defs/Sec"}, {"type": "null"}]
            }
        },
        "$defs": {
            "Sec": {
                "description": "The section type.",
                "type": "object",
                "required": ["kind"],
                "properties": {
                    "kind": {"description": "Which.", "$ref": "#/$defs/Kind"},
                    "path": {"description": "Where.", "type": ["string", "null"]},
                    "size": {
                        "description": "How many.",
                        "anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}],
                        "default": 8,
                        "x-aliases": ["bucket"]
                    }
                }
            },
            "Kind": {
                "oneOf": [
                    {"description": "Host memory.", "type": "string", "const": "cpu"},
                    {"description": "A disk.", "type": "string", "const": "nvme"}
                ]
            }
        }
    })
}

#[test]
fn nullable_reference_becomes_a_section_with_its_keys() {
    let md = render(&nested()).unwrap();
    assert!(md.contains("## `[section]`\n\nA section.\n\nThe section type.\n\n"));
    assert_eq!(
        row(&md, "section.kind"),
        "| `section.kind` | one of `\"cpu\"`, `\"nvme\"` | **required** \
         | Which.<br>`\"cpu\"`: Host memory.<br>`\"nvme\"`: A disk. |"
    );
    assert_eq!(
        row(&md, "section.path"),
        "| `section.path` | string | *unset* | Where. |"
    );
    assert_eq!(
        row(&md, "section.size"),
        "| `section.size` | integer ≥ 1 or `\"auto\"` | `8` \
         | How many.<br>Also accepted as `bucket`. |"
    );
    assert!(
        !md.contains("| `section` |"),
        "a table is a section, not a row"
    );
}

#[test]
fn keys_are_sorted_and_sections_follow_the_root_keys() {
    let md = render(&nested()).unwrap();
    let at = |s: &str| md.find(s).unwrap_or_else(|| panic!("{s} missing"));
    assert!(at("| `alpha` |") < at("| `zeta` |"));
    assert!(at("| `zeta` |") < at("## `[section]`"));
    assert!(md.starts_with(
        "## Contents\n\n- [Top-level keys](#top-level-keys)\n- [`[section]`](#section)\n"
    ));
    assert_eq!(
        row(&md, "alpha"),
        "| `alpha` | integer from 0 to 3 | — | First. |"
    );
    assert_eq!(md, render(&nested()).unwrap(), "output is deterministic");
}

#[test]
fn nested_tables_are_subsections_in_depth_first_order() {
    let schema = json!({
        "type": "object",
        "properties": {
            "b": {"type": "object", "properties": {"x": {"description": "X.", "type": "number"}}},
            "a": {"description": "A.", "$ref": "#/$defs/A"}
        },
        "$defs": {"A": {"type": "object", "properties": {
            "inner": {"description": "Inner.", "$ref": "#/$defs/Leafy"},
            "n": {"description": "N.", "type": "number", "exclusiveMinimum": 0, "maximum": 1}
        }}, "Leafy": {"type": "object", "properties": {
            "betas": {"description": "Pair.", "type": "array", "items": {"type": "number"},
                      "minItems": 2, "maxItems": 2}
        }}}
    });
    let md = render(&schema).unwrap();
    let order: Vec<&str> = md.lines().filter(|l| l.starts_with('#')).collect();
    assert_eq!(
        order,
        [
            "## Contents",
            "## Top-level keys",
            "## `[a]`",
            "### `[a.inner]`",
            "## `[b]`"
        ]
    );
    assert!(md.contains("  - [`[a.inner]`](#ainner)\n"));
    assert_eq!(
        row(&md, "a.inner.betas"),
        "| `a.inner.betas` | array of 2 numbers | — | Pair. |"
    );
    assert_eq!(row(&md, "a.n"), "| `a.n` | number > 0, ≤ 1 | — | N. |");
    assert_eq!(row(&md, "b.x"), "| `b.x` | number | — | X. |");
}

#[test]
fn pipes_are_escaped_and_undocumented_keys_are_marked() {
    let schema = json!({"type": "object", "properties": {
        "sep": {"description": "Either a|b.", "enum": ["|", "/", null]},
        "bare": {"type": "string"}
    }});
    let md = render(&schema).unwrap();
    assert_eq!(
        row(&md, "sep"),
        "| `sep` | one of `\"\\|\"`, `\"/\"` | *unset* | Either a\\|b. |"
    );
    assert_eq!(
        row(&md, "bare"),
        "| `bare` | string | — | *(undocumented)* |"
    );
}

#[test]
fn dangling_and_foreign_references_name_the_key() {
    let dangling = json!({"type": "object", "properties": {
        "t": {"type": "object", "properties": {"k": {"$ref": "#/$defs/Missing"}}}
    }});
    let (at, why) = failure(dangling);
    assert_eq!(at, "t.k");
    assert!(why.contains("`#/$defs/Missing` points at nothing"), "{why}");
    let foreign = json!({"type": "object", "properties": {
        "k": {"$ref": "https://example.com/s.json"}
    }});
    assert!(failure(foreign).1.contains("only local references"));
}

#[test]
fn cyclic_references_and_recursive_tables_are_errors_not_overflows() {
    let cycle = json!({"type": "object", "properties": {"k": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}});
    assert!(failure(cycle).1.contains("cycle"));
    let recursive = json!({"type": "object", "properties": {"node": {"$ref": "#/$defs/Node"}},
    "$defs": {"Node": {"type": "object", "properties": {
        "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}
    }}}});
    let (at, why) = failure(recursive);
    assert_eq!(
        (at.as_str(), why.as_str()),
        ("node.child", "the table contains itself")
    );
}

#[test]
fn malformed_schemas_are_errors() {
    assert!(failure(json!({"type": "string"}))
        .1
        .contains("root is not one object"));
    let bad_type = json!({"type": "object", "properties": {"k": {"type": "decimal"}}});
    assert_eq!(
        failure(bad_type),
        ("k".into(), "unknown type `decimal`".into())
    );
    let bad_alias = json!({"type": "object", "properties": {
        "k": {"type": "boolean", "x-aliases": "kk"}
    }});
    assert!(failure(bad_alias).1.contains("`x-aliases` is not a list"));
    let all_of = json!({"type": "object", "properties": {
        "k": {"allOf": [{"type": "integer"}, {"minimum": 1}]}
    }});
    assert!(failure(all_of).1.contains("`allOf`"));
    let not_schema = json!({"type": "object", "properties": {"k": 3}});
    assert!(failure(not_schema).1.contains("not a schema"));
}

#[test]
fn ferrozero_schema_renders_every_section() {
    let md = super::markdown().unwrap();
    for heading in [
        "## `[zero_optimization]`",
        "### `[zero_optimization.offload_optimizer]`",
        "### `[zero_optimization.offload_param]`",
        "## `[optimizer]`",
        "### `[optimizer.params]`",
        "## `[scheduler]`",
        "## `[bf16]`",
        "## `[fp16]`",
        "## `[aio]`",
        "## `[activation_checkpointing]`",
        "## `[comms]`",
    ] {
        assert!(md.contains(&format!("\n{heading}\n")), "{heading} missing");
    }
    assert!(row(&md, "zero_optimization.stage").contains("integer from 0 to 3 | `0`"));
    assert!(!md.contains("(undocumented)"));
}

#[test]
fn large_round_defaults_also_read_in_scientific_notation() {
    let schema = json!({"type": "object", "properties": {
        "bucket": {"description": "B.", "type": "integer", "default": 500_000_000},
        "block": {"description": "K.", "type": "integer", "default": 1_048_576},
        "small": {"description": "S.", "type": "integer", "default": 1000},
        "ratio": {"description": "R.", "type": "number", "default": 1.0}
    }});
    let md = render(&schema).unwrap();
    assert!(row(&md, "bucket").contains("| `500000000` (5e8) |"));
    assert!(row(&md, "block").contains("| `1048576` |"));
    assert!(row(&md, "small").contains("| `1000` |"));
    assert!(row(&md, "ratio").contains("| `1.0` |"));
}

#[test]
fn code_spans_survive_backticks() {
    use super::words::code;
    assert_eq!(code("a"), "`a`");
    assert_eq!(code("a`b"), "``a`b``");
    assert_eq!(code("`x`"), "`` `x` ``");
}
