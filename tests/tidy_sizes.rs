//! The size rules, as a test: no Rust file in the workspace over [`MAX_FILE_LINES`] lines and
//! no function in non-test code (`src/` of every crate, `examples/`) over [`MAX_FN_LINES`]
//! lines, except the entries of [`FILES_ALLOWED`] and [`FNS_ALLOWED`], each with its reason. A
//! file or function growing past its limit fails with its path, name and length; an allowance
//! that no longer matches anything over the limit fails too, so the lists only shrink.

use std::path::{Path, PathBuf};

/// Lines a Rust file may have (a module past it splits into a folder).
const MAX_FILE_LINES: usize = 800;

/// Lines a function may span, signature to closing brace.
const MAX_FN_LINES: usize = 120;

/// (file under the workspace root, why it may be longer).
const FILES_ALLOWED: &[(&str, &str)] = &[];

/// (file under the workspace root, function, why it may be longer).
const FNS_ALLOWED: &[(&str, &str, &str)] = &[
    (
        "runtime/src/nn/gradcheck.rs",
        "check_on",
        "not split yet: finite differences over every parameter, one loop",
    ),
    (
        "runtime/src/backend/cuda/driver/gemm/mod.rs",
        "validate",
        "cuBLASLt's refusals one after another, in the order cuBLASLt checks them",
    ),
];

#[test]
fn no_file_over_the_line_limit_outside_the_allowances() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for path in rust_files(root) {
        let rel = relative(root, &path);
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        if lines > MAX_FILE_LINES {
            over.push(rel.clone());
            if !FILES_ALLOWED.iter().any(|(f, _)| *f == rel) {
                panic!("{rel}: {lines} lines, over {MAX_FILE_LINES}: split it by subject");
            }
        }
    }
    for (f, _) in FILES_ALLOWED {
        assert!(
            over.iter().any(|o| o == f),
            "{f} is allowed past {MAX_FILE_LINES} lines but is not: drop it from FILES_ALLOWED"
        );
    }
}

#[test]
fn no_function_over_the_line_limit_outside_the_allowances() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for path in rust_files(root) {
        let rel = relative(root, &path);
        if !is_non_test_code(&rel) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for f in functions(&code_only(&text)) {
            if f.lines <= MAX_FN_LINES {
                continue;
            }
            over.push((rel.clone(), f.name.clone()));
            if !FNS_ALLOWED
                .iter()
                .any(|(p, n, _)| *p == rel && *n == f.name)
            {
                panic!(
                    "{rel}:{}: fn {} spans {} lines, over {MAX_FN_LINES}: split it into named steps",
                    f.line, f.name, f.lines
                );
            }
        }
    }
    for (p, n, _) in FNS_ALLOWED {
        assert!(
            over.iter().any(|(op, on)| op == p && on == n),
            "{p}: fn {n} is allowed past {MAX_FN_LINES} lines but is not: drop it from FNS_ALLOWED"
        );
    }
}

#[test]
fn the_scanner_measures_functions_and_ignores_braces_in_literals_and_comments() {
    let src = "fn a() {\n    let s = \"}}{\";\n    let c = '}';\n    // }\n    /* { */\n    \
               let r = r#\"}\"#;\n}\ntrait T {\n    fn decl(&self);\n    fn body<'a>(&'a self) {}\n}\n\
               pub(crate) unsafe fn b() -> u8 {\n    0\n}\n";
    let fs = functions(&code_only(src));
    let got: Vec<(&str, usize, usize)> = fs
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.lines))
        .collect();
    assert_eq!(got, [("a", 1, 7), ("body", 10, 1), ("b", 12, 3)]);
}

/// Every `.rs` file under `root`, skipping hidden folders and build output: any cargo target
/// directory, whatever its name (`CARGO_TARGET_DIR` may point inside the checkout), is marked
/// by the `CACHEDIR.TAG` cargo writes there.
fn rust_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && !path.join("CACHEDIR.TAG").exists() {
                    dirs.push(path);
                }
            } else if name.ends_with(".rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap().to_string_lossy();
    rel.replace('\\', "/")
}

/// Library and binary sources and examples; not integration tests.
fn is_non_test_code(rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    !parts.contains(&"tests") && (parts.contains(&"src") || parts[0] == "examples")
}

/// One function: its name, the line its signature starts on, and the lines it spans.
struct Function {
    name: String,
    line: usize,
    lines: usize,
}

/// The text with comments and the contents of string and char literals blanked (newlines
/// kept), so that braces count only where they are code.
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    // Blanks `c[from..to]`, keeping its newlines.
    let blank = |out: &mut String, from: usize, to: usize| {
        out.extend(c[from..to.min(c.len())].iter().filter(|&&x| x == '\n'));
    };
    while i < c.len() {
        let ident_before = i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
        let end = if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            (i..c.len()).find(|&j| c[j] == '\n').unwrap_or(c.len())
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            block_comment_end(&c, i)
        } else if c[i] == 'r' && !ident_before && raw_string_start(&c, i).is_some() {
            raw_string_end(&c, i)
        } else if c[i] == '"' {
            string_end(&c, i)
        } else if c[i] == '\'' {
            char_literal_end(&c, i).unwrap_or(i)
        } else {
            i
        };
        if end > i {
            blank(&mut out, i, end);
            out.push(' ');
            i = end;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn block_comment_end(c: &[char], start: usize) -> usize {
    let (mut depth, mut j) = (0, start);
    while j < c.len() {
        if c[j] == '/' && c.get(j + 1) == Some(&'*') {
            depth += 1;
            j += 2;
        } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
            depth -= 1;
            j += 2;
            if depth == 0 {
                return j;
            }
        } else {
            j += 1;
        }
    }
    c.len()
}

/// The number of `#` of a raw string starting at `c[i] == 'r'`, if one does.
fn raw_string_start(c: &[char], i: usize) -> Option<usize> {
    let hashes = c[i + 1..].iter().take_while(|&&x| x == '#').count();
    (c.get(i + 1 + hashes) == Some(&'"')).then_some(hashes)
}

fn raw_string_end(c: &[char], i: usize) -> usize {
    let hashes = raw_string_start(c, i).unwrap();
    let closing: Vec<char> = std::iter::once('"')
        .chain(std::iter::repeat_n('#', hashes))
        .collect();
    let body = i + 2 + hashes;
    (body..c.len())
        .find(|&j| c[j..].starts_with(&closing))
        .map_or(c.len(), |j| j + closing.len())
}

fn string_end(c: &[char], i: usize) -> usize {
    let mut j = i + 1;
    while j < c.len() && c[j] != '"' {
        j += if c[j] == '\\' { 2 } else { 1 };
    }
    j + 1
}

/// The end of a char literal at `c[i] == '\''`; none for a lifetime.
fn char_literal_end(c: &[char], i: usize) -> Option<usize> {
    if c.get(i + 1) == Some(&'\\') {
        return (i + 2..c.len()).find(|&j| c[j] == '\'').map(|j| j + 1);
    }
    (c.get(i + 2) == Some(&'\'')).then_some(i + 3)
}

/// The functions with bodies in code-only text (declarations without a body are skipped).
fn functions(code: &str) -> Vec<Function> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else {
            continue;
        };
        let mut depth = 0i64;
        let mut opened = false;
        'scan: for (j, l) in lines.iter().enumerate().skip(start) {
            for ch in l.chars() {
                match ch {
                    ';' if !opened => break 'scan,
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
                if opened && depth == 0 {
                    out.push(Function {
                        name,
                        line: start + 1,
                        lines: j - start + 1,
                    });
                    break 'scan;
                }
            }
        }
    }
    out
}

/// The name of the function whose signature starts on `line`, if one does.
fn fn_name(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    loop {
        let before = rest;
        for word in [
            "pub ", "const ", "async ", "unsafe ", "default ", "extern  ",
        ] {
            rest = rest.strip_prefix(word).unwrap_or(rest).trim_start();
        }
        if rest.starts_with("pub(") {
            rest = rest[rest.find(')')? + 1..].trim_start();
        }
        if rest == before {
            break;
        }
    }
    let name: String = rest
        .strip_prefix("fn ")?
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
        .collect();
    (!name.is_empty()).then_some(name)
}
