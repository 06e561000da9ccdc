//! ferrozero's CUDA kernels on the CPU emulator of the device: `rope.cu`: rotary embeddings, bit for bit against the CPU backend.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;

// ---- RoPE ----------------------------------------------------------------------------------

/// The host's table, built as backend/cpu/rope.rs builds its own: (cos, sin) for +theta.
fn rope_table(seq: usize, head_dim: usize, theta: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let mut t = Vec::with_capacity(seq * half * 2);
    for pos in 0..seq {
        for i in 0..half {
            let inv = f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64);
            let a = pos as f64 * inv;
            t.push(a.cos() as f32);
            t.push(a.sin() as f32);
        }
    }
    t
}

fn check_rope<T: Elem>(emu: &Emu) {
    let theta = 10_000.0f32;
    // head_dim 6: odd half (element by element); 64: vectors.
    for &(batch, seq, heads, head_dim) in &[
        (2usize, 5usize, 3usize, 8usize),
        (1, 3, 2, 6),
        (2, 7, 4, 64),
    ] {
        let rows = batch * seq;
        let n = rows * heads * head_dim;
        let table = Buf::from(&rope_table(seq, head_dim, theta));
        for inverse in [false, true] {
            let (x, xv) = dev::<T>(&rand_vec(n as u64, n, 2.0), 0);
            let args = [
                x.ptr(),
                table.ptr(),
                Arg::I64(rows as i64),
                Arg::I32(seq as i32),
                Arg::I32(heads as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(inverse as i32),
            ];
            // Rows across threadIdx.y too, and fewer blocks than rows.
            emu.try_launch(&name::<T>("rope"), [2, 1, 1], [16, 3, 1], 0, &args)
                .unwrap();
            let mut want = xv.clone();
            cpu::rope(&mut want, batch, seq, heads, head_dim, theta, inverse);
            let what = format!("rope head_dim={head_dim} inverse={inverse}");
            assert_bits(&what, &host(&x, 0, n), &round_to::<T>(&want));
        }
    }
}

#[test]
fn rope_matches_cpu_bit_for_bit() {
    let emu = emu_or_skip!();
    check_rope::<f32>(emu);
    check_rope::<bf16>(emu);
    check_rope::<f16>(emu);
}
