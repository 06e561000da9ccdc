//! The fused loss head (`TokenOps::head_loss_fused`) on every device against the CPU's
//! forward then backward, and on the emulated device against its own forward then backward:
//! the same bits, three products per chunk instead of four, chunks of padded rows.

mod device_common;

use device_common::{assert_close, cpu, get, rand, Dev, Tol};
use ferrozero_runtime::backend::{Backend, HeadShape};
use ferrozero_runtime::nn::IGNORE_INDEX;
use ferrozero_runtime::tensor::Storage;

/// Targets with every fifth row ignored.
fn targets(s: HeadShape) -> Vec<i32> {
    (0..s.rows)
        .map(|r| {
            if r % 5 == 2 {
                IGNORE_INDEX
            } else {
                ((r * 11 + 3) % s.vocab) as i32
            }
        })
        .collect()
}

/// Loss sum, dx and dw of a head on `be` (inputs already rounded to its dtype): fused, or
/// forward then backward. `dw` starts at `dw0` (the op accumulates into it).
fn run(
    be: &dyn Backend,
    s: HeadShape,
    (x, w, dw0): (&[f32], &[f32], &[f32]),
    fused: bool,
) -> [Vec<f32>; 3] {
    let t = be.upload_ids(&targets(s)).unwrap();
    let put = |v: &[f32], dtype| {
        let mut b = ferrozero_runtime::tensor::FlatBuf::zeros(dtype, v.len());
        b.store_f32(0, v);
        be.upload(b.as_ref()).unwrap()
    };
    let act = be.act_dtype();
    let (xs, ws) = (put(x, act), put(w, act));
    let mut dx: Storage = be.zeros(act, s.rows * s.dim).unwrap();
    let mut dw = put(dw0, ferrozero_runtime::tensor::DType::F32);
    let (g, ids) = (0.37, t.ids());
    let loss = if fused {
        be.head_loss_fused(
            s,
            xs.view(),
            ws.view(),
            ids,
            g,
            dx.view_mut(),
            Some(dw.view_mut()),
        )
        .unwrap()
    } else {
        let out = be
            .head_loss_forward(s, xs.view(), ws.view(), ids, true)
            .unwrap();
        let saved = out.saved.unwrap();
        be.head_loss_backward(
            s,
            xs.view(),
            ws.view(),
            ids,
            saved,
            g,
            dx.view_mut(),
            Some(dw.view_mut()),
        )
        .unwrap();
        out.loss
    };
    [get(&loss), get(&dx), get(&dw)]
}

/// Shapes: a vocabulary that is not a multiple of 8 (every row of packed logits at another
/// alignment), one past a multiple of 128 (the padding's worst case), a width not a multiple
/// of 8.
const SHAPES: [HeadShape; 3] = [
    HeadShape {
        rows: 13,
        dim: 16,
        vocab: 37,
    },
    HeadShape {
        rows: 9,
        dim: 24,
        vocab: 257,
    },
    HeadShape {
        rows: 6,
        dim: 12,
        vocab: 301,
    },
];

fn inputs(d: &Dev, s: HeadShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        d.round(&rand(s.rows * s.dim, 40 + s.vocab as u64)),
        d.round(&rand(s.vocab * s.dim, 41 + s.vocab as u64)),
        rand(s.vocab * s.dim, 42),
    )
}

/// The fused head on the device against the CPU's forward then backward: loss within the
/// reduction tolerance, dx within the activation dtype's over a vocabulary-long sum, dW
/// within it over a rows-long one. On the CPU the fused op is forward then backward: bit for
/// bit.
fn head_fused(d: &Dev) {
    let c = cpu();
    for s in SHAPES {
        let (x, w, dw0) = inputs(d, s);
        let want = run(&*c.be, s, (&x, &w, &dw0), false);
        let got = run(&*d.be, s, (&x, &w, &dw0), true);
        if d.name == "cpu" {
            assert_eq!(
                got, want,
                "cpu: fused differs from forward then backward, {s:?}"
            );
            continue;
        }
        let t = d.tol();
        let tol = |k: usize| Tol {
            abs: t.abs * (k as f64).sqrt(),
            rel: t.rel,
        };
        let loss_tol = Tol {
            abs: 1e-3,
            rel: t.rel,
        };
        assert_close(
            &format!("{} loss {s:?}", d.name),
            &got[0],
            &want[0],
            loss_tol,
        );
        assert_close(
            &format!("{} dx {s:?}", d.name),
            &got[1],
            &want[1],
            tol(s.vocab),
        );
        assert_close(
            &format!("{} dw {s:?}", d.name),
            &got[2],
            &want[2],
            tol(s.rows),
        );
    }
    // A target outside the vocabulary is an error naming it, before any work.
    let s = SHAPES[0];
    let bad = d.be.upload_ids(&vec![s.vocab as i32; s.rows]).unwrap();
    let (x, w) = (
        d.put(&rand(s.rows * s.dim, 1)),
        d.put(&rand(s.vocab * s.dim, 2)),
    );
    let (mut dx, mut dw) = (d.zeros(s.rows * s.dim), d.zeros_f32(s.vocab * s.dim));
    let e =
        d.be.head_loss_fused(
            s,
            x.view(),
            w.view(),
            bad.ids(),
            1.0,
            dx.view_mut(),
            Some(dw.view_mut()),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("target id 37 is outside the vocabulary of 37"),
        "{e}"
    );
    // A dw of the wrong length is refused by name.
    let mut short = d.zeros_f32(3);
    let ok = d.be.upload_ids(&targets(s)).unwrap();
    let e =
        d.be.head_loss_fused(
            s,
            x.view(),
            w.view(),
            ok.ids(),
            1.0,
            dx.view_mut(),
            Some(short.view_mut()),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("dweight"), "{e}");
}

test_device!(head_fused);

/// On the emulated device with chunks of 4 rows (13 rows: three whole chunks and one of 1):
/// the fused head gives forward-then-backward's bits on the same device, runs three GEMMs
/// per chunk and part of the vocabulary (its multiple of 8, then the rest) where forward
/// and backward run four, and agrees with the CPU.
#[cfg(feature = "cuda")]
#[test]
fn fused_head_skips_the_recompute() {
    use ferrozero_runtime::backend::cuda;
    use ferrozero_runtime::tensor::DType;
    for act in [DType::F32, DType::Bf16] {
        let Ok(base) = cuda::emulated(act) else {
            cuda::emu::skip_unless_required("fused head: no emulator");
            return;
        };
        let be = base.with_head_chunk_rows(4);
        let d = Dev {
            name: "cuda_emu_chunked",
            be: std::sync::Arc::new(be),
        };
        for s in SHAPES {
            let chunks = s.rows.div_ceil(4) as u64;
            let parts = if s.vocab % 8 == 0 { 1 } else { 2 };
            let (x, w, dw0) = inputs(&d, s);
            let a0 = d.be.activity().unwrap();
            let split = run(&*d.be, s, (&x, &w, &dw0), false);
            let a1 = d.be.activity().unwrap();
            let fused = run(&*d.be, s, (&x, &w, &dw0), true);
            let a2 = d.be.activity().unwrap();
            assert_eq!(
                a1.gemms - a0.gemms,
                4 * chunks * parts,
                "{act:?} {s:?}: forward + backward"
            );
            assert_eq!(
                a2.gemms - a1.gemms,
                3 * chunks * parts,
                "{act:?} {s:?}: fused"
            );
            // One kernel per chunk (loss and dlogits) and one loss sum besides the GEMMs.
            assert_eq!(
                (a2.kernel_launches - a1.kernel_launches) - (a2.gemms - a1.gemms),
                chunks + 1,
                "{act:?} {s:?}: fused kernels"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (i, what) in ["loss", "dx", "dw"].iter().enumerate() {
                assert_eq!(
                    bits(&fused[i]),
                    bits(&split[i]),
                    "{act:?} {s:?}: fused {what}"
                );
            }
        }
        head_fused(&d);
    }
}
