//! cuBLASLt for the real driver: the handle, a workspace per stream, the heuristic's algorithm
//! cached per shape, and one [`Gemm`] run as layouts, a matmul descriptor (transposes and the
//! epilogue), the algorithm and the call.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{result as cu, CudaContext};

use super::gemm::{Epilogue, Gemm, Op};
use super::real::{cu_err, driver_words};
use super::{DevPtr, StreamKind};
use crate::tensor::DType;
use crate::{Error, Result};

/// cuBLASLt's workspace per stream: NVIDIA's recommendation for Hopper (32 MiB), used on every
/// architecture.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt's name and message for a status.
fn blas_words(e: lt::CublasError) -> String {
    // SAFETY: both return static NUL-terminated strings for every status.
    let (name, msg) = unsafe {
        (
            ltsys::cublasLtGetStatusName(e.0),
            ltsys::cublasLtGetStatusString(e.0),
        )
    };
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (s(name), s(msg)) {
        (Some(n), Some(m)) => format!("{n}: {m}"),
        (Some(n), None) => n,
        _ => format!("{:?}", e.0),
    }
}

fn blas_err(op: &str, e: lt::CublasError, g: &Gemm) -> Error {
    Error::Device {
        op: op.into(),
        detail: format!("{} for {}", blas_words(e), g.describe()),
    }
}

/// What decides cuBLASLt's algorithm choice: everything but the scalars and the addresses
/// (whose alignments are part of it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct GemmKey {
    ops: (Op, Op),
    mnk: (u64, u64, u64),
    lds: (u64, u64, u64),
    types: (DType, DType),
    batch: Option<(u32, u64, u64, u64)>,
    epilogue: u32,
    aux_ld: u64,
    align: [u32; 5],
}

/// cuBLASLt's state: the handle, per-stream workspaces and the algorithm cache.
pub(super) struct Blas {
    handle: ltsys::cublasLtHandle_t,
    state: Mutex<BlasState>,
    pub(super) version: (u32, u32, u32),
}

#[derive(Default)]
struct BlasState {
    /// Workspace per stream (0: not yet allocated).
    workspaces: [u64; 3],
    algos: HashMap<GemmKey, ltsys::cublasLtMatmulAlgo_t>,
}

/// The largest power of two (up to 256) dividing an address: what cuBLASLt's heuristic may
/// assume about it (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, whose default, 256, would let
/// it pick kernels that fail on a less aligned view).
fn alignment(p: u64) -> u32 {
    1 << p.trailing_zeros().min(8)
}

fn cuda_type(t: DType) -> ltsys::cudaDataType {
    match t {
        DType::F32 => ltsys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => ltsys::cudaDataType::CUDA_R_16BF,
        DType::F16 => ltsys::cudaDataType::CUDA_R_16F,
    }
}

/// Descriptors destroyed on drop, however a GEMM ends.
struct LayoutGuard(ltsys::cublasLtMatrixLayout_t);
impl Drop for LayoutGuard {
    fn drop(&mut self) {
        // SAFETY: created once and destroyed exactly once, here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct DescGuard(ltsys::cublasLtMatmulDesc_t);
impl Drop for DescGuard {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct PrefGuard(ltsys::cublasLtMatmulPreference_t);
impl Drop for PrefGuard {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

impl Blas {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> std::result::Result<Blas, String> {
        // SAFETY: only tries to open the library (cudarc panics on calls without it).
        if !unsafe { ltsys::is_culib_present() } {
            return Err(
                "cuBLASLt (libcublasLt.so) could not be loaded; put the directory \
                        holding it on LD_LIBRARY_PATH"
                    .into(),
            );
        }
        ctx.bind_to_thread().map_err(driver_words)?;
        let handle =
            lt::create_handle().map_err(|e| format!("cublasLtCreate: {}", blas_words(e)))?;
        // SAFETY: no preconditions.
        let v = unsafe { ltsys::cublasLtGetVersion() } as u32;
        Ok(Blas {
            handle,
            state: Mutex::new(BlasState::default()),
            version: (v / 10000, (v / 100) % 100, v % 100),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `Blas::new` and destroyed exactly once, here; the driver freed the
        // workspaces and the context outlives this field.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A matmul descriptor and what its epilogue reads: the bias (or bias-gradient) pointer and the
/// GELU auxiliary buffer with its leading dimension.
struct Desc {
    desc: DescGuard,
    epilogue: ltsys::cublasLtEpilogue_t,
    bias: Option<DevPtr>,
    aux: Option<(DevPtr, u64)>,
}

impl Blas {
    /// Runs `g` (already validated and range-checked) on `stream`, the driver's stream `s`.
    pub(super) fn run(&self, g: &Gemm, s: StreamKind, stream: ltsys::cudaStream_t) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let ws = workspace(&mut st, s)?;
        let a_layout = layout(g, g.a_type, g.a_shape(), g.lda, g.batch.map(|b| b.stride_a))?;
        let b_layout = layout(g, g.b_type, g.b_shape(), g.ldb, g.batch.map(|b| b.stride_b))?;
        let c_layout = layout(g, g.c_type, (g.m, g.n), g.ldc, g.batch.map(|b| b.stride_c))?;
        let d = describe(g)?;
        let key = GemmKey::of(g, &d);
        let algo = match st.algos.get(&key) {
            Some(a) => *a,
            None => {
                let layouts = [&a_layout, &b_layout, &c_layout];
                let algo = self.choose(g, &key, &d, layouts)?;
                st.algos.insert(key, algo);
                algo
            }
        };
        let (alpha, beta) = (g.alpha, g.beta);
        let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
        // SAFETY: descriptors, handle and workspace are live; every operand range was checked
        // against live allocations; alpha and beta are host f32 (the default pointer mode and
        // the f32 scale type); D is C, or out of place, with C's layout.
        unsafe {
            lt::matmul(
                self.handle,
                d.desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.a.0 as *const c_void,
                a_layout.0,
                g.b.0 as *const c_void,
                b_layout.0,
                g.c.0 as *const c_void,
                c_layout.0,
                g.d.unwrap_or(g.c).0 as *mut c_void,
                c_layout.0,
                &algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream,
            )
        }
        .map_err(e("cublasLtMatmul"))
    }

    /// Frees the per-stream workspaces (the driver's streams are idle).
    pub(super) fn free_workspaces(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for w in st.workspaces.iter_mut().filter(|w| **w != 0) {
            // SAFETY: allocated by `workspace` with cuMemAlloc, streams are idle.
            let _ = unsafe { cu::free_sync(*w) };
            *w = 0;
        }
    }

    /// The heuristic's algorithm for `key`, within the workspace and the operands' alignments.
    fn choose(
        &self,
        g: &Gemm,
        key: &GemmKey,
        d: &Desc,
        [a_layout, b_layout, c_layout]: [&LayoutGuard; 3],
    ) -> Result<ltsys::cublasLtMatmulAlgo_t> {
        let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
        let pref =
            PrefGuard(lt::create_matmul_pref().map_err(e("cublasLtMatmulPreferenceCreate"))?);
        use ltsys::cublasLtMatmulPreferenceAttributes_t as P;
        let ws_bytes = WORKSPACE_BYTES as u64;
        let prefs: [(P, u64); 1] = [(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws_bytes)];
        let aligns: [(P, u32); 4] = [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
        ];
        // SAFETY: `pref` is live; MAX_WORKSPACE_BYTES is uint64, MIN_ALIGNMENT_* uint32.
        unsafe {
            for (attr, v) in prefs {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    &v as *const u64 as *const c_void,
                    std::mem::size_of::<u64>(),
                )
                .map_err(e("cublasLtMatmulPreferenceSetAttribute"))?;
            }
            for (attr, v) in aligns {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    &v as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                )
                .map_err(e("cublasLtMatmulPreferenceSetAttribute"))?;
            }
        }
        // SAFETY: every descriptor is live; C and D share a layout (in place).
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(
                self.handle,
                d.desc.0,
                a_layout.0,
                b_layout.0,
                c_layout.0,
                c_layout.0,
                pref.0,
            )
        }
        .map_err(e("cublasLtMatmulAlgoGetHeuristic"))?;
        if heuristic.workspaceSize > WORKSPACE_BYTES {
            return Err(Error::Device {
                op: "cublasLtMatmulAlgoGetHeuristic".into(),
                detail: format!(
                    "the chosen algorithm needs {} bytes of workspace, more than {} for {}",
                    heuristic.workspaceSize,
                    WORKSPACE_BYTES,
                    g.describe()
                ),
            });
        }
        Ok(heuristic.algo)
    }
}

/// Stream `s`'s workspace, allocated on first use (the context is current).
fn workspace(st: &mut BlasState, s: StreamKind) -> Result<u64> {
    Ok(match st.workspaces[s.index()] {
        0 => {
            // SAFETY: the context is current.
            let w = unsafe { cu::malloc_sync(WORKSPACE_BYTES) }
                .map_err(|e| cu_err("cuMemAlloc(cuBLASLt workspace)", e))?;
            st.workspaces[s.index()] = w;
            w
        }
        w => w,
    })
}

/// A column-major `rows x cols` layout of `t` with leading dimension `ld`, strided-batched when
/// `g` is batched.
fn layout(
    g: &Gemm,
    t: DType,
    (rows, cols): (u64, u64),
    ld: u64,
    stride: Option<u64>,
) -> Result<LayoutGuard> {
    let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
    let l = LayoutGuard(
        lt::create_matrix_layout(cuda_type(t), rows, cols, ld as i64)
            .map_err(e("cublasLtMatrixLayoutCreate"))?,
    );
    if let (Some(b), Some(stride)) = (g.batch, stride) {
        let count = b.count as i32;
        let stride = stride as i64;
        use ltsys::cublasLtMatrixLayoutAttribute_t as L;
        // SAFETY: the layout is live; the values have the attributes' types (int32, int64).
        unsafe {
            lt::set_matrix_layout_attribute(
                l.0,
                L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &count as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
            .map_err(e("cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)"))?;
            lt::set_matrix_layout_attribute(
                l.0,
                L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                std::mem::size_of::<i64>(),
            )
            .map_err(e("cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)"))?;
        }
    }
    Ok(l)
}

/// Sets one matmul-descriptor attribute from a value of exactly its C type.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set<T>(
    desc: &DescGuard,
    attr: ltsys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> std::result::Result<(), lt::CublasError> {
    // SAFETY: per the function's contract.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc.0,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
}

/// `g`'s matmul descriptor: f32 compute and scale, the transposes and the epilogue.
fn describe(g: &Gemm) -> Result<Desc> {
    let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
    let desc = DescGuard(
        lt::create_matmul_desc(
            ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ltsys::cudaDataType::CUDA_R_32F,
        )
        .map_err(e("cublasLtMatmulDescCreate"))?,
    );
    use ltsys::cublasLtMatmulDescAttributes_t as D;
    let op = |o: Op| -> i32 {
        match o {
            Op::N => 0, // CUBLAS_OP_N
            Op::T => 1, // CUBLAS_OP_T
        }
    };
    use ltsys::cublasLtEpilogue_t as E;
    let (epilogue, bias, aux) = match g.epilogue {
        Epilogue::None => (E::CUBLASLT_EPILOGUE_DEFAULT, None, None),
        Epilogue::Bias { bias } => (E::CUBLASLT_EPILOGUE_BIAS, Some(bias), None),
        Epilogue::GeluAuxBias { bias, aux, aux_ld } => (
            E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Some(bias),
            Some((aux, aux_ld)),
        ),
        Epilogue::BiasGradA { bias_grad } => (E::CUBLASLT_EPILOGUE_BGRADA, Some(bias_grad), None),
        Epilogue::BiasGradB { bias_grad } => (E::CUBLASLT_EPILOGUE_BGRADB, Some(bias_grad), None),
        // The bias gradient goes where the bias would (BIAS_POINTER), the saved pre-activation
        // is read through the aux pointer.
        Epilogue::DGeluBiasGrad {
            aux,
            aux_ld,
            bias_grad,
        } => (
            E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            Some(bias_grad),
            Some((aux, aux_ld)),
        ),
    };
    // SAFETY: `desc` is live; each value has its attribute's C type: cublasOperation_t (int32),
    // cublasLtEpilogue_t (uint32), pointers (void*, 64-bit), int64 for AUX_LD.
    unsafe {
        set(&desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.transa))
            .map_err(e("cublasLtMatmulDescSetAttribute(TRANSA)"))?;
        set(&desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.transb))
            .map_err(e("cublasLtMatmulDescSetAttribute(TRANSB)"))?;
        set(&desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))
            .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE)"))?;
        if let Some(bias) = bias {
            set(&desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias.0)
                .map_err(e("cublasLtMatmulDescSetAttribute(BIAS_POINTER)"))?;
        }
        if let Some((aux, aux_ld)) = aux {
            set(&desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux.0)
                .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)"))?;
            set(
                &desc,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &(aux_ld as i64),
            )
            .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)"))?;
        }
    }
    Ok(Desc {
        desc,
        epilogue,
        bias,
        aux,
    })
}

impl GemmKey {
    fn of(g: &Gemm, d: &Desc) -> Self {
        GemmKey {
            ops: (g.transa, g.transb),
            mnk: (g.m, g.n, g.k),
            lds: (g.lda, g.ldb, g.ldc),
            types: (g.a_type, g.c_type),
            batch: g
                .batch
                .map(|b| (b.count, b.stride_a, b.stride_b, b.stride_c)),
            epilogue: d.epilogue as u32,
            aux_ld: d.aux.map_or(0, |(_, ld)| ld),
            align: [
                alignment(g.a.0),
                alignment(g.b.0),
                alignment(g.c.0).min(alignment(g.d.unwrap_or(g.c).0)),
                d.bias.map_or(0, |p| alignment(p.0)),
                d.aux.map_or(0, |(p, _)| alignment(p.0)),
            ],
        }
    }
}
