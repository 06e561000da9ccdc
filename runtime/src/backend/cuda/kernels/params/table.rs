//! The declarations, file by file in the registry's order (`kernels/mod.rs`). Laid out by
//! hand, a few parameters a line, to read like the signatures they mirror.

use super::CType::{Float, In, Int, LongLong, Out, ULongLong};
use super::Elem::{Bf16, OptTensor, F16, F32, F64, I32, T, U8};
use super::{p, per_dtype, single, Family, Param};

/// Adam's multi-tensor step (`adam_multi_*`, `adam_bf16_state`).
#[rustfmt::skip]
const ADAM: &[Param] = &[
    p("t", In(OptTensor)), p("ntensors", Int), p("total_chunks", LongLong), p("chunk", Int),
    p("lr", Float), p("beta1", Float), p("beta2", Float), p("eps", Float),
    p("weight_decay", Float), p("decoupled", Int), p("step_size", Float), p("bc2_sqrt", Float),
    p("grad_scale", In(F32)),
];

/// SGD's multi-tensor step (`sgd_multi_*`, `sgd_bf16_state`).
#[rustfmt::skip]
const SGD: &[Param] = &[
    p("t", In(OptTensor)), p("ntensors", Int), p("total_chunks", LongLong), p("chunk", Int),
    p("lr", Float), p("momentum", Float), p("dampening", Float), p("weight_decay", Float),
    p("nesterov", Int), p("first_step", Int), p("grad_scale", In(F32)),
];

/// Lion's multi-tensor step (`lion_multi_*`, `lion_bf16_state`).
#[rustfmt::skip]
const LION: &[Param] = &[
    p("t", In(OptTensor)), p("ntensors", Int), p("total_chunks", LongLong), p("chunk", Int),
    p("lr", Float), p("beta1", Float), p("beta2", Float), p("weight_decay", Float),
    p("grad_scale", In(F32)),
];

/// Flash attention's forward (`attention_forward_dDP_*`, every padded head dim alike).
#[rustfmt::skip]
const ATTENTION_FORWARD: &[Param] = &[
    p("q", In(T)), p("k", In(T)), p("v", In(T)), p("out", Out(T)), p("lse", Out(F32)),
    p("q_stride", LongLong), p("q_off", LongLong), p("k_stride", LongLong),
    p("k_off", LongLong), p("v_stride", LongLong), p("v_off", LongLong), p("batch", Int),
    p("seq", Int), p("q_heads", Int), p("kv_heads", Int), p("head_dim", Int), p("scale", Float),
    p("seed", ULongLong), p("offset", ULongLong), p("p", Float),
];

/// Attention backward's dK/dV pass (`attention_bwd_dkdv_dDP_*`).
#[rustfmt::skip]
const ATTENTION_DKDV: &[Param] = &[
    p("q", In(T)), p("k", In(T)), p("v", In(T)), p("dout", In(T)), p("lse", In(F32)),
    p("di", In(F32)), p("dk", Out(T)), p("dv", Out(T)), p("q_stride", LongLong),
    p("q_off", LongLong), p("k_stride", LongLong), p("k_off", LongLong),
    p("v_stride", LongLong), p("v_off", LongLong), p("batch", Int), p("seq", Int),
    p("q_heads", Int), p("kv_heads", Int), p("head_dim", Int), p("scale", Float),
    p("seed", ULongLong), p("offset", ULongLong), p("p", Float),
];

/// Attention backward's dQ pass (`attention_bwd_dq_dDP_*`).
#[rustfmt::skip]
const ATTENTION_DQ: &[Param] = &[
    p("q", In(T)), p("k", In(T)), p("v", In(T)), p("dout", In(T)), p("lse", In(F32)),
    p("di", In(F32)), p("dq", Out(T)), p("q_stride", LongLong), p("q_off", LongLong),
    p("k_stride", LongLong), p("k_off", LongLong), p("v_stride", LongLong),
    p("v_off", LongLong), p("batch", Int), p("seq", Int), p("q_heads", Int), p("kv_heads", Int),
    p("head_dim", Int), p("scale", Float),
    p("seed", ULongLong), p("offset", ULongLong), p("p", Float),
];

/// Every kernel's parameters (one entry per family of dtype variants).
#[rustfmt::skip]
pub const TABLE: &[Family] = &[
    // elementwise.cu
    per_dtype("gelu_forward", &[p("x", In(T)), p("y", Out(T)), p("n", LongLong)]),
    per_dtype("gelu_backward", &[p("x", In(T)), p("dy", In(T)), p("dx", Out(T)), p("n", LongLong)]),
    per_dtype("swiglu_forward", &[
        p("gate", In(T)), p("up", In(T)), p("y", Out(T)), p("n", LongLong),
    ]),
    per_dtype("swiglu_backward", &[
        p("gate", In(T)), p("up", In(T)), p("dy", In(T)), p("dgate", Out(T)), p("dup", Out(T)),
        p("n", LongLong),
    ]),
    per_dtype("add_assign", &[p("dst", Out(T)), p("src", In(T)), p("n", LongLong)]),
    per_dtype("dropout", &[
        p("x", Out(T)), p("n", LongLong), p("seed", ULongLong), p("offset", ULongLong),
        p("p", Float),
    ]),
    per_dtype("fill", &[p("x", Out(T)), p("n", LongLong), p("value", Float)]),
    per_dtype("add_bias_rows", &[
        p("y", Out(T)), p("bias", In(T)), p("rows", LongLong), p("cols", LongLong),
    ]),
    // norm.cu
    per_dtype("layernorm_forward", &[
        p("x", In(T)), p("gamma", In(T)), p("beta", In(T)), p("y", Out(T)), p("mean", Out(F32)),
        p("rstd", Out(F32)), p("rows", LongLong), p("dim", Int), p("eps", Float),
    ]),
    per_dtype("layernorm_backward", &[
        p("x", In(T)), p("gamma", In(T)), p("mean", In(F32)), p("rstd", In(F32)), p("dy", In(T)),
        p("dx", Out(T)), p("partial", Out(F32)), p("rows", LongLong), p("dim", Int),
        p("rows_per_chunk", Int),
    ]),
    per_dtype("rmsnorm_forward", &[
        p("x", In(T)), p("gamma", In(T)), p("y", Out(T)), p("rstd", Out(F32)), p("rows", LongLong),
        p("dim", Int), p("eps", Float),
    ]),
    per_dtype("rmsnorm_backward", &[
        p("x", In(T)), p("gamma", In(T)), p("rstd", In(F32)), p("dy", In(T)), p("dx", Out(T)),
        p("partial", Out(F32)), p("rows", LongLong), p("dim", Int), p("rows_per_chunk", Int),
    ]),
    per_dtype("residual_layernorm_forward", &[
        p("x", In(T)), p("residual", In(T)), p("gamma", In(T)), p("beta", In(T)), p("sum", Out(T)),
        p("y", Out(T)), p("mean", Out(F32)), p("rstd", Out(F32)), p("rows", LongLong),
        p("dim", Int), p("eps", Float),
    ]),
    per_dtype("residual_rmsnorm_forward", &[
        p("x", In(T)), p("residual", In(T)), p("gamma", In(T)), p("sum", Out(T)), p("y", Out(T)),
        p("rstd", Out(F32)), p("rows", LongLong), p("dim", Int), p("eps", Float),
    ]),
    per_dtype("layernorm_backward_residual", &[
        p("x", In(T)), p("gamma", In(T)), p("mean", In(F32)), p("rstd", In(F32)), p("dy", In(T)),
        p("dresidual", In(T)), p("dx", Out(T)), p("partial", Out(F32)), p("rows", LongLong),
        p("dim", Int), p("rows_per_chunk", Int),
    ]),
    per_dtype("rmsnorm_backward_residual", &[
        p("x", In(T)), p("gamma", In(T)), p("rstd", In(F32)), p("dy", In(T)),
        p("dresidual", In(T)), p("dx", Out(T)), p("partial", Out(F32)), p("rows", LongLong),
        p("dim", Int), p("rows_per_chunk", Int),
    ]),
    single("norm_dparams_finalize", &[
        p("partial", In(F32)), p("nchunks", LongLong), p("dim", Int), p("dgamma", Out(F32)),
        p("dbeta", Out(F32)),
    ]),
    // embed.cu
    per_dtype("embedding_forward", &[
        p("tokens", In(I32)), p("table", In(T)), p("out", Out(T)), p("rows", LongLong),
        p("dim", Int), p("vocab", LongLong), p("accumulate", Int), p("bad", Out(I32)),
    ]),
    per_dtype("position_forward", &[
        p("wpe", In(T)), p("out", Out(T)), p("rows", LongLong), p("seq", Int), p("dim", Int),
    ]),
    per_dtype("embedding_backward", &[
        p("dout", In(T)), p("uniq", In(I32)), p("offsets", In(I32)), p("positions", In(I32)),
        p("dtable", Out(F32)), p("n_uniq", Int), p("dim", Int), p("vocab", LongLong),
        p("bad", Out(I32)),
    ]),
    per_dtype("position_backward", &[
        p("dout", In(T)), p("dwpe", Out(F32)), p("batch", LongLong), p("seq", Int), p("dim", Int),
    ]),
    // loss.cu
    per_dtype("cross_entropy_forward", &[
        p("logits", In(T)), p("targets", In(I32)), p("lse", Out(F32)), p("loss", Out(F32)),
        p("rows", LongLong), p("vocab", Int), p("ld", Int), p("bad", Out(I32)),
    ]),
    per_dtype("cross_entropy_backward", &[
        p("logits", In(T)), p("targets", In(I32)), p("lse", In(F32)), p("dlogits", Out(T)),
        p("rows", LongLong), p("vocab", Int), p("ld", Int), p("g", Float),
    ]),
    per_dtype("cross_entropy_fused", &[
        p("logits", Out(T)), p("targets", In(I32)), p("loss", Out(F32)), p("rows", LongLong),
        p("vocab", Int), p("ld", Int), p("g", Float), p("bad", Out(I32)),
    ]),
    per_dtype("argmax", &[p("x", In(T)), p("out", Out(I32)), p("rows", LongLong), p("cols", Int)]),
    single("cross_entropy_loss_sum", &[
        p("loss", In(F32)), p("rows", LongLong), p("out", Out(F32)), p("acc", Out(F64)),
    ]),
    // rope.cu
    per_dtype("rope", &[
        p("x", Out(T)), p("cos_sin", In(F32)), p("rows", LongLong), p("seq", Int), p("heads", Int),
        p("head_dim", Int), p("inverse", Int),
    ]),
    per_dtype("rope_qk", &[
        p("q", Out(T)), p("k", Out(T)), p("cos_sin", In(F32)), p("rows", LongLong), p("seq", Int),
        p("q_heads", Int), p("k_heads", Int), p("head_dim", Int), p("inverse", Int),
    ]),
    // reduce.cu
    per_dtype("unscale", &[
        p("x", Out(T)), p("n", LongLong), p("s", Float), p("nonfinite", Out(I32)),
    ]),
    per_dtype("sum_squares", &[p("x", In(T)), p("n", LongLong), p("partials", Out(F64))]),
    per_dtype("colsum_partial", &[
        p("m", In(T)), p("partial", Out(F32)), p("rows", LongLong), p("cols", Int),
        p("rows_per_chunk", Int),
    ]),
    single("cast_f32_to_bf16", &[p("src", In(F32)), p("dst", Out(Bf16)), p("n", LongLong)]),
    single("cast_f32_to_f16", &[p("src", In(F32)), p("dst", Out(F16)), p("n", LongLong)]),
    single("cast_bf16_to_f32", &[p("src", In(Bf16)), p("dst", Out(F32)), p("n", LongLong)]),
    single("cast_f16_to_f32", &[p("src", In(F16)), p("dst", Out(F32)), p("n", LongLong)]),
    single("cast_bf16_to_f16", &[p("src", In(Bf16)), p("dst", Out(F16)), p("n", LongLong)]),
    single("cast_f16_to_bf16", &[p("src", In(F16)), p("dst", Out(Bf16)), p("n", LongLong)]),
    single("max_assign_f32", &[p("dst", Out(F32)), p("src", In(F32)), p("n", LongLong)]),
    single("div_f32", &[p("x", Out(F32)), p("n", LongLong), p("d", Float)]),
    single("sum_squares_f32_as_bf16", &[
        p("x", In(F32)), p("n", LongLong), p("partials", Out(F64)),
    ]),
    single("sum_squares_f32_as_f16", &[
        p("x", In(F32)), p("n", LongLong), p("partials", Out(F64)),
    ]),
    single("sum_squares_finalize", &[
        p("partials", In(F64)), p("nparts", LongLong), p("out", Out(F64)), p("out_f32", Out(F32)),
    ]),
    single("colsum_finalize", &[
        p("partial", In(F32)), p("acc", Out(F32)), p("nchunks", LongLong), p("cols", Int),
    ]),
    // optim.cu
    per_dtype("adam_multi", ADAM),
    per_dtype("sgd_multi", SGD),
    per_dtype("lion_multi", LION),
    single("adam_bf16_state", ADAM),
    single("sgd_bf16_state", SGD),
    single("lion_bf16_state", LION),
    single("lamb_moments", &[
        p("t", In(OptTensor)), p("ntensors", Int), p("total_chunks", LongLong), p("chunk", Int),
        p("beta1", Float), p("beta2", Float), p("eps", Float), p("eps_inside", Int),
        p("weight_decay", Float), p("grad_scale", In(F32)), p("sums", Out(F64)),
    ]),
    per_dtype("lamb_apply", &[
        p("t", In(OptTensor)), p("ntensors", Int), p("total_chunks", LongLong), p("chunk", Int),
        p("eps", Float), p("eps_inside", Int), p("weight_decay", Float), p("scale", Float),
    ]),
    single("clip_grad_scale", &[
        p("sums", In(F64)), p("n", Int), p("rule", In(F64)), p("grad_scale", Out(F32)),
    ]),
    // attention.cu
    per_dtype("attention_forward_d32", ATTENTION_FORWARD),
    per_dtype("attention_forward_d64", ATTENTION_FORWARD),
    per_dtype("attention_forward_d96", ATTENTION_FORWARD),
    per_dtype("attention_forward_d128", ATTENTION_FORWARD),
    per_dtype("attention_bwd_dot", &[
        p("out", In(T)), p("dout", In(T)), p("di", Out(F32)), p("batch", Int), p("seq", Int),
        p("q_heads", Int), p("head_dim", Int),
    ]),
    per_dtype("attention_bwd_dkdv_d32", ATTENTION_DKDV),
    per_dtype("attention_bwd_dkdv_d64", ATTENTION_DKDV),
    per_dtype("attention_bwd_dkdv_d96", ATTENTION_DKDV),
    per_dtype("attention_bwd_dkdv_d128", ATTENTION_DKDV),
    per_dtype("attention_bwd_dq_d32", ATTENTION_DQ),
    per_dtype("attention_bwd_dq_d64", ATTENTION_DQ),
    per_dtype("attention_bwd_dq_d96", ATTENTION_DQ),
    per_dtype("attention_bwd_dq_d128", ATTENTION_DQ),
    // quant.cu
    per_dtype("quantize", &[
        p("x", In(T)), p("n", LongLong), p("block", Int), p("bits", Int), p("out", Out(U8)),
    ]),
    per_dtype("dequantize", &[
        p("src", In(U8)), p("n", LongLong), p("block", Int), p("bits", Int), p("y", Out(T)),
    ]),
];
