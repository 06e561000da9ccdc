//! Every layer's backward against central finite differences (via the public gradcheck),
//! on odd sizes that are not multiples of any SIMD width, plus kernel-level checks.

mod nn_common;

use ferrozero_runtime::backend::{
    self, Epilogue, HeadShape, MatmulShape, Rope, Rotation, Transpose,
};
use ferrozero_runtime::nn::gpt2::{self, Gpt2Config};
use ferrozero_runtime::nn::gradcheck::{self, Options};
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::{Model, IGNORE_INDEX};
use ferrozero_runtime::tensor::{IdBuf, Storage, Tensor, View, ViewMut};
use nn_common::{batch, random, Weights};

fn odd_gpt2(dropout: f32) -> Gpt2Config {
    let mut c = Gpt2Config::preset("tiny").unwrap();
    (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.n_positions) = (1, 3, 15, 37, 11);
    (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) = (dropout, dropout, dropout);
    c
}

fn odd_llama(tied: bool) -> LlamaConfig {
    let mut c = LlamaConfig::preset("tiny").unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (18, 37, 1);
    (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) = (3, Some(1), 29);
    c.tie_word_embeddings = tied;
    c
}

/// Gradchecks every unit of `model`, feeding each unit a random input of the right shape.
fn check_model(model: &Model, width: usize, seed: u64) {
    let b = batch(2, 7, vocab_of(model), seed);
    let w = {
        let mut w = Weights::init(model, seed);
        // Larger weights than the 0.02 default so every path carries signal.
        for v in w.units.iter_mut().flatten().chain(w.shared.iter_mut()) {
            for (i, x) in v.iter_mut().enumerate() {
                *x += 0.3 * (backend::rng::uniform_f32(seed ^ 99, i as u64) - 0.5);
            }
        }
        w
    };
    for (u, unit) in model.units.iter().enumerate() {
        let input = if u == 0 {
            Tensor::default()
        } else {
            random(vec![2, 7, width], seed + u as u64)
        };
        let mut params = w.unit_vecs(model, u);
        let opts = Options {
            max_per_tensor: 40,
            ..Options::default()
        };
        let report =
            gradcheck::check(unit.module.as_ref(), &b, &mut params, &input, &opts).unwrap();
        assert!(report.passed(), "unit {}:\n{report}", unit.name);
        let expected = params.len() + usize::from(u != 0);
        assert_eq!(
            report.tensors.len(),
            expected,
            "every tensor checked in {}",
            unit.name
        );
        assert!(report.tensors.iter().all(|t| t.checked > 0));
    }
}

fn vocab_of(model: &Model) -> usize {
    let head = model.units.last().unwrap();
    let specs = head.module.param_specs();
    specs
        .iter()
        .chain(&model.shared)
        .map(|s| s.shape[0])
        .max()
        .unwrap()
}

#[test]
fn gpt2_units_match_finite_differences() {
    check_model(&gpt2::build(&odd_gpt2(0.0)).unwrap(), 15, 1);
}

#[test]
fn gpt2_units_with_dropout_match_finite_differences() {
    check_model(&gpt2::build(&odd_gpt2(0.3)).unwrap(), 15, 2);
}

#[test]
fn llama_units_match_finite_differences() {
    check_model(&llama::build(&odd_llama(false)).unwrap(), 18, 3);
    check_model(&llama::build(&odd_llama(true)).unwrap(), 18, 4);
}

#[test]
fn gradcheck_catches_a_wrong_backward() {
    // A module whose backward is off by a factor must fail the check.

    use ferrozero_runtime::nn::{Ctx, Grads, Module, ParamSpec, Params};
    struct Scale;
    impl Module for Scale {
        fn param_specs(&self) -> Vec<ParamSpec> {
            vec![]
        }
        fn forward(
            &self,
            _c: &mut Ctx<'_>,
            _p: &Params<'_>,
            x: &Tensor,
        ) -> ferrozero_runtime::Result<Tensor> {
            let y = x.host_f32()?.iter().map(|v| v * v).collect();
            Tensor::from_f32(x.shape.clone(), y)
        }
        fn backward(
            &self,
            _c: &mut Ctx<'_>,
            _p: &Params<'_>,
            _g: &mut Grads<'_>,
            gy: &Tensor,
        ) -> ferrozero_runtime::Result<Tensor> {
            gy.try_clone() // wrong: ignores d(x²)/dx = 2x
        }
    }
    let b = batch(1, 5, 7, 0);
    let r = gradcheck::check(
        &Scale,
        &b,
        &mut [],
        &random(vec![1, 5, 3], 5),
        &Options::default(),
    )
    .unwrap();
    assert!(!r.passed());
    assert_eq!(r.tensors[0].name, "input");
}

fn naive(s: MatmulShape, a: &[f32], b: &[f32]) -> Vec<f64> {
    let mut c = vec![0.0f64; s.m * s.n];
    for i in 0..s.m {
        for j in 0..s.n {
            for p in 0..s.k {
                let av = if s.ta == Transpose::No {
                    a[i * s.k + p]
                } else {
                    a[p * s.m + i]
                };
                let bv = if s.tb == Transpose::No {
                    b[p * s.n + j]
                } else {
                    b[j * s.k + p]
                };
                c[i * s.n + j] += f64::from(av) * f64::from(bv);
            }
        }
    }
    c
}

#[test]
fn matmul_matches_naive_for_all_layouts_and_odd_sizes() {
    let be = backend::cpu();
    for (m, n, k) in [(1, 1, 1), (7, 13, 5), (33, 17, 65), (130, 67, 129)] {
        for ta in [Transpose::No, Transpose::Yes] {
            for tb in [Transpose::No, Transpose::Yes] {
                let s = MatmulShape { m, n, k, ta, tb };
                let a = random(vec![m * k], 1).to_vec_f32().unwrap();
                let b = random(vec![k * n], 2).to_vec_f32().unwrap();
                let mut c = vec![0.5f32; m * n];
                let (av, bv) = (View::from(&a[..]), View::from(&b[..]));
                be.matmul(s, av, bv, ViewMut::from(&mut c[..]), Epilogue::Accumulate)
                    .unwrap();
                for (got, want) in c.iter().zip(naive(s, &a, &b)) {
                    assert!(
                        (f64::from(*got) - want - 0.5).abs() < 1e-4 * (k as f64),
                        "{s:?}"
                    );
                }
            }
        }
    }
    let s = MatmulShape {
        m: 2,
        n: 2,
        k: 3,
        ta: Transpose::No,
        tb: Transpose::No,
    };
    assert!(be
        .matmul(
            s,
            View::from(&[0.0f32; 5][..]),
            View::from(&[0.0f32; 6][..]),
            ViewMut::from(&mut [0.0f32; 4][..]),
            Epilogue::Store
        )
        .is_err());
}

#[test]
fn cross_entropy_sums_valid_rows_and_is_stable() {
    let be = backend::cpu();
    // With an identity weight the logits are x itself; huge logits would overflow a naive exp.
    let x = vec![1000.0, 0.0, -1000.0, 3.0, 1.0, 2.0, 5.0, 5.0, 5.0];
    let eye = vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
    let shape = HeadShape {
        rows: 3,
        dim: 3,
        vocab: 3,
    };
    let targets = IdBuf::Host(vec![1, IGNORE_INDEX, 2]);
    let (xv, wv) = (View::from(&x[..]), View::from(&eye[..]));
    let out = be
        .head_loss_forward(shape, xv, wv, targets.ids(), true)
        .unwrap();
    let loss = f64::from(out.loss.to_vec_f32().unwrap()[0]);
    let want = 1000.0 + 3f64.ln();
    assert!((loss - want).abs() < 1e-3, "{loss} vs {want}");
    let (mut dx, mut dw) = (vec![7.0f32; 9], vec![0.0f32; 9]);
    be.head_loss_backward(
        shape,
        xv,
        wv,
        targets.ids(),
        out.saved.unwrap(),
        2.0,
        ViewMut::from(&mut dx[..]),
        Some(ViewMut::from(&mut dw[..])),
    )
    .unwrap();
    // dx = dlogits · I = 2 (p - onehot).
    assert_eq!(&dx[3..6], &[0.0, 0.0, 0.0], "ignored row has no gradient");
    assert!((dx[1] + 2.0).abs() < 1e-6 && (dx[0] - 2.0).abs() < 1e-6);
    let bad = IdBuf::Host(vec![3]);
    let one = HeadShape { rows: 1, ..shape };
    let err = be
        .head_loss_forward(one, View::from(&x[..3]), wv, bad.ids(), false)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn rope_inverse_undoes_forward_and_preserves_norms() {
    let be = backend::cpu();
    let x = random(vec![2 * 5 * 3 * 6], 9).to_vec_f32().unwrap();
    let mut y = x.clone();
    be.rope(
        ViewMut::from(&mut y[..]),
        2,
        5,
        3,
        6,
        &Rope::plain(10000.0),
        Rotation::Forward,
    )
    .unwrap();
    assert_ne!(x, y);
    let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
    assert!((norm(&x) - norm(&y)).abs() < 1e-3);
    be.rope(
        ViewMut::from(&mut y[..]),
        2,
        5,
        3,
        6,
        &Rope::plain(10000.0),
        Rotation::Inverse,
    )
    .unwrap();
    x.iter()
        .zip(&y)
        .for_each(|(a, b)| assert!((a - b).abs() < 1e-5));
}

#[test]
fn dropout_is_seeded_scaled_and_near_its_rate() {
    let be = backend::cpu();
    let mut a = vec![1.0f32; 100_003];
    let mut b = a.clone();
    be.dropout(5, 0, 0.25, ViewMut::from(&mut a[..])).unwrap();
    be.dropout(5, 0, 0.25, ViewMut::from(&mut b[..])).unwrap();
    assert_eq!(a, b, "same seed, same mask");
    let zeros = a.iter().filter(|&&v| v == 0.0).count() as f64 / a.len() as f64;
    assert!((zeros - 0.25).abs() < 0.01, "drop rate {zeros}");
    assert!(a.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
    let mut c = vec![1.0f32; 100_003];
    be.dropout(6, 0, 0.25, ViewMut::from(&mut c[..])).unwrap();
    assert_ne!(a, c, "another seed, another mask");
}

#[test]
fn dropout_at_a_row_offset_draws_the_rows_of_a_bigger_batch() {
    use backend::{AttentionShape, AttnDropout, RowView};
    let be = backend::cpu();
    // Elementwise: rows 2..5 of 6 rows of 13, alone at the offset of row 2.
    let (row, rows, first) = (13, 6, 2);
    let x = random(vec![rows * row], 3).to_vec_f32().unwrap();
    let mut big = x.clone();
    be.dropout(9, 0, 0.3, ViewMut::from(&mut big[..])).unwrap();
    let mut part = x[first * row..].to_vec();
    let offset = (first * row) as u64;
    be.dropout(9, offset, 0.3, ViewMut::from(&mut part[..]))
        .unwrap();
    assert_eq!(part, big[first * row..], "elementwise rows at an offset");
    let mut at_zero = x[first * row..].to_vec();
    be.dropout(9, 0, 0.3, ViewMut::from(&mut at_zero[..]))
        .unwrap();
    assert_ne!(part, at_zero, "the offset moves the mask");

    // Attention: sequences 1..3 of 3, alone at the offset of sequence 1.
    let (seqs, t, heads, hd) = (3, 9, 2, 4);
    let w = heads * hd;
    let qkv: Vec<Vec<f32>> = (0..3)
        .map(|i| random(vec![seqs * t * w], 20 + i).to_vec_f32().unwrap())
        .collect();
    let attend = |first: usize, offset: u64| {
        let n = seqs - first;
        let s = AttentionShape {
            batch: n,
            seq: t,
            q_heads: heads,
            kv_heads: heads,
            head_dim: hd,
            dropout: Some(AttnDropout {
                seed: 5,
                offset,
                p: 0.3,
            }),
        };
        let view = |i: usize| {
            (
                View::from(&qkv[i][first * t * w..]),
                RowView {
                    stride: w,
                    offset: 0,
                },
            )
        };
        let mut o = vec![0.0; n * t * w];
        be.attention_forward(s, view(0), view(1), view(2), ViewMut::from(&mut o[..]))
            .unwrap();
        o
    };
    let big = attend(0, 0);
    let part = attend(1, (heads * t * t) as u64);
    assert_eq!(part, big[t * w..], "attention sequences at an offset");
    assert_ne!(attend(1, 0), part, "the offset moves the attention mask");
}

/// GPT-2's units with every dropout on, run forward on rows 1..4 of a batch alone at
/// `rng_row` 1, give those rows of the whole batch's outputs: the layers count their masks
/// from `Ctx::rng_row`. (Bit for bit on x86-64 today; the bound leaves a product free to
/// block rows differently. At `rng_row` 0 the rows differ by about 8e-2.)
#[test]
fn units_at_rng_row_draw_the_masks_of_the_batch_they_came_from() {
    use ferrozero_runtime::nn::{Batch, BatchIds, Ctx, Params};
    let be = backend::cpu();
    let model = gpt2::build(&odd_gpt2(0.2)).unwrap();
    let w = Weights::init(&model, 4);
    let (rows, t, first) = (4, 7, 1);
    let whole = batch(rows, t, vocab_of(&model), 8);
    let part = Batch {
        batch: rows - first,
        seq: t,
        tokens: whole.tokens[first * t..].to_vec(),
        targets: whole.targets[first * t..].to_vec(),
    };
    // Each unit's output but the head's (a loss over the batch), the units chained.
    let outputs = |b: &Batch, rng_row: u64| -> Vec<Vec<f32>> {
        let ids = BatchIds::new(&*be, b).unwrap();
        let mut x = Tensor::default();
        let body = &model.units[..model.units.len() - 1];
        body.iter()
            .enumerate()
            .map(|(u, unit)| {
                let stores = nn_common::upload_params(&*be, &model, &w, u, be.act_dtype());
                let stores = stores.unwrap();
                let mut saved = None;
                let mut ctx = Ctx {
                    be: &*be,
                    batch: b,
                    ids: &ids,
                    training: true,
                    rng_seed: 77 + u as u64,
                    rng_row,
                    saved: &mut saved,
                };
                let p = Params::new(stores.iter().map(Storage::view).collect());
                x = unit.module.forward(&mut ctx, &p, &x).unwrap();
                x.to_vec_f32().unwrap()
            })
            .collect()
    };
    let (want, got, unmoved) = (outputs(&whole, 0), outputs(&part, 1), outputs(&part, 0));
    for (u, (want, (got, unmoved))) in want.iter().zip(got.iter().zip(&unmoved)).enumerate() {
        let want = &want[want.len() / rows * first..];
        let diff = |a: &[f32]| {
            a.iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max)
        };
        assert!(
            diff(got) < 1e-5,
            "unit {u}: rows at rng_row 1 differ by {}",
            diff(got)
        );
        assert!(
            diff(unmoved) > 1e-2,
            "unit {u}: rng_row 0 draws the same masks"
        );
    }
}

/// Plain f64 causal GQA attention: returns O and, for upstream gradient `dout`, dQ, dK, dV.
#[allow(clippy::type_complexity)]
fn naive_attention(
    sh: &backend::AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, d, hq, hk) = (sh.seq, sh.head_dim, sh.q_heads, sh.kv_heads);
    let (qw, kw) = (hq * d, hk * d);
    let mut o = vec![0.0; sh.batch * t * qw];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; o.len()],
        vec![0.0; sh.batch * t * kw],
        vec![0.0; sh.batch * t * kw],
    );
    let scale = 1.0 / (d as f64).sqrt();
    for b in 0..sh.batch {
        for h in 0..hq {
            let kh = h / (hq / hk);
            let qi = |i: usize, c: usize| (b * t + i) * qw + h * d + c;
            let ki = |j: usize, c: usize| (b * t + j) * kw + kh * d + c;
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| f64::from(q[qi(i, c)]) * f64::from(k[ki(j, c)]))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
                let dp: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| f64::from(dout[qi(i, c)]) * f64::from(v[ki(j, c)]))
                            .sum()
                    })
                    .collect();
                // Dropout's factor per key: 0 where dropped, 1/(1-p) where kept.
                let f: Vec<f64> = (0..=i)
                    .map(|j| match &sh.dropout {
                        Some(dr) if dr.keep(sh, (b, h, i, j)) => f64::from(dr.scale()),
                        Some(_) => 0.0,
                        None => 1.0,
                    })
                    .collect();
                let dp: Vec<f64> = dp.iter().zip(&f).map(|(g, f)| g * f).collect();
                let dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - dot) * scale;
                    for c in 0..d {
                        o[qi(i, c)] += p[j] * f[j] * f64::from(v[ki(j, c)]);
                        dv[ki(j, c)] += p[j] * f[j] * f64::from(dout[qi(i, c)]);
                        dq[qi(i, c)] += ds * f64::from(k[ki(j, c)]);
                        dk[ki(j, c)] += ds * f64::from(q[qi(i, c)]);
                    }
                }
            }
        }
    }
    (o, dq, dk, dv)
}

#[test]
fn blocked_attention_matches_a_naive_reference_across_row_blocks() {
    blocked_attention_against_naive(None);
}

#[test]
fn attention_dropout_matches_a_naive_reference_with_the_same_mask() {
    let dr = backend::AttnDropout {
        seed: 17,
        offset: 0,
        p: 0.3,
    };
    blocked_attention_against_naive(Some(dr));
}

fn blocked_attention_against_naive(dropout: Option<backend::AttnDropout>) {
    use backend::{AttentionGrads, AttentionShape, RowView};
    let be = backend::cpu();
    // seq 71 spans three row blocks with a ragged last one; 6 query heads share 2 kv heads.
    let sh = AttentionShape {
        batch: 2,
        seq: 71,
        q_heads: 6,
        kv_heads: 2,
        head_dim: 5,
        dropout,
    };
    let (n, qw, kw) = (2 * 71, 30, 10);
    let host = |t: Tensor| t.to_vec_f32().unwrap();
    let (q, k, v) = (
        host(random(vec![n * qw], 1)),
        host(random(vec![n * kw], 2)),
        host(random(vec![n * kw], 3)),
    );
    let dout = host(random(vec![n * qw], 4));
    let view = |stride| RowView { stride, offset: 0 };
    let (qv, kv, vv) = (
        (View::from(&q[..]), view(qw)),
        (View::from(&k[..]), view(kw)),
        (View::from(&v[..]), view(kw)),
    );
    let mut o = vec![0.0; n * qw];
    let saved: Storage = be
        .attention_forward(sh, qv, kv, vv, ViewMut::from(&mut o[..]))
        .unwrap();
    let (mut dq, mut dk, mut dv) = (vec![9.0; n * qw], vec![9.0; n * kw], vec![9.0; n * kw]);
    let grads = AttentionGrads::Split {
        dq: ViewMut::from(&mut dq[..]),
        dk: ViewMut::from(&mut dk[..]),
        dv: ViewMut::from(&mut dv[..]),
    };
    be.attention_backward(
        sh,
        qv,
        kv,
        vv,
        View::from(&o[..]),
        &saved,
        View::from(&dout[..]),
        grads,
    )
    .unwrap();
    let (ro, rdq, rdk, rdv) = naive_attention(&sh, &q, &k, &v, &dout);
    for (name, got, want) in [
        ("o", &o, &ro),
        ("dq", &dq, &rdq),
        ("dk", &dk, &rdk),
        ("dv", &dv, &rdv),
    ] {
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!((f64::from(*g) - w).abs() < 1e-4, "{name}[{i}]: {g} vs {w}");
        }
    }
}

#[test]
fn half_precision_operands_accumulate_in_f32() {
    use ferrozero_runtime::tensor::BufRef;
    use half::{bf16, f16};
    let be = backend::cpu();
    let s = MatmulShape {
        m: 9,
        n: 11,
        k: 300,
        ta: Transpose::No,
        tb: Transpose::Yes,
    };
    let a = random(vec![9 * 300], 1).to_vec_f32().unwrap();
    let b = random(vec![11 * 300], 2).to_vec_f32().unwrap();
    let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
    let b16: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
    let mut c = vec![0.0; 99];
    be.matmul(
        s,
        View::Host(BufRef::Bf16(&a16)),
        View::Host(BufRef::F16(&b16)),
        ViewMut::from(&mut c[..]),
        Epilogue::Store,
    )
    .unwrap();
    let wa: Vec<f32> = a16.iter().map(|v| v.to_f32()).collect();
    let wb: Vec<f32> = b16.iter().map(|v| v.to_f32()).collect();
    for (got, want) in c.iter().zip(naive(s, &wa, &wb)) {
        // f32 accumulation of exact products: far tighter than bf16's 3 significant digits.
        assert!((f64::from(*got) - want).abs() < 1e-4, "{got} vs {want}");
    }
    assert!(be
        .matmul(
            s,
            View::from(&a[1..]),
            View::Host(BufRef::F16(&b16)),
            ViewMut::from(&mut c[..]),
            Epilogue::Accumulate
        )
        .is_err());
}
