//! The engine's observers: the monitors (`tensorboard`, `csv_monitor`), the communication
//! logger (`comms_logger`) and the FLOPs profiler (`flops_profiler`), engine-level so that
//! every program built on the engine gets them. None changes what is computed: the monitor
//! reads the step's report, the logger and the profiler only time what they forward.

use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_offload::store::Traffic;

use super::trace::Trace;
use super::{StepReport, Timings};
use crate::backend::{Backend, DeviceActivity};
use crate::comm::logger::{CommStats, CommsLogger};
use crate::comm::Communicator;
use crate::monitor::Monitor;
use crate::nn::Model;
use crate::profiler::{FlopsProfile, Profiler};
use crate::Result;

/// What watches the engine's steps, and the marks its reports count from; at the end the
/// communication summary is logged once more and the monitor's files are flushed.
pub(super) struct Observers {
    pub(super) monitor: Option<Monitor>,
    pub(super) comms: Option<Arc<CommStats>>,
    profiler: Option<Profiler>,
    every: u64,
    /// The recorded schedule (off unless asked for).
    pub(super) trace: Trace,
    /// Seconds by phase since the last step report.
    pub(super) timings: Timings,
    /// The device's counts when the current step began (reports carry the difference; none
    /// where the device counts nothing).
    pub(super) activity_mark: Option<DeviceActivity>,
    /// NVMe traffic at the end of the last step (reports carry the difference).
    pub(super) traffic_mark: Traffic,
}

impl Observers {
    /// Opens the configured observers; the communicator comes back wrapped in the logger
    /// when `comms_logger` is enabled.
    pub(super) fn open(
        cfg: &ResolvedConfig,
        comm: Box<dyn Communicator>,
    ) -> Result<(Self, Box<dyn Communicator>)> {
        let rank = comm.rank();
        let (comms, comm) = match &cfg.monitor.comms_logger {
            Some(c) => {
                let stats = Arc::new(CommStats::new(c.clone(), rank));
                let wrapped: Box<dyn Communicator> =
                    Box::new(CommsLogger::new(comm, stats.clone()));
                (Some(stats), wrapped)
            }
            None => (None, comm),
        };
        let (profiler, comm) = match &cfg.monitor.flops_profiler {
            Some(p) => {
                let (p, comm) = Profiler::open(p.clone(), comm);
                (Some(p), comm)
            }
            None => (None, comm),
        };
        let observers = Observers {
            monitor: Monitor::open(cfg, rank)?,
            comms,
            profiler,
            every: cfg.steps_per_print.max(1) as u64,
            trace: Trace::default(),
            timings: Timings::default(),
            activity_mark: None,
            traffic_mark: Traffic::default(),
        };
        Ok((observers, comm))
    }

    /// The backend and the model as the engine runs them: wrapped by the profiler when it
    /// is enabled, else as they are.
    pub(super) fn instrument(
        &mut self,
        be: Arc<dyn Backend>,
        model: Model,
    ) -> (Arc<dyn Backend>, Model) {
        match &mut self.profiler {
            Some(p) => p.instrument(be, model),
            None => (be, model),
        }
    }

    /// Before the first forward of optimizer step `step`.
    pub(super) fn step_begin(&mut self, step: u64, be: &dyn Backend) -> Result<()> {
        match &mut self.profiler {
            Some(p) => p.begin(step, be),
            None => Ok(()),
        }
    }

    /// After the update of optimizer step `step`: its profile, if it was profiled.
    pub(super) fn step_end(&mut self, step: u64, be: &dyn Backend) -> Result<Option<FlopsProfile>> {
        match &mut self.profiler {
            Some(p) => p.end(step, be, self.timings.optimizer),
            None => Ok(None),
        }
    }

    /// After each optimizer step: the monitor's scalars; every `steps_per_print` steps a
    /// flush and the communication summary.
    pub(super) fn step(&mut self, report: &StepReport) -> Result<()> {
        if let Some(m) = &mut self.monitor {
            m.record(report)?;
        }
        if report.step.is_multiple_of(self.every) {
            if let Some(m) = &self.monitor {
                m.flush();
            }
            if let Some(c) = &self.comms {
                c.log_summary();
            }
        }
        Ok(())
    }
}

impl Drop for Observers {
    fn drop(&mut self) {
        if let Some(c) = &self.comms {
            c.log_summary();
        }
    }
}
