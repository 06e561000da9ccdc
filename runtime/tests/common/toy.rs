//! A small, fully explicit model for engine tests: a tied embedding, residual tanh layers and
//! a tied softmax head. Small enough to reason about, odd-sized so padding is exercised.

#![allow(dead_code)]

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrozero_runtime::nn::module::SavedState;
use ferrozero_runtime::nn::{
    Batch, Ctx, Grads, Init, Model, Module, ParamSpec, Params, Unit, IGNORE_INDEX,
};
use ferrozero_runtime::tensor::Tensor;
use ferrozero_runtime::{Error, Result};

struct Keep(Vec<Vec<f32>>);

impl SavedState for Keep {
    fn bytes(&self) -> usize {
        self.0.iter().map(|v| v.len() * 4).sum()
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

fn take(ctx: &mut Ctx<'_>) -> Result<Vec<Vec<f32>>> {
    let s = ctx
        .saved
        .take()
        .ok_or_else(|| Error::Invalid("backward without saved state".into()))?;
    Ok(s.into_any()
        .downcast::<Keep>()
        .map_err(|_| Error::Invalid("wrong saved state".into()))?
        .0)
}

/// x[b,t] = wte[token] + pos[t]; `wte` is shared (index 0).
pub struct Embed {
    pub vocab: usize,
    pub dim: usize,
    pub seq: usize,
}

impl Module for Embed {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "pos".into(),
            shape: vec![self.seq, self.dim],
            init: Init::Normal { std: 0.1 },
        }]
    }
    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, _input: &Tensor) -> Result<Tensor> {
        let (pos, wte, d) = (p.get(0).host()?, p.get(1).host()?, self.dim);
        let n = ctx.batch.tokens.len();
        let mut x = vec![0.0; n * d];
        for (i, &tok) in ctx.batch.tokens.iter().enumerate() {
            let t = i % ctx.batch.seq;
            for j in 0..d {
                x[i * d + j] = wte[tok as usize * d + j] + pos[t * d + j];
            }
        }
        if ctx.training {
            *ctx.saved = Some(Box::new(Keep(vec![])));
        }
        Tensor::from_f32(vec![n, d], x)
    }
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        _p: &Params<'_>,
        g: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        take(ctx)?;
        let (d, dy) = (self.dim, dy.host_f32()?);
        for (i, &tok) in ctx.batch.tokens.iter().enumerate() {
            let t = i % ctx.batch.seq;
            for j in 0..d {
                g.require(0)?.host()?[t * d + j] += dy[i * d + j];
                g.require(1)?.host()?[tok as usize * d + j] += dy[i * d + j];
            }
        }
        Ok(Tensor::default())
    }
}

/// y = x + tanh(x W + b).
pub struct Residual {
    pub name: String,
    pub dim: usize,
}

impl Module for Residual {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec {
                name: format!("{}.w", self.name),
                shape: vec![self.dim, self.dim],
                init: Init::Normal { std: 0.3 },
            },
            ParamSpec {
                name: format!("{}.b", self.name),
                shape: vec![self.dim],
                init: Init::Zeros,
            },
        ]
    }
    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let (w, b, d) = (p.get(0).host()?, p.get(1).host()?, self.dim);
        let n = x.numel() / d;
        let (shape, x) = (x.shape.clone(), x.host_f32()?);
        let mut h = vec![0.0; n * d];
        for r in 0..n {
            for j in 0..d {
                let mut acc = b[j];
                for k in 0..d {
                    acc += x[r * d + k] * w[k * d + j];
                }
                h[r * d + j] = acc.tanh();
            }
        }
        let y: Vec<f32> = x.iter().zip(&h).map(|(a, b)| a + b).collect();
        if ctx.training {
            *ctx.saved = Some(Box::new(Keep(vec![x.to_vec(), h])));
        }
        Tensor::from_f32(shape, y)
    }
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        g: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let s = take(ctx)?;
        let (x, h, w, d) = (&s[0], &s[1], p.get(0).host()?, self.dim);
        let n = x.len() / d;
        let (shape, dy) = (dy.shape.clone(), dy.host_f32()?);
        let mut dx = dy.to_vec();
        for r in 0..n {
            for j in 0..d {
                let dz = dy[r * d + j] * (1.0 - h[r * d + j] * h[r * d + j]);
                g.require(1)?.host()?[j] += dz;
                for k in 0..d {
                    g.require(0)?.host()?[k * d + j] += x[r * d + k] * dz;
                    dx[r * d + k] += dz * w[k * d + j];
                }
            }
        }
        Tensor::from_f32(shape, dx)
    }
}

/// logits = y wte^T (wte shared, index 0 after no own params); returns the summed token CE.
pub struct Head {
    pub vocab: usize,
    pub dim: usize,
}

impl Module for Head {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![]
    }
    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, y: &Tensor) -> Result<Tensor> {
        let (wte, v, d) = (p.get(0).host()?, self.vocab, self.dim);
        let n = y.numel() / d;
        let y = y.host_f32()?;
        let mut probs = vec![0.0; n * v];
        let mut loss = 0.0f32;
        for r in 0..n {
            let row = &mut probs[r * v..(r + 1) * v];
            for (c, out) in row.iter_mut().enumerate() {
                *out = (0..d).map(|k| y[r * d + k] * wte[c * d + k]).sum();
            }
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|l| (l - m).exp()).sum();
            let t = ctx.batch.targets[r];
            if t != IGNORE_INDEX {
                loss += m + z.ln() - row[t as usize];
            }
            for l in row.iter_mut() {
                *l = (*l - m).exp() / z;
            }
        }
        if ctx.training {
            *ctx.saved = Some(Box::new(Keep(vec![y.to_vec(), probs])));
        }
        Ok(Tensor::scalar(loss))
    }
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        g: &mut Grads<'_>,
        dl: &Tensor,
    ) -> Result<Tensor> {
        let s = take(ctx)?;
        let (y, probs, wte, v, d) = (&s[0], &s[1], p.get(0).host()?, self.vocab, self.dim);
        let dl = dl.host_f32()?[0];
        let n = y.len() / d;
        let mut dy = vec![0.0; n * d];
        for r in 0..n {
            let t = ctx.batch.targets[r];
            if t == IGNORE_INDEX {
                continue;
            }
            for c in 0..v {
                let dlogit = (probs[r * v + c] - if c as i32 == t { 1.0 } else { 0.0 }) * dl;
                for k in 0..d {
                    dy[r * d + k] += dlogit * wte[c * d + k];
                    g.require(0)?.host()?[c * d + k] += dlogit * y[r * d + k];
                }
            }
        }
        Tensor::from_f32(vec![n, d], dy)
    }
}

/// The toy model: embed, `layers` residual units, head; `wte` tied.
pub fn model(vocab: usize, dim: usize, seq: usize, layers: usize) -> Model {
    let blocks = (0..layers).map(|i| {
        let name = format!("h.{i}");
        let block: Arc<dyn Module> = Arc::new(Residual {
            name: name.clone(),
            dim,
        });
        (name, block)
    });
    let table = ParamSpec {
        name: "wte".into(),
        shape: vec![vocab, dim],
        init: Init::Normal { std: 0.5 },
    };
    let embed = Arc::new(Embed { vocab, dim, seq });
    tied(
        embed,
        blocks.collect(),
        Arc::new(Head { vocab, dim }),
        table,
    )
}

/// A model of an embedding, `blocks` (named) and a head, the embedding and the head sharing
/// `table` (the only shared parameter), nothing frozen.
pub fn tied(
    embed: Arc<dyn Module>,
    blocks: Vec<(String, Arc<dyn Module>)>,
    head: Arc<dyn Module>,
    table: ParamSpec,
) -> Model {
    let unit = |name: String, module, uses_shared| Unit {
        name,
        module,
        uses_shared,
    };
    let mut units = vec![unit("embed".into(), embed, vec![0])];
    units.extend(blocks.into_iter().map(|(n, m)| unit(n, m, vec![])));
    units.push(unit("head".into(), head, vec![0]));
    Model {
        shared: vec![table],
        units,
        frozen: Default::default(),
    }
}

/// A deterministic batch: `rows` rows of `seq` tokens starting at row `first`.
pub fn batch(vocab: usize, seq: usize, first: usize, rows: usize) -> Batch {
    let tok = |r: usize, t: usize| ((r * 7 + t * 3 + (r * t) % 5) % vocab) as u32;
    let mut tokens = Vec::new();
    let mut targets = Vec::new();
    for r in first..first + rows {
        for t in 0..seq {
            tokens.push(tok(r, t));
            targets.push(if (r + t) % 11 == 3 {
                IGNORE_INDEX
            } else {
                tok(r, t + 1) as i32
            });
        }
    }
    Batch {
        batch: rows,
        seq,
        tokens,
        targets,
    }
}

/// A residual layer whose bias gradient turns NaN in its `at`-th backward (0-based).
pub struct NanAt {
    inner: Residual,
    at: usize,
    calls: AtomicUsize,
}

impl NanAt {
    /// Residual layer `name` of width `dim` whose bias gradient is NaN in backward `at`.
    pub fn new(name: &str, dim: usize, at: usize) -> Self {
        Self {
            inner: Residual {
                name: name.into(),
                dim,
            },
            at,
            calls: AtomicUsize::new(0),
        }
    }
}

impl Module for NanAt {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.inner.param_specs()
    }
    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(ctx, p, x)
    }
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        g: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let dx = self.inner.backward(ctx, p, g, dy)?;
        if self.calls.fetch_add(1, Ordering::Relaxed) == self.at {
            g.require(1)?.host()?[0] = f32::NAN;
        }
        Ok(dx)
    }
}
