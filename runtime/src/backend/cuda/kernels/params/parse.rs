//! Reading `extern "C" __global__` signatures out of CUDA C source (tests only): enough C to
//! read ferrozero's own kernels, whose parameter lists are plain or one object-like macro.

use std::collections::HashMap;

/// One kernel signature as written: its name and its parameters' (C type, name) pairs, the type
/// with whitespace collapsed and `*` attached to it (`const float*`).
#[derive(Debug, PartialEq, Eq)]
pub struct Signature {
    /// The kernel's name.
    pub name: String,
    /// (type, name) per parameter, in order.
    pub params: Vec<(String, String)>,
}

/// The code without comments, so a kernel named in prose is not taken for a definition.
pub fn strip_comments(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// Object-like `#define NAME body` macros (continuation lines joined).
fn defines(code: &str) -> HashMap<String, String> {
    let joined = code.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("#define"))
        .map(|l| {
            let l = l.trim_start();
            let end = l
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(l.len());
            (l[..end].to_string(), l[end..].trim().to_string())
        })
        .collect()
}

/// One parameter declaration (`const float *x`) as (type, name).
fn param(decl: &str) -> (String, String) {
    let decl = decl.split_whitespace().collect::<Vec<_>>().join(" ");
    let split = decl
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let ty = decl[..split].trim().replace(" *", "*");
    (ty, decl[split..].to_string())
}

/// Every `extern "C" __global__` signature in `code`, in order (a `__launch_bounds__(...)`
/// between the qualifiers and the name is skipped; a parameter list that is one macro name is
/// expanded).
pub fn signatures(code: &str) -> Vec<Signature> {
    let code = strip_comments(code);
    let macros = defines(&code);
    let marker = "extern \"C\" __global__";
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find(marker) {
        rest = &rest[i + marker.len()..];
        let mut decl = rest.trim_start();
        if let Some(r) = decl.strip_prefix("__launch_bounds__") {
            decl = r.find(')').map_or("", |j| &r[j + 1..]).trim_start();
        }
        let decl = decl.strip_prefix("void").unwrap_or(decl).trim_start();
        let name: String = decl
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let list = decl
            .find('(')
            .and_then(|a| decl[a + 1..].find(')').map(|b| &decl[a + 1..a + 1 + b]))
            .unwrap_or("")
            .trim();
        let list = macros.get(list).map_or(list, String::as_str);
        let params = list
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(param)
            .collect();
        out.push(Signature { name, params });
    }
    out
}
