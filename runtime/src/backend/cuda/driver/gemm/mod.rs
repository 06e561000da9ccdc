//! One cuBLASLt matmul in cuBLASLt's own terms and the one validation both drivers apply; the
//! emulator's reference implementation is in `reference.rs`.
//!
//! cuBLASLt is column-major: element `(i, j)` of a matrix with leading dimension `ld` lives at
//! element offset `i + j * ld`. It computes
//!
//! ```text
//! D = epilogue(alpha * op(A) · op(B) + beta * C)       op(A): m x k, op(B): k x n, C, D: m x n
//! ```
//!
//! with `op(X) = X` for [`Op::N`] and `X^T` for [`Op::T`], so A is stored `m x k` (N) or `k x m`
//! (T), B `k x n` (N) or `n x k` (T). Here D is C (in place) unless [`Gemm::d`] puts it elsewhere. A row-major matrix `R[r, c]` is the
//! column-major matrix `R^T` (`c x r`, leading dimension `c`), so the row-major product
//! `Y[M, N] = X[M, K] · W[N, K]^T` (a linear layer) is the column-major `Y^T = W^T^T · X^T`:
//! `m = N, n = M, k = K`, A = W with [`Op::T`] and `lda = K`, B = X with [`Op::N`] and
//! `ldb = K`, C = Y with `ldc = N`.

pub(crate) mod plan;
mod reference;

use super::DevPtr;
use crate::tensor::DType;
use crate::{Error, Result};

/// Whether cuBLASLt uses an operand as stored or transposed (`CUBLAS_OP_N` / `CUBLAS_OP_T`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

/// Strided batching: `count` independent products, operand `p` of each at its base pointer plus
/// `p * stride` elements (`CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT` and
/// `CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET`). A stride of 0 shares an input across the
/// batch; C's stride must keep the outputs apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Batch {
    /// Number of products (at least 1).
    pub count: u32,
    /// Elements between consecutive A matrices.
    pub stride_a: u64,
    /// Elements between consecutive B matrices.
    pub stride_b: u64,
    /// Elements between consecutive C (= D) matrices.
    pub stride_c: u64,
}

/// What cuBLASLt does to each result before storing it (`CUBLASLT_MATMUL_DESC_EPILOGUE`).
/// Vectors (bias, bias gradient, aux) have C's element type (cuBLASLt's default
/// `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` and `..._EPILOGUE_AUX_DATA_TYPE`, which are never set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `CUBLASLT_EPILOGUE_DEFAULT`: `D = alpha * op(A) op(B) + beta * C`.
    None,
    /// `CUBLASLT_EPILOGUE_BIAS`: adds `bias[i]` (length m) to every column of the result before
    /// it is stored. Shared by every product of a batch.
    Bias {
        /// The bias vector, m elements of C's type.
        bias: DevPtr,
    },
    /// `CUBLASLT_EPILOGUE_GELU_AUX_BIAS`: `pre = alpha * op(A) op(B) + beta * C + bias`, then
    /// `aux = pre` (the GELU input, kept for backward) and `D = gelu_tanh(pre)`. Not batched.
    GeluAuxBias {
        /// The bias vector, m elements of C's type.
        bias: DevPtr,
        /// The pre-activation output: an m x n column-major matrix of C's type, 16-byte aligned.
        aux: DevPtr,
        /// Its leading dimension: at least m and a multiple of 8 (cuBLASLt's rule).
        aux_ld: u64,
    },
    /// `CUBLASLT_EPILOGUE_BGRADA`: also writes (overwrites) `bias_grad[i] = sum over k of
    /// op(A)[i, l]` (length m). Only with `transa = N`, `alpha = 1` and no batch.
    BiasGradA {
        /// The bias-gradient output, m elements of C's type.
        bias_grad: DevPtr,
    },
    /// `CUBLASLT_EPILOGUE_BGRADB`: also writes (overwrites) `bias_grad[j] = sum over k of
    /// op(B)[l, j]` (length n). Only with `transb = T`, `alpha = 1` and no batch: the weight
    /// gradient `dW^T = X^T · dY` of a linear layer with the output gradient as B, where the sum
    /// is the bias gradient.
    BiasGradB {
        /// The bias-gradient output, n elements of C's type.
        bias_grad: DevPtr,
    },
    /// `CUBLASLT_EPILOGUE_DGELU_BGRAD`: the backward of [`Epilogue::GeluAuxBias`] through the
    /// next layer: `D = (alpha * op(A) op(B)) * gelu_tanh'(aux)` with `aux` the saved
    /// pre-activation, and also writes (overwrites) `bias_grad[i] = sum over j of D[i, j]`
    /// (length m; the sum of the unrounded products, rounded once), the gradient of the bias
    /// that produced `aux`. Only with `alpha = 1`, `beta = 0` and no batch.
    DGeluBiasGrad {
        /// The pre-activation saved by the forward GELU: an m x n column-major matrix of C's
        /// type, 16-byte aligned.
        aux: DevPtr,
        /// Its leading dimension: at least m and a multiple of 8 (cuBLASLt's rule).
        aux_ld: u64,
        /// The bias-gradient output, m elements of C's type.
        bias_grad: DevPtr,
    },
}

impl Epilogue {
    /// cuBLASLt's name for it.
    pub fn cublas_name(&self) -> &'static str {
        match self {
            Epilogue::None => "CUBLASLT_EPILOGUE_DEFAULT",
            Epilogue::Bias { .. } => "CUBLASLT_EPILOGUE_BIAS",
            Epilogue::GeluAuxBias { .. } => "CUBLASLT_EPILOGUE_GELU_AUX_BIAS",
            Epilogue::BiasGradA { .. } => "CUBLASLT_EPILOGUE_BGRADA",
            Epilogue::BiasGradB { .. } => "CUBLASLT_EPILOGUE_BGRADB",
            Epilogue::DGeluBiasGrad { .. } => "CUBLASLT_EPILOGUE_DGELU_BGRAD",
        }
    }
}

/// One cuBLASLt matmul, `C = epilogue(alpha * op(A) · op(B) + beta * C)`, in cuBLASLt's terms
/// (column-major; see the module documentation for the row-major translation).
///
/// Always computed with `CUBLAS_COMPUTE_32F` and f32 scale type: f32 accumulation, never TF32
/// (not even for f32 inputs). Supported types: A and B the same type, C either that type or
/// f32 (f32/f32/f32, bf16/bf16/bf16, bf16/bf16/f32, f16/f16/f16, f16/f16/f32). `beta = 0`
/// overwrites C without reading it (NaN in C does not propagate); `beta = 1` accumulates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// How A is used.
    pub transa: Op,
    /// How B is used.
    pub transb: Op,
    /// Rows of op(A) and of C.
    pub m: u64,
    /// Columns of op(B) and of C.
    pub n: u64,
    /// Columns of op(A), rows of op(B).
    pub k: u64,
    /// A's first element.
    pub a: DevPtr,
    /// A's leading dimension (elements between columns; at least its stored row count).
    pub lda: u64,
    /// A's element type.
    pub a_type: DType,
    /// B's first element.
    pub b: DevPtr,
    /// B's leading dimension.
    pub ldb: u64,
    /// B's element type (must equal A's).
    pub b_type: DType,
    /// C's first element (and D's, unless `d` is set).
    pub c: DevPtr,
    /// C's leading dimension (at least m).
    pub ldc: u64,
    /// C's element type (A's type or f32).
    pub c_type: DType,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C's old value: 0 overwrites, 1 accumulates.
    pub beta: f32,
    /// Strided batch, or `None` for one product.
    pub batch: Option<Batch>,
    /// What happens to each result before it is stored.
    pub epilogue: Epilogue,
    /// D's first element when the result goes out of place (cuBLASLt's D pointer, with C's
    /// layout and type; C is then only read, with `beta`); `None` writes C in place.
    pub d: Option<DevPtr>,
}

/// One memory range a GEMM reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    /// Which operand (`A`, `B`, `C`, `bias`, `aux`, `bias_grad`).
    pub what: &'static str,
    /// First byte.
    pub start: u64,
    /// Bytes from the first to one past the last element touched.
    pub bytes: u64,
    /// Whether the GEMM writes it.
    pub written: bool,
}

fn dname(t: DType) -> &'static str {
    match t {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
    }
}

/// Elements from a matrix's first element to one past its last, over a batch.
fn extent(rows: u64, cols: u64, ld: u64, count: u64, stride: u64) -> Option<u64> {
    let one = (cols - 1).checked_mul(ld)?.checked_add(rows)?;
    (count - 1).checked_mul(stride)?.checked_add(one)
}

impl Gemm {
    /// A plain product `C = op(A) · op(B)` of one element type with the given leading
    /// dimensions (alpha 1, beta 0, no batch, no epilogue); set fields for anything else.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        transa: Op,
        transb: Op,
        m: u64,
        n: u64,
        k: u64,
        a: DevPtr,
        lda: u64,
        b: DevPtr,
        ldb: u64,
        c: DevPtr,
        ldc: u64,
        dtype: DType,
    ) -> Self {
        Gemm {
            transa,
            transb,
            m,
            n,
            k,
            a,
            lda,
            a_type: dtype,
            b,
            ldb,
            b_type: dtype,
            c,
            ldc,
            c_type: dtype,
            alpha: 1.0,
            beta: 0.0,
            batch: None,
            epilogue: Epilogue::None,
            d: None,
        }
    }

    /// Rows and columns of A as stored.
    pub fn a_shape(&self) -> (u64, u64) {
        match self.transa {
            Op::N => (self.m, self.k),
            Op::T => (self.k, self.m),
        }
    }

    /// Rows and columns of B as stored.
    pub fn b_shape(&self) -> (u64, u64) {
        match self.transb {
            Op::N => (self.k, self.n),
            Op::T => (self.n, self.k),
        }
    }

    /// The number of products (1 without a batch).
    pub fn batch_count(&self) -> u32 {
        self.batch.map_or(1, |b| b.count)
    }

    /// A one-line description for error messages.
    pub fn describe(&self) -> String {
        let op = |o: Op| if o == Op::N { "N" } else { "T" };
        format!(
            "gemm {}{} m={} n={} k={} A {} lda={} B {} ldb={} C {} ldc={} alpha={} beta={}{} {}",
            op(self.transa),
            op(self.transb),
            self.m,
            self.n,
            self.k,
            dname(self.a_type),
            self.lda,
            dname(self.b_type),
            self.ldb,
            dname(self.c_type),
            self.ldc,
            self.alpha,
            self.beta,
            match self.batch {
                Some(b) => format!(
                    " batch {} (strides {}, {}, {})",
                    b.count, b.stride_a, b.stride_b, b.stride_c
                ),
                None => String::new(),
            },
            self.epilogue.cublas_name(),
        )
    }

    fn invalid(&self, why: impl std::fmt::Display) -> Error {
        Error::Invalid(format!("{}: {why}", self.describe()))
    }

    /// Every memory range the GEMM touches (A, B, C and the epilogue's vectors), from its
    /// dimensions, leading dimensions, transposes and batch; fails on arithmetic overflow.
    pub(crate) fn ranges(&self) -> Result<Vec<Range>> {
        let (count, sa, sb, sc) = match self.batch {
            Some(b) => (
                u64::from(b.count.max(1)),
                b.stride_a,
                b.stride_b,
                b.stride_c,
            ),
            None => (1, 0, 0, 0),
        };
        let overflow = || self.invalid("operand extent overflows 64 bits");
        let bytes = |elems: u64, t: DType| elems.checked_mul(t.size() as u64).ok_or_else(overflow);
        let (ar, ac) = self.a_shape();
        let (br, bc) = self.b_shape();
        let a = extent(ar, ac, self.lda, count, sa).ok_or_else(overflow)?;
        let b = extent(br, bc, self.ldb, count, sb).ok_or_else(overflow)?;
        let c = extent(self.m, self.n, self.ldc, count, sc).ok_or_else(overflow)?;
        let mut out = vec![
            Range {
                what: "A",
                start: self.a.0,
                bytes: bytes(a, self.a_type)?,
                written: false,
            },
            Range {
                what: "B",
                start: self.b.0,
                bytes: bytes(b, self.b_type)?,
                written: false,
            },
            Range {
                what: "C",
                start: self.c.0,
                bytes: bytes(c, self.c_type)?,
                written: self.d.is_none(),
            },
        ];
        if let Some(d) = self.d {
            out.push(Range {
                what: "D",
                start: d.0,
                bytes: bytes(c, self.c_type)?,
                written: true,
            });
        }
        let vec_bytes = |len: u64| bytes(len, self.c_type);
        match self.epilogue {
            Epilogue::None => {}
            Epilogue::Bias { bias } => out.push(Range {
                what: "bias",
                start: bias.0,
                bytes: vec_bytes(self.m)?,
                written: false,
            }),
            Epilogue::GeluAuxBias { bias, aux, aux_ld } => {
                out.push(Range {
                    what: "bias",
                    start: bias.0,
                    bytes: vec_bytes(self.m)?,
                    written: false,
                });
                let e = extent(self.m, self.n, aux_ld, 1, 0).ok_or_else(overflow)?;
                out.push(Range {
                    what: "aux",
                    start: aux.0,
                    bytes: vec_bytes(e)?,
                    written: true,
                });
            }
            Epilogue::BiasGradA { bias_grad } => out.push(Range {
                what: "bias_grad",
                start: bias_grad.0,
                bytes: vec_bytes(self.m)?,
                written: true,
            }),
            Epilogue::BiasGradB { bias_grad } => out.push(Range {
                what: "bias_grad",
                start: bias_grad.0,
                bytes: vec_bytes(self.n)?,
                written: true,
            }),
            Epilogue::DGeluBiasGrad {
                aux,
                aux_ld,
                bias_grad,
            } => {
                let e = extent(self.m, self.n, aux_ld, 1, 0).ok_or_else(overflow)?;
                out.push(Range {
                    what: "aux",
                    start: aux.0,
                    bytes: vec_bytes(e)?,
                    written: false,
                });
                out.push(Range {
                    what: "bias_grad",
                    start: bias_grad.0,
                    bytes: vec_bytes(self.m)?,
                    written: true,
                });
            }
        }
        for r in &out {
            r.start.checked_add(r.bytes).ok_or_else(overflow)?;
        }
        Ok(out)
    }

    /// The rules of an epilogue with an aux matrix: no batch, and cuBLASLt's leading
    /// dimension for it.
    fn check_aux(&self, which: &str, aux_ld: u64) -> Result<()> {
        if self.batch_count() > 1 {
            return Err(self.invalid(format!("the {which} epilogue is not batched here")));
        }
        if aux_ld < self.m || !aux_ld.is_multiple_of(8) {
            return Err(self.invalid(format!(
                "the aux leading dimension {aux_ld} must be at least m = {} and a multiple of \
                 8 (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)",
                self.m
            )));
        }
        Ok(())
    }

    /// Checks everything cuBLASLt would reject (or silently get wrong) before any device work,
    /// identically for both drivers: dimensions, leading dimensions, type combinations,
    /// alignment, batch strides, the epilogue's layout rules, and outputs overlapping inputs.
    pub fn validate(&self) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return Err(self.invalid("m, n and k must all be at least 1"));
        }
        let limit = i64::MAX as u64;
        if [self.m, self.n, self.k, self.lda, self.ldb, self.ldc]
            .iter()
            .any(|&v| v > limit)
        {
            return Err(self.invalid("dimensions must fit in int64"));
        }
        if self.a_type != self.b_type {
            return Err(self.invalid(
                "A and B must have the same type (cuBLASLt has no mixed-input f32-compute GEMM)",
            ));
        }
        if self.c_type != self.a_type && self.c_type != DType::F32 {
            return Err(self.invalid(format!(
                "C must be {} or f32 for {} inputs",
                dname(self.a_type),
                dname(self.a_type)
            )));
        }
        let (ar, _) = self.a_shape();
        let (br, _) = self.b_shape();
        if self.lda < ar {
            return Err(self.invalid(format!(
                "lda {} is less than A's stored rows {ar} (column-major: {} for op N, k for op T)",
                self.lda,
                if self.transa == Op::N { "m" } else { "k" }
            )));
        }
        if self.ldb < br {
            return Err(self.invalid(format!(
                "ldb {} is less than B's stored rows {br} (column-major: k for op N, n for op T)",
                self.ldb
            )));
        }
        if self.ldc < self.m {
            return Err(self.invalid(format!("ldc {} is less than m {}", self.ldc, self.m)));
        }
        if let Some(b) = self.batch {
            if b.count == 0 {
                return Err(self.invalid("a batch must hold at least one product"));
            }
            let span = self.ldc.saturating_mul(self.n - 1).saturating_add(self.m);
            if b.count > 1 && b.stride_c < span {
                return Err(self.invalid(format!(
                    "C's batch stride {} makes the outputs of consecutive products overlap \
                     (each spans {span} elements)",
                    b.stride_c
                )));
            }
        }
        let batched = self.batch_count() > 1;
        match self.epilogue {
            Epilogue::None | Epilogue::Bias { .. } => {}
            Epilogue::GeluAuxBias { aux_ld, .. } => self.check_aux("GELU_AUX_BIAS", aux_ld)?,
            Epilogue::DGeluBiasGrad { aux_ld, .. } => {
                self.check_aux("DGELU_BGRAD", aux_ld)?;
                if self.alpha != 1.0 || self.beta != 0.0 {
                    return Err(self.invalid(
                        "the DGELU_BGRAD epilogue requires alpha = 1 and beta = 0 (its output \
                         and bias gradient are the gradient of the product alone)",
                    ));
                }
            }
            Epilogue::BiasGradA { .. } | Epilogue::BiasGradB { .. } => {
                let (which, op, need) = match self.epilogue {
                    Epilogue::BiasGradA { .. } => ("BGRADA", self.transa, Op::N),
                    _ => ("BGRADB", self.transb, Op::T),
                };
                if op != need {
                    return Err(self.invalid(format!(
                        "the {which} epilogue is supported only with trans{} = {need:?} (the \
                         reduced operand stored with k as its column index)",
                        if which == "BGRADA" { "a" } else { "b" }
                    )));
                }
                if batched {
                    return Err(self.invalid(format!("the {which} epilogue is not batched here")));
                }
                if self.alpha != 1.0 {
                    return Err(self.invalid(format!(
                        "the {which} epilogue requires alpha = 1 (the bias gradient is the \
                         unscaled sum)"
                    )));
                }
            }
        }
        let ranges = self.ranges()?;
        for r in &ranges {
            let elem = match r.what {
                "A" => self.a_type.size(),
                "B" => self.b_type.size(),
                _ => self.c_type.size(),
            } as u64;
            if r.start == 0 {
                return Err(self.invalid(format!("{} is a null pointer", r.what)));
            }
            if r.start % elem != 0 {
                return Err(self.invalid(format!(
                    "{} at {:#x} is not aligned to its {elem}-byte elements",
                    r.what, r.start
                )));
            }
        }
        if let Epilogue::GeluAuxBias { aux, .. } | Epilogue::DGeluBiasGrad { aux, .. } =
            self.epilogue
        {
            if aux.0 % 16 != 0 {
                return Err(self.invalid(format!(
                    "aux at {aux} must be 16-byte aligned (cuBLASLt stores it in 16-byte vectors, \
                     hence its leading dimension in multiples of 8)"
                )));
            }
        }
        for w in ranges.iter().filter(|r| r.written) {
            for o in ranges.iter().filter(|o| o.what != w.what) {
                let disjoint = w.start + w.bytes <= o.start || o.start + o.bytes <= w.start;
                if !disjoint {
                    return Err(self.invalid(format!(
                        "output {} [{:#x}, +{}) overlaps {} [{:#x}, +{}) (cuBLASLt's result \
                         would be undefined)",
                        w.what, w.start, w.bytes, o.what, o.start, o.bytes
                    )));
                }
            }
        }
        Ok(())
    }
}
