//! ferrozero's CUDA kernels on the CPU emulator of the device: `loss.cu`: cross-entropy forward and backward, the loss sum and argmax against the CPU backend.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- loss ----------------------------------------------------------------------------------

fn check_loss<T: Elem>(emu: &Emu) {
    // Odd vocabularies put rows at every alignment (unaligned heads, vector bodies, tails).
    for &(rows, vocab, block) in &[
        (1usize, 37usize, 32u32),
        (9, 1001, 128),
        (4, 4096, 256),
        (3, 5, 64),
    ] {
        let what = |k: &str| format!("{k} rows={rows} vocab={vocab}");
        let (logits, lv) = dev::<T>(
            &rand_vec(rows as u64 * 3 + vocab as u64, rows * vocab, 6.0),
            0,
        );
        let mut rng = fastrand::Rng::with_seed(vocab as u64);
        let mut targets: Vec<i32> = (0..rows).map(|_| rng.i32(0..vocab as i32)).collect();
        if rows > 1 {
            targets[1] = -100; // an ignored row
        }
        let tg = Buf::from(&targets);
        let (lse, loss) = (Buf::<f32>::zeros(rows), Buf::<f32>::zeros(rows));
        let bad = Buf::<i32>::zeros(1);
        let (r, v) = (Arg::I64(rows as i64), Arg::I32(vocab as i32));
        let grid = blocks(rows, 1, 4);
        let args = [
            logits.ptr(),
            tg.ptr(),
            lse.ptr(),
            loss.ptr(),
            r,
            v,
            bad.ptr(),
        ];
        emu.run(&name::<T>("cross_entropy_forward"), grid, block, &args);
        assert_eq!(bad.get()[0], 0);

        // Per row against f64 loops; the total against the CPU backend.
        let (got_lse, got_loss) = (lse.get(), loss.get());
        for row in 0..rows {
            let x = &lv[row * vocab..][..vocab];
            let max = x
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let lse_ref = max
                + x.iter()
                    .map(|&v| (f64::from(v) - max).exp())
                    .sum::<f64>()
                    .ln();
            let t = targets[row];
            let loss_ref = if t == -100 {
                0.0
            } else {
                lse_ref - f64::from(x[t as usize])
            };
            assert_close::<f32>(&what("lse"), &[got_lse[row]], &[lse_ref as f32], REDUCTION);
            assert_close::<f32>(
                &what("loss"),
                &[got_loss[row]],
                &[loss_ref as f32],
                REDUCTION,
            );
        }
        let (_probs, cpu_sum) = cpu::cross_entropy_forward(&lv, vocab, &targets);
        let (sum, acc) = (Buf::<f32>::zeros(1), Buf::from(&[0.25f64]));
        for _ in 0..2 {
            emu.run(
                "cross_entropy_loss_sum",
                1,
                1024,
                &[loss.ptr(), r, sum.ptr(), acc.ptr()],
            );
        }
        assert_close::<f32>(&what("loss sum"), &sum.get(), &[cpu_sum as f32], REDUCTION);
        let acc_got = acc.get()[0];
        assert!(
            (acc_got - (0.25 + 2.0 * cpu_sum)).abs() <= 1e-5 * (1.0 + cpu_sum.abs()),
            "{}: {acc_got} vs {}",
            what("loss accumulator"),
            0.25 + 2.0 * cpu_sum
        );

        // Backward: into a separate buffer, then in place.
        let g = 0.37f32;
        let want = cpu::cross_entropy_backward(&lv, vocab, &targets, g);
        let dl = Buf::<T>::zeros(rows * vocab);
        let args = [
            logits.ptr(),
            tg.ptr(),
            lse.ptr(),
            dl.ptr(),
            r,
            v,
            Arg::F32(g),
        ];
        emu.run(&name::<T>("cross_entropy_backward"), grid, block, &args);
        let tol = Tol {
            rel: 1e-5,
            abs: 1e-6 * g,
        };
        assert_close::<T>(&what("dlogits"), &host(&dl, 0, rows * vocab), &want, tol);
        let args = [
            logits.ptr(),
            tg.ptr(),
            lse.ptr(),
            logits.ptr(),
            r,
            v,
            Arg::F32(g),
        ];
        emu.run(&name::<T>("cross_entropy_backward"), grid, block, &args);
        assert_eq!(
            host(&logits, 0, rows * vocab),
            host(&dl, 0, rows * vocab),
            "{}",
            what("in place")
        );
    }

    // An out-of-range target: flagged, loss 0, zero gradient row, no read outside the row.
    let (rows, vocab) = (2usize, 37usize);
    let (logits, _) = dev::<T>(&rand_vec(9, rows * vocab, 2.0), 0);
    let tg = Buf::from(&[3i32, 37]);
    let (lse, loss, bad) = (
        Buf::<f32>::zeros(rows),
        Buf::<f32>::zeros(rows),
        Buf::<i32>::zeros(1),
    );
    let (r, v) = (Arg::I64(rows as i64), Arg::I32(vocab as i32));
    let args = [
        logits.ptr(),
        tg.ptr(),
        lse.ptr(),
        loss.ptr(),
        r,
        v,
        bad.ptr(),
    ];
    emu.run(&name::<T>("cross_entropy_forward"), 2, 32, &args);
    assert_eq!(bad.get()[0], 1);
    assert_eq!(loss.get()[1], 0.0);
    let dl = Buf::<T>::from(&vec![T::from_f32(9.0); rows * vocab]);
    let args = [
        logits.ptr(),
        tg.ptr(),
        lse.ptr(),
        dl.ptr(),
        r,
        v,
        Arg::F32(1.0),
    ];
    emu.run(&name::<T>("cross_entropy_backward"), 2, 32, &args);
    assert!(host(&dl, vocab, vocab).iter().all(|&x| x == 0.0));
}

fn check_argmax<T: Elem>(emu: &Emu) {
    for &(rows, cols, block) in &[(6usize, 37usize, 32u32), (4, 1001, 256), (3, 1, 32)] {
        let mut rng = fastrand::Rng::with_seed(cols as u64);
        // Small integers: many ties, which must go to the first index.
        let mut x: Vec<f32> = (0..rows * cols).map(|_| rng.i32(-5..6) as f32).collect();
        if cols > 2 {
            x[cols + 1] = f32::NAN; // NaN never wins
            x[2 * cols] = f32::NAN; // a NaN first element: 0
        }
        let (xb, xv) = dev::<T>(&x, 0);
        let out = Buf::<i32>::zeros(rows);
        let args = [
            xb.ptr(),
            out.ptr(),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
        ];
        emu.run(&name::<T>("argmax"), 2, block, &args);
        let want: Vec<i32> = cpu::argmax_rows(&xv, cols)
            .iter()
            .map(|&i| i as i32)
            .collect();
        assert_eq!(
            out.get(),
            want,
            "argmax rows={rows} cols={cols} ({})",
            T::SUFFIX
        );
    }
}

#[test]
fn loss_and_argmax_match_cpu() {
    let emu = emu_or_skip!();
    check_loss::<f32>(emu);
    check_loss::<bf16>(emu);
    check_loss::<f16>(emu);
    check_argmax::<f32>(emu);
    check_argmax::<bf16>(emu);
    check_argmax::<f16>(emu);
}
