//! Shared test helpers: a hand-built resolved config and the toy model.

#![allow(dead_code)]

pub mod ledgers;
pub mod models;
pub mod runs;
pub mod scratch;
pub mod tiny;
pub mod toy;

use std::time::Duration;

use ferrozero_config::resolved::*;

/// ZeRO stages 0-3.
pub const STAGES: [ZeroStage; 4] = [
    ZeroStage::Stage0,
    ZeroStage::Stage1,
    ZeroStage::Stage2,
    ZeroStage::Stage3,
];

/// A resolved config for tests: AdamW, no scheduler, clipping on, f32 unless told.
pub fn config(
    stage: ZeroStage,
    world: usize,
    micro: usize,
    gas: usize,
    precision: Precision,
) -> ResolvedConfig {
    let off = Offload {
        target: OffloadTarget::None,
        pin_memory: false,
        buffer_count: 4,
        buffer_size: 100_000_000,
        max_in_cpu: 1_000_000_000,
        pin_memory_fallback: false,
    };
    ResolvedConfig {
        train_batch_size: micro * gas * world,
        train_micro_batch_size_per_gpu: micro,
        gradient_accumulation_steps: gas,
        world_size: world,
        gradient_clipping: 1.0,
        steps_per_print: 10,
        wall_clock_breakdown: false,
        seed: 1234,
        // The toy model computes with host loops: the CPU backend.
        device: ferrozero_config::Device::Cpu,
        device_memory_limit: None,
        zero: ZeroConfig {
            stage,
            overlap_comm: false,
            reduce_scatter: true,
            // Small buckets so chunked communication paths run too.
            reduce_bucket_size: 40,
            allgather_bucket_size: 24,
            sub_group_size: 17,
            prefetch_bucket_size: 1000,
            param_persistence_threshold: 0,
            max_live_parameters: 1_000_000,
            max_reuse_distance: 1_000_000,
            hpz_partition_size: 1,
            quantized_weights: false,
            quantized_nontrainable_weights: false,
            quantized_gradients: false,
            mics_shard_size: 0,
            offload_param: off.clone(),
            offload_optimizer: off,
        },
        precision,
        bf16_state: Default::default(),
        grad_accum_f32: false,
        optimizer: OptimizerConfig::Adam {
            lr: 3e-2,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
            adam_w_mode: true,
            bias_correction: true,
        },
        scheduler: None,
        activation_checkpointing: None,
        aio: AioConfig {
            block_size: 1 << 20,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true,
        },
        comms: CommsConfig {
            backend: CommBackend::Local,
            timeout: Duration::from_secs(30),
            reduction: CommReduction::RankOrdered,
            data_type: None,
        },
        monitor: Default::default(),
    }
}

/// The optimizer of the parity fixtures (`gen_hf_parity.py`, `gen_peft_parity.py`): AdamW
/// (lr 3e-3, betas 0.9/0.95, eps 1e-6, weight decay 0.1), clipping at 1.0, f32, one micro-step.
pub fn parity_config(stage: ZeroStage, world: usize, micro: usize) -> ResolvedConfig {
    let mut cfg = config(stage, world, micro, 1, Precision::F32);
    cfg.optimizer = OptimizerConfig::Adam {
        lr: 3e-3,
        betas: (0.9, 0.95),
        eps: 1e-6,
        weight_decay: 0.1,
        adam_w_mode: true,
        bias_correction: true,
    };
    cfg.gradient_clipping = 1.0;
    cfg
}

/// Activation checkpointing on every unit.
pub fn checkpointing(cpu: bool) -> ActivationCheckpointing {
    ActivationCheckpointing {
        cpu_checkpointing: cpu,
    }
}

/// LAMB at `lr` with the hyperparameters every LAMB test uses: betas (0.9, 0.999), eps 1e-8
/// outside the root, weight decay 0.01, bias correction, trust ratio clamped to [0.01, 10].
pub fn lamb(lr: f64) -> OptimizerConfig {
    OptimizerConfig::Lamb {
        lr,
        betas: (0.9, 0.999),
        eps: 1e-8,
        eps_inside_sqrt: false,
        weight_decay: 0.01,
        bias_correction: true,
        max_coeff: 10.0,
        min_coeff: 0.01,
    }
}

/// The communication logger profiling every operation, quietly.
pub fn comms_logger() -> CommsLoggerConfig {
    CommsLoggerConfig {
        verbose: false,
        prof_all: true,
        prof_ops: Vec::new(),
        debug: false,
    }
}

/// AdamW, Adam with L2 decay, SGD with momentum (`dampening`, `nesterov` as told) and Lion,
/// at the learning rates the optimizer-state tests step them with.
pub fn update_rules(dampening: f32, nesterov: bool) -> Vec<ferrozero_runtime::backend::UpdateRule> {
    use ferrozero_offload::optim::{AdamHyper, LionHyper, SgdHyper, WeightDecay};
    use ferrozero_runtime::backend::UpdateRule;
    let adam = |decay| AdamHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        decay,
        bias_correction: true,
    };
    vec![
        UpdateRule::Adam(adam(WeightDecay::Decoupled)),
        UpdateRule::Adam(adam(WeightDecay::L2)),
        UpdateRule::Sgd(SgdHyper {
            lr: 1e-2,
            momentum: 0.9,
            dampening,
            weight_decay: 0.01,
            nesterov,
        }),
        UpdateRule::Lion(LionHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.1,
        }),
    ]
}

/// DeepSpeed's dynamic loss scale from `2^initial_scale_power`, doubled after `window` clean
/// steps, halved after `hysteresis` overflows, down to a scale of 1.
pub fn dynamic_scaling(initial_scale_power: u32, window: u64, hysteresis: u32) -> LossScaling {
    LossScaling::Dynamic {
        initial_scale_power,
        loss_scale_window: window,
        hysteresis,
        consecutive_hysteresis: false,
        min_loss_scale: 1.0,
    }
}

/// Two micro-steps of two rows at `stage` on `world` ranks in `precision`, clipping at `clip`,
/// and a warmup schedule (a learning rate that changes every step).
pub fn warmup(stage: ZeroStage, world: usize, precision: Precision, clip: f64) -> ResolvedConfig {
    let mut cfg = config(stage, world, 2, 2, precision);
    cfg.gradient_clipping = clip;
    cfg.scheduler = Some(SchedulerConfig::WarmupLR {
        warmup_min_lr: 1e-3,
        warmup_max_lr: 3e-2,
        warmup_num_steps: 3,
        warmup_type: WarmupType::Linear,
    });
    cfg
}
