//! ferrozero's CUDA kernels on the CPU emulator of the device: `embed.cu`: token and position embeddings, forward and backward, bit for bit against the CPU backend.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;
use std::collections::BTreeMap;

// ---- embeddings ----------------------------------------------------------------------------

/// The host's CSR for embedding backward: distinct ids, offsets, positions in increasing order.
fn csr(tokens: &[i32]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut by_token: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for (p, &t) in tokens.iter().enumerate() {
        by_token.entry(t).or_default().push(p as i32);
    }
    let (mut uniq, mut offsets, mut positions) = (Vec::new(), vec![0], Vec::new());
    for (t, ps) in by_token {
        uniq.push(t);
        positions.extend(ps);
        offsets.push(positions.len() as i32);
    }
    (uniq, offsets, positions)
}

fn check_embeddings<T: Elem>(emu: &Emu) {
    let vocab = 50usize;
    for &(batch, seq, dim) in &[(1usize, 1usize, 7usize), (3, 13, 64), (2, 20, 48)] {
        let rows = batch * seq;
        let what = |k: &str| format!("{k} rows={rows} dim={dim}");
        let mut rng = fastrand::Rng::with_seed(dim as u64);
        // Few distinct ids, so most repeat.
        let tokens: Vec<i32> = (0..rows)
            .map(|_| rng.i32(0..vocab.min(12) as i32))
            .collect();
        let tok_u: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let (table, tv) = dev::<T>(&rand_vec(1, vocab * dim, 1.0), 0);
        let (out, ov) = dev::<T>(&rand_vec(2, rows * dim, 1.0), 0);
        let tok_d = Buf::from(&tokens);
        let bad = Buf::<i32>::zeros(1);
        let (r, d) = (Arg::I64(rows as i64), Arg::I32(dim as i32));

        for add in [true, false] {
            let args = [
                tok_d.ptr(),
                table.ptr(),
                out.ptr(),
                r,
                d,
                Arg::I64(vocab as i64),
                Arg::I32(add as i32),
                bad.ptr(),
            ];
            let before = host(&out, 0, rows * dim);
            emu.run(&name::<T>("embedding_forward"), 2, 64, &args);
            let mut want = before.clone();
            cpu::embedding_forward(&tok_u, &tv, dim, &mut want, add);
            assert_bits(
                &what("embedding_forward"),
                &host(&out, 0, rows * dim),
                &round_to::<T>(&want),
            );
            assert_eq!(bad.get()[0], 0);
        }
        let _ = ov;

        // Out-of-range ids: flagged, never read; the row is zeroed (or kept when adding).
        let mut bad_tokens = tokens.clone();
        bad_tokens[0] = -1;
        *bad_tokens.last_mut().unwrap() = vocab as i32;
        let bt = Buf::from(&bad_tokens);
        for add in [false, true] {
            let bad = Buf::<i32>::zeros(1);
            let (o, ov) = dev::<T>(&rand_vec(3, rows * dim, 1.0), 0);
            let args = [
                bt.ptr(),
                table.ptr(),
                o.ptr(),
                r,
                d,
                Arg::I64(vocab as i64),
                Arg::I32(add as i32),
                bad.ptr(),
            ];
            emu.run(&name::<T>("embedding_forward"), 1, 64, &args);
            assert_eq!(bad.get()[0], 1, "{}", what("bad id flag"));
            let got = host(&o, 0, rows * dim);
            let last = rows - 1;
            let expect_row = |row: usize| {
                if add {
                    ov[row * dim..][..dim].to_vec()
                } else {
                    vec![0.0; dim]
                }
            };
            assert_bits(&what("bad row 0"), &got[..dim], &expect_row(0));
            assert_bits(&what("bad last row"), &got[last * dim..], &expect_row(last));
        }

        // Position forward: out[b, t] += wpe[t].
        let (wpe, wv) = dev::<T>(&rand_vec(4, seq * dim, 1.0), 0);
        let before = host(&out, 0, rows * dim);
        let args = [wpe.ptr(), out.ptr(), r, Arg::I32(seq as i32), d];
        emu.run(&name::<T>("position_forward"), 1, 64, &args);
        let want: Vec<f32> = (0..rows * dim)
            .map(|i| before[i] + wv[(i / dim % seq) * dim + i % dim])
            .collect();
        assert_bits(
            &what("position_forward"),
            &host(&out, 0, rows * dim),
            &round_to::<T>(&want),
        );

        // Embedding backward through the host-built CSR: the CPU's serial scatter, bit for bit.
        let (dout, dv) = dev::<T>(&rand_vec(5, rows * dim, 1.0), 0);
        let acc0 = rand_vec(6, vocab * dim, 0.5);
        let (uniq, offsets, positions) = csr(&tokens);
        let dtable = Buf::from(&acc0);
        let bad = Buf::<i32>::zeros(1);
        let (u, o, p) = (Buf::from(&uniq), Buf::from(&offsets), Buf::from(&positions));
        let args = [
            dout.ptr(),
            u.ptr(),
            o.ptr(),
            p.ptr(),
            dtable.ptr(),
            Arg::I32(uniq.len() as i32),
            d,
            Arg::I64(vocab as i64),
            bad.ptr(),
        ];
        emu.run(&name::<T>("embedding_backward"), 3, 32, &args);
        let mut want = acc0.clone();
        cpu::embedding_backward(&tok_u, &dv, dim, &mut want);
        assert_bits(&what("embedding_backward"), &dtable.get(), &want);
        assert_eq!(bad.get()[0], 0);

        // An id outside the table in the CSR: skipped and flagged.
        let bad_uniq = Buf::from(&[vocab as i32 + 3]);
        let one = Buf::from(&[0i32, 1]);
        let args = [
            dout.ptr(),
            bad_uniq.ptr(),
            one.ptr(),
            p.ptr(),
            dtable.ptr(),
            Arg::I32(1),
            d,
            Arg::I64(vocab as i64),
            bad.ptr(),
        ];
        emu.run(&name::<T>("embedding_backward"), 1, 32, &args);
        assert_eq!(bad.get()[0], 1);
        assert_bits(&what("embedding_backward untouched"), &dtable.get(), &want);

        // Position backward: dwpe[t] += dout[b, t] for b in order (the CPU's scatter of
        // position ids).
        let dwpe0 = rand_vec(7, seq * dim, 0.5);
        let dwpe = Buf::from(&dwpe0);
        let args = [
            dout.ptr(),
            dwpe.ptr(),
            Arg::I64(batch as i64),
            Arg::I32(seq as i32),
            d,
        ];
        emu.run(&name::<T>("position_backward"), 2, 32, &args);
        let pos_ids: Vec<u32> = (0..rows).map(|i| (i % seq) as u32).collect();
        let mut want = dwpe0.clone();
        cpu::embedding_backward(&pos_ids, &dv, dim, &mut want);
        assert_bits(&what("position_backward"), &dwpe.get(), &want);
    }
}

#[test]
fn embeddings_match_cpu() {
    let emu = emu_or_skip!();
    check_embeddings::<f32>(emu);
    check_embeddings::<bf16>(emu);
    check_embeddings::<f16>(emu);
}
