//! The device layer without a GPU: the emulated driver (memory checks, copies, events, GEMMs as
//! cuBLASLt defines them, kernel launches through an emulator library), the caching allocator on
//! top of it, and the real driver's refusal to open without a device.
#![cfg(feature = "cuda")]

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use ferrozero_runtime::backend::cuda::driver::{
    self, Allocator, Batch, CudaDriver, DevPtr, DeviceBuffer, Driver, EmuDriver, EmuOptions,
    Epilogue, Gemm, LaunchConfig, Op, Program, StreamKind, LARGE_SEGMENT_ROUND, SMALL_SEGMENT,
};
use ferrozero_runtime::tensor::DType;
use ferrozero_runtime::Error;
use half::{bf16, f16};

const S: StreamKind = StreamKind::Compute;

fn emu() -> Arc<dyn Driver> {
    Arc::new(EmuDriver::new(EmuOptions::default()).unwrap())
}

fn emu_with_memory(total: u64) -> Arc<dyn Driver> {
    Arc::new(
        EmuDriver::new(EmuOptions {
            total_memory: total,
            ..EmuOptions::default()
        })
        .unwrap(),
    )
}

fn device_err(r: Result<impl std::fmt::Debug, Error>) -> (String, String) {
    match r {
        Err(Error::Device { op, detail }) => (op, detail),
        other => panic!("expected Error::Device, got {other:?}"),
    }
}

fn invalid(r: Result<(), Error>) -> String {
    match r {
        Err(Error::Invalid(msg)) => msg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The real driver on a machine without a GPU.

#[test]
fn real_driver_says_why_there_is_no_device() {
    match driver::open(0) {
        Ok(d) => {
            // A machine with a GPU: then it must be a real one.
            assert!(!d.info().emulated);
            eprintln!("opened a real device: {}", d.info());
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, Error::Unavailable { .. }), "{msg}");
            assert!(msg.contains("no CUDA device"), "{msg}");
            eprintln!("{msg}");
            assert!(driver::device_count().is_err() || driver::device_count().unwrap() == 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Emulated memory.

/// Host memory registered for copies: copies through it round-trip, a second registration of
/// the same pages and an unregistration of unregistered memory are refused with CUDA's names.
fn host_registration_round_trips(d: &Arc<dyn Driver>) {
    let mut a = vec![0u8; 3 << 20];
    let p = a.as_mut_ptr();
    // SAFETY: `a` outlives its registration (unregistered below).
    unsafe { d.host_register(p, a.len()) }.unwrap();
    let again = unsafe { d.host_register(p, a.len()) }.unwrap_err();
    assert!(again.to_string().contains("ALREADY_REGISTERED"), "{again}");
    let dp = d.malloc(a.len()).unwrap();
    for (i, x) in a.iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    d.copy_htod(&a, dp, S).unwrap();
    let mut back = vec![0u8; a.len()];
    d.copy_dtoh(dp, &mut back, S).unwrap();
    assert!(back == a, "round trip through registered memory");
    a.fill(0);
    d.copy_dtoh(dp, &mut a, S).unwrap();
    assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    unsafe { d.host_unregister(p) }.unwrap();
    let none = unsafe { d.host_unregister(p) }.unwrap_err();
    assert!(none.to_string().contains("NOT_REGISTERED"), "{none}");
    unsafe { d.free(dp) }.unwrap();
}

fn memory_is_aligned_and_round_trips(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let p = d.malloc(1000).unwrap();
    assert_eq!(p.0 % 256, 0, "cudaMalloc alignment");
    if d.info().emulated {
        let mut fresh = vec![0u8; 1000];
        d.copy_dtoh(p, &mut fresh, S).unwrap();
        assert!(
            fresh.iter().all(|&b| b == 0xFF),
            "fresh memory reads as NaN bytes"
        );
    }

    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    d.copy_htod(&data, p, StreamKind::HostToDevice).unwrap();
    let mut back = vec![0u8; 1000];
    d.copy_dtoh(p, &mut back, StreamKind::DeviceToHost).unwrap();
    assert_eq!(back, data);

    d.memset_zero(p.offset(100), 50, S).unwrap();
    d.copy_dtoh(p, &mut back, S).unwrap();
    assert!(back[100..150].iter().all(|&b| b == 0));
    assert_eq!(back[..100], data[..100]);
    assert_eq!(back[150..], data[150..]);

    let q = d.malloc(600).unwrap();
    d.copy_dtod(p.offset(400), q, 600, S).unwrap();
    let mut part = vec![0u8; 600];
    d.copy_dtoh(q, &mut part, S).unwrap();
    assert_eq!(part, data[400..]);

    // Asynchronous forms, ordered across streams with an event.
    let src = vec![9u8; 64];
    unsafe { d.copy_htod_async(src.as_ptr(), 64, q, StreamKind::HostToDevice) }.unwrap();
    let uploaded = d.event_create().unwrap();
    d.event_record(uploaded, StreamKind::HostToDevice).unwrap();
    d.stream_wait_event(StreamKind::DeviceToHost, uploaded)
        .unwrap();
    let mut dst = vec![0u8; 64];
    unsafe { d.copy_dtoh_async(q, dst.as_mut_ptr(), 64, StreamKind::DeviceToHost) }.unwrap();
    d.synchronize(StreamKind::DeviceToHost).unwrap();
    assert_eq!(dst, src);
    d.event_destroy(uploaded).unwrap();

    assert_eq!(d.allocated(), base_allocated + 1600);
    unsafe { d.free(p) }.unwrap();
    unsafe { d.free(q) }.unwrap();
    assert_eq!(d.allocated(), base_allocated);
}

fn memory_rejects_what_a_gpu_would_fault_on(d: &Arc<dyn Driver>) {
    let p = d.malloc(256).unwrap();
    let buf = vec![0u8; 257];

    // One byte past the end.
    let (op, detail) = device_err(d.copy_htod(&buf, p, S));
    assert_eq!(op, "cuMemcpyHtoDAsync");
    assert!(
        detail.contains("runs 1 bytes past the end of the 256-byte allocation"),
        "{detail}"
    );
    let mut out = vec![0u8; 16];
    let (op, _) = device_err(d.copy_dtoh(p.offset(250), &mut out, S));
    assert_eq!(op, "cuMemcpyDtoHAsync");
    let (op, _) = device_err(d.memset_zero(p.offset(8), 256, S));
    assert_eq!(op, "cuMemsetD8Async");

    // Foreign and null pointers.
    let host = [0u8; 64];
    let (_, detail) = device_err(d.copy_htod(&buf[..8], DevPtr(host.as_ptr() as u64), S));
    assert!(
        detail.contains("no allocation of this device contains it"),
        "{detail}"
    );
    let (_, detail) = device_err(d.memset_zero(DevPtr::NULL, 4, S));
    assert!(detail.contains("null pointer"), "{detail}");

    // Overlapping device-to-device copy.
    let (op, detail) = device_err(d.copy_dtod(p, p.offset(64), 128, S));
    assert_eq!(op, "cuMemcpyDtoDAsync");
    assert!(detail.contains("overlap"), "{detail}");

    // Frees: interior pointer, then use after free, then double free.
    let (op, detail) = device_err(unsafe { d.free(p.offset(16)) });
    assert_eq!(op, "cuMemFree");
    assert!(detail.contains("not to its start"), "{detail}");
    unsafe { d.free(p) }.unwrap();
    let (_, detail) = device_err(d.copy_htod(&buf[..4], p.offset(4), S));
    assert!(detail.contains("was freed"), "{detail}");
    let (op, detail) = device_err(unsafe { d.free(p) });
    assert_eq!(op, "cuMemFree");
    assert!(detail.contains("was freed"), "{detail}");

    // Zero bytes.
    let (op, _) = device_err(d.malloc(0));
    assert_eq!(op, "cuMemAlloc");
}

#[test]
fn emulated_memory_runs_out_at_its_total() {
    let d = emu_with_memory(1 << 20);
    let a = d.malloc(700 << 10).unwrap();
    match d.malloc(400 << 10) {
        Err(Error::DeviceMemory {
            requested,
            live,
            limit,
            detail,
            ..
        }) => {
            assert_eq!(requested, 400 << 10);
            assert_eq!(live, 700 << 10);
            assert_eq!(limit, 1 << 20);
            assert!(detail.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{detail}");
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    unsafe { d.free(a) }.unwrap();
    let b = d.malloc(400 << 10).unwrap();
    unsafe { d.free(b) }.unwrap();
}

fn events_order_streams_and_are_checked(d: &Arc<dyn Driver>) {
    let e = d.event_create().unwrap();
    assert!(
        d.event_query(e).unwrap(),
        "an event never recorded is complete"
    );
    d.event_record(e, StreamKind::HostToDevice).unwrap();
    d.stream_wait_event(S, e).unwrap();
    d.event_synchronize(e).unwrap();
    assert!(d.event_query(e).unwrap());
    d.synchronize(S).unwrap();
    d.event_destroy(e).unwrap();
    let (op, _) = device_err(d.event_record(e, S));
    assert_eq!(op, "cuEventRecord");
    let (op, _) = device_err(d.event_destroy(e));
    assert_eq!(op, "cuEventDestroy");
}

#[test]
fn emulated_builtin_registry_knows_its_kernels() {
    let d = driver::emulated().unwrap();
    assert!(d.info().emulated);
    assert!(d.info().to_string().contains("emulated"));
    let (op, detail) = device_err(d.kernel("no_such_kernel"));
    assert_eq!(op, "cuModuleGetFunction");
    assert!(
        detail.contains("no kernel named no_such_kernel"),
        "{detail}"
    );
    for p in driver::builtin_programs() {
        for k in &p.kernels {
            d.kernel(k).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GEMM: the emulator computes what cuBLASLt defines.

/// Rounds to `t` and back (the values a buffer of type `t` can hold).
fn quantize(v: f32, t: DType) -> f32 {
    match t {
        DType::F32 => v,
        DType::Bf16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
    }
}

fn to_bytes(v: &[f32], t: DType) -> Vec<u8> {
    match t {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::Bf16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
    }
}

fn from_bytes(b: &[u8], t: DType) -> Vec<f32> {
    match t {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
    }
}

/// Deterministic test values in [-2, 2), already representable in `t`.
fn values(n: usize, seed: u64, t: DType) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| quantize(rng.f32() * 4.0 - 2.0, t)).collect()
}

/// A device buffer holding `v` in type `t`.
fn upload(d: &Arc<dyn Driver>, v: &[f32], t: DType) -> DevPtr {
    let bytes = to_bytes(v, t);
    let p = d.malloc(bytes.len().max(1)).unwrap();
    d.copy_htod(&bytes, p, S).unwrap();
    p
}

fn download(d: &Arc<dyn Driver>, p: DevPtr, n: usize, t: DType) -> Vec<f32> {
    let mut b = vec![0u8; n * t.size()];
    d.copy_dtoh(p, &mut b, S).unwrap();
    from_bytes(&b, t)
}

/// Stores the logical `rows x cols` matrix `m` (row-major in the test) column-major with
/// leading dimension `ld`, padding filled with NaN so that reading it shows.
fn store_col_major(m: &[f32], rows: usize, cols: usize, ld: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; ld * (cols - 1) + rows];
    for i in 0..rows {
        for j in 0..cols {
            out[i + j * ld] = m[i * cols + j];
        }
    }
    out
}

/// Stores logical op(X) (`r x c`, row-major in the test) as cuBLASLt's X for `op`.
fn store_operand(opx: &[f32], r: usize, c: usize, op: Op, ld: usize) -> Vec<f32> {
    match op {
        Op::N => store_col_major(opx, r, c, ld),
        Op::T => {
            let mut t = vec![0f32; r * c];
            for i in 0..r {
                for j in 0..c {
                    t[j * r + i] = opx[i * c + j];
                }
            }
            store_col_major(&t, c, r, ld)
        }
    }
}

/// Whether `got` is `want` rounded to `t`, within one unit in the last place of `t`, plus the
/// f32 rounding of the terms (`scale`: the sum of their magnitudes) that both cuBLASLt (in f32,
/// in an unspecified order) and the emulator (f64 dot, f32 scaling) incur.
fn close(got: f32, want: f64, scale: f64, t: DType) -> bool {
    (f64::from(got) - want).abs() <= tol(want, scale, t)
}

/// [`close`]'s bound.
fn tol(want: f64, scale: f64, t: DType) -> f64 {
    ulp(t) * want.abs() + 8.0 * 2f64.powi(-24) * scale + 1e-30
}

/// One unit in the last place of `t`, relative.
fn ulp(t: DType) -> f64 {
    match t {
        DType::F32 => 2f64.powi(-23),
        DType::Bf16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
    }
}

/// `sum op(A)[i, l] op(B)[l, j]`, and the sum of the terms' magnitudes scaled by `(8 + k) / 8`:
/// with [`close`]'s `8 u`, an error bound of `(8 + k) u sum |terms|` that holds for f32
/// accumulation in any order (cuBLASLt's), not only for the emulator's f64 dot.
fn dot_scale(a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32, k: usize) -> (f64, f64) {
    let (sum, mag) = (0..k).fold((0.0, 0.0), |(s, m), l| {
        let p = f64::from(a(l)) * f64::from(b(l));
        (s + p, m + p.abs())
    });
    (sum, mag * (8 + k) as f64 / 8.0)
}

struct Case {
    ta: Op,
    tb: Op,
    m: usize,
    n: usize,
    k: usize,
    pad: usize,
    ab: DType,
    c: DType,
    alpha: f32,
    beta: f32,
}

/// Runs one GEMM through the emulator from logical matrices and checks every element of C
/// against an f64 reference computed here, independently of the driver's layout code.
fn check_case(d: &Arc<dyn Driver>, case: &Case, seed: u64) {
    let Case {
        ta,
        tb,
        m,
        n,
        k,
        pad,
        ab,
        c: ct,
        alpha,
        beta,
    } = *case;
    let opa = values(m * k, seed, ab);
    let opb = values(k * n, seed + 1, ab);
    let c0 = values(m * n, seed + 2, ct);
    let (a_rows, b_rows) = (
        if ta == Op::N { m } else { k },
        if tb == Op::N { k } else { n },
    );
    let (lda, ldb, ldc) = (a_rows + pad, b_rows + pad, m + pad);
    let a = upload(d, &store_operand(&opa, m, k, ta, lda), ab);
    let b = upload(d, &store_operand(&opb, k, n, tb, ldb), ab);
    // With beta = 0 C starts as NaN: cuBLASLt does not read it then.
    let c_init = if beta == 0.0 {
        vec![f32::NAN; m * n]
    } else {
        c0.clone()
    };
    let c = upload(d, &store_col_major(&c_init, m, n, ldc), ct);
    let mut g = Gemm::new(
        ta, tb, m as u64, n as u64, k as u64, a, lda as u64, b, ldb as u64, c, ldc as u64, ab,
    );
    g.c_type = ct;
    g.alpha = alpha;
    g.beta = beta;
    d.gemm(&g, S).unwrap();
    let out = download(d, c, ldc * (n - 1) + m, ct);
    for i in 0..m {
        for j in 0..n {
            let (dot, scale) = dot_scale(|l| opa[i * k + l], |l| opb[l * n + j], k);
            let old = if beta != 0.0 {
                f64::from(beta) * f64::from(c0[i * n + j])
            } else {
                0.0
            };
            let want = f64::from(alpha) * dot + old;
            let scale = f64::from(alpha.abs()) * scale + old.abs();
            let got = out[i + j * ldc];
            // With a bf16/f16 C and beta != 0, cuBLASLt may round alpha * op(A) op(B) to C's
            // type before adding beta * C (seen on an H100, cuBLASLt 13.1: 1.5 ulp off at k = 2):
            // one more rounding of each term. The emulator rounds once.
            let rounded_terms = if beta != 0.0 && ct != DType::F32 {
                ulp(ct) * (f64::from(alpha) * dot).abs() + ulp(ct) * old.abs()
            } else {
                0.0
            };
            assert!(
                (f64::from(got) - want).abs() <= tol(want, scale, ct) + rounded_terms,
                "{} at ({i}, {j}): got {got}, want {want}",
                g.describe()
            );
        }
    }
    // Padding rows of C are never written.
    for j in 0..n - 1 {
        for p in m..ldc {
            assert!(out[p + j * ldc].is_nan(), "padding of C written");
        }
    }
    for p in [a, b, c] {
        unsafe { d.free(p) }.unwrap();
    }
}

fn gemm_reads_operands_through_cublaslt_layouts(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let mut seed = 1;
    for (ab, ct) in [
        (DType::F32, DType::F32),
        (DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
    ] {
        for ta in [Op::N, Op::T] {
            for tb in [Op::N, Op::T] {
                for (m, n, k, pad) in [(5, 3, 7, 0), (17, 9, 33, 3), (1, 1, 1, 0), (4, 13, 2, 8)] {
                    for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)] {
                        let case = Case {
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            pad,
                            ab,
                            c: ct,
                            alpha,
                            beta,
                        };
                        check_case(d, &case, seed);
                        seed += 10;
                    }
                }
            }
        }
    }
    assert_eq!(d.allocated(), base_allocated);
}

fn gemm_large_matches_reference(d: &Arc<dyn Driver>) {
    let case = Case {
        ta: Op::T,
        tb: Op::N,
        m: 70,
        n: 65,
        k: 129,
        pad: 1,
        ab: DType::Bf16,
        c: DType::F32,
        alpha: 1.0,
        beta: 1.0,
    };
    check_case(d, &case, 99);
}

/// The linear layer `Y[M, N] = X[M, K] · W[N, K]^T + bias[N]` with row-major buffers, through
/// the translation the module documentation gives (m = N, n = M, k = K, A = W with op T).
fn gemm_row_major_linear_layer_translation(d: &Arc<dyn Driver>) {
    let (mm, nn, kk) = (6usize, 5usize, 7usize);
    let x = values(mm * kk, 3, DType::F32);
    let w = values(nn * kk, 4, DType::F32);
    let bias = values(nn, 5, DType::F32);
    let (xp, wp, bp) = (
        upload(d, &x, DType::F32),
        upload(d, &w, DType::F32),
        upload(d, &bias, DType::F32),
    );
    let yp = d.malloc(mm * nn * 4).unwrap();
    let mut g = Gemm::new(
        Op::T,
        Op::N,
        nn as u64,
        mm as u64,
        kk as u64,
        wp,
        kk as u64,
        xp,
        kk as u64,
        yp,
        nn as u64,
        DType::F32,
    );
    g.epilogue = Epilogue::Bias { bias: bp };
    d.gemm(&g, S).unwrap();
    let y = download(d, yp, mm * nn, DType::F32);
    for r in 0..mm {
        for c in 0..nn {
            let (dot, scale) = dot_scale(|l| x[r * kk + l], |l| w[c * kk + l], kk);
            let want = dot + f64::from(bias[c]);
            let scale = scale + f64::from(bias[c].abs());
            assert!(close(y[r * nn + c], want, scale, DType::F32), "Y[{r}, {c}]");
        }
    }

    // The classic mistake, reading row-major X as if it were column-major M x K (m = M,
    // lda = M), computes something else: the emulator gives different numbers, as the GPU
    // would.
    let mut wrong = Gemm::new(
        Op::N,
        Op::N,
        mm as u64,
        nn as u64,
        kk as u64,
        xp,
        mm as u64,
        wp,
        kk as u64,
        yp,
        mm as u64,
        DType::F32,
    );
    wrong.epilogue = Epilogue::None;
    d.gemm(&wrong, S).unwrap();
    let y2 = download(d, yp, mm * nn, DType::F32);
    assert_ne!(y, y2);
}

fn gemm_strided_batch_with_a_shared_operand(d: &Arc<dyn Driver>) {
    let (m, n, k, count) = (3usize, 4usize, 5usize, 3usize);
    let t = DType::Bf16;
    let a_all = values(m * k * count, 11, t); // col-major m x k per product, contiguous
    let b = values(k * n, 12, t); // shared: stride 0
    let (ap, bp) = (upload(d, &a_all, t), upload(d, &b, t));
    let stride_c = m * n + 2; // a gap between outputs
    let cp = upload(d, &vec![f32::NAN; stride_c * count], DType::F32);
    let mut g = Gemm::new(
        Op::N,
        Op::N,
        m as u64,
        n as u64,
        k as u64,
        ap,
        m as u64,
        bp,
        k as u64,
        cp,
        m as u64,
        t,
    );
    g.c_type = DType::F32;
    g.batch = Some(Batch {
        count: count as u32,
        stride_a: (m * k) as u64,
        stride_b: 0,
        stride_c: stride_c as u64,
    });
    d.gemm(&g, S).unwrap();
    let c = download(d, cp, stride_c * count, DType::F32);
    for p in 0..count {
        for i in 0..m {
            for j in 0..n {
                let (want, scale) =
                    dot_scale(|l| a_all[p * m * k + i + l * m], |l| b[l + j * k], k);
                assert!(close(c[p * stride_c + i + j * m], want, scale, DType::F32));
            }
        }
        // The gap between products is never written.
        assert!(c[p * stride_c + m * n].is_nan() && c[p * stride_c + m * n + 1].is_nan());
    }
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn gemm_epilogues_as_cublaslt_documents_them(d: &Arc<dyn Driver>) {
    let (m, n, k) = (6usize, 4usize, 9usize);
    for t in [DType::F32, DType::Bf16] {
        let a = values(m * k, 21, t); // N: m x k col-major, lda = m
        let b = values(k * n, 22, t); // N: k x n, ldb = k
        let bias = values(m, 23, t);
        let (ap, bp, biasp) = (upload(d, &a, t), upload(d, &b, t), upload(d, &bias, t));
        let aux_ld = 8usize;
        let auxp = upload(d, &vec![f32::NAN; aux_ld * n], t);
        let cp = upload(d, &vec![f32::NAN; m * n], t);
        let dot = |i: usize, j: usize| dot_scale(|l| a[i + l * m], |l| b[l + j * k], k);
        let mut g = Gemm::new(
            Op::N,
            Op::N,
            m as u64,
            n as u64,
            k as u64,
            ap,
            m as u64,
            bp,
            k as u64,
            cp,
            m as u64,
            t,
        );

        // Bias: added to every column.
        g.epilogue = Epilogue::Bias { bias: biasp };
        d.gemm(&g, S).unwrap();
        let c = download(d, cp, m * n, t);
        for i in 0..m {
            for j in 0..n {
                let (dot, scale) = dot(i, j);
                let bias = f64::from(bias[i]);
                assert!(close(c[i + j * m], dot + bias, scale + bias.abs(), t));
            }
        }

        // GELU_AUX_BIAS: aux keeps the pre-activation, C gets GELU of it.
        g.epilogue = Epilogue::GeluAuxBias {
            bias: biasp,
            aux: auxp,
            aux_ld: aux_ld as u64,
        };
        d.gemm(&g, S).unwrap();
        let c = download(d, cp, m * n, t);
        let aux = download(d, auxp, aux_ld * n, t);
        for i in 0..m {
            for j in 0..n {
                let (dot, scale) = dot(i, j);
                let pre = dot + f64::from(bias[i]);
                let scale = scale + f64::from(bias[i].abs());
                assert!(close(aux[i + j * aux_ld], pre, scale, t), "aux ({i}, {j})");
                let tol = if t == DType::F32 { 1e-5 } else { 1e-2 };
                let got = f64::from(c[i + j * m]);
                assert!(
                    (got - gelu(pre)).abs() <= tol * (1.0 + scale),
                    "gelu ({i}, {j})"
                );
            }
            // aux padding rows stay untouched.
            assert!(aux[m + 1].is_nan());
        }

        // BGRADA (transa = N): bias_grad[i] = sum over k of A[i, l]; the product as usual.
        let gradp = upload(d, &vec![f32::NAN; m.max(n)], t);
        g.epilogue = Epilogue::BiasGradA { bias_grad: gradp };
        d.gemm(&g, S).unwrap();
        let grad = download(d, gradp, m, t);
        for i in 0..m {
            let (want, scale) = dot_scale(|l| a[i + l * m], |_| 1.0, k);
            assert!(close(grad[i], want, scale, t), "BGRADA[{i}]");
        }
        let c = download(d, cp, m * n, t);
        let (dot00, scale00) = dot(0, 0);
        assert!(close(c[0], dot00, scale00, t));

        // BGRADB (transb = T): B stored n x k, bias_grad[j] = sum over k of op(B)[l, j].
        let bt = values(n * k, 24, t);
        let btp = upload(d, &bt, t);
        let mut g2 = g;
        g2.transb = Op::T;
        g2.b = btp;
        g2.ldb = n as u64;
        g2.epilogue = Epilogue::BiasGradB { bias_grad: gradp };
        d.gemm(&g2, S).unwrap();
        let grad = download(d, gradp, n, t);
        for j in 0..n {
            let (want, scale) = dot_scale(|l| bt[j + l * n], |_| 1.0, k);
            assert!(close(grad[j], want, scale, t), "BGRADB[{j}]");
        }
    }
}

fn gemm_rejects_what_cublaslt_would(d: &Arc<dyn Driver>) {
    let t = DType::F32;
    let a = upload(d, &vec![1.0; 64], t);
    let b = upload(d, &vec![1.0; 64], t);
    let c = upload(d, &vec![0.0; 64], t);
    let base = Gemm::new(Op::N, Op::N, 4, 4, 4, a, 4, b, 4, c, 4, t);
    d.gemm(&base, S).unwrap();

    let msg = invalid(d.gemm(&Gemm { m: 0, ..base }, S));
    assert!(msg.contains("at least 1"), "{msg}");
    let msg = invalid(d.gemm(&Gemm { lda: 3, ..base }, S));
    assert!(
        msg.contains("lda 3 is less than A's stored rows 4"),
        "{msg}"
    );
    let msg = invalid(d.gemm(&Gemm { ldc: 2, ..base }, S));
    assert!(msg.contains("ldc"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            b_type: DType::Bf16,
            ..base
        },
        S,
    ));
    assert!(msg.contains("same type"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            c_type: DType::Bf16,
            ..base
        },
        S,
    ));
    assert!(msg.contains("C must be f32 or f32"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            a: a.offset(2),
            ..base
        },
        S,
    ));
    assert!(msg.contains("not aligned"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            c: a.offset(16),
            ..base
        },
        S,
    ));
    assert!(msg.contains("overlaps"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::BiasGradB {
                bias_grad: c.offset(128),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("only with transb = T"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::BiasGradA {
                bias_grad: c.offset(128),
            },
            alpha: 2.0,
            ..base
        },
        S,
    ));
    assert!(msg.contains("alpha = 1"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::GeluAuxBias {
                bias: c.offset(192),
                aux: c.offset(64),
                aux_ld: 4,
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("multiple of 8"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::GeluAuxBias {
                bias: c.offset(192),
                aux: c.offset(72),
                aux_ld: 8,
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("16-byte aligned"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            batch: Some(Batch {
                count: 2,
                stride_a: 0,
                stride_b: 0,
                stride_c: 8,
            }),
            ..base
        },
        S,
    ));
    assert!(msg.contains("overlap"), "{msg}");

    // Valid shapes whose extent leaves the allocation: a device error naming the operand, as
    // the emulator's stand-in for the GPU's illegal address.
    let (op, detail) = device_err(d.gemm(&Gemm { ldb: 21, ..base }, S));
    assert_eq!(op, "cublasLtMatmul");
    assert!(
        detail.starts_with("CUDA_ERROR_INVALID_VALUE: B "),
        "{detail}"
    );
    let (op, detail) = device_err(d.gemm(
        &Gemm {
            batch: Some(Batch {
                count: 5,
                stride_a: 16,
                stride_b: 0,
                stride_c: 16,
            }),
            ..base
        },
        S,
    ));
    assert_eq!(op, "cublasLtMatmul");
    assert!(detail.contains("past the end"), "{detail}");
    unsafe { d.free(a) }.unwrap();
    let (_, detail) = device_err(d.gemm(&base, S));
    assert!(detail.contains("freed"), "{detail}");
}

// ---------------------------------------------------------------------------------------------
// Kernel launches through an emulator library (the fixture kernels and a stand-in library
// until the kernels registry's emulator is merged).

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture_program() -> Program {
    let text = std::fs::read_to_string(fixtures().join("driver_fixture.cu")).unwrap();
    Program::new(
        "driver_fixture.cu",
        text,
        &["fz_fixture_axpy", "fz_fixture_iota", "fz_fixture_block_sum"],
    )
}

/// Builds the stand-in emulator library once per test process; `None` (test skipped) without
/// a C++ compiler.
fn stub_library() -> Option<PathBuf> {
    static LIB: OnceLock<Option<PathBuf>> = OnceLock::new();
    LIB.get_or_init(|| {
        let cxx = ["c++", "g++", "clang++"].into_iter().find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        let Some(cxx) = cxx else {
            ferrozero_runtime::backend::cuda::emu::skip_unless_required(
                "no C++ compiler for the stand-in emulator library",
            );
            return None;
        };
        // Named by the sources' content, built once, published by rename: concurrent test
        // processes share it and no stale copy is ever loaded.
        let mut text = Vec::new();
        for f in ["emu_stub.cpp", "driver_fixture.cu"] {
            text.extend(std::fs::read(fixtures().join(f)).unwrap());
        }
        let hash = text.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let out = dir.join(format!("libfz_emu_stub-{hash:016x}.so"));
        if out.is_file() {
            return Some(out);
        }
        let tmp = dir.join(format!(
            "libfz_emu_stub-{hash:016x}.{}.tmp",
            std::process::id()
        ));
        let status = std::process::Command::new(cxx)
            .args([
                "-std=c++17",
                "-O1",
                "-fPIC",
                "-shared",
                "-ffp-contract=off",
                "-I",
            ])
            .arg(fixtures())
            .arg(fixtures().join("emu_stub.cpp"))
            .arg("-o")
            .arg(&tmp)
            .status()
            .unwrap();
        assert!(status.success(), "building the stand-in emulator failed");
        std::fs::rename(&tmp, &out).unwrap();
        assert!(status.success(), "building the stand-in emulator failed");
        Some(out)
    })
    .clone()
}

fn stub_driver() -> Option<Arc<dyn Driver>> {
    let lib = stub_library()?;
    Some(Arc::new(
        EmuDriver::new(EmuOptions {
            library: Some(lib),
            programs: vec![fixture_program()],
            ..EmuOptions::default()
        })
        .unwrap(),
    ))
}

fn launches_run_kernels_with_raw_parameters(d: &Arc<dyn Driver>) {
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 11.0).collect();
    let y: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let xp = upload(d, &x, DType::F32);
    let yp = upload(d, &y, DType::F32);
    let k = d.kernel("fz_fixture_axpy").unwrap();
    let mut a = 1.5f32;
    let (mut xa, mut ya, mut na) = (xp.0, yp.0, n as i64);
    let mut params = [
        &mut a as *mut f32 as *mut c_void,
        &mut xa as *mut u64 as *mut c_void,
        &mut ya as *mut u64 as *mut c_void,
        &mut na as *mut i64 as *mut c_void,
    ];
    // A small grid: the kernel's grid-stride loop covers the rest.
    let cfg = LaunchConfig::for_elements(n as u64, 128, 3);
    assert_eq!(cfg.grid, [3, 1, 1]);
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let got = download(d, yp, n, DType::F32);
    for i in 0..n {
        assert_eq!(got[i].to_bits(), (1.5 * x[i] + y[i]).to_bits(), "y[{i}]");
    }

    // A 2-D grid visits every index once.
    let k = d.kernel("fz_fixture_iota").unwrap();
    let n = 3 * 4 * 32 - 5;
    let op = d.malloc(n * 4).unwrap();
    let (mut oa, mut off, mut nn) = (op.0, 7u32, n as i64);
    let mut params = [
        &mut oa as *mut u64 as *mut c_void,
        &mut off as *mut u32 as *mut c_void,
        &mut nn as *mut i64 as *mut c_void,
    ];
    let cfg = LaunchConfig {
        grid: [3, 4, 1],
        block: [32, 1, 1],
        dyn_smem: 0,
    };
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let mut out = vec![0u8; n * 4];
    d.copy_dtoh(op, &mut out, S).unwrap();
    for (i, c) in out.chunks_exact(4).enumerate() {
        assert_eq!(u32::from_le_bytes(c.try_into().unwrap()), i as u32 + 7);
    }
}

fn launches_reject_what_the_gpu_would(d: &Arc<dyn Driver>) {
    let (op, detail) = device_err(d.kernel("fz_fixture_nope"));
    assert_eq!(op, "cuModuleGetFunction");
    assert!(
        detail.contains("fz_fixture_axpy"),
        "lists the known kernels: {detail}"
    );

    let k = d.kernel("fz_fixture_iota").unwrap();
    let mut params: [*mut c_void; 0] = [];
    for (cfg, why) in [
        (LaunchConfig::linear(1, 2048), "2048 threads per block"),
        (LaunchConfig::linear(0, 32), "at least 1"),
        (
            LaunchConfig {
                grid: [1, 70000, 1],
                block: [32, 1, 1],
                dyn_smem: 0,
            },
            "grid dimensions",
        ),
        (
            LaunchConfig {
                grid: [1, 1, 1],
                block: [32, 1, 1],
                dyn_smem: 228 * 1024,
            },
            "dynamic shared memory",
        ),
    ] {
        let (op, detail) = device_err(unsafe { d.launch(k, &cfg, &mut params, S) });
        assert_eq!(op, "cuLaunchKernel");
        assert!(detail.contains(why), "{detail}");
    }
}

#[test]
fn emulated_launches_run_kernels_with_raw_parameters() {
    if let Some(d) = stub_driver() {
        launches_run_kernels_with_raw_parameters(&d);
    }
}

#[test]
fn emulated_launches_reject_what_the_gpu_would() {
    let Some(d) = stub_driver() else { return };
    launches_reject_what_the_gpu_would(&d);
    let mut params: [*mut c_void; 0] = [];
    // A kernel the library cannot run reports the library's own words.
    let k = d.kernel("fz_fixture_block_sum").unwrap();
    let (op, detail) =
        device_err(unsafe { d.launch(k, &LaunchConfig::linear(1, 256), &mut params, S) });
    assert_eq!(op, "cuLaunchKernel");
    assert!(
        detail.contains("cannot run kernel fz_fixture_block_sum"),
        "{detail}"
    );

    // Duplicate kernel names across programs are refused when the driver is built.
    let mut twice = fixture_program();
    twice.file = "again.cu".into();
    let err = EmuDriver::new(EmuOptions {
        programs: vec![fixture_program(), twice],
        ..EmuOptions::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("defined by both"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// A GPU, when there is one: every shared check above, run on the real driver.

/// The fixture's shared-memory reduction, which the stand-in emulator cannot run.
fn block_sum_runs(d: &Arc<dyn Driver>) {
    let blocks = 5usize;
    let x: Vec<f32> = (0..blocks * 256).map(|i| (i % 17) as f32 - 8.0).collect();
    let xp = upload(d, &x, DType::F32);
    let op = d.malloc(blocks * 4).unwrap();
    let k = d.kernel("fz_fixture_block_sum").unwrap();
    let (mut xa, mut oa) = (xp.0, op.0);
    let mut params = [
        &mut xa as *mut u64 as *mut c_void,
        &mut oa as *mut u64 as *mut c_void,
    ];
    let cfg = LaunchConfig::linear(blocks as u32, 256);
    unsafe { d.launch(k, &cfg, &mut params, S) }.unwrap();
    let got = download(d, op, blocks, DType::F32);
    for (b, g) in got.iter().enumerate() {
        let want: f32 = x[b * 256..(b + 1) * 256].iter().sum();
        assert_eq!(*g, want, "block {b}");
    }
    unsafe { d.free(xp) }.unwrap();
    unsafe { d.free(op) }.unwrap();
}

#[test]
fn real_device_passes_the_same_checks() {
    let d: Arc<dyn Driver> = match CudaDriver::open(0, vec![fixture_program()]) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("{}", d.info());
    type Check = fn(&Arc<dyn Driver>);
    let checks: [(&str, Check); 19] = [
        (
            "host_registration_round_trips",
            host_registration_round_trips,
        ),
        (
            "memory_is_aligned_and_round_trips",
            memory_is_aligned_and_round_trips,
        ),
        (
            "memory_rejects_what_a_gpu_would_fault_on",
            memory_rejects_what_a_gpu_would_fault_on,
        ),
        (
            "events_order_streams_and_are_checked",
            events_order_streams_and_are_checked,
        ),
        (
            "gemm_reads_operands_through_cublaslt_layouts",
            gemm_reads_operands_through_cublaslt_layouts,
        ),
        ("gemm_large_matches_reference", gemm_large_matches_reference),
        (
            "gemm_row_major_linear_layer_translation",
            gemm_row_major_linear_layer_translation,
        ),
        (
            "gemm_strided_batch_with_a_shared_operand",
            gemm_strided_batch_with_a_shared_operand,
        ),
        (
            "gemm_epilogues_as_cublaslt_documents_them",
            gemm_epilogues_as_cublaslt_documents_them,
        ),
        (
            "gemm_rejects_what_cublaslt_would",
            gemm_rejects_what_cublaslt_would,
        ),
        (
            "launches_run_kernels_with_raw_parameters",
            launches_run_kernels_with_raw_parameters,
        ),
        (
            "launches_reject_what_the_gpu_would",
            launches_reject_what_the_gpu_would,
        ),
        ("block_sum_runs", block_sum_runs),
        (
            "allocator_reuses_blocks_without_driver_calls_once_warm",
            allocator_reuses_blocks_without_driver_calls_once_warm,
        ),
        (
            "allocator_counts_live_and_peak_bytes",
            allocator_counts_live_and_peak_bytes,
        ),
        (
            "allocator_limit_fails_with_every_number",
            allocator_limit_fails_with_every_number,
        ),
        (
            "allocator_splits_best_fits_and_merges",
            allocator_splits_best_fits_and_merges,
        ),
        (
            "allocator_holds_blocks_used_on_other_streams_until_their_event",
            allocator_holds_blocks_used_on_other_streams_until_their_event,
        ),
        (
            "allocator_is_thread_safe_and_buffers_cross_threads",
            allocator_is_thread_safe_and_buffers_cross_threads,
        ),
    ];
    // Every check runs (a GPU run is scarce): each failure prints its panic, then all are named.
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(_, check)| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&d))).is_err()
        })
        .map(|(name, _)| *name)
        .collect();
    assert!(failed.is_empty(), "failed on {}: {failed:?}", d.info());
}

// ---------------------------------------------------------------------------------------------
// The caching allocator on the emulated driver.

fn allocator_reuses_blocks_without_driver_calls_once_warm(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let alloc = Allocator::new(d.clone());
    let sizes = [100usize, 4096, 70_000, 3 << 20, 10 << 20, 512, 1 << 20];
    let step = |alloc: &Arc<Allocator>| {
        let bufs: Vec<DeviceBuffer> = sizes.iter().map(|&s| alloc.alloc(s).unwrap()).collect();
        for b in &bufs {
            assert_eq!(b.ptr().0 % 256, 0);
            assert!(b.rounded_len() >= b.len() as u64 && b.rounded_len() % 512 == 0);
        }
        drop(bufs);
    };
    step(&alloc);
    let warm = alloc.stats();
    assert!(warm.driver_allocs > 0);
    for _ in 0..5 {
        step(&alloc);
    }
    let after = alloc.stats();
    assert_eq!(
        after.driver_allocs, warm.driver_allocs,
        "no cuMemAlloc once warm"
    );
    assert_eq!(after.reserved, warm.reserved);
    assert_eq!(after.live, 0);
    assert_eq!(after.live_buffers, 0);
    assert_eq!(d.allocated(), base_allocated + after.reserved);

    alloc.empty_cache().unwrap();
    let empty = alloc.stats();
    assert_eq!(empty.reserved, 0);
    assert_eq!(empty.segments, 0);
    assert_eq!(empty.driver_frees, empty.driver_allocs);
    assert_eq!(d.allocated(), base_allocated);
}

fn allocator_counts_live_and_peak_bytes(d: &Arc<dyn Driver>) {
    let alloc = Allocator::new(d.clone());
    let a = alloc.alloc(1000).unwrap(); // 1024
    let b = alloc.alloc(3 << 20).unwrap(); // 3 MiB
    let s = alloc.stats();
    assert_eq!(s.live, 1024 + (3 << 20));
    assert_eq!(s.peak_live, s.live);
    assert_eq!(s.reserved, SMALL_SEGMENT + 2 * LARGE_SEGMENT_ROUND);
    assert_eq!(s.live_buffers, 2);
    drop(b);
    let s = alloc.stats();
    assert_eq!(s.live, 1024);
    assert_eq!(s.peak_live, 1024 + (3 << 20));
    alloc.reset_peak();
    let s = alloc.stats();
    assert_eq!(s.peak_live, 1024);
    assert_eq!(s.peak_reserved, s.reserved);
    let zero = alloc.alloc(0).unwrap();
    assert!(zero.is_empty() && zero.ptr().is_null());
    assert_eq!(alloc.stats().live, 1024);
    drop((a, zero));
    assert_eq!(alloc.stats().live, 0);
}

fn allocator_limit_fails_with_every_number(d: &Arc<dyn Driver>) {
    let alloc = Allocator::with_limit(d.clone(), Some(10_000));
    let a = alloc.alloc(6000).unwrap(); // 6144
    let err = alloc.alloc(4000).unwrap_err(); // 4096: 10240 > 10000
    match &err {
        Error::DeviceMemory {
            requested,
            live,
            peak,
            limit,
            ..
        } => {
            assert_eq!(
                (*requested, *live, *peak, *limit),
                (4000, 6144, 6144, 10_000)
            );
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    let msg = err.to_string();
    for n in ["4000", "4096", "6144", "10000"] {
        assert!(msg.contains(n), "{n} missing from: {msg}");
    }
    let b = alloc.alloc(3500).unwrap(); // 3584: 9728 fits
    drop(b);
    alloc.set_limit(None);
    assert!(matches!(
        alloc.alloc(usize::MAX),
        Err(Error::DeviceMemory { .. })
    ));
    let c = alloc.alloc(1 << 20).unwrap();
    assert_eq!(alloc.limit(), None);
    drop((a, c));
}

fn allocator_splits_best_fits_and_merges(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    let alloc = Allocator::new(d.clone());
    // Three small blocks carved from one 1 MiB segment, in address order.
    let a = alloc.alloc(1024).unwrap();
    let b = alloc.alloc(2048).unwrap();
    let c = alloc.alloc(512).unwrap();
    assert_eq!(alloc.stats().segments, 1);
    assert_eq!(b.ptr().0, a.ptr().0 + 1024);
    assert_eq!(c.ptr().0, b.ptr().0 + 2048);
    let (pa, pb) = (a.ptr(), b.ptr());
    // Freeing a and b merges them: a 3 KiB request fits exactly where a was.
    drop(b);
    drop(a);
    let ab = alloc.alloc(3072).unwrap();
    assert_eq!(ab.ptr(), pa);
    // Best fit: a 2 KiB hole (after ab is split off again) is preferred over the segment's tail.
    drop(ab);
    let x = alloc.alloc(1024).unwrap();
    assert_eq!(x.ptr(), pa);
    let y = alloc.alloc(2048).unwrap();
    assert_eq!(y.ptr(), pb, "the 2 KiB hole, not the large tail");
    drop((x, y, c));
    assert_eq!(alloc.stats().segments, 1);

    // Large: a 6 MiB segment serves a later 3 MiB request by splitting (more than 1 MiB
    // left), and a 5.5 MiB request takes a 6 MiB block whole (less than 1 MiB left).
    let big = alloc.alloc(6 << 20).unwrap();
    let pbig = big.ptr();
    drop(big);
    let allocs = alloc.stats().driver_allocs;
    let half = alloc.alloc(3 << 20).unwrap();
    assert_eq!(half.ptr(), pbig);
    let rest = alloc.alloc(2 << 20).unwrap();
    assert_eq!(rest.ptr().0, pbig.0 + (3 << 20), "the split-off tail");
    assert_eq!(alloc.stats().driver_allocs, allocs, "both from the cache");
    drop((half, rest));
    let whole = alloc.alloc((5 << 20) + (512 << 10)).unwrap();
    assert_eq!(whole.ptr(), pbig);
    drop(whole);
    let small_after = alloc.alloc(100).unwrap();
    assert_ne!(
        small_after.ptr(),
        pbig,
        "small requests never take large blocks"
    );
    drop(small_after);
    alloc.empty_cache().unwrap();
    assert_eq!(d.allocated(), base_allocated);
}

#[test]
fn allocator_empties_its_cache_and_retries_when_the_device_is_full() {
    let d = emu_with_memory(8 << 20);
    let alloc = Allocator::new(d.clone());
    drop(alloc.alloc(100 << 10).unwrap()); // a cached 1 MiB small segment
    drop(alloc.alloc(2 << 20).unwrap()); // a cached 2 MiB large segment
    assert_eq!(d.allocated(), 3 << 20);
    // 7.5 MiB needs an 8 MiB segment: only after the cache goes back.
    let big = alloc.alloc((7 << 20) + (512 << 10)).unwrap();
    let s = alloc.stats();
    assert_eq!(s.oom_retries, 1);
    assert_eq!(s.driver_frees, 2);
    assert_eq!(s.reserved, 8 << 20);
    // Now nothing more fits, even after emptying the (empty) cache.
    let err = alloc.alloc(1 << 20).unwrap_err();
    match &err {
        Error::DeviceMemory {
            live,
            limit,
            detail,
            ..
        } => {
            assert_eq!(*live, (7 << 20) + (512 << 10));
            assert_eq!(*limit, 8 << 20);
            assert!(detail.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{detail}");
        }
        other => panic!("expected DeviceMemory, got {other:?}"),
    }
    drop(big);
}

fn allocator_holds_blocks_used_on_other_streams_until_their_event(d: &Arc<dyn Driver>) {
    let alloc = Allocator::new(d.clone());
    let mut a = alloc.alloc(4096).unwrap();
    let pa = a.ptr();
    a.record_stream(StreamKind::HostToDevice);
    drop(a);
    // The emulator's events complete at once, so the next request reuses the block.
    let b = alloc.alloc(4096).unwrap();
    assert_eq!(b.ptr(), pa);
    drop(b);
    let mut c = alloc.alloc(4096).unwrap();
    c.record_stream(StreamKind::DeviceToHost);
    drop(c);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved, 0);
}

fn allocator_is_thread_safe_and_buffers_cross_threads(d: &Arc<dyn Driver>) {
    let base_allocated = d.allocated();
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<DeviceBuffer>();
    assert_send_sync::<Allocator>();
    let alloc = Allocator::new(d.clone());
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for i in 0..200usize {
                    let bytes = 1 + (i * 7919 + t * 104_729) % (1 << 18) * (1 + i % 5);
                    let b = alloc.alloc(bytes).unwrap();
                    let fill = vec![(i % 251) as u8; bytes.min(4096)];
                    b.copy_from_host(&fill, S).unwrap();
                    let mut back = vec![0u8; fill.len()];
                    b.copy_to_host(&mut back, S).unwrap();
                    assert_eq!(back, fill);
                    if i % 5 == 0 {
                        kept.push(b);
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<Vec<DeviceBuffer>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let live: u64 = kept.iter().flatten().map(|b| b.rounded_len()).sum();
    assert_eq!(alloc.stats().live, live);
    // Buffers are dropped on another thread than the one that allocated them.
    std::thread::spawn(move || drop(kept)).join().unwrap();
    let s = alloc.stats();
    assert_eq!((s.live, s.live_buffers), (0, 0));
    assert!(s.reserved >= s.live);
    alloc.empty_cache().unwrap();
    assert_eq!(d.allocated(), base_allocated);
    // A buffer bigger than the host slice is fine; a slice bigger than the buffer is not.
    let b = alloc.alloc(10).unwrap();
    assert!(matches!(
        b.copy_from_host(&[0u8; 11], S),
        Err(Error::Shape { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// The shared checks on the emulator (`real_device_passes_the_same_checks` runs them on a GPU).

#[test]
fn emulated_host_registration_round_trips() {
    host_registration_round_trips(&emu());
}

#[test]
fn emulated_memory_is_aligned_and_round_trips() {
    memory_is_aligned_and_round_trips(&emu());
}

#[test]
fn emulated_memory_rejects_what_a_gpu_would_fault_on() {
    memory_rejects_what_a_gpu_would_fault_on(&emu());
}

#[test]
fn emulated_events_order_streams_and_are_checked() {
    events_order_streams_and_are_checked(&emu());
}

#[test]
fn emulated_gemm_reads_operands_through_cublaslt_layouts() {
    gemm_reads_operands_through_cublaslt_layouts(&emu());
}

#[test]
fn emulated_gemm_large_matches_reference() {
    gemm_large_matches_reference(&emu());
}

#[test]
fn emulated_gemm_row_major_linear_layer_translation() {
    gemm_row_major_linear_layer_translation(&emu());
}

#[test]
fn emulated_gemm_strided_batch_with_a_shared_operand() {
    gemm_strided_batch_with_a_shared_operand(&emu());
}

#[test]
fn emulated_gemm_epilogues_as_cublaslt_documents_them() {
    gemm_epilogues_as_cublaslt_documents_them(&emu());
}

#[test]
fn emulated_gemm_rejects_what_cublaslt_would() {
    gemm_rejects_what_cublaslt_would(&emu());
}

#[test]
fn emulated_allocator_reuses_blocks_without_driver_calls_once_warm() {
    allocator_reuses_blocks_without_driver_calls_once_warm(&emu());
}

#[test]
fn emulated_allocator_counts_live_and_peak_bytes() {
    allocator_counts_live_and_peak_bytes(&emu());
}

#[test]
fn emulated_allocator_limit_fails_with_every_number() {
    allocator_limit_fails_with_every_number(&emu());
}

#[test]
fn emulated_allocator_splits_best_fits_and_merges() {
    allocator_splits_best_fits_and_merges(&emu());
}

#[test]
fn emulated_allocator_holds_blocks_used_on_other_streams_until_their_event() {
    allocator_holds_blocks_used_on_other_streams_until_their_event(&emu());
}

#[test]
fn emulated_allocator_is_thread_safe_and_buffers_cross_threads() {
    allocator_is_thread_safe_and_buffers_cross_threads(&emu());
}
