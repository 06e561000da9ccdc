//! Causal flash attention (`attention.cu`); the rotary embeddings' trait methods, launched by
//! `rope.rs`.
//!
//! Attention forward writes O and keeps one log-sum-exp per query row (f32 `[batch][q_heads]
//! [seq]`, the saved state) instead of the CPU's probabilities. Backward runs three kernels:
//! `di = rowsum(dO ∘ O)`, then dK/dV (a block per tile of keys of one kv head, summing over the
//! group's query heads and the query tiles in a fixed order) and dQ (a block per tile of query
//! rows, summing over the key tiles in order): no atomics, so results depend on the shape alone.
//! Probability dropout is two trailing kernel parameters (seed, p; p = 0 is none): each kernel
//! redraws the CPU's mask element by element, so nothing is stored for backward.
//! The kernels are compiled for head dims padded to 32, 64, 96 and 128; this file mirrors their
//! tile table (`attention.cu`'s header), and a kernel traps when launched with other sizes.

use super::backend::{expect_dtype, expect_len, CudaBackend};
use super::device::BLOCK;
use super::driver::{DevPtr, LaunchConfig};
use super::launch::Args;
use super::storage::{by_dtype, variant_names, CudaBuf, CudaView};
use crate::backend::{AttentionGrads, AttentionOps, AttentionShape, Rope, Rotation, RowView};
use crate::tensor::{DType, Storage, View, ViewMut};
use crate::{Error, Result};

/// Head dims the kernels are compiled for (their `_dDP` infix); a call runs the smallest one
/// that holds its head dim, zero-padded.
const PADDED_DIMS: [usize; 4] = [32, 64, 96, 128];

/// A kernel's names per padded head dim (rows, as `PADDED_DIMS`) and dtype (columns, as
/// `dtype_index`).
macro_rules! per_dim_and_dtype {
    ($base:literal) => {
        [
            variant_names!($base: "_d32_f32", "_d32_bf16", "_d32_f16"),
            variant_names!($base: "_d64_f32", "_d64_bf16", "_d64_f16"),
            variant_names!($base: "_d96_f32", "_d96_bf16", "_d96_f16"),
            variant_names!($base: "_d128_f32", "_d128_bf16", "_d128_f16"),
        ]
    };
}

const FORWARD: [[&str; 3]; 4] = per_dim_and_dtype!("attention_forward");
const DKDV: [[&str; 3]; 4] = per_dim_and_dtype!("attention_bwd_dkdv");
const DQ: [[&str; 3]; 4] = per_dim_and_dtype!("attention_bwd_dq");

/// Tensor-core tiles per padded head dim, `attention.cu`'s `Cfg`: forward warps and key tile,
/// dK/dV warps and query tile, dQ warps and key tile.
#[derive(Debug, Clone, Copy)]
struct MmaCfg {
    fw: usize,
    fn_: usize,
    kw: usize,
    km: usize,
    qw: usize,
    qn: usize,
}

/// `attention.cu`'s `Cfg` values in its order: `fw, fn_, kw, km, qw, qn`.
const fn mma_cfg([fw, fn_, kw, km, qw, qn]: [usize; 6]) -> MmaCfg {
    MmaCfg {
        fw,
        fn_,
        kw,
        km,
        qw,
        qn,
    }
}

const MMA_CFG: [MmaCfg; 4] = [
    mma_cfg([4, 64, 4, 64, 4, 64]),
    mma_cfg([4, 64, 4, 32, 4, 64]),
    mma_cfg([4, 64, 4, 32, 4, 32]),
    mma_cfg([4, 64, 4, 32, 4, 32]),
];

/// The f32 (SIMT) kernels' tile: rows per block and per tile, threads, and the width of the
/// score buffers in shared memory.
const SIMT_ROWS: usize = 32;
const SIMT_THREADS: usize = 128;
const SIMT_LP: usize = 33;

/// Which attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    DkDv,
    Dq,
}

/// A launch of one attention kernel: its name, threads, rows of the sequence per block, and
/// dynamic shared memory, as `attention.cu` computes them.
#[derive(Debug, Clone, Copy)]
struct Launch {
    name: &'static str,
    threads: usize,
    rows: usize,
    smem: usize,
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

/// The kernel, block and shared memory of `pass` for padded head dim `PADDED_DIMS[di]`.
fn launch_for(pass: Pass, dtype: DType, di: usize) -> Launch {
    let dp = PADDED_DIMS[di];
    let names = match pass {
        Pass::Forward => &FORWARD,
        Pass::DkDv => &DKDV,
        Pass::Dq => &DQ,
    };
    let name = names[di][dtype_index(dtype)];
    if dtype == DType::F32 {
        let ld = dp + 4;
        let (r, f) = (SIMT_ROWS, 4);
        let smem = match pass {
            Pass::Forward => 5 * r * ld * f + r * SIMT_LP * f,
            Pass::DkDv => 6 * r * ld * f + 4 * r * f + 2 * r * SIMT_LP * f,
            Pass::Dq => 6 * r * ld * f + r * SIMT_LP * f,
        };
        return Launch {
            name,
            threads: SIMT_THREADS,
            rows: r,
            smem,
        };
    }
    let c = MMA_CFG[di];
    let ld = dp + 8;
    let (warps, smem) = match pass {
        Pass::Forward => (c.fw, (16 * c.fw + 4 * c.fn_) * ld * 2),
        Pass::DkDv => (c.kw, (32 * c.kw + 4 * c.km) * ld * 2 + 16 * c.km),
        Pass::Dq => (c.qw, (32 * c.qw + 4 * c.qn) * ld * 2),
    };
    Launch {
        name,
        threads: 32 * warps,
        rows: 16 * warps,
        smem,
    }
}

/// The checked sizes of a call as the kernels take them.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: i32,
    seq: i32,
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    /// Index into `PADDED_DIMS`.
    padded: usize,
}

/// Checks the shape: kv heads dividing q heads, a head dim the kernels take, sizes in range.
fn dims(op: &'static str, s: &AttentionShape) -> Result<Dims> {
    s.check_heads(op)?;
    let Some(padded) = PADDED_DIMS.iter().position(|&p| s.head_dim <= p) else {
        return Err(Error::Unavailable {
            what: "CUDA attention",
            why: format!(
                "head_dim {} is larger than the kernels' largest tile ({})",
                s.head_dim,
                PADDED_DIMS[PADDED_DIMS.len() - 1]
            ),
        });
    };
    // Tiles index the grid and rows in `int`; keep every product the kernels form in range.
    let limit = 1usize << 30;
    let heads_rows = s.batch.saturating_mul(s.q_heads);
    if s.seq >= limit || heads_rows >= limit / 16 || s.q_heads * s.head_dim >= limit {
        return Err(Error::Unavailable {
            what: "CUDA attention",
            why: format!(
                "{} sequences of {} tokens with {} heads exceed the kernels' 32-bit indexing",
                s.batch, s.seq, s.q_heads
            ),
        });
    }
    Ok(Dims {
        batch: s.batch as i32,
        seq: s.seq as i32,
        q_heads: s.q_heads as i32,
        kv_heads: s.kv_heads as i32,
        head_dim: s.head_dim as i32,
        padded,
    })
}

/// The grid of `pass`: a block per tile of rows of every (sequence, head).
fn grid(l: &Launch, d: &Dims, heads: i32) -> Result<LaunchConfig> {
    let tiles = (d.seq as usize).div_ceil(l.rows);
    let blocks = tiles * d.batch as usize * heads as usize;
    if blocks > i32::MAX as usize {
        return Err(Error::Unavailable {
            what: "CUDA attention",
            why: format!("{blocks} blocks exceed a launch's grid"),
        });
    }
    Ok(LaunchConfig {
        grid: [blocks as u32, 1, 1],
        block: [l.threads as u32, 1, 1],
        dyn_smem: l.smem as u32,
    })
}

/// Appends the views' strides and offsets, the sizes and the dropout (every kernel's trailing
/// parameters; p = 0 is no dropout).
fn view_args(
    args: Args,
    (q, k, v): (RowView, RowView, RowView),
    s: &AttentionShape,
    d: &Dims,
) -> Args {
    let (seed, offset, p) = s
        .dropout
        .map_or((0, 0, 0.0), |dr| (dr.seed, dr.offset, dr.p));
    args.len(q.stride)
        .len(q.offset)
        .len(k.stride)
        .len(k.offset)
        .len(v.stride)
        .len(v.offset)
        .i32(d.batch)
        .i32(d.seq)
        .i32(d.q_heads)
        .i32(d.kv_heads)
        .i32(d.head_dim)
        .f32(softmax_scale(s.head_dim))
        .u64(seed)
        .u64(offset)
        .f32(p)
}

/// The CPU backend's softmax scale, `1 / √head_dim` in f32.
fn softmax_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

impl CudaBackend {
    /// Q, K and V on this device in one dtype, each checked against its view, and the
    /// shape's sizes as the kernels take them.
    fn qkv_in<'a>(
        &self,
        op: &'static str,
        s: &AttentionShape,
        q: (View<'a>, RowView),
        k: (View<'a>, RowView),
        v: (View<'a>, RowView),
    ) -> Result<([CudaView<'a>; 3], Dims)> {
        let (qd, kd, vd) = (
            self.dev_in(op, "q", q.0)?,
            self.dev_in(op, "k", k.0)?,
            self.dev_in(op, "v", v.0)?,
        );
        expect_dtype(op, qd.dtype(), &[("k", kd.dtype()), ("v", vd.dtype())])?;
        let d = dims(op, s)?;
        s.check_qkv(op, [qd.len(), kd.len(), vd.len()], (q.1, k.1, v.1))?;
        Ok(([qd, kd, vd], d))
    }
}

impl AttentionOps for CudaBackend {
    fn attention_forward(
        &self,
        s: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: ViewMut<'_>,
    ) -> Result<Storage> {
        const OP: &str = "attention";
        let views = (q.1, k.1, v.1);
        let ([qd, kd, vd], d) = self.qkv_in(OP, &s, q, k, v)?;
        let out = self.dev_out(OP, "out", out)?;
        let dt = qd.dtype();
        expect_dtype(OP, dt, &[("out", out.dtype())])?;
        s.check_view(OP, "out", out.len(), s.out_view(), s.q_heads)?;
        let lse = CudaBuf::uninit(&self.dev, DType::F32, s.batch * s.q_heads * s.seq)?;
        if lse.is_empty() {
            return Ok(Storage::Cuda(lse));
        }
        let l = launch_for(Pass::Forward, dt, d.padded);
        let cfg = grid(&l, &d, d.q_heads)?;
        let args = Args::new()
            .ptr(qd.ptr())
            .ptr(kd.ptr())
            .ptr(vd.ptr())
            .ptr(out.ptr())
            .ptr(lse.view().ptr());
        let mut args = view_args(args, views, &s, &d);
        self.dev.launch(l.name, cfg, &mut args)?;
        Ok(Storage::Cuda(lse))
    }

    fn attention_backward(
        &self,
        s: AttentionShape,
        q: (View<'_>, RowView),
        k: (View<'_>, RowView),
        v: (View<'_>, RowView),
        out: View<'_>,
        saved: &Storage,
        dout: View<'_>,
        grads: AttentionGrads<'_>,
    ) -> Result<()> {
        const OP: &str = "attention backward";
        let views = (q.1, k.1, v.1);
        let ([qd, kd, vd], d) = self.qkv_in(OP, &s, q, k, v)?;
        let (od, dod) = (self.dev_in(OP, "out", out)?, self.dev_in(OP, "dout", dout)?);
        let lse = self.dev_in(OP, "the saved log-sum-exp", saved.view())?;
        let dt = qd.dtype();
        expect_dtype(OP, dt, &[("out", od.dtype()), ("dout", dod.dtype())])?;
        expect_dtype(OP, DType::F32, &[("the saved log-sum-exp", lse.dtype())])?;
        let rows = s.batch * s.q_heads * s.seq;
        expect_len(OP, "the saved log-sum-exp", lse.len(), rows)?;
        s.check_view(OP, "out", od.len(), s.out_view(), s.q_heads)?;
        s.check_view(OP, "dout", dod.len(), s.out_view(), s.q_heads)?;
        grads.check(OP, &s, views)?;
        let (dq, dk, dv): (DevPtr, DevPtr, DevPtr) = match grads {
            AttentionGrads::Fused(buf) => {
                let buf = self.dev_out(OP, "dqkv", buf)?;
                expect_dtype(OP, dt, &[("dqkv", buf.dtype())])?;
                (buf.ptr(), buf.ptr(), buf.ptr())
            }
            AttentionGrads::Split { dq, dk, dv } => {
                let (dq, dk, dv) = (
                    self.dev_out(OP, "dq", dq)?,
                    self.dev_out(OP, "dk", dk)?,
                    self.dev_out(OP, "dv", dv)?,
                );
                expect_dtype(
                    OP,
                    dt,
                    &[("dq", dq.dtype()), ("dk", dk.dtype()), ("dv", dv.dtype())],
                )?;
                (dq.ptr(), dk.ptr(), dv.ptr())
            }
        };
        if rows == 0 {
            return Ok(());
        }
        // di = rowsum(dO ∘ O): a warp per (token, head).
        let di = self.dev.alloc(rows * 4)?;
        let mut args = Args::new()
            .ptr(od.ptr())
            .ptr(dod.ptr())
            .ptr(di.ptr())
            .i32(d.batch)
            .i32(d.seq)
            .i32(d.q_heads)
            .i32(d.head_dim);
        let warps_per_block = (BLOCK / 32) as usize;
        let cfg = LaunchConfig::linear(
            rows.div_ceil(warps_per_block).clamp(1, 1 << 20) as u32,
            BLOCK,
        );
        self.dev
            .launch(by_dtype!("attention_bwd_dot", dt), cfg, &mut args)?;

        // Both passes read Q, K, V, dO, the log-sum-exp and di, then write their gradients.
        let inputs = [qd.ptr(), kd.ptr(), vd.ptr(), dod.ptr(), lse.ptr(), di.ptr()];
        for (pass, heads, outs) in [
            (Pass::DkDv, d.kv_heads, &[dk, dv][..]),
            (Pass::Dq, d.q_heads, &[dq]),
        ] {
            let l = launch_for(pass, dt, d.padded);
            let cfg = grid(&l, &d, heads)?;
            let args = inputs
                .iter()
                .chain(outs)
                .fold(Args::new(), |a, &p| a.ptr(p));
            let mut args = view_args(args, views, &s, &d);
            self.dev.launch(l.name, cfg, &mut args)?;
        }
        Ok(())
    }

    fn rope(
        &self,
        x: ViewMut<'_>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        dir: Rotation,
    ) -> Result<()> {
        let rows = (batch, seq, head_dim);
        self.rope_launch((x, heads), None, rows, rope, dir)
    }

    fn rope_qk(
        &self,
        q: ViewMut<'_>,
        k: ViewMut<'_>,
        s: AttentionShape,
        rope: &Rope,
        dir: Rotation,
    ) -> Result<()> {
        let rows = (s.batch, s.seq, s.head_dim);
        self.rope_launch((q, s.q_heads), Some((k, s.kv_heads)), rows, rope, dir)
    }
}
