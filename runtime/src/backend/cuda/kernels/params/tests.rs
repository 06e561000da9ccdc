use super::parse::{signatures, Signature};
use super::*;
use crate::backend::cuda::kernels::SOURCES;

/// Compares one parsed signature with the declaration; the error names the kernel and the
/// parameter.
fn compare(file: &str, sig: &Signature) -> std::result::Result<(), String> {
    let k = &sig.name;
    let (params, t) =
        params_of(k).ok_or_else(|| format!("{file}: kernel {k} has no declared parameter list"))?;
    for (i, decl) in params.iter().enumerate() {
        let Some((ty, name)) = sig.params.get(i) else {
            return Err(format!(
                "{file}: kernel {k} lacks declared parameter {i} `{}`",
                decl.name
            ));
        };
        let want = decl.ty.c_name(t);
        if *name != decl.name || *ty != want {
            return Err(format!(
                "{file}: kernel {k} parameter {i} is `{ty} {name}`, declared as `{want} {}`",
                decl.name
            ));
        }
    }
    if let Some((ty, name)) = sig.params.get(params.len()) {
        return Err(format!(
            "{file}: kernel {k} parameter {} `{ty} {name}` is not declared",
            params.len()
        ));
    }
    Ok(())
}

fn compare_code(file: &str, code: &str) -> std::result::Result<(), String> {
    signatures(code).iter().try_for_each(|s| compare(file, s))
}

#[test]
fn every_signature_matches_its_declaration() {
    for src in SOURCES {
        if let Err(e) = compare_code(src.file, src.code) {
            panic!("{e}");
        }
    }
}

#[test]
fn every_declaration_has_a_kernel() {
    let all: Vec<String> = SOURCES
        .iter()
        .flat_map(|s| signatures(s.code))
        .map(|s| s.name)
        .collect();
    for f in TABLE {
        let names: Vec<String> = if f.per_dtype {
            SUFFIXES
                .iter()
                .map(|(s, _)| format!("{}{s}", f.name))
                .collect()
        } else {
            vec![f.name.to_string()]
        };
        for n in names {
            assert!(all.contains(&n), "declared kernel {n} is in no .cu file");
        }
    }
}

/// A real signature, then the same with one change: each change must fail naming the kernel
/// and the parameter.
const GELU: &str = "extern \"C\" __global__ void gelu_backward_bf16(const bf16_t* x,\n\
                    const bf16_t *dy, bf16_t* dx, long long n) {}";

fn mutated(from: &str, to: &str) -> String {
    let e = compare_code("elementwise.cu", &GELU.replacen(from, to, 1)).unwrap_err();
    assert!(e.contains("gelu_backward_bf16"), "{e}");
    e
}

#[test]
fn a_changed_type_fails_naming_kernel_and_parameter() {
    compare_code("elementwise.cu", GELU).unwrap();
    let e = mutated("long long n", "int n");
    assert!(
        e.contains("parameter 3 is `int n`, declared as `long long n`"),
        "{e}"
    );
    let e = mutated("const bf16_t *dy", "const float* dy");
    assert!(
        e.contains("`const float* dy`, declared as `const bf16_t* dy`"),
        "{e}"
    );
    let e = mutated("bf16_t* dx", "const bf16_t* dx");
    assert!(e.contains("parameter 2 is `const bf16_t* dx`"), "{e}");
}

#[test]
fn a_reordered_parameter_fails_naming_it() {
    let e = mutated(
        "const bf16_t* x,\nconst bf16_t *dy",
        "const bf16_t* dy, const bf16_t* x",
    );
    assert!(
        e.contains("parameter 0 is `const bf16_t* dy`, declared as `const bf16_t* x`"),
        "{e}"
    );
}

#[test]
fn an_added_or_removed_parameter_fails_naming_it() {
    let e = mutated("long long n)", "long long n, float s)");
    assert!(e.contains("parameter 4 `float s` is not declared"), "{e}");
    let e = mutated(", long long n)", ")");
    assert!(e.contains("lacks declared parameter 3 `n`"), "{e}");
}

#[test]
fn macro_parameter_lists_are_expanded() {
    let code = "#define FZ_P \\\n  const OptTensor *t, int ntensors\n\
                extern \"C\" __global__ void k(FZ_P) {}";
    let s = signatures(code);
    let want = [("const OptTensor*", "t"), ("int", "ntensors")];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(s[0].params, want);
}

#[test]
fn launches_are_checked_against_the_declaration() {
    use ArgKind::{Float, LongLong, Ptr};
    check_launch("gelu_forward_f16", &[Ptr, Ptr, LongLong]).unwrap();
    let e = check_launch("gelu_forward_f16", &[Ptr, Ptr, Float]).unwrap_err();
    assert!(
        e.contains("gelu_forward_f16: argument 2 for parameter `n` (long long)"),
        "{e}"
    );
    let e = check_launch("gelu_forward_f16", &[Ptr]).unwrap_err();
    assert!(
        e.contains("takes 3 arguments, the launch passes 1 (the first missing is `y`)"),
        "{e}"
    );
    let e = check_launch("gelu_forward_f64", &[Ptr]).unwrap_err();
    assert!(
        e.contains("gelu_forward_f64 has no declared parameter list"),
        "{e}"
    );
}

#[test]
fn the_optimizer_descriptor_is_64_bytes() {
    assert_eq!(std::mem::size_of::<OptTensor>(), 64);
}
