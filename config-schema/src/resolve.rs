//! Turning a [`Config`] into the engine's [`ResolvedConfig`]: `"auto"` replaced (Hugging Face's
//! rules), stage-dependent defaults applied, and the batch rule checked at the real world size.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::diagnostic::{Diagnostic, DiagnosticKind, LineIndex, Severity};
use crate::error::LoadError;
use crate::model::{AutoOr, ByteSize, Config, OffloadDevice, OffloadSection};
use crate::resolved::*;

mod batch;
mod parts;

/// What resolution needs to know about the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolveContext {
    /// Data-parallel world size.
    pub world_size: usize,
    /// The model's hidden size, for `"auto"` bucket sizes.
    pub hidden_size: Option<usize>,
    /// The micro-batch to use where `train_micro_batch_size_per_gpu` is `"auto"`.
    pub micro_batch_hint: Option<usize>,
}

impl ResolveContext {
    /// A context with only the world size known.
    pub fn new(world_size: usize) -> Self {
        ResolveContext {
            world_size,
            hidden_size: None,
            micro_batch_hint: None,
        }
    }
}

/// One value decided during resolution (an `"auto"` or a context-dependent default), for logs
/// and `ferrozero config show --resolved`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Dotted key path.
    pub path: String,
    /// The value chosen.
    pub value: String,
    /// Why.
    pub rule: String,
}

/// A resolved configuration with the decisions that produced it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Resolution {
    /// The configuration the engine reads.
    pub config: ResolvedConfig,
    /// Every `"auto"` and derived value, with the rule used.
    pub decisions: Vec<Decision>,
}

/// Collects decisions and errors during one resolution.
pub(crate) struct Resolver<'c> {
    pub config: &'c Config,
    pub ctx: ResolveContext,
    index: LineIndex<'c>,
    pub errors: Vec<Diagnostic>,
    pub decisions: Vec<Decision>,
}

impl<'c> Resolver<'c> {
    pub(crate) fn decide(&mut self, path: &str, value: impl std::fmt::Display, rule: &str) {
        self.decisions.push(Decision {
            path: path.into(),
            value: value.to_string(),
            rule: rule.into(),
        });
    }

    pub(crate) fn fail(
        &mut self,
        kind: DiagnosticKind,
        path: &str,
        message: String,
        help: Option<String>,
        notes: Vec<String>,
    ) {
        let spans = &self.config.source.spans;
        let mut p = path;
        let span = loop {
            if let Some(s) = spans.get(p) {
                break Some(s.clone());
            }
            match p.rfind('.') {
                Some(i) => p = &p[..i],
                None => break None,
            }
        };
        let location = if self.config.source.text.is_empty() {
            None
        } else {
            span.map(|s| self.index.locate(&s))
        };
        self.errors.push(Diagnostic {
            severity: Severity::Error,
            kind,
            path: path.into(),
            message,
            help,
            notes,
            location,
            related: vec![],
        });
    }

    /// An `"auto"` that needs something the context does not have.
    pub(crate) fn missing(&mut self, path: &str, what: &str) {
        self.fail(
            DiagnosticKind::Auto,
            path,
            format!("\"auto\" cannot be resolved: {what}"),
            Some(format!("write a value for `{path}`")),
            vec![],
        );
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

impl Config {
    /// Resolves every `"auto"` and default for a run; all failures are reported together.
    pub fn resolve(&self, ctx: &ResolveContext) -> Result<ResolvedConfig, LoadError> {
        self.resolve_explained(ctx).map(|r| r.config)
    }

    /// Checks only the batch-size rule at `world_size` (what `ferrozero validate --world-size`
    /// reports); nothing is checked when the micro-batch is `"auto"`, as it needs the caller.
    pub fn check_batch_size(&self, world_size: usize) -> Vec<Diagnostic> {
        if self.train_micro_batch_size_per_gpu == Some(AutoOr::Auto) {
            return Vec::new();
        }
        let mut r = Resolver {
            config: self,
            ctx: ResolveContext::new(world_size),
            index: LineIndex::new(&self.source.text, &self.source.origin),
            errors: Vec::new(),
            decisions: Vec::new(),
        };
        batch::resolve_batch(&mut r);
        r.errors
    }

    /// The `comms` section, resolved: it needs no world size, so a communicator can be built
    /// from it before the rest of the config is resolved against that communicator's world.
    pub fn resolve_comms(&self) -> CommsConfig {
        CommsConfig {
            backend: match self.comms.backend {
                crate::model::Backend::Local => CommBackend::Local,
                crate::model::Backend::Mpi => CommBackend::Mpi,
                crate::model::Backend::Nccl => CommBackend::Nccl,
            },
            timeout: Duration::from_secs(self.comms.timeout),
            reduction: match self.comms.reduction {
                crate::model::Reduction::Native => CommReduction::Native,
                crate::model::Reduction::RankOrdered => CommReduction::RankOrdered,
            },
            data_type: self.communication_data_type,
        }
    }

    /// The monitors and the communication logger, resolved (disabled ones are `None`).
    pub fn resolve_monitor(&self) -> MonitorConfig {
        let output = |m: &crate::model::MonitorSection| {
            m.enabled.then(|| MonitorOutput {
                dir: PathBuf::from(&m.output_path).join(&m.job_name),
                all_ranks: m.all_ranks,
            })
        };
        let c = &self.comms_logger;
        MonitorConfig {
            tensorboard: output(&self.tensorboard),
            csv_monitor: output(&self.csv_monitor),
            comms_logger: c.enabled.then(|| CommsLoggerConfig {
                verbose: c.verbose,
                prof_all: c.prof_all,
                prof_ops: c.prof_ops.clone(),
                debug: c.debug,
            }),
            flops_profiler: self.flops_profiler.enabled.then(|| {
                let f = &self.flops_profiler;
                FlopsProfilerConfig {
                    profile_step: f.profile_step,
                    module_depth: usize::try_from(f.module_depth).ok(),
                    top_modules: to_usize(f.top_modules),
                    detailed: f.detailed,
                    output_file: f.output_file.as_ref().map(PathBuf::from),
                }
            }),
            peak_tflops: self.flops_profiler.peak_tflops,
        }
    }

    /// Like [`Config::resolve`], also returning each decision taken, for logging.
    pub fn resolve_explained(&self, ctx: &ResolveContext) -> Result<Resolution, LoadError> {
        let mut r = Resolver {
            config: self,
            ctx: *ctx,
            index: LineIndex::new(&self.source.text, &self.source.origin),
            errors: Vec::new(),
            decisions: Vec::new(),
        };
        let (train, micro, gas) = batch::resolve_batch(&mut r);
        let gradient_clipping = match self.gradient_clipping {
            AutoOr::Value(v) => v,
            AutoOr::Auto => {
                r.decide(
                    "gradient_clipping",
                    1.0,
                    "\"auto\": Hugging Face's default max_grad_norm",
                );
                1.0
            }
        };
        let zero = parts::zero(&mut r);
        let precision = parts::precision(&mut r);
        let bf16_state = Bf16State {
            master_weights_and_grads: precision == Precision::Bf16
                && self.bf16.bf16_master_weights_and_grads,
            optimizer_states: precision == Precision::Bf16 && self.bf16.bf16_optimizer_states,
        };
        let grad_accum_f32 = parts::grad_accum_f32(&r, &precision, bf16_state);
        let optimizer = parts::optimizer(&mut r);
        let scheduler = optimizer
            .as_ref()
            .and_then(|o| parts::scheduler(&mut r, o.lr()));
        if !r.errors.is_empty() {
            return Err(LoadError::Invalid {
                origin: self.source.origin.clone(),
                diagnostics: r.errors,
            });
        }
        let config = ResolvedConfig {
            train_batch_size: train,
            train_micro_batch_size_per_gpu: micro,
            gradient_accumulation_steps: gas,
            world_size: ctx.world_size,
            gradient_clipping,
            steps_per_print: to_usize(self.steps_per_print),
            wall_clock_breakdown: self.wall_clock_breakdown,
            seed: self.seed,
            device: self.device,
            device_memory_limit: self.device_memory_limit.map(ByteSize::bytes),
            zero,
            bf16_state,
            grad_accum_f32,
            precision,
            optimizer: optimizer.expect("a missing optimizer is reported as an error"),
            scheduler,
            activation_checkpointing: self.activation_checkpointing.as_ref().map(|a| {
                ActivationCheckpointing {
                    cpu_checkpointing: a.cpu_checkpointing,
                }
            }),
            aio: AioConfig {
                block_size: to_usize(self.aio.block_size),
                queue_depth: to_usize(self.aio.queue_depth),
                intra_op_parallelism: to_usize(self.aio.intra_op_parallelism),
                single_submit: self.aio.single_submit,
                overlap_events: self.aio.overlap_events,
            },
            comms: self.resolve_comms(),
            monitor: self.resolve_monitor(),
        };
        Ok(Resolution {
            config,
            decisions: r.decisions,
        })
    }
}

/// Resolves an offload section; `default_buffers` differs between parameters and optimizer state.
pub(crate) fn offload(section: Option<&OffloadSection>, default_buffers: u64) -> Offload {
    let d = OffloadSection::default();
    let s = section.unwrap_or(&d);
    Offload {
        target: match (s.device, &s.nvme_path) {
            (OffloadDevice::None, _) => OffloadTarget::None,
            (OffloadDevice::Cpu, _) => OffloadTarget::Cpu,
            (OffloadDevice::Nvme, path) => OffloadTarget::Nvme(path.clone().unwrap_or_default()),
        },
        pin_memory: s.pin_memory,
        buffer_count: to_usize(s.buffer_count.unwrap_or(default_buffers)),
        buffer_size: to_usize(s.buffer_size),
        max_in_cpu: to_usize(s.max_in_cpu),
        pin_memory_fallback: s.pin_memory_fallback,
    }
}
