//! The emulated driver refuses the GEMMs cuBLASLt would refuse, with the reason: shapes,
//! leading dimensions, alignment, epilogue combinations and buffers out of range or freed.
#![cfg(feature = "cuda")]

mod cuda_driver_common;

use std::sync::Arc;

use cuda_driver_common::{device_err, emu, invalid, on_real_device, upload, S};
use ferrozero_runtime::backend::cuda::driver::{Batch, Driver, Epilogue, Gemm, Op};
use ferrozero_runtime::tensor::DType;

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
    let dgelu = Epilogue::DGeluBiasGrad {
        aux: c.offset(64),
        aux_ld: 8,
        bias_grad: c.offset(192),
    };
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: dgelu,
            beta: 1.0,
            ..base
        },
        S,
    ));
    assert!(msg.contains("alpha = 1 and beta = 0"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::DGeluBiasGrad {
                aux: c.offset(64),
                aux_ld: 4,
                bias_grad: c.offset(192),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("CUBLASLT_EPILOGUE_DGELU_BGRAD"), "{msg}");
    assert!(msg.contains("multiple of 8"), "{msg}");
    let msg = invalid(d.gemm(
        &Gemm {
            epilogue: Epilogue::DGeluBiasGrad {
                aux: c.offset(64),
                aux_ld: 8,
                bias_grad: c.offset(68),
            },
            ..base
        },
        S,
    ));
    assert!(msg.contains("output bias_grad"), "{msg}");
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

// The shared checks on the emulator (`real_device_passes_the_gemm_refusal_checks` runs them on a GPU).

#[test]
fn emulated_gemm_rejects_what_cublaslt_would() {
    gemm_rejects_what_cublaslt_would(&emu());
}

#[test]
fn real_device_passes_the_gemm_refusal_checks() {
    on_real_device(&[(
        "gemm_rejects_what_cublaslt_would",
        gemm_rejects_what_cublaslt_would,
    )]);
}
