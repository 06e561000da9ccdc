//! Host memory a device page-locks for a run, from what the measured step registered: the
//! engine's own registration (the stage-3 host parameter store, registered once at build),
//! the device's small-upload ring, and the rest of the device's registrations (the staging
//! pool of the offloaded copies, host checkpoints and snapshots). A device that page-locks
//! nothing (the CPU) reads 0.

use serde::Serialize;

use super::run::Measured;

/// Page-locked host bytes by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PageLockedFigures {
    /// The stage-3 parameter shards in host memory (`offload_param.device = "cpu"`).
    pub parameters: u64,
    /// The device's staging buffers: the offloaded optimizer's copies (gradients down,
    /// parameters up), `cpu_checkpointing`'s checkpoints and the speculative overlap's
    /// snapshots of device values, those of at least
    /// `tensor::in_flight::PAGE_LOCK_MIN_BYTES`.
    pub staging: u64,
    /// The small-upload ring.
    pub ring: u64,
    /// Of `staging`, the speculative overlap's snapshots of device values: host optimizer
    /// state in the engine's ledger too.
    pub snapshots: u64,
}

impl PageLockedFigures {
    /// The figures of a measured step: its peak of page-locked bytes, split into the engine's
    /// registration, the ring, and the staging that makes up the rest.
    pub(super) fn of(m: &Measured) -> Self {
        let (peak, parameters) = m.page_locked;
        if peak == 0 {
            return Self::default();
        }
        let ring = m.upload_ring.min(peak - parameters.min(peak));
        let staging = peak.saturating_sub(parameters + ring);
        PageLockedFigures {
            parameters,
            staging,
            ring,
            snapshots: m.snapshots.taken_locked.min(staging),
        }
    }

    /// All of them.
    pub fn total(&self) -> u64 {
        self.parameters + self.staging + self.ring
    }

    /// Of [`PageLockedFigures::total`], the bytes the engine's ledger already counts as host
    /// memory: the parameter store and the snapshots' staging. A host-memory total adds only
    /// the rest, so neither is counted twice. (Staging that holds host checkpoints is counted
    /// in both, which errs on the side of more host memory.)
    pub fn in_host_ledger(&self) -> u64 {
        self.parameters + self.snapshots
    }
}
