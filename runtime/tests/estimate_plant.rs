//! The estimate and the engine share one code path: a buffer planted in a layer's forward (and
//! kept for its backward, as saved state is) moves the estimate by exactly its size, with no
//! change anywhere in the estimator, on the CPU's ledger and on a GPU's caching allocator.

use std::any::Any;
use std::sync::Arc;

use ferrozero_config::resolved::{Precision, ResolvedConfig, ZeroStage};
use ferrozero_config::Device;
use ferrozero_runtime::engine::estimate::estimate;
use ferrozero_runtime::engine::ledger::Category;
use ferrozero_runtime::nn::module::SavedState;
use ferrozero_runtime::nn::{gpt2, Ctx, Grads, Model, Module, ParamSpec, Params};
use ferrozero_runtime::tensor::{DType, Storage, Tensor};
use ferrozero_runtime::{Error, Result};

mod common;

/// Bytes planted: a multiple of the CUDA allocator's 512-byte blocks, in its small pool.
const PLANTED: usize = 64 << 10;

/// The inner module's saved state and the planted buffer beside it.
struct Planted(Option<Box<dyn SavedState>>, Storage);

impl SavedState for Planted {
    fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.bytes()) + self.1.bytes() as usize
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// `inner`, whose forward also allocates [`PLANTED`] bytes on its device and keeps them for
/// backward.
struct Plant(Arc<dyn Module>);

impl Module for Plant {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.0.param_specs()
    }
    fn forward(&self, ctx: &mut Ctx<'_>, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let y = self.0.forward(ctx, p, x)?;
        if ctx.training {
            let planted = ctx.be.buffer(DType::F32, PLANTED / 4)?;
            *ctx.saved = Some(Box::new(Planted(ctx.saved.take(), planted)));
        }
        Ok(y)
    }
    fn backward(
        &self,
        ctx: &mut Ctx<'_>,
        p: &Params<'_>,
        g: &mut Grads<'_>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let saved = ctx
            .saved
            .take()
            .ok_or_else(|| Error::Invalid("no saved state".into()))?;
        let planted = saved
            .into_any()
            .downcast::<Planted>()
            .map_err(|_| Error::Invalid("not the planted state".into()))?;
        *ctx.saved = planted.0;
        self.0.backward(ctx, p, g, dy)
    }
}

fn gpt2_tiny(planted: bool) -> Model {
    let mut m = gpt2::build(&gpt2::Gpt2Config::preset("tiny").unwrap()).unwrap();
    if planted {
        let inner = m.units[1].module.clone();
        m.units[1].module = Arc::new(Plant(inner));
    }
    m
}

fn cfg(device: Device) -> ResolvedConfig {
    let mut c = common::config(ZeroStage::Stage0, 1, 2, 1, Precision::Bf16);
    c.device = device;
    c
}

#[test]
fn a_planted_buffer_moves_the_estimate_by_its_size() {
    let devices = [Device::Cpu]
        .into_iter()
        .chain(cfg!(feature = "cuda").then_some(Device::Cuda(None)));
    for device in devices {
        let c = cfg(device);
        let plain = estimate(&gpt2_tiny(false), &c, 2, 16).unwrap();
        let planted = estimate(&gpt2_tiny(true), &c, 2, 16).unwrap();
        let act = |e: &ferrozero_runtime::engine::estimate::Estimate| {
            e.device.category(Category::Activations)
        };
        assert_eq!(
            act(&planted) - act(&plain),
            PLANTED as u64,
            "{device}: activations"
        );
        assert_eq!(
            planted.device.peak_bytes - plain.device.peak_bytes,
            PLANTED as u64,
            "{device}: device peak"
        );
        assert_eq!(
            planted.host, plain.host,
            "{device}: nothing moves on the host"
        );
    }
}
