//! The backward matrix-product epilogues on every device against the CPU's separate steps
//! (product, then `gelu_backward`, then `sum_rows`): the weight gradient with its bias
//! gradient in one product (cuBLASLt's BGRADA/BGRADB) and the input gradient through a GELU
//! with the bias gradient before it (DGELU_BGRAD), both accumulating into the gradient as
//! the layers do over micro-steps; and the kernel launches of one GPT-2 block's backward on
//! the emulated device.

mod device_common;
mod nn_common;

use device_common::{assert_close, cpu, get, rand, tol_k, Dev};
use ferrozero_runtime::backend::{Epilogue, MatmulShape, Operand, Transpose};
use ferrozero_runtime::tensor::{DType, View, ViewMut};

/// `dW += xᵀ·dy` with `db += Σ_rows dy` for dy as either operand, against the CPU's
/// accumulating product and `sum_rows`; a layout cuBLASLt cannot reduce is refused.
fn weight_grad_with_bias_grad(d: &Dev) {
    let c = cpu();
    let (rows, d_in, d_out) = (37, 24, 16);
    for of in [Operand::A, Operand::B] {
        // dy is [rows, d_out]; as A the product is dyᵀ·x (OutIn), as B xᵀ·dy (InOut).
        let (m, n) = if of == Operand::A {
            (d_out, d_in)
        } else {
            (d_in, d_out)
        };
        let s = MatmulShape {
            m,
            n,
            k: rows,
            ta: Transpose::Yes,
            tb: Transpose::No,
        };
        let (x, dy) = (
            d.round(&rand(rows * d_in, 1)),
            d.round(&rand(rows * d_out, 2)),
        );
        let (a, b) = if of == Operand::A {
            (&dy, &x)
        } else {
            (&x, &dy)
        };
        // dW in f32 (the engine's gradients: cuBLASLt's bias gradient, of C's type, is f32)
        // and, on a device with narrower activations, in those (the column sums run apart).
        let narrow = d.act() != DType::F32;
        for wide in [true, false].into_iter().filter(|&w| w || narrow) {
            let (w0, b0) = (d.round(&rand(m * n, 3)), rand(d_out, 4));
            let (da, db) = (d.put(a), d.put(b));
            let mut dw = if wide { d.put_f32(&w0) } else { d.put(&w0) };
            let mut dbias = d.put_f32(&b0);
            let epi = Epilogue::AccumulateBiasGrad {
                of,
                bias_grad: dbias.view_mut(),
            };
            let before = d.be.activity();
            d.be.matmul(s, da.view(), db.view(), dw.view_mut(), epi)
                .unwrap();
            if let (Some(before), Some(after)) = (before, d.be.activity()) {
                // One matmul writing the bias gradient to a scratch and one add into the
                // gradient; apart: the matmul and the column sums' two kernels.
                let used = after - before;
                let want = if wide { (1, 2) } else { (1, 3) };
                let got = (used.gemms, used.kernel_launches);
                assert_eq!(got, want, "{} wide={wide}: {used:?}", d.name);
            }
            let (mut want_w, mut want_b) = (w0.clone(), b0.clone());
            c.be.matmul(
                s,
                View::from(&a[..]),
                View::from(&b[..]),
                ViewMut::from(&mut want_w[..]),
                Epilogue::Accumulate,
            )
            .unwrap();
            c.be.sum_rows(View::from(&dy[..]), d_out, ViewMut::from(&mut want_b[..]))
                .unwrap();
            let what = format!("{} bias grad of {of:?} wide={wide}", d.name);
            assert_close(&format!("{what}: dW"), &get(&dw), &want_w, tol_k(d, rows));
            assert_close(
                &format!("{what}: db"),
                &get(&dbias),
                &want_b,
                tol_k(d, rows),
            );
        }
    }
    let s = MatmulShape {
        m: 4,
        n: 4,
        k: 4,
        ta: Transpose::No,
        tb: Transpose::No,
    };
    let (a, mut w, mut g) = (
        d.put(&[0.0; 16]),
        d.put_f32(&[0.0; 16]),
        d.put_f32(&[0.0; 4]),
    );
    let epi = Epilogue::AccumulateBiasGrad {
        of: Operand::A,
        bias_grad: g.view_mut(),
    };
    let err = d.be.matmul(s, a.view(), a.view(), w.view_mut(), epi);
    let msg = err.unwrap_err().to_string();
    assert!(
        msg.contains("bias gradient of operand A needs it stored [k, len]"),
        "{msg}"
    );
    // A bias gradient of the wrong length is named, and nothing is written.
    let s = MatmulShape {
        ta: Transpose::Yes,
        ..s
    };
    let mut short = d.put_f32(&[0.0; 3]);
    let epi = Epilogue::AccumulateBiasGrad {
        of: Operand::A,
        bias_grad: short.view_mut(),
    };
    let err = d.be.matmul(s, a.view(), a.view(), w.view_mut(), epi);
    let msg = err.unwrap_err().to_string();
    assert!(msg.contains("bias gradient with 4 elements"), "{msg}");
    assert_eq!(get(&w), vec![0.0; 16], "{}", d.name);
    let pre = d.put(&[0.0; 5]);
    let epi = Epilogue::GeluBackwardBiasGrad {
        pre: pre.view(),
        bias_grad: g.view_mut(),
    };
    let mut c = d.zeros(16);
    let err = d.be.matmul(s, a.view(), a.view(), c.view_mut(), epi);
    let msg = err.unwrap_err().to_string();
    assert!(msg.contains("pre-activation with 16 elements"), "{msg}");
}
test_device!(weight_grad_with_bias_grad);

/// `dh = (dy·Wᵀ) ⊙ gelu'(pre)` with `db += Σ_rows dh`, against the CPU's product,
/// `gelu_backward` and `sum_rows`: on a device the separate kernels (the default).
fn gelu_input_grad_with_bias_grad(d: &Dev) {
    gelu_grad_check(d, false);
}
test_device!(gelu_input_grad_with_bias_grad);

/// The same through cuBLASLt's DGELU_BGRAD epilogue, where the backend is asked for it: n =
/// 32 takes the epilogue, n = 12 (not a multiple of 8: no valid aux leading dimension) the
/// separate path still.
#[cfg(feature = "cuda")]
#[test]
fn gelu_input_grad_with_cublaslt_epilogue() {
    use ferrozero_runtime::backend::cuda;
    for (name, act) in [
        ("cuda_emu_f32_dgelu", DType::F32),
        ("cuda_emu_bf16_dgelu", DType::Bf16),
    ] {
        let Ok(base) = cuda::emulated(act) else {
            cuda::emu::skip_unless_required("DGELU epilogue: no emulator");
            return;
        };
        let be = std::sync::Arc::new(base.with_fused_dgelu(true));
        gelu_grad_check(&Dev { name, be }, true);
    }
}

/// The GELU-gradient product's check; `fused`: whether the backend takes the epilogue.
fn gelu_grad_check(d: &Dev, fused: bool) {
    let c = cpu();
    for n in [32, 12] {
        let (rows, k) = (21, 16);
        let s = MatmulShape {
            m: rows,
            n,
            k,
            ta: Transpose::No,
            tb: Transpose::Yes,
        };
        let (dy, w) = (d.round(&rand(rows * k, 5)), d.round(&rand(n * k, 6)));
        let pre: Vec<f32> = rand(rows * n, 7).iter().map(|v| 3.0 * v).collect();
        let (pre, b0) = (d.round(&pre), rand(n, 8));
        let (ddy, dw, dpre) = (d.put(&dy), d.put(&w), d.put(&pre));
        let (mut dh, mut dbias) = (d.zeros(rows * n), d.put_f32(&b0));
        let epi = Epilogue::GeluBackwardBiasGrad {
            pre: dpre.view(),
            bias_grad: dbias.view_mut(),
        };
        let before = d.be.activity();
        d.be.matmul(s, ddy.view(), dw.view(), dh.view_mut(), epi)
            .unwrap();
        if let (Some(before), Some(after)) = (before, d.be.activity()) {
            // Fused: the matmul, (a widening cast of a bf16 bias gradient,) the add into the
            // gradient. Separate: the matmul, the GELU gradient, the column sums' two kernels.
            let want = match (n % 8, d.act(), fused) {
                (0, DType::F32, true) => 2,
                (0, _, true) => 3,
                _ => 4,
            };
            let used = after - before;
            assert_eq!(used.kernel_launches, want, "{} n={n}: {used:?}", d.name);
        }
        let mut product = vec![0.0; rows * n];
        c.be.matmul(
            s,
            View::from(&dy[..]),
            View::from(&w[..]),
            ViewMut::from(&mut product[..]),
            Epilogue::Store,
        )
        .unwrap();
        let (mut want_h, mut want_b) = (vec![0.0; rows * n], b0.clone());
        c.be.gelu_backward(
            View::from(&pre[..]),
            View::from(&product[..]),
            ViewMut::from(&mut want_h[..]),
        )
        .unwrap();
        c.be.sum_rows(View::from(&want_h[..]), n, ViewMut::from(&mut want_b[..]))
            .unwrap();
        let what = format!("{} dgelu n={n}", d.name);
        assert_close(&format!("{what}: dh"), &get(&dh), &want_h, tol_k(d, k));
        // The bias gradient sums `rows` GELU gradients, each within the tolerance above.
        assert_close(
            &format!("{what}: db"),
            &get(&dbias),
            &want_b,
            tol_k(d, k * rows),
        );
    }
}

/// Kernel launches (cuBLASLt matmuls included) of one GPT-2 block's backward on the emulated
/// device with bf16 activations and no dropout, f32 gradients, counted by the driver:
///
/// - 8 matmuls: the input and weight gradients of c_attn, c_proj, c_fc and the MLP's c_proj,
///   three of them with their bias gradient (BGRADA);
/// - 3 adds of those (overwritten) bias gradients into the accumulated ones;
/// - c_fc's GELU gradient after its plain input-gradient product (the default: cuBLASLt's
///   DGELU_BGRAD epilogue measured slower on an H200) and its bias gradient, a 2-kernel
///   column sum;
/// - 2 LayerNorm backwards of 2 kernels each (rows, then the dgamma/dbeta partials' sum), the
///   rows' kernel also adding the residual gradient around the norm to its input gradient;
/// - 3 attention-backward kernels.
///
/// 8 + 3 + 3 + 4 + 3 = 21 (20 with the DGELU_BGRAD epilogue: its add and a widening cast
/// instead of the 3). Before the residual gradient went into the norms: 2 more (separate
/// adds); before the backward epilogues: 6 more (2-kernel column sums instead of the adds).
#[cfg(feature = "cuda")]
const GPT2_BLOCK_BACKWARD_LAUNCHES: u64 = 21;

#[cfg(feature = "cuda")]
#[test]
fn gpt2_block_backward_stays_within_its_launch_budget() {
    use ferrozero_runtime::backend::{self, Backend};
    use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
    use ferrozero_runtime::nn::{BatchIds, Ctx, Grads, Module, Params};
    use ferrozero_runtime::tensor::{FlatBuf, Storage, Tensor};

    let be: std::sync::Arc<dyn Backend> = match backend::cuda::emulated(DType::Bf16) {
        Ok(be) => be,
        Err(e) => return backend::cuda::emu::skip_unless_required(&e.to_string()),
    };
    let mut cfg = Gpt2Config::preset("tiny").unwrap();
    (cfg.n_head, cfg.n_embd, cfg.resid_pdrop) = (2, 32, 0.0);
    let block = gpt2::block(&cfg, 0);
    let put = |v: &[f32], t: DType| {
        let mut b = FlatBuf::zeros(t, v.len());
        b.store_f32(0, v);
        be.upload(b.as_ref()).unwrap()
    };
    let specs = block.param_specs();
    let lens: Vec<usize> = specs.iter().map(|s| s.shape.iter().product()).collect();
    let params: Vec<Storage> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| put(&rand(n, 40 + i as u64), DType::Bf16))
        .collect();
    let mut grads: Vec<Storage> = lens
        .iter()
        .map(|&n| be.zeros(DType::F32, n).unwrap())
        .collect();
    let b = nn_common::batch(2, 8, 50, 3);
    let ids = BatchIds::new(&*be, &b).unwrap();
    let shape = vec![2, 8, 32];
    let x = Tensor::new(shape.clone(), put(&rand(512, 60), DType::Bf16)).unwrap();
    let gy = Tensor::new(shape, put(&rand(512, 61), DType::Bf16)).unwrap();
    let mut saved = None;
    let mut ctx = Ctx {
        be: &*be,
        batch: &b,
        ids: &ids,
        training: true,
        rng_seed: 1,
        rng_row: 0,
        saved: &mut saved,
    };
    let p = Params::new(params.iter().map(Storage::view).collect());
    block.forward(&mut ctx, &p, &x).unwrap();
    let before = be.activity().unwrap();
    let mut g = Grads::new(grads.iter_mut().map(Storage::view_mut).collect());
    block.backward(&mut ctx, &p, &mut g, &gy).unwrap();
    let used = be.activity().unwrap() - before;
    eprintln!("gpt2 block backward: {used:?}");
    assert_eq!(used.gemms, 8, "{used:?}");
    assert_eq!(
        used.kernel_launches, GPT2_BLOCK_BACKWARD_LAUNCHES,
        "{used:?}"
    );
}
