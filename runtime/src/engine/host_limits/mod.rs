//! `initialize`'s checks of the host's limits, before anything is allocated: the locked
//! memory `mlock` takes against `RLIMIT_MEMLOCK`, and (`ram.rs`) the host RAM a device run
//! needs, page-locked and pageable.
//!
//! Two kinds of locked host memory, checked against different limits and never both for one
//! buffer (no buffer of the engine is both mlocked and registered):
//! - `mlock` (`ferrozero_offload::pool`, the NVMe optimizer's buffers under
//!   `offload_optimizer.pin_memory`): charged by the kernel against `RLIMIT_MEMLOCK`;
//!   `Estimate::mlocked_host_bytes`.
//! - a device driver's registration (`cuMemHostRegister`: the stage-3 host parameter store,
//!   the host gradient accumulators, copy staging, the upload ring): NVIDIA's kernel module
//!   pins those pages with `get_user_pages` and charges nothing to `locked_vm`, so not against
//!   `RLIMIT_MEMLOCK`; they are resident and count against host RAM and a cgroup's limit;
//!   `Estimate::page_locked`.

mod ram;

pub use ram::{check_host_ram, headroom, HostRam, HostRamNeed};

use ferrozero_config::ResolvedConfig;
use ferrozero_offload::preflight::{memlock_fix, MemlockLimits};
use ferrozero_offload::sys::{self, MemlockLimit};

use super::estimate::Estimate;
use crate::{Error, Result};

/// Ranks of this job that run in this process's machine: all of them with the local
/// backend, else the launcher's `LOCAL_WORLD_SIZE` (1 when unset).
pub(super) fn ranks_here(cfg: &ResolvedConfig) -> u64 {
    match cfg.comms.backend {
        ferrozero_config::resolved::CommBackend::Local => cfg.world_size as u64,
        _ => std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
    }
}

/// What the locked-memory check does with `need` mlocked bytes under a soft limit and a
/// hard one (`None`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockVerdict {
    /// Within the soft limit (or nothing is locked).
    Fits,
    /// Over the soft limit, within the hard one: raise the soft limit.
    Raise,
    /// Over the hard limit.
    Refuse,
}

/// The decision for `need` mlocked bytes (only those: registered bytes are not charged).
pub fn memlock_verdict(need: u64, soft: MemlockLimit, hard: Option<u64>) -> MemlockVerdict {
    match soft {
        MemlockLimit::Bytes(s) if need > s => {
            if hard.is_none_or(|h| need <= h) {
                MemlockVerdict::Raise
            } else {
                MemlockVerdict::Refuse
            }
        }
        _ => MemlockVerdict::Fits,
    }
}

/// The locked-memory check of `pin_memory = true`, at `initialize`: when the bytes this
/// machine's ranks `mlock` (`Estimate::mlocked_host_bytes`) exceed the soft
/// `RLIMIT_MEMLOCK`, the soft limit is raised to the hard one if that suffices; otherwise the
/// run is refused with the exact `ulimit` / `limits.conf` / systemd / docker lines that fix
/// it, unless every pinned section sets `pin_memory_fallback = true`, in which case pinning is
/// turned off with a warning. Either way before step 1, never as an allocation failure.
pub(super) fn check_locked_memory(cfg: &mut ResolvedConfig, e: &Estimate) -> Result<()> {
    let here = ranks_here(cfg);
    let need = e.mlocked_host_bytes.saturating_mul(here);
    let soft = sys::memlock_limit();
    let (_, hard) = sys::memlock_rlimit();
    let verdict = memlock_verdict(need, soft, hard);
    if verdict == MemlockVerdict::Fits {
        return Ok(());
    }
    let soft = match soft {
        MemlockLimit::Bytes(s) => Some(s),
        _ => None,
    };
    if verdict == MemlockVerdict::Raise && sys::raise_memlock_soft(hard).is_ok() {
        tracing::info!(
            "pin_memory: raised the soft RLIMIT_MEMLOCK from {} bytes to {} so that {need} \
             bytes of mlocked buffers fit ({here} rank(s) on this machine)",
            soft.unwrap_or(0),
            hard.map_or("unlimited".to_string(), |h| format!("{h} bytes"))
        );
        return Ok(());
    }
    let who = if here == 1 {
        "1 rank on this machine".to_string()
    } else {
        format!("{here} ranks on this machine")
    };
    let msg = memlock_fix(need, MemlockLimits { soft, hard }, &sys::user_name(), &who);
    let z = &mut cfg.zero;
    let fallback = [&z.offload_optimizer, &z.offload_param]
        .iter()
        .filter(|o| o.pin_memory)
        .all(|o| o.pin_memory_fallback);
    if fallback {
        z.offload_optimizer.pin_memory = false;
        z.offload_param.pin_memory = false;
        tracing::warn!("{msg}\npin_memory_fallback = true: continuing with pageable buffers");
        return Ok(());
    }
    Err(Error::Config(format!("locked memory: {msg}")))
}

/// The host-RAM check of a device run at `initialize` (a run whose device memory is the
/// host's is counted whole by the pre-flight instead): `ram` is this machine's figures, or
/// `None` where they cannot be read (then nothing is checked). A warning is logged when the
/// run fits closely.
pub(super) fn check_device_host_ram(
    cfg: &ResolvedConfig,
    e: &Estimate,
    ram: Option<HostRam>,
) -> Result<()> {
    let Some(ram) = ram else {
        return Ok(());
    };
    let here = ranks_here(cfg);
    if let Some(w) = check_host_ram(&HostRamNeed::of(e, here), here, &ram)? {
        tracing::warn!("{w}");
    }
    Ok(())
}
