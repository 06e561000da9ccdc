//! The emulator's GEMM: the documented operation computed on host memory, epilogues included.

use half::{bf16, f16};

use super::{Epilogue, Gemm, Op};
use crate::backend::cuda::driver::DevPtr;
use crate::tensor::DType;

impl Gemm {
    /// The emulator's GEMM: exactly the documented operation on host memory. Each product is a
    /// dot product of op(A)'s row and op(B)'s column accumulated in f64 (so the result does not
    /// depend on summation order) and rounded to f32; then, in f32, `alpha * dot` plus
    /// `beta * C` (C is not read when beta is 0), plus the bias, then GELU (or times GELU's
    /// derivative at aux); rounded once (round-to-nearest-even) into C's type. Bias gradients
    /// are f64 sums (of the inputs, or for DGELU_BGRAD of the f32 results) rounded once. Inputs
    /// in bf16/f16 are widened to f32 exactly.
    ///
    /// # Safety
    /// [`Gemm::validate`] passed, and every range of [`Gemm::ranges`] is valid host memory.
    pub(crate) unsafe fn reference(&self) {
        let (count, sa, sb, sc) = match self.batch {
            Some(b) => (b.count as u64, b.stride_a, b.stride_b, b.stride_c),
            None => (1, 0, 0, 0),
        };
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let (bias, aux) = match self.epilogue {
            Epilogue::Bias { bias } => (Some(bias), None),
            Epilogue::GeluAuxBias { bias, aux, aux_ld } => (Some(bias), Some((aux, aux_ld))),
            _ => (None, None),
        };
        let dgelu = match self.epilogue {
            Epilogue::DGeluBiasGrad {
                aux,
                aux_ld,
                bias_grad,
            } => Some((aux, aux_ld, bias_grad)),
            _ => None,
        };
        // SAFETY (all loads and stores below): the caller guarantees every range is valid.
        let bias: Option<Vec<f32>> = bias.map(|p| {
            (0..m)
                .map(|i| unsafe { load(p, i as u64, self.c_type) })
                .collect()
        });
        for p in 0..count {
            let a = DevPtr(self.a.0 + p * sa * self.a_type.size() as u64);
            let b = DevPtr(self.b.0 + p * sb * self.b_type.size() as u64);
            let c = DevPtr(self.c.0 + p * sc * self.c_type.size() as u64);
            let d = DevPtr(self.d.unwrap_or(self.c).0 + p * sc * self.c_type.size() as u64);
            // op(A) row-major (m x k) and op(B) column-major (k x n) in f32, so every dot
            // product reads two contiguous slices.
            let opa = unsafe { rows_of(a, self.a_type, self.transa == Op::T, self.lda, (m, k)) };
            let opb = unsafe { rows_of(b, self.b_type, self.transb == Op::N, self.ldb, (n, k)) };
            match self.epilogue {
                Epilogue::BiasGradA { bias_grad } => {
                    for i in 0..m {
                        let s: f64 = opa[i * k..(i + 1) * k].iter().map(|&x| f64::from(x)).sum();
                        unsafe { store(bias_grad, i as u64, self.c_type, s as f32) };
                    }
                }
                Epilogue::BiasGradB { bias_grad } => {
                    for j in 0..n {
                        let s: f64 = opb[j * k..(j + 1) * k].iter().map(|&x| f64::from(x)).sum();
                        unsafe { store(bias_grad, j as u64, self.c_type, s as f32) };
                    }
                }
                _ => {}
            }
            // Each column's values before rounding, kept only for DGELU_BGRAD's bias gradient.
            let column = |j: usize| -> Vec<f32> {
                let mut kept = Vec::with_capacity(if dgelu.is_some() { m } else { 0 });
                let bj = &opb[j * k..(j + 1) * k];
                for i in 0..m {
                    let dot = dot_f64(&opa[i * k..(i + 1) * k], bj);
                    let ci = i as u64 + j as u64 * self.ldc;
                    let mut v = self.alpha * (dot as f32);
                    if self.beta != 0.0 {
                        v += self.beta * unsafe { load(c, ci, self.c_type) };
                    }
                    if let Some(bias) = &bias {
                        v += bias[i];
                    }
                    if let Some((aux, aux_ld)) = aux {
                        unsafe { store(aux, i as u64 + j as u64 * aux_ld, self.c_type, v) };
                        v = gelu_tanh(v);
                    }
                    if let Some((aux, aux_ld, _)) = dgelu {
                        v *= gelu_tanh_grad(unsafe {
                            load(aux, i as u64 + j as u64 * aux_ld, self.c_type)
                        });
                        kept.push(v);
                    }
                    unsafe { store(d, ci, self.c_type, v) };
                }
                kept
            };
            // Columns of C are disjoint (ldc >= m), so large products split them across plain
            // scoped threads. Not rayon: the caller holds the emulator's memory lock, and a
            // rayon wait may run another job of the caller's pool that needs the same lock.
            let threads = std::thread::available_parallelism()
                .map_or(1, |t| t.get())
                .min(n);
            let columns: Vec<Vec<f32>> = if m * n * k >= 1 << 18 && threads > 1 {
                let per = n.div_ceil(threads);
                std::thread::scope(|scope| {
                    let parts: Vec<_> = (0..threads)
                        .map(|t| {
                            let column = &column;
                            scope.spawn(move || {
                                (t * per..((t + 1) * per).min(n))
                                    .map(column)
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    parts
                        .into_iter()
                        .flat_map(|p| p.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                        .collect()
                })
            } else {
                (0..n).map(column).collect()
            };
            if let Some((_, _, bias_grad)) = dgelu {
                for i in 0..m {
                    let s: f64 = columns.iter().map(|col| f64::from(col[i])).sum();
                    unsafe { store(bias_grad, i as u64, self.c_type, s as f32) };
                }
            }
        }
    }
}

/// `sum x[l] * y[l]` in f64 over four interleaved partial sums (a fixed order, so the result
/// is reproducible; f32 products are exact in f64).
fn dot_f64(x: &[f32], y: &[f32]) -> f64 {
    let mut acc = [0f64; 4];
    let mut xs = x.chunks_exact(4);
    let mut ys = y.chunks_exact(4);
    for (a, b) in (&mut xs).zip(&mut ys) {
        for l in 0..4 {
            acc[l] += f64::from(a[l]) * f64::from(b[l]);
        }
    }
    let mut tail = 0f64;
    for (&a, &b) in xs.remainder().iter().zip(ys.remainder()) {
        tail += f64::from(a) * f64::from(b);
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + tail
}

/// cuBLASLt's GELU: the tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// The derivative of [`gelu_tanh`] (cuBLASLt's DGELU).
fn gelu_tanh_grad(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const C: f32 = 0.044_715;
    let t = (SQRT_2_OVER_PI * (x + C * x * x * x)).tanh();
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * C * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

/// `rows` rows of `k` values each, in f32, of a column-major matrix at `x` with leading
/// dimension `ld`: its rows, or with `columns` its columns (a transposed op(A), op(B) as
/// stored), so that every dot product reads two contiguous slices.
///
/// # Safety
/// Every element read is valid memory of type `t`.
unsafe fn rows_of(
    x: DevPtr,
    t: DType,
    columns: bool,
    ld: u64,
    (rows, k): (usize, usize),
) -> Vec<f32> {
    let mut out = vec![0f32; rows * k];
    for r in 0..rows {
        for l in 0..k {
            let idx = match columns {
                false => r as u64 + l as u64 * ld,
                true => l as u64 + r as u64 * ld,
            };
            // SAFETY: the caller's contract.
            out[r * k + l] = unsafe { load(x, idx, t) };
        }
    }
    out
}

/// Element `idx` of type `t` at `p`, widened to f32.
///
/// # Safety
/// The element is valid, aligned host memory.
unsafe fn load(p: DevPtr, idx: u64, t: DType) -> f32 {
    let addr = p.0 + idx * t.size() as u64;
    // SAFETY: the caller guarantees the element is valid and aligned.
    unsafe {
        match t {
            DType::F32 => std::ptr::read(addr as *const f32),
            DType::Bf16 => bf16::from_bits(std::ptr::read(addr as *const u16)).to_f32(),
            DType::F16 => f16::from_bits(std::ptr::read(addr as *const u16)).to_f32(),
        }
    }
}

/// Rounds `v` to type `t` (round-to-nearest-even) and stores it as element `idx` at `p`.
///
/// # Safety
/// The element is valid, aligned host memory that nothing else accesses concurrently.
unsafe fn store(p: DevPtr, idx: u64, t: DType, v: f32) {
    let addr = p.0 + idx * t.size() as u64;
    // SAFETY: the caller guarantees the element is valid, aligned and exclusively ours.
    unsafe {
        match t {
            DType::F32 => std::ptr::write(addr as *mut f32, v),
            DType::Bf16 => std::ptr::write(addr as *mut u16, bf16::from_f32(v).to_bits()),
            DType::F16 => std::ptr::write(addr as *mut u16, f16::from_f32(v).to_bits()),
        }
    }
}
