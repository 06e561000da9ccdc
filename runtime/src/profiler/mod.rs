//! DeepSpeed's `flops_profiler`: at `profile_step`, the time, FLOPs and achieved TFLOP/s of
//! every module of the model and of every kernel family, as a table on rank 0 and in the
//! step's report; and the model FLOPs per token and device peaks behind every step's `mfu`.
//!
//! Design: decorators, so that neither the layers nor the backends know the profiler.
//! - [`ProfilingBackend`] wraps the engine's `Arc<dyn Backend>` and forwards every
//!   operation; while a step is profiled it times each one and counts its FLOPs from the
//!   operation's shape (`flops`), under the module the training thread is in. The time is
//!   the operation's own on every device: each starts and ends with a wait on a
//!   compute-stream event through [`crate::backend::StreamOps`] (complete at once on the
//!   CPU, a device event on a GPU), so the same code measures both, at the price of two host
//!   syncs per operation in the profiled step only.
//! - Each unit's module is wrapped (`scoped`) so that its forward and backward name the
//!   unit; operations outside every unit count as `engine`, those of other threads (the
//!   communication worker, the optimizer lane) as `background`. Within a unit the split is
//!   by kernel family (depth 2), which needs no change to any layer.
//! - Collectives are timed by a communication logger of the profiler's own over the
//!   engine's communicator (the `communication` family).
//! - The optimizer update of state in host memory (the CPU's, or offloaded) runs the host
//!   kernels directly, not through the backend: the engine's own timing of the update
//!   (`Timings::optimizer`) supplies the `optimizer` row's time beyond its operations.
//!
//! Nothing is installed unless `flops_profiler.enabled`: a disabled profiler costs nothing;
//! an enabled one costs one atomic load per operation outside the profiled step.

mod backend;
pub mod flops;
mod peak;
mod record;
mod report;
mod scoped;
mod table;

use std::sync::Arc;
use std::time::Instant;

use ferrozero_config::resolved::{CommsLoggerConfig, FlopsProfilerConfig};

pub use backend::ProfilingBackend;
pub use flops::model_flops_per_token;
pub use peak::{mfu, stated_peak_tflops};
pub use record::{Cell, Family};
pub use report::{FamilyRow, FlopsProfile, ModuleRow, OTHER};
pub use table::render;

use crate::backend::{Backend, Stream};
use crate::comm::logger::{CommStats, CommsLogger};
use crate::comm::Communicator;
use crate::nn::{Model, Unit};
use crate::{Error, Result};
use record::Recorder;

/// The profiler of one rank's engine.
pub struct Profiler {
    cfg: FlopsProfilerConfig,
    rec: Arc<Recorder>,
    comms: Arc<CommStats>,
    rank: usize,
    units: Vec<(Arc<str>, u64)>,
    params: u64,
    device: String,
    /// When the profiled step started, and the communicator's totals then.
    started: Option<(Instant, f64, u64)>,
}

impl Profiler {
    /// A profiler for `cfg`, its communication logger wrapped around `comm`.
    pub fn open(
        cfg: FlopsProfilerConfig,
        comm: Box<dyn Communicator>,
    ) -> (Self, Box<dyn Communicator>) {
        let rank = comm.rank();
        let quiet = CommsLoggerConfig {
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
        };
        let comms = Arc::new(CommStats::new(quiet, rank));
        let comm: Box<dyn Communicator> = Box::new(CommsLogger::new(comm, comms.clone()));
        let p = Profiler {
            cfg,
            rec: Arc::default(),
            comms,
            rank,
            units: Vec::new(),
            params: 0,
            device: String::new(),
            started: None,
        };
        (p, comm)
    }

    /// Wraps the backend and every unit of the model.
    pub fn instrument(&mut self, be: Arc<dyn Backend>, model: Model) -> (Arc<dyn Backend>, Model) {
        self.device = be.name();
        self.params = model.num_params() as u64;
        self.units = model
            .units
            .iter()
            .map(|u| {
                let own = u
                    .module
                    .param_specs()
                    .iter()
                    .map(|p| p.numel() as u64)
                    .sum();
                (Arc::<str>::from(u.name.as_str()), own)
            })
            .collect();
        let units = model
            .units
            .into_iter()
            .map(|u| Unit {
                module: Arc::new(scoped::Scoped {
                    name: Arc::from(u.name.as_str()),
                    inner: u.module,
                    rec: self.rec.clone(),
                }),
                ..u
            })
            .collect();
        let be: Arc<dyn Backend> = Arc::new(ProfilingBackend::new(be, self.rec.clone()));
        let model = Model {
            shared: model.shared,
            units,
            frozen: model.frozen,
        };
        (be, model)
    }

    /// Before the first forward of optimizer step `step` (1-based): starts recording when it
    /// is `profile_step`, after the device's earlier work has finished (afresh when a failed
    /// attempt at the step is retried).
    pub fn begin(&mut self, step: u64, be: &dyn Backend) -> Result<()> {
        if step != self.cfg.profile_step {
            return Ok(());
        }
        be.record(Stream::Compute)?.synchronize()?;
        let (ms, calls) = self.comm_totals();
        self.rec.start();
        self.started = Some((Instant::now(), ms, calls));
        Ok(())
    }

    /// After the update of optimizer step `step`, whose update took `optimizer_seconds` by
    /// the engine's clock: the profile when this step was recorded; rank 0 prints its table
    /// to `output_file` or standard output.
    pub fn end(
        &mut self,
        step: u64,
        be: &dyn Backend,
        optimizer_seconds: f64,
    ) -> Result<Option<FlopsProfile>> {
        let Some((t, ms0, calls0)) = self.started.take() else {
            return Ok(None);
        };
        be.record(Stream::Compute)?.synchronize()?;
        let step_seconds = t.elapsed().as_secs_f64();
        let cells = self.rec.stop();
        let (ms, calls) = self.comm_totals();
        let measured = report::Measured {
            step,
            rank: self.rank,
            device: self.device.clone(),
            params: self.params,
            units: self.units.clone(),
            step_seconds,
            comm_seconds: (ms - ms0) / 1e3,
            comm_calls: calls - calls0,
            optimizer_seconds,
        };
        let profile = FlopsProfile::build(measured, cells);
        if self.rank == 0 {
            self.print(&render(&profile, &self.cfg))?;
        }
        Ok(Some(profile))
    }

    fn comm_totals(&self) -> (f64, u64) {
        let s = self.comms.snapshot();
        (
            s.iter().map(|o| o.total_ms).sum(),
            s.iter().map(|o| o.count).sum(),
        )
    }

    fn print(&self, table: &str) -> Result<()> {
        match &self.cfg.output_file {
            None => {
                print!("{table}");
                Ok(())
            }
            Some(path) => std::fs::write(path, table).map_err(|e| Error::Io {
                context: format!("write the flops profile to {}", path.display()),
                source: e,
            }),
        }
    }
}
