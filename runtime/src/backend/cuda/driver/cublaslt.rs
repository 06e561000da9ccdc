//! cuBLASLt for the real driver: the handle, a workspace per stream, and one [`Gemm`] run as
//! layouts, a matmul descriptor (transposes and the epilogue), the heuristic's algorithm and
//! the call. Layouts, descriptor and algorithm are made once per [`PlanKey`] and kept in the
//! device's bounded [`PlanCache`]; a call only points the descriptor at its epilogue's buffers.

use std::collections::HashSet;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{result as cu, CudaContext};

use super::gemm::plan::{epilogue_operands, PlanCache, PlanKey, PLAN_CAPACITY};
use super::gemm::{Epilogue, Gemm, Op};
use super::real::{cu_err, driver_words};
use super::StreamKind;
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

/// A failed cuBLASLt call as an error: "not supported" for a product with a fused epilogue is
/// [`Error::GemmRefused`], which the backend answers with separate kernels; anything else is a
/// device error.
fn blas_err(op: &str, e: lt::CublasError, g: &Gemm) -> Error {
    if e.0 == ltsys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED && g.epilogue != Epilogue::None {
        return Error::GemmRefused {
            epilogue: g.epilogue.cublas_name(),
            detail: format!("{op}: {} for {}", blas_words(e), g.describe()),
        };
    }
    Error::Device {
        op: op.into(),
        detail: format!("{} for {}", blas_words(e), g.describe()),
    }
}

/// cuBLASLt's state: the handle, per-stream workspaces and the plans.
pub(super) struct Blas {
    handle: ltsys::cublasLtHandle_t,
    state: Mutex<BlasState>,
    pub(super) version: (u32, u32, u32),
}

struct BlasState {
    /// Workspace per stream (0: not yet allocated).
    workspaces: [u64; 4],
    plans: PlanCache<Plan>,
    /// Products whose epilogue cuBLASLt refused, so a refusal asks the heuristic once.
    refused: HashSet<PlanKey>,
}

/// One product's layouts, descriptor and algorithm, destroyed when the cache drops it.
struct Plan {
    a: LayoutGuard,
    b: LayoutGuard,
    c: LayoutGuard,
    desc: Desc,
    algo: ltsys::cublasLtMatmulAlgo_t,
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
            state: Mutex::new(BlasState {
                workspaces: [0; 4],
                plans: PlanCache::new(PLAN_CAPACITY),
                refused: HashSet::new(),
            }),
            version: (v / 10000, (v / 100) % 100, v % 100),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let (reused, made) = st.plans.counts();
        tracing::debug!(
            "cuBLASLt: {made} plans made, {reused} reused, {} held at close",
            st.plans.len()
        );
        // SAFETY: created in `Blas::new` and destroyed exactly once, here; the driver freed the
        // workspaces and the context outlives this field.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A matmul descriptor: transposes, epilogue and the auxiliary buffer's leading dimension; the
/// epilogue's pointers are set per call ([`point`]).
struct Desc {
    desc: DescGuard,
}

impl Blas {
    /// Runs `g` (already validated and range-checked) on `stream`, the driver's stream `s`.
    pub(super) fn run(&self, g: &Gemm, s: StreamKind, stream: ltsys::cudaStream_t) -> Result<()> {
        // Held through the call: a cached descriptor is pointed at this call's buffers.
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *guard;
        let ws = workspace(st, s)?;
        let key = PlanKey::of(g, WORKSPACE_BYTES as u64);
        if st.refused.contains(&key) {
            return Err(Error::GemmRefused {
                epilogue: g.epilogue.cublas_name(),
                detail: format!("refused before for {}", g.describe()),
            });
        }
        let plan = match st.plans.get_or_make(key, |key| self.plan(g, key)) {
            Ok(plan) => plan,
            Err(e) => {
                if matches!(e, Error::GemmRefused { .. }) {
                    st.refused.insert(key);
                }
                return Err(e);
            }
        };
        point(&plan.desc, g)?;
        let Plan {
            a: a_layout,
            b: b_layout,
            c: c_layout,
            desc: d,
            algo,
        } = &*plan;
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
                algo,
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

    /// `g`'s layouts, descriptor and algorithm (what [`PlanKey`] `key` stands for).
    fn plan(&self, g: &Gemm, key: &PlanKey) -> Result<Plan> {
        let a = layout(g, g.a_type, g.a_shape(), g.lda, g.batch.map(|b| b.stride_a))?;
        let b = layout(g, g.b_type, g.b_shape(), g.ldb, g.batch.map(|b| b.stride_b))?;
        let c = layout(g, g.c_type, (g.m, g.n), g.ldc, g.batch.map(|b| b.stride_c))?;
        let desc = describe(g)?;
        point(&desc, g)?;
        let algo = self.choose(g, key, &desc, [&a, &b, &c])?;
        Ok(Plan {
            a,
            b,
            c,
            desc,
            algo,
        })
    }

    /// The heuristic's algorithm for `key`, within the workspace and the operands' alignments.
    fn choose(
        &self,
        g: &Gemm,
        key: &PlanKey,
        d: &Desc,
        [a_layout, b_layout, c_layout]: [&LayoutGuard; 3],
    ) -> Result<ltsys::cublasLtMatmulAlgo_t> {
        let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
        let pref =
            PrefGuard(lt::create_matmul_pref().map_err(e("cublasLtMatmulPreferenceCreate"))?);
        use ltsys::cublasLtMatmulPreferenceAttributes_t as P;
        let ws_bytes = WORKSPACE_BYTES as u64;
        let prefs: [(P, u64); 1] = [(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws_bytes)];
        let [align_a, align_b, align_c] = key.operand_alignments();
        let aligns: [(P, u32); 4] = [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c),
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
    let epilogue = match g.epilogue {
        Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::Bias { .. } => E::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        Epilogue::BiasGradA { .. } => E::CUBLASLT_EPILOGUE_BGRADA,
        Epilogue::BiasGradB { .. } => E::CUBLASLT_EPILOGUE_BGRADB,
        Epilogue::DGeluBiasGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
    };
    let (_, aux) = epilogue_operands(&g.epilogue);
    // SAFETY: `desc` is live; each value has its attribute's C type: cublasOperation_t (int32),
    // cublasLtEpilogue_t (uint32), int64 for AUX_LD.
    unsafe {
        set(&desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.transa))
            .map_err(e("cublasLtMatmulDescSetAttribute(TRANSA)"))?;
        set(&desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.transb))
            .map_err(e("cublasLtMatmulDescSetAttribute(TRANSB)"))?;
        set(&desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))
            .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE)"))?;
        if let Some((_, aux_ld)) = aux {
            set(
                &desc,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &(aux_ld as i64),
            )
            .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)"))?;
        }
    }
    Ok(Desc { desc })
}

/// Points `d` (made for `g`'s [`PlanKey`]) at `g`'s epilogue buffers. The bias gradient goes
/// where the bias would (BIAS_POINTER); GELU's saved pre-activation is read or written through
/// the aux pointer.
fn point(d: &Desc, g: &Gemm) -> Result<()> {
    use ltsys::cublasLtMatmulDescAttributes_t as D;
    let e = |op: &'static str| move |err: lt::CublasError| blas_err(op, err, g);
    let (bias, aux) = epilogue_operands(&g.epilogue);
    // SAFETY: `d` is live; pointers are the attributes' void* (64-bit).
    unsafe {
        if let Some(bias) = bias {
            set(&d.desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias.0)
                .map_err(e("cublasLtMatmulDescSetAttribute(BIAS_POINTER)"))?;
        }
        if let Some((aux, _)) = aux {
            set(
                &d.desc,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                &aux.0,
            )
            .map_err(e("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)"))?;
        }
    }
    Ok(())
}
