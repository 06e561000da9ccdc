//! ferrozero's CUDA kernels on the CPU emulator of the device: `elementwise.cu`: GELU, SwiGLU, residual adds, dropout and fill against the CPU backend and exact f64 references.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- elementwise ----------------------------------------------------------------------------

// f64 references of the pointwise activations (the same formulas, exact arithmetic).
fn gelu_f64(x: f32) -> f64 {
    let (k, c) = (f64::from(0.797_884_6f32), f64::from(0.044_715f32));
    let x = f64::from(x);
    0.5 * x * (1.0 + (k * (x + c * x * x * x)).tanh())
}

fn gelu_grad_f64(x: f32) -> f64 {
    let (k, c) = (f64::from(0.797_884_6f32), f64::from(0.044_715f32));
    let x = f64::from(x);
    let t = (k * (x + c * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x)
}

fn sigmoid_f64(x: f32) -> f64 {
    1.0 / (1.0 + (-f64::from(x)).exp())
}

/// Largest |gpu - exact| / (1 + |exact|) (f32 outputs only: how far from the truth).
fn worst_vs_exact(gpu: &[f32], exact: &[f64]) -> f64 {
    gpu.iter()
        .zip(exact)
        .map(|(&g, &e)| (f64::from(g) - e).abs() / (1.0 + e.abs()))
        .fold(0.0, f64::max)
}

fn check_elementwise<T: Elem>(emu: &Emu) {
    for (case, &(n, off)) in SIZES.iter().enumerate() {
        let seed = case as u64 * 10;
        let grid = blocks(n, 64 * 8, 5);
        let len = Arg::I64(n as i64);
        let (x, xv) = dev::<T>(&rand_vec(seed, n, 4.0), off);
        let (dy, dyv) = dev::<T>(&rand_vec(seed + 1, n, 1.0), off);
        let (up, upv) = dev::<T>(&rand_vec(seed + 2, n, 2.0), off);
        let what = |k: &str| format!("{k} n={n} off={off}");

        // Activations: against the CPU backend, and (f32) against exact f64 evaluations.
        // (The CPU's own error against exact is up to 2.3e-6 in GELU's gradient, measured.)
        let exact = |gpu: &[f32], _cpu: &[f32], e: Vec<f64>, k: &str| {
            if T::IS_F32 {
                let err = worst_vs_exact(gpu, &e);
                assert!(err <= EXACT_POINTWISE, "{}: {err:e} from exact", what(k));
            }
        };
        let y = Buf::<T>::zeros(n + off);
        emu.run(
            &name::<T>("gelu_forward"),
            grid,
            64,
            &[x.at(off), y.at(off), len],
        );
        let want = cpu::gelu_forward(&xv);
        exact(
            &host(&y, off, n),
            &want,
            xv.iter().map(|&x| gelu_f64(x)).collect(),
            "gelu",
        );
        assert_close::<T>(&what("gelu_forward"), &host(&y, off, n), &want, POINTWISE);

        let dx = Buf::<T>::zeros(n + off);
        let args = [x.at(off), dy.at(off), dx.at(off), len];
        emu.run(&name::<T>("gelu_backward"), grid, 64, &args);
        let want = cpu::gelu_backward(&xv, &dyv);
        let e = xv
            .iter()
            .zip(&dyv)
            .map(|(&x, &d)| f64::from(d) * gelu_grad_f64(x))
            .collect();
        exact(&host(&dx, off, n), &want, e, "gelu_grad");
        assert_close::<T>(&what("gelu_backward"), &host(&dx, off, n), &want, POINTWISE);

        emu.run(
            &name::<T>("swiglu_forward"),
            grid,
            64,
            &[x.at(off), up.at(off), y.at(off), len],
        );
        let want = cpu::swiglu_forward(&xv, &upv);
        let e = xv
            .iter()
            .zip(&upv)
            .map(|(&g, &u)| f64::from(g) * sigmoid_f64(g) * f64::from(u))
            .collect();
        exact(&host(&y, off, n), &want, e, "swiglu");
        assert_close::<T>(&what("swiglu_forward"), &host(&y, off, n), &want, POINTWISE);

        let (dg, du) = (Buf::<T>::zeros(n + off), Buf::<T>::zeros(n + off));
        let args = [
            x.at(off),
            up.at(off),
            dy.at(off),
            dg.at(off),
            du.at(off),
            len,
        ];
        emu.run(&name::<T>("swiglu_backward"), grid, 64, &args);
        let (want_g, want_u) = cpu::swiglu_backward(&xv, &upv, &dyv);
        let e = (0..n)
            .map(|i| {
                let (g, u, d) = (xv[i], f64::from(upv[i]), f64::from(dyv[i]));
                let s = sigmoid_f64(g);
                d * u * s * (1.0 + f64::from(g) * (1.0 - s))
            })
            .collect();
        exact(&host(&dg, off, n), &want_g, e, "swiglu dgate");
        assert_close::<T>(
            &what("swiglu dgate"),
            &host(&dg, off, n),
            &want_g,
            POINTWISE,
        );
        assert_close::<T>(&what("swiglu dup"), &host(&du, off, n), &want_u, POINTWISE);

        // dst += src: one f32 add, one rounding: bit-exact.
        emu.run(
            &name::<T>("add_assign"),
            grid,
            64,
            &[x.at(off), up.at(off), len],
        );
        let mut want = xv.clone();
        cpu::add_assign(&mut want, &upv);
        assert_bits(
            &what("add_assign"),
            &host(&x, off, n),
            &round_to::<T>(&want),
        );

        // Dropout: the same mask and the same scaled values as the CPU, bit for bit; the
        // offsets reach past 32 bits and wrap past 64.
        let offsets = [0u64, 3 << 40, u64::MAX - 5];
        for ((seed, p), offset) in [(7u64, 0.1f32), (u64::MAX, 0.5), (3, 0.0)]
            .into_iter()
            .zip(offsets)
        {
            let (b, bv) = dev::<T>(&rand_vec(seed, n, 3.0), off);
            let args = [
                b.at(off),
                len,
                Arg::U64(seed),
                Arg::U64(offset),
                Arg::F32(p),
            ];
            emu.run(&name::<T>("dropout"), grid, 64, &args);
            let mut want = bv.clone();
            cpu::dropout(seed, offset, p, &mut want);
            assert_bits(&what("dropout"), &host(&b, off, n), &round_to::<T>(&want));
        }

        emu.run(
            &name::<T>("fill"),
            grid,
            64,
            &[up.at(off), len, Arg::F32(0.1)],
        );
        assert_bits(
            &what("fill"),
            &host(&up, off, n),
            &round_to::<T>(&vec![0.1; n]),
        );
        assert_eq!(
            up.get()[..off],
            vec![T::from_f32(0.0); off][..],
            "fill wrote before"
        );
    }
}

#[test]
fn elementwise_matches_cpu() {
    let emu = emu_or_skip!();
    check_elementwise::<f32>(emu);
    check_elementwise::<bf16>(emu);
    check_elementwise::<f16>(emu);
}
