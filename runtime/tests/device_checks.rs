//! Every device refuses the same bad calls with the same words: the argument checks the
//! backends share (`backend::check` and the attention family's) run on the CPU and on the
//! emulated device alike, each call here failing on exactly one argument.

mod device_common;

use device_common::Dev;
use ferrozero_runtime::backend::{
    Accumulate, AttentionGrads, AttentionShape, Epilogue, HeadShape, MatmulShape, Rope, Rotation,
    RowView, Transpose,
};
use ferrozero_runtime::tensor::{Storage, View};
use ferrozero_runtime::Result;

/// The error's text, failing the test when the call succeeded.
fn refused<T: std::fmt::Debug>(what: &str, r: Result<T>) -> String {
    r.expect_err(what).to_string()
}

fn norms(d: &Dev) {
    let (x, g, mut y) = (d.put(&[0.5; 8]), d.put(&[1.0; 4]), d.zeros(8));
    let (mut mean, mut rstd, mut bad) = (d.zeros_f32(2), d.zeros_f32(2), d.zeros_f32(3));
    let narrow = d.put(&[1.0; 3]);
    let r = d.be.layernorm_forward(
        x.view(),
        narrow.view(),
        narrow.view(),
        1e-5,
        y.view_mut(),
        mean.view_mut(),
        rstd.view_mut(),
    );
    assert_eq!(
        refused("width", r),
        "shape mismatch in layernorm: expected whole rows of the parameter width 3, got 8 \
         elements"
    );
    let r =
        d.be.rmsnorm_forward(x.view(), g.view(), 1e-5, y.view_mut(), bad.view_mut());
    assert_eq!(
        refused("rstd", r),
        "shape mismatch in rmsnorm: expected rstd with 2 elements, got 3"
    );
    let (mut dx, mut dg, mut db) = (d.zeros(8), d.zeros_f32(4), d.zeros_f32(5));
    let r = d.be.layernorm_backward(
        x.view(),
        g.view(),
        mean.view(),
        rstd.view(),
        x.view(),
        dx.view_mut(),
        dg.view_mut(),
        db.view_mut(),
    );
    assert_eq!(
        refused("dbeta", r),
        "shape mismatch in layernorm backward: expected dbeta with 4 elements, got 5"
    );
}
test_device!(norms);

fn tokens(d: &Dev) {
    let (dim, table) = (2, d.put(&[0.25; 8]));
    let ids = d.be.upload_ids(&[1, 9]).unwrap();
    let mut out = d.zeros(4);
    let r = d.be.embedding_forward(
        ids.ids(),
        table.view(),
        dim,
        out.view_mut(),
        Accumulate::Overwrite,
    );
    assert_eq!(
        refused("token", r),
        "invalid argument: token id 9 at position 1 is outside the embedding table of 4 rows"
    );
    let mut out = d.zeros(12);
    let r = d.be.position_forward(table.view(), 1, 6, out.view_mut());
    assert_eq!(
        refused("positions", r),
        "invalid argument: position embedding: sequence length 6 exceeds the table's 4 positions"
    );
    let s = HeadShape {
        rows: 2,
        dim: 2,
        vocab: 4,
    };
    let targets = d.be.upload_ids(&[-100, 7]).unwrap();
    let (x, w) = (d.put(&[0.5; 4]), d.put(&[0.5; 8]));
    let r =
        d.be.head_loss_forward(s, x.view(), w.view(), targets.ids(), true);
    assert_eq!(
        refused("target", r),
        "invalid argument: target id 7 is outside the vocabulary of 4 (use -100 to ignore a \
         position)"
    );
    let (targets, mut dx, mut dw) = (
        d.be.upload_ids(&[0, 1]).unwrap(),
        d.zeros(4),
        d.zeros_f32(7),
    );
    let r = d.be.head_loss_fused(
        s,
        x.view(),
        w.view(),
        targets.ids(),
        1.0,
        dx.view_mut(),
        Some(dw.view_mut()),
    );
    let want = "dweight with 8 elements, got 7";
    assert!(refused("dweight", r).ends_with(want), "{want}");
}
test_device!(tokens);

fn elementwise_and_products(d: &Dev) {
    let (a, mut acc) = (d.put(&[1.0; 6]), d.zeros_f32(4));
    let r = d.be.sum_rows(a.view(), 4, acc.view_mut());
    assert_eq!(
        refused("rows", r),
        "shape mismatch in sum_rows: expected whole rows of 4, got 6 elements"
    );
    let (mut dg, mut du) = (d.zeros(6), d.zeros(5));
    let r =
        d.be.swiglu_backward(a.view(), a.view(), a.view(), dg.view_mut(), du.view_mut());
    assert_eq!(
        refused("dup", r),
        "shape mismatch in swiglu backward: expected dup with 6 elements, got 5"
    );
    let s = MatmulShape {
        ta: Transpose::No,
        tb: Transpose::No,
        m: 2,
        n: 2,
        k: 3,
    };
    let (b, mut c) = (d.put(&[1.0; 5]), d.zeros(4));
    let r =
        d.be.matmul(s, a.view(), b.view(), c.view_mut(), Epilogue::Store);
    assert_eq!(
        refused("B", r),
        "shape mismatch in matmul: expected B with 6 elements, got 5"
    );
    let mut x = d.zeros(2 * 2 * 3);
    let r = d.be.rope(
        x.view_mut(),
        1,
        2,
        2,
        3,
        &Rope::plain(10000.0),
        Rotation::Forward,
    );
    assert_eq!(
        refused("odd", r),
        "shape mismatch in rope: expected x: 1x2 rows of 2 heads of an even head_dim 3, got \
         12 elements"
    );
}
test_device!(elementwise_and_products);

/// `b` read through `view`.
fn at(b: &Storage, view: RowView) -> (View<'_>, RowView) {
    (b.view(), view)
}

/// Attention's backward checks Q, K and V against their views, and a fused gradient buffer's
/// views for disjoint columns, on the CPU as on the device.
fn attention(d: &Dev) {
    let s = AttentionShape {
        batch: 1,
        seq: 2,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 4,
        dropout: None,
    };
    let view = RowView {
        stride: 4,
        offset: 0,
    };
    let (qkv, dout, mut out) = (d.put(&[0.5; 8]), d.put(&[0.25; 8]), d.zeros(8));
    let at = |b| at(b, view);
    let saved =
        d.be.attention_forward(s, at(&qkv), at(&qkv), at(&qkv), out.view_mut())
            .unwrap();
    let short = d.put(&[0.5; 7]);
    let mut grads = [d.zeros(8), d.zeros(8), d.zeros(8)];
    let [dq, dk, dv] = &mut grads;
    let split = AttentionGrads::Split {
        dq: dq.view_mut(),
        dk: dk.view_mut(),
        dv: dv.view_mut(),
    };
    let r = d.be.attention_backward(
        s,
        at(&short),
        at(&qkv),
        at(&qkv),
        out.view(),
        &saved,
        dout.view(),
        split,
    );
    assert_eq!(
        refused("short q", r),
        "shape mismatch in attention backward: expected q: 2 rows of stride 4 holding 1 heads \
         of 4 at offset 0, got 7 elements"
    );
    let mut fused = d.zeros(8);
    let r = d.be.attention_backward(
        s,
        at(&qkv),
        at(&qkv),
        at(&qkv),
        out.view(),
        &saved,
        dout.view(),
        AttentionGrads::Fused(fused.view_mut()),
    );
    assert_eq!(
        refused("overlap", r),
        format!(
            "invalid argument: attention backward: fused dq/dk/dv views must share one stride \
             and hold disjoint columns, got q {view:?}, k {view:?}, v {view:?}"
        )
    );
}
test_device!(attention);
