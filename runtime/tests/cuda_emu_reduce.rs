//! ferrozero's CUDA kernels on the CPU emulator of the device: `reduce.cu`: unscaling with the overflow flag, max/div, sums of squares and column sums.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- reductions ----------------------------------------------------------------------------

fn check_reduce<T: Elem>(emu: &Emu) {
    for &(n, off) in SIZES {
        let what = |k: &str| format!("{k} n={n} off={off}");
        let len = Arg::I64(n as i64);
        let grid = blocks(n, 64 * 8, 6);

        // acc = round(acc + src): FlatBuf::accumulate's kernel on a large accumulator.
        let (acc, av) = dev::<T>(&rand_vec(1, n, 100.0), off);
        let (src, sv) = dev::<T>(&rand_vec(2, n, 1.0), off);
        emu.run(
            &name::<T>("add_assign"),
            grid,
            64,
            &[acc.at(off), src.at(off), len],
        );
        let want: Vec<f32> = av.iter().zip(&sv).map(|(a, b)| a + b).collect();
        assert_bits(
            &what("accumulate"),
            &host(&acc, off, n),
            &round_to::<T>(&want),
        );

        // Unscale: values bit-exact, the flag only for a non-finite result.
        let flag = Buf::<i32>::zeros(1);
        let s = 1.0 / 1024.0;
        emu.run(
            &name::<T>("unscale"),
            grid,
            64,
            &[src.at(off), len, Arg::F32(s), flag.ptr()],
        );
        let want: Vec<f32> = sv.iter().map(|v| v * s).collect();
        assert_bits(&what("unscale"), &host(&src, off, n), &round_to::<T>(&want));
        assert_eq!(flag.get()[0], 0, "{}", what("unscale flag"));
        let mut vals = rand_vec(3, n, 1.0);
        vals[n / 2] = if n % 2 == 0 { f32::INFINITY } else { f32::NAN };
        let (b, _) = dev::<T>(&vals, off);
        let before = b.get();
        emu.run(
            &name::<T>("unscale"),
            grid,
            64,
            &[b.at(off), len, Arg::F32(1.0), flag.ptr()],
        );
        assert_eq!(flag.get()[0], 1, "{}", what("unscale flag"));
        let same = b
            .get()
            .iter()
            .zip(&before)
            .all(|(x, y)| bytemuck::bytes_of(x) == bytemuck::bytes_of(y));
        assert!(same, "{}", what("s = 1 writes nothing"));

        // Sum of squares: per-block f64 partials, then their ordered sum.
        let (x, xv) = dev::<T>(&rand_vec(4, n, 3.0), off);
        for parts in [1usize, 7] {
            let partials = Buf::<f64>::zeros(parts);
            let args = [x.at(off), len, partials.ptr()];
            emu.run(&name::<T>("sum_squares"), parts as u32, 64, &args);
            let (out, out32) = (Buf::<f64>::zeros(1), Buf::<f32>::zeros(1));
            let args = [
                partials.ptr(),
                Arg::I64(parts as i64),
                out.ptr(),
                out32.ptr(),
            ];
            emu.run("sum_squares_finalize", 1, 32, &args);
            let want = cpu::sum_squares(&xv);
            let got = out.get()[0];
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "{}: {got} vs {want}",
                what("sum_squares")
            );
            assert_eq!(out32.get()[0], got as f32);
        }
    }

    // f16 overflow on the way back is non-finite too.
    if T::SUFFIX == "f16" {
        let (b, _) = dev::<T>(&[60000.0, 1.0], 0);
        let flag = Buf::<i32>::zeros(1);
        emu.run(
            &name::<T>("unscale"),
            1,
            32,
            &[b.ptr(), Arg::I64(2), Arg::F32(2.0), flag.ptr()],
        );
        assert_eq!(flag.get()[0], 1);
    }

    // Column sums (bias gradients): per-chunk partials, then chunk order.
    for &(rows, cols, rpc) in &[(70usize, 33usize, 16usize), (5, 64, 32), (1, 3, 1)] {
        let (m, mv) = dev::<T>(&rand_vec(rows as u64, rows * cols, 1.0), 0);
        let nchunks = rows.div_ceil(rpc);
        let partial = Buf::<f32>::zeros(nchunks * cols);
        let acc0 = rand_vec(5, cols, 1.0);
        let acc = Buf::from(&acc0);
        let args = [
            m.ptr(),
            partial.ptr(),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
            Arg::I32(rpc as i32),
        ];
        emu.run(&name::<T>("colsum_partial"), 2, 32, &args);
        let args = [
            partial.ptr(),
            acc.ptr(),
            Arg::I64(nchunks as i64),
            Arg::I32(cols as i32),
        ];
        emu.run("colsum_finalize", 1, 32, &args);
        let mut want = acc0.clone();
        cpu::column_sums(&mv, cols, &mut want);
        assert_close::<f32>(
            &format!("colsum rows={rows} cols={cols}"),
            &acc.get(),
            &want,
            REDUCTION,
        );
    }
}

#[test]
fn reductions_match_cpu() {
    let emu = emu_or_skip!();
    check_reduce::<f32>(emu);
    check_reduce::<bf16>(emu);
    check_reduce::<f16>(emu);
}
