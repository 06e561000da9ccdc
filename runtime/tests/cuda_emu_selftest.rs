//! ferrozero's CUDA kernels on the CPU emulator of the device: the emulator's own CUDA semantics: shuffles, votes, barriers, shared memory, misuse reports, speed and tensor-core fragments.
//! Tolerances and the skip rule: `cuda_emu_common/mod.rs`.

#[macro_use]
mod cuda_emu_common;

use cuda_emu_common::*;
use ferrozero_runtime::backend::cuda::kernels::KernelSource;

// ---- the emulator itself -------------------------------------------------------------------

const SELFTEST: &[KernelSource] = &[KernelSource {
    file: "emu_selftest.cu",
    code: include_str!("cuda_emu_common/emu_selftest.cu"),
    kernels: &[
        "t_shfl",
        "t_shfl_wide",
        "t_vote",
        "t_sync_votes",
        "t_reverse_3d",
        "t_dyn_smem",
        "t_divergent_barrier",
        "t_deadlock",
        "t_bad_mask",
        "t_trap",
        "t_fault",
        "t_stack_overflow",
        "t_early_exit",
        "t_partial_warp_sum",
        "t_half_warps",
        "t_busy",
        "t_mma",
    ],
}];

macro_rules! selftest_or_skip {
    () => {
        match cuda_emu_common::harness::custom(SELFTEST) {
            Some(e) => e,
            None => return,
        }
    };
}

const POISON: u32 = u32::MAX;

/// CUDA's documented shuffle results (Programming Guide, warp shuffle functions), written from
/// the prose independently of the emulator's PTX-rule implementation. `None`: the source lane
/// does not exist (undefined in CUDA, poison in the emulator).
fn shfl_model(mode: i32, lane: usize, arg: i32, width: usize, present: usize) -> Option<u32> {
    let base = lane / width * width; // the lane's segment
    let src = match mode {
        // "srcLane modulo width", within the segment.
        0 => base + (arg.rem_euclid(width as i32)) as usize,
        // Up: lanes below delta in the segment keep their own value.
        1 => {
            let d = (arg as u32 & 31) as usize;
            if lane - base >= d {
                lane - d
            } else {
                lane
            }
        }
        // Down: sources past the segment's end keep their own value.
        2 => {
            let d = (arg as u32 & 31) as usize;
            if lane - base + d < width {
                lane + d
            } else {
                lane
            }
        }
        // Xor: earlier segments may be read, later ones give the own value.
        _ => {
            let s = lane ^ (arg as u32 & 31) as usize;
            if s < base + width {
                s
            } else {
                lane
            }
        }
    };
    (src < present).then_some(1000 + src as u32)
}

#[test]
fn emulator_shuffles_follow_cuda() {
    let emu = selftest_or_skip!();
    let mut rng = fastrand::Rng::with_seed(5);
    for threads in [32usize, 64, 48] {
        for mode in 0..4 {
            for width in [1usize, 2, 4, 8, 16, 32] {
                let args: Vec<i32> = (0..threads)
                    .map(|_| match mode {
                        0 => rng.i32(-40..70),
                        1 | 2 => rng.i32(0..40),
                        _ => rng.i32(0..32),
                    })
                    .collect();
                let (a, out) = (Buf::from(&args), Buf::<u32>::zeros(threads));
                let params = [a.ptr(), out.ptr(), Arg::I32(mode), Arg::I32(width as i32)];
                emu.run("t_shfl", 1, threads as u32, &params);
                let got = out.get();
                for lane in 0..threads {
                    let want =
                        shfl_model(mode, lane % 32, args[lane], width, threads - lane / 32 * 32)
                            .map(|v| v + (lane / 32 * 32) as u32)
                            .unwrap_or(POISON);
                    assert_eq!(
                        got[lane], want,
                        "mode {mode} width {width} block {threads} lane {lane} arg {}",
                        args[lane]
                    );
                }
            }
        }
    }
    let (d, l) = (Buf::<f64>::zeros(64), Buf::<i64>::zeros(64));
    emu.run("t_shfl_wide", 1, 64, &[d.ptr(), l.ptr()]);
    for t in 0..64 {
        assert_eq!(d.get()[t], 0.5 + (t ^ 1) as f64);
        assert_eq!(l.get()[t], (1i64 << 40) + (t ^ 1) as i64);
    }
    // A width that is not a power of two is an error.
    let (a, out) = (Buf::from(&[0i32; 32]), Buf::<u32>::zeros(32));
    let err = emu
        .try_launch(
            "t_shfl",
            [1, 1, 1],
            [32, 1, 1],
            0,
            &[a.ptr(), out.ptr(), Arg::I32(0), Arg::I32(3)],
        )
        .unwrap_err();
    assert!(err.contains("width 3"), "{err}");
}

#[test]
fn emulator_votes_and_block_votes() {
    let emu = selftest_or_skip!();
    let mut rng = fastrand::Rng::with_seed(9);
    for mask in [0xffff_ffffu32, 0x0000_ffff, 0x8000_0001, 0x00f0_0f00] {
        let pred: Vec<i32> = (0..64).map(|_| rng.i32(0..3) - 1).collect();
        let (p, out) = (Buf::from(&pred), Buf::<u32>::from(&vec![7u32; 3 * 64]));
        emu.run(
            "t_vote",
            1,
            64,
            &[p.ptr(), out.ptr(), Arg::I32(mask as i32)],
        );
        let got = out.get();
        for warp in 0..2 {
            let mut ballot = 0u32;
            for lane in 0..32 {
                if mask >> lane & 1 == 1 && pred[warp * 32 + lane] != 0 {
                    ballot |= 1 << lane;
                }
            }
            for lane in 0..32 {
                let t = warp * 32 + lane;
                if mask >> lane & 1 == 0 {
                    assert_eq!(got[3 * t..3 * t + 3], [7, 7, 7]);
                    continue;
                }
                let want = [ballot, (ballot != 0) as u32, (ballot == mask) as u32];
                assert_eq!(got[3 * t..3 * t + 3], want, "mask {mask:#x} thread {t}");
            }
        }
    }
    let pred: Vec<i32> = (0..96).map(|i| (i % 3 == 0) as i32).collect();
    let (p, out) = (Buf::from(&pred), Buf::<i32>::zeros(3 * 96));
    emu.run("t_sync_votes", 1, 96, &[p.ptr(), out.ptr()]);
    for t in 0..96 {
        assert_eq!(out.get()[3 * t..3 * t + 3], [32, 0, 1]);
    }
}

#[test]
fn emulator_blocks_threads_and_shared_memory() {
    let emu = selftest_or_skip!();
    // A 3-D grid of 3-D blocks: threadIdx decomposition (x fastest) and per-block shared memory.
    let (bx, by, bz) = (5u32, 3u32, 2u32);
    let (gx, gy, gz) = (2u32, 2u32, 1u32);
    let per = (bx * by * bz) as usize;
    let blocks_n = (gx * gy * gz) as usize;
    let input: Vec<f32> = (0..per * blocks_n).map(|i| i as f32).collect();
    let (i, o, idx) = (
        Buf::from(&input),
        Buf::<f32>::zeros(input.len()),
        Buf::<u32>::zeros(4 * input.len()),
    );
    emu.try_launch(
        "t_reverse_3d",
        [gx, gy, gz],
        [bx, by, bz],
        0,
        &[i.ptr(), o.ptr(), idx.ptr()],
    )
    .unwrap();
    let (out, idx) = (o.get(), idx.get());
    for b in 0..blocks_n {
        for t in 0..per {
            assert_eq!(out[b * per + t], (b * per + per - 1 - t) as f32);
            let k = 4 * (b * per + t);
            let t = t as u32;
            assert_eq!(
                idx[k..k + 4],
                [t % bx, t / bx % by, t / (bx * by), b as u32]
            );
        }
    }
    // Dynamic shared memory: poisoned before every block, private to the block.
    let (first, out) = (Buf::<u32>::zeros(3), Buf::<f32>::zeros(3 * 64));
    emu.try_launch(
        "t_dyn_smem",
        [3, 1, 1],
        [64, 1, 1],
        64 * 4,
        &[first.ptr(), out.ptr()],
    )
    .unwrap();
    assert_eq!(first.get(), [POISON; 3]);
    for b in 0..3 {
        for t in 0..64 {
            assert_eq!(out.get()[b * 64 + t], (63 - t + 1000 * b) as f32);
        }
    }
    // Exited threads count as arrived at barriers and drop out of warp collectives.
    let out = Buf::<i32>::zeros(64);
    emu.run("t_early_exit", 1, 64, &[Arg::I32(40), out.ptr()]);
    let got = out.get();
    let v = |t: usize| (40 - 1 - t) as i32;
    for (t, &g) in got.iter().enumerate().take(40) {
        assert_eq!(g, v(t) + v(t ^ 1), "thread {t}");
    }
    // Half-warps with their own masks.
    let out = Buf::<i32>::zeros(32);
    emu.run("t_half_warps", 1, 32, &[out.ptr()]);
    assert_eq!(
        out.get(),
        (0..32)
            .map(|t| if t < 16 { 15 } else { 16 })
            .collect::<Vec<_>>()
    );
    // A partial last warp: its lanes read poison from lanes that do not exist.
    let input: Vec<f32> = (0..48).map(|i| i as f32).collect();
    let (i, o) = (Buf::from(&input), Buf::<f32>::zeros(48));
    emu.run("t_partial_warp_sum", 1, 48, &[i.ptr(), o.ptr()]);
    let got = o.get();
    assert!(got[..32].iter().all(|&v| v == (0..32).sum::<i32>() as f32));
    assert!(got[32..].iter().all(|v| v.is_nan()), "{:?}", &got[32..]);
}

#[test]
fn emulator_reports_misuse_instead_of_hanging_or_crashing() {
    let emu = selftest_or_skip!();
    let out = Buf::<i32>::zeros(1024);
    let launch =
        |k: &str, block: u32, args: &[Arg]| emu.try_launch(k, [1, 1, 1], [block, 1, 1], 0, args);

    let err = launch("t_divergent_barrier", 32, &[out.ptr()]).unwrap_err();
    assert!(
        err.contains("different __syncthreads()") && err.contains("emu_selftest.cu:"),
        "{err}"
    );
    let err = launch("t_deadlock", 32, &[out.ptr()]).unwrap_err();
    assert!(
        err.contains("deadlock") && err.contains("__shfl_sync") && err.contains("__syncthreads"),
        "{err}"
    );
    let err = launch("t_bad_mask", 32, &[out.ptr()]).unwrap_err();
    assert!(err.contains("does not include the calling lane 0"), "{err}");
    let err = launch("t_trap", 32, &[out.ptr()]).unwrap_err();
    assert!(
        err.contains("__trap") && err.contains("thread (5,0,0)"),
        "{err}"
    );
    let err = emu
        .try_launch("t_fault", [2, 1, 1], [32, 1, 1], 0, &[null()])
        .unwrap_err();
    assert!(
        err.contains("SIGSEGV") && err.contains("block (0,0,0) thread (3,0,0)"),
        "{err}"
    );
    let err = launch("t_stack_overflow", 1, &[out.ptr()]).unwrap_err();
    assert!(err.contains("SIGSEGV"), "{err}");
    // The emulator is still usable after all of that.
    launch("t_early_exit", 64, &[Arg::I32(64), out.ptr()]).unwrap();

    // Launch configuration errors.
    let err = launch("t_nonexistent", 32, &[]).unwrap_err();
    assert!(err.contains("unknown kernel `t_nonexistent`"), "{err}");
    let err = emu
        .try_launch("t_busy", [1, 1, 1], [1025, 1, 1], 0, &[out.ptr()])
        .unwrap_err();
    assert!(err.contains("invalid launch configuration"), "{err}");
    let err = emu
        .try_launch("t_busy", [1, 1, 1], [32, 32, 2], 0, &[out.ptr()])
        .unwrap_err();
    assert!(err.contains("2048 threads"), "{err}");
    let err = emu
        .try_launch("t_busy", [0, 1, 1], [32, 1, 1], 0, &[out.ptr()])
        .unwrap_err();
    assert!(err.contains("invalid launch configuration"), "{err}");
    let err = emu
        .try_launch(
            "t_dyn_smem",
            [1, 1, 1],
            [32, 1, 1],
            300 << 10,
            &[out.ptr(), out.ptr()],
        )
        .unwrap_err();
    assert!(err.contains("dynamic shared memory"), "{err}");
}

/// CPU time of the calling thread: the emulator runs a launch's fibers on the caller's thread,
/// so this measures its work and not how many other processes share the machine's cores.
fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn emulator_is_fast_enough() {
    let emu = selftest_or_skip!();
    // 16 blocks of 256 threads, 8 barriers and 4 shuffles each: 4096 fibers.
    let out = Buf::<f32>::zeros(16 * 256);
    emu.run("t_busy", 16, 256, &[out.ptr()]);
    // The fastest of a few launches, in thread CPU time: a loaded machine (many builds on two
    // cores) stretches wall time and single launches, not the cheapest launch's own work.
    let per = (0..10)
        .map(|_| {
            let t = thread_cpu_time();
            emu.run("t_busy", 16, 256, &[out.ptr()]);
            thread_cpu_time() - t
        })
        .min()
        .expect("ten launches");
    eprintln!("4096-thread launch with 8 barriers: {per:?} of CPU time");
    assert!(per.as_millis() < 200, "{per:?}");
}

#[test]
fn emulator_tensor_core_mma_follows_ptx_fragments() {
    let emu = selftest_or_skip!();
    let mut rng = fastrand::Rng::with_seed(3);
    // Small integers: every product and sum is exact, whatever the accumulation order.
    let a: Vec<f32> = (0..16 * 16).map(|_| rng.i32(-4..5) as f32).collect();
    let b: Vec<f32> = (0..16 * 8).map(|_| rng.i32(-4..5) as f32).collect();
    let c: Vec<f32> = (0..16 * 8).map(|_| rng.i32(-50..50) as f32).collect();
    let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect() };
    let (ad, bd, cd) = (Buf::from(&bits(&a)), Buf::from(&bits(&b)), Buf::from(&c));
    let d = Buf::<f32>::zeros(16 * 8);
    emu.run("t_mma", 1, 32, &[ad.ptr(), bd.ptr(), cd.ptr(), d.ptr()]);
    let got = d.get();
    for m in 0..16 {
        for n in 0..8 {
            let want = c[m * 8 + n] + (0..16).map(|k| a[m * 16 + k] * b[k * 8 + n]).sum::<f32>();
            assert_eq!(got[m * 8 + n], want, "D[{m}][{n}]");
        }
    }
    // Fewer than 32 lanes: mma.sync.aligned needs the whole warp.
    let err = emu
        .try_launch(
            "t_mma",
            [1, 1, 1],
            [16, 1, 1],
            0,
            &[ad.ptr(), bd.ptr(), cd.ptr(), d.ptr()],
        )
        .unwrap_err();
    assert!(err.contains("all 32 lanes"), "{err}");
}
