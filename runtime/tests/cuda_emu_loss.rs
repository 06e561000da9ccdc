//! ferrozero's CUDA kernels on the CPU emulator of the device: `loss.cu`: cross-entropy forward,
//! backward and fused, the loss sum and argmax against the CPU backend; padded rows (ld > vocab).
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
            v, // ld: packed rows
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
            v, // ld: packed rows
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
            v, // ld: packed rows
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
        v, // ld
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
        v, // ld
        Arg::F32(1.0),
    ];
    emu.run(&name::<T>("cross_entropy_backward"), 2, 32, &args);
    assert!(host(&dl, vocab, vocab).iter().all(|&x| x == 0.0));
}

/// Rows with a leading dimension past the vocabulary (NaN padding): forward reads only the
/// vocabulary's columns, and the fused kernel gives forward's losses and backward's gradients
/// bit for bit, in place, leaving the padding as it was.
fn check_fused_padded<T: Elem>(emu: &Emu) {
    for &(rows, vocab, ld, block) in &[(5usize, 37usize, 128usize, 32u32), (3, 1001, 1024, 256)] {
        let what = |k: &str| format!("{k} rows={rows} vocab={vocab} ld={ld} ({})", T::SUFFIX);
        let vals = rand_vec(vocab as u64 + 7, rows * vocab, 6.0);
        let mut padded = vec![f32::NAN; rows * ld];
        for r in 0..rows {
            padded[r * ld..][..vocab].copy_from_slice(&vals[r * vocab..][..vocab]);
        }
        let (packed, _) = dev::<T>(&vals, 0);
        let (logits, _) = dev::<T>(&padded, 0);
        let mut targets: Vec<i32> = (0..rows).map(|r| ((r * 13 + 5) % vocab) as i32).collect();
        targets[1] = -100;
        let tg = Buf::from(&targets);
        let (r, v, g) = (Arg::I64(rows as i64), Arg::I32(vocab as i32), 0.37f32);
        let ldv = Arg::I32(ld as i32);
        let grid = blocks(rows, 1, 4);
        let run_forward = |x: &Buf<T>, ld: Arg| {
            let (lse, loss, bad) = (
                Buf::<f32>::zeros(rows),
                Buf::<f32>::zeros(rows),
                Buf::<i32>::zeros(1),
            );
            let args = [
                x.ptr(),
                tg.ptr(),
                lse.ptr(),
                loss.ptr(),
                r,
                v,
                ld,
                bad.ptr(),
            ];
            emu.run(&name::<T>("cross_entropy_forward"), grid, block, &args);
            assert_eq!(bad.get()[0], 0);
            (lse, loss)
        };
        let (lse, loss) = run_forward(&packed, v);
        let (plse, ploss) = run_forward(&logits, ldv);
        assert_eq!(ploss.get(), loss.get(), "{}", what("padded forward loss"));
        assert_eq!(plse.get(), lse.get(), "{}", what("padded forward lse"));
        let args = [
            packed.ptr(),
            tg.ptr(),
            lse.ptr(),
            packed.ptr(),
            r,
            v,
            v,
            Arg::F32(g),
        ];
        emu.run(&name::<T>("cross_entropy_backward"), grid, block, &args);
        let (floss, bad) = (Buf::<f32>::zeros(rows), Buf::<i32>::zeros(1));
        let args = [
            logits.ptr(),
            tg.ptr(),
            floss.ptr(),
            r,
            v,
            ldv,
            Arg::F32(g),
            bad.ptr(),
        ];
        emu.run(&name::<T>("cross_entropy_fused"), grid, block, &args);
        assert_eq!(bad.get()[0], 0);
        assert_eq!(floss.get(), loss.get(), "{}", what("fused loss"));
        let (grads, all) = (host(&packed, 0, rows * vocab), host(&logits, 0, rows * ld));
        for r in 0..rows {
            let row = &all[r * ld..][..ld];
            let want = &grads[r * vocab..][..vocab];
            let same = row[..vocab]
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{}", what(&format!("fused dlogits row {r}")));
            assert!(
                row[vocab..].iter().all(|x| x.is_nan()),
                "{}",
                what("padding written")
            );
        }
    }
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
    check_fused_padded::<f32>(emu);
    check_fused_padded::<bf16>(emu);
    check_fused_padded::<f16>(emu);
    check_argmax::<f32>(emu);
    check_argmax::<bf16>(emu);
    check_argmax::<f16>(emu);
}
