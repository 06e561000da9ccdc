//! ferrozero's CUDA kernels on the CPU emulator of the device: `norm.cu`: LayerNorm and RMSNorm forward and backward against the CPU backend.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- norms ---------------------------------------------------------------------------------

/// (rows, dim, grid): one row, odd widths, rows beyond grid * warps, a GPT-2 width, and
/// enough 32-row chunks (10) for the finalize's eight-at-a-time sums.
const NORM_SHAPES: &[(usize, usize, u32)] = &[
    (1, 7, 1),
    (70, 64, 2),
    (33, 768, 3),
    (5, 100, 1),
    (300, 40, 4),
];

fn check_norms<T: Elem>(emu: &Emu) {
    let eps = 1e-5f32;
    for (case, &(rows, dim, grid)) in NORM_SHAPES.iter().enumerate() {
        let seed = 100 + case as u64 * 10;
        let what = |k: &str| format!("{k} rows={rows} dim={dim}");
        let (x, xv) = dev::<T>(&rand_vec(seed, rows * dim, 2.0), 0);
        let x_shift: Vec<f32> = xv.iter().map(|v| v + 0.5).collect();
        let (x, xv) = if case % 2 == 0 {
            (x, xv)
        } else {
            dev::<T>(&x_shift, 0)
        };
        let (gamma, gv) = dev::<T>(&rand_vec(seed + 1, dim, 1.5), 0);
        let (beta, bv) = dev::<T>(&rand_vec(seed + 2, dim, 0.5), 0);
        let (dy, dyv) = dev::<T>(&rand_vec(seed + 3, rows * dim, 1.0), 0);
        let (r, d) = (Arg::I64(rows as i64), Arg::I32(dim as i32));

        // LayerNorm forward.
        let y = Buf::<T>::zeros(rows * dim);
        let (mean, rstd) = (Buf::<f32>::zeros(rows), Buf::<f32>::zeros(rows));
        let args = [
            x.ptr(),
            gamma.ptr(),
            beta.ptr(),
            y.ptr(),
            mean.ptr(),
            rstd.ptr(),
            r,
            d,
            Arg::F32(eps),
        ];
        emu.run(&name::<T>("layernorm_forward"), grid, 128, &args);
        let (wy, wm, wr) = cpu::layernorm_forward(&xv, &gv, &bv, eps);
        assert_close::<T>(
            &what("layernorm y"),
            &host(&y, 0, rows * dim),
            &wy,
            REDUCTION,
        );
        assert_close::<f32>(&what("layernorm mean"), &mean.get(), &wm, REDUCTION);
        assert_close::<f32>(&what("layernorm rstd"), &rstd.get(), &wr, REDUCTION);

        // LayerNorm backward from the CPU's statistics, into non-zero accumulators.
        let acc0 = rand_vec(seed + 4, dim, 1.0);
        for rpc in [32usize, 7, 64] {
            let nchunks = rows.div_ceil(rpc);
            let (mean_d, rstd_d) = (Buf::from(&wm), Buf::from(&wr));
            let dx = Buf::<T>::zeros(rows * dim);
            let partial = Buf::<f32>::zeros(2 * nchunks * dim);
            let (dgamma, dbeta) = (Buf::from(&acc0), Buf::from(&acc0));
            let args = [
                x.ptr(),
                gamma.ptr(),
                mean_d.ptr(),
                rstd_d.ptr(),
                dy.ptr(),
                dx.ptr(),
                partial.ptr(),
                r,
                d,
                Arg::I32(rpc as i32),
            ];
            emu.run(&name::<T>("layernorm_backward"), grid, 128, &args);
            let args = [
                partial.ptr(),
                Arg::I64(nchunks as i64),
                d,
                dgamma.ptr(),
                dbeta.ptr(),
            ];
            emu.run("norm_dparams_finalize", blocks(dim, 64, 4), 64, &args);
            let (mut wg, mut wb) = (acc0.clone(), acc0.clone());
            let wdx = cpu::layernorm_backward(&xv, &gv, &wm, &wr, &dyv, &mut wg, &mut wb);
            assert_close::<T>(
                &what("layernorm dx"),
                &host(&dx, 0, rows * dim),
                &wdx,
                REDUCTION,
            );
            if rpc == 32 {
                // The CPU's 32-row blocks: the same sums in the same order.
                assert_bits(&what("layernorm dgamma"), &dgamma.get(), &wg);
                assert_bits(&what("layernorm dbeta"), &dbeta.get(), &wb);
            } else {
                assert_close::<f32>(&what("layernorm dgamma"), &dgamma.get(), &wg, REDUCTION);
                assert_close::<f32>(&what("layernorm dbeta"), &dbeta.get(), &wb, REDUCTION);
            }
        }

        // RMSNorm forward and backward.
        let args = [
            x.ptr(),
            gamma.ptr(),
            y.ptr(),
            rstd.ptr(),
            r,
            d,
            Arg::F32(eps),
        ];
        emu.run(&name::<T>("rmsnorm_forward"), grid, 64, &args);
        let (wy, wr) = cpu::rmsnorm_forward(&xv, &gv, eps);
        assert_close::<T>(&what("rmsnorm y"), &host(&y, 0, rows * dim), &wy, REDUCTION);
        assert_close::<f32>(&what("rmsnorm rstd"), &rstd.get(), &wr, REDUCTION);
        for rpc in [32usize, 5, 40] {
            let nchunks = rows.div_ceil(rpc);
            let rstd_d = Buf::from(&wr);
            let dx = Buf::<T>::zeros(rows * dim);
            let partial = Buf::<f32>::zeros(nchunks * dim);
            let dgamma = Buf::from(&acc0);
            let args = [
                x.ptr(),
                gamma.ptr(),
                rstd_d.ptr(),
                dy.ptr(),
                dx.ptr(),
                partial.ptr(),
                r,
                d,
                Arg::I32(rpc as i32),
            ];
            emu.run(&name::<T>("rmsnorm_backward"), 2, 96, &args);
            let args = [
                partial.ptr(),
                Arg::I64(nchunks as i64),
                d,
                dgamma.ptr(),
                null(),
            ];
            emu.run("norm_dparams_finalize", 1, 32, &args);
            let mut wg = acc0.clone();
            let wdx = cpu::rmsnorm_backward(&xv, &gv, &wr, &dyv, &mut wg);
            assert_close::<T>(
                &what("rmsnorm dx"),
                &host(&dx, 0, rows * dim),
                &wdx,
                REDUCTION,
            );
            if rpc == 32 {
                assert_bits(&what("rmsnorm dgamma"), &dgamma.get(), &wg);
            } else {
                assert_close::<f32>(&what("rmsnorm dgamma"), &dgamma.get(), &wg, REDUCTION);
            }
        }
    }
}

#[test]
fn norms_match_cpu() {
    let emu = emu_or_skip!();
    check_norms::<f32>(emu);
    check_norms::<bf16>(emu);
    check_norms::<f16>(emu);
}
