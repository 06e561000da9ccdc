//! Every field of the resolved configuration (`ResolvedConfig` and the types it holds, enum
//! variants' fields included) must be read somewhere in the runtime, or be listed below with
//! the reason it is not: a key the validator accepts either changes behaviour or says that it
//! is ignored (`zero_hpz_partition_size` was once resolved and never used, and nothing noticed).
//!
//! "Read" is judged from the source: a field access `.name` that is not an assignment, or a
//! shorthand pattern `name,` / `name }` (match arms destructuring a variant). Struct literals
//! (`name: value`) are writes and do not count.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Fields deliberately not read by the runtime, with the reason. Keep this list short.
const NOT_READ: &[(&str, &str)] = &[];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Field names declared in `resolved.rs`: `pub name: T` in structs, `name: T` in variants.
fn resolved_fields(src: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in src.lines() {
        let t = line.trim_start();
        if t.starts_with("//") || !line.starts_with("    ") {
            continue;
        }
        let t = t.strip_prefix("pub ").unwrap_or(t);
        let Some((name, rest)) = t.split_once(": ") else {
            continue;
        };
        if !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && rest.trim_end().ends_with(',')
        {
            out.insert(name.to_string());
        }
    }
    out
}

/// Whether `code` reads `field` (see the module documentation).
fn reads(code: &str, field: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = code[from..].find(field) {
        let at = from + i;
        let end = at + field.len();
        from = end;
        let before = code[..at].chars().next_back();
        let after = code[end..].chars().next();
        if before.is_some_and(ident) || after.is_some_and(ident) {
            continue;
        }
        let rest = code[end..].trim_start();
        if before == Some('.') {
            let assignment =
                rest.starts_with('=') && !rest.starts_with("==") && !rest.starts_with("=>");
            if !assignment {
                return true;
            }
        } else if rest.starts_with(',') || rest.starts_with('}') {
            return true;
        }
    }
    false
}

#[test]
fn every_resolved_field_is_read_by_the_runtime_or_listed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let resolved = std::fs::read_to_string(root.join("config-schema/src/resolved.rs")).unwrap();
    let fields = resolved_fields(&resolved);
    for must in [
        "sub_group_size",
        "max_live_parameters",
        "pin_memory_fallback",
        "reduction",
    ] {
        assert!(
            fields.contains(must),
            "field scan missed `{must}`: {fields:?}"
        );
    }
    let mut files = Vec::new();
    rust_files(&root.join("runtime/src"), &mut files);
    let code: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let unread: Vec<&String> = fields
        .iter()
        .filter(|f| !NOT_READ.iter().any(|(n, _)| n == f))
        .filter(|f| !reads(&code, f))
        .collect();
    assert!(
        unread.is_empty(),
        "resolved config fields the runtime never reads: {unread:?}; act on them, or refuse or \
         warn about the key in config-schema and drop the field, or list it in NOT_READ with \
         the reason"
    );
    // The exceptions must still be exceptions (and exist).
    for (name, _) in NOT_READ {
        assert!(
            fields.contains(*name),
            "NOT_READ lists unknown field `{name}`"
        );
        assert!(
            !reads(&code, name),
            "`{name}` is read now: drop it from NOT_READ"
        );
    }
}

#[test]
fn the_read_check_tells_reads_from_writes() {
    assert!(reads(
        "let t = cfg.zero.sub_group_size.max(1);",
        "sub_group_size"
    ));
    assert!(reads("Adam { lr, betas, .. } => x", "betas"));
    assert!(reads("match c { Foo { lr } => 1 }", "lr"));
    assert!(!reads("cfg.zero.sub_group_size = 3;", "sub_group_size"));
    assert!(!reads("Offload { pin_memory: false, .. }", "pin_memory"));
    assert!(!reads(
        "let hpz_partition_size_x = 1; x.hpz_partition_sizes",
        "hpz_partition_size"
    ));
    assert!(reads("if a.b == c.ratio == d {}", "ratio"));
    // A match guard's field ends at `=>`: a read, not an assignment.
    assert!(reads(
        "Some(a) if a.cpu_checkpointing => Host,",
        "cpu_checkpointing"
    ));
}
