//! Host RAM for a device run: what the device page-locks (`Estimate::page_locked`) plus the
//! pageable host state, against what this process may use (`MemAvailable`, and the cgroup's
//! limit when there is one).
//!
//! Page-locked here means registered with the device's driver (`cuMemHostRegister`).
//! NVIDIA's kernel module pins those pages with `get_user_pages`
//! (`kernel-open/nvidia/os-mlock.c`, `os_lock_user_pages`) and charges nothing to
//! `locked_vm`, so they do not count against `RLIMIT_MEMLOCK` (that is also why PyTorch's
//! `pin_memory()` works in containers with a 64 KiB memlock limit). They are still resident,
//! unswappable host memory: they count against the host's RAM and a cgroup's memory limit,
//! which is what this check compares.

use std::path::Path;

use ferrozero_offload::sys::human;

use crate::engine::estimate::Estimate;
use crate::{Error, Result};

/// Share of the available memory past which a run that fits is still warned about.
const CLOSE: f64 = 0.9;

/// What host memory this process may use, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRam {
    /// `MemAvailable` from `/proc/meminfo`.
    pub mem_available: u64,
    /// What the process's memory cgroup still allows (its limit less its usage without
    /// reclaimable page cache, the tightest level of the hierarchy); `None` without a limit.
    pub cgroup_headroom: Option<u64>,
}

impl HostRam {
    /// Reads this machine's figures; an error where `MemAvailable` cannot be read.
    pub fn probe() -> Result<HostRam> {
        let mem_available = ferrozero_offload::sys::mem_available()
            .map_err(|e| Error::Config(format!("host memory: {e}")))?;
        Ok(HostRam {
            mem_available,
            cgroup_headroom: cgroup_headroom_here(),
        })
    }

    /// The bytes a run may count on: the smaller of the two figures.
    pub fn usable(&self) -> u64 {
        self.cgroup_headroom
            .map_or(self.mem_available, |c| c.min(self.mem_available))
    }

    fn describe(&self) -> String {
        match self.cgroup_headroom {
            Some(c) => format!(
                "MemAvailable {}, the memory cgroup's limit leaves {}",
                bytes(self.mem_available),
                bytes(c)
            ),
            None => format!("MemAvailable {}", bytes(self.mem_available)),
        }
    }
}

fn bytes(n: u64) -> String {
    format!("{} ({n} bytes)", human(n))
}

/// A device run's host memory for the ranks of one machine, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRamNeed {
    /// Registered with the device's driver: resident and unswappable.
    pub page_locked: u64,
    /// Of which the stage-3 parameter store (`offload_param`).
    pub parameters: u64,
    /// Of which the offloaded optimizer's copy staging (`offload_optimizer`).
    pub optimizer_side: u64,
    /// Ordinary host memory besides (offloaded optimizer state, checkpointed activations,
    /// swap buffers, snapshots).
    pub pageable: u64,
}

impl HostRamNeed {
    /// The need of `here` ranks each estimated by `e`; a buffer both in the host ledger and
    /// registered (the parameter store, host checkpoints, snapshots) is counted once, as
    /// page-locked.
    pub fn of(e: &Estimate, here: u64) -> Self {
        let p = &e.page_locked;
        let pageable = e
            .host_total_bytes()
            .saturating_sub(p.in_host_ledger())
            .saturating_mul(here);
        HostRamNeed {
            page_locked: p.total().saturating_mul(here),
            parameters: p.parameters.saturating_mul(here),
            optimizer_side: p.staging.saturating_mul(here),
            pageable,
        }
    }

    /// Page-locked and pageable together.
    pub fn total(&self) -> u64 {
        self.page_locked.saturating_add(self.pageable)
    }

    fn describe(&self, here: u64) -> String {
        format!(
            "{here} rank(s) on this machine need {} of host RAM: {} page-locked by the device \
             (parameter store {}, moved by offload_param.device; copy staging {}, moved by \
             offload_optimizer.device) and {} pageable",
            bytes(self.total()),
            bytes(self.page_locked),
            human(self.parameters),
            human(self.optimizer_side),
            bytes(self.pageable)
        )
    }
}

/// The host-RAM decision for a device run: an error naming every figure when `need` exceeds
/// what `ram` allows, a warning when it takes more than 90% of it, else nothing.
pub fn check_host_ram(need: &HostRamNeed, here: u64, ram: &HostRam) -> Result<Option<String>> {
    let usable = ram.usable();
    let total = need.total();
    let fixes = "offload_param.device = \"none\" keeps the parameters on the device, \
                 offload_optimizer.device = \"nvme\" moves the optimizer state to disk, or run \
                 fewer ranks per machine; pin_memory does not change this figure (locked or \
                 not, these bytes are host memory; the locked ones cannot be swapped out, and \
                 they do not count against RLIMIT_MEMLOCK)";
    if total > usable {
        return Err(Error::Config(format!(
            "host memory: {}, but {} is usable ({}). To fit: {fixes}",
            need.describe(here),
            bytes(usable),
            ram.describe()
        )));
    }
    if total as f64 > CLOSE * usable as f64 {
        return Ok(Some(format!(
            "host memory: {}, {:.0}% of the {} usable ({}); the host may start swapping or the \
             cgroup may kill the job. To make room: {fixes}",
            need.describe(here),
            100.0 * total as f64 / usable.max(1) as f64,
            bytes(usable),
            ram.describe()
        )));
    }
    Ok(None)
}

/// The tightest cgroup headroom of this process (v2 unified hierarchy, else v1's memory
/// controller), `None` without a limit or where none can be read.
fn cgroup_headroom_here() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let root = Path::new("/sys/fs/cgroup");
    if let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) {
        return headroom_up(&root.join(path.trim_start_matches('/')), root, V2);
    }
    let path = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, p) = (f.next()?, f.next()?, f.next()?);
        ctl.split(',').any(|c| c == "memory").then_some(p)
    })?;
    let mount = root.join("memory");
    let inner = mount.join(path.trim_start_matches('/'));
    // Inside a container the process's path is often not visible: its cgroup is the mount.
    let start = if inner.exists() { inner } else { mount.clone() };
    headroom_up(&start, &mount, V1)
}

/// File names of one cgroup version: limit, usage, and the stat key of reclaimable cache.
struct Files {
    limit: &'static str,
    usage: &'static str,
    inactive: &'static str,
}

const V2: Files = Files {
    limit: "memory.max",
    usage: "memory.current",
    inactive: "inactive_file",
};
const V1: Files = Files {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    inactive: "total_inactive_file",
};

/// The smallest headroom from `dir` up to `root`.
fn headroom_up(dir: &Path, root: &Path, files: Files) -> Option<u64> {
    dir.ancestors()
        .take_while(|d| d.starts_with(root))
        .filter_map(|d| {
            let read = |f: &str| std::fs::read_to_string(d.join(f)).ok();
            headroom(
                &read(files.limit)?,
                &read(files.usage)?,
                read("memory.stat").as_deref(),
                files.inactive,
            )
        })
        .min()
}

/// A cgroup's headroom from its files' text: `limit` less `usage` less the reclaimable
/// `inactive` page cache of `stat` (how the kubelet and `docker stats` count a working set);
/// `None` for no limit (`max`, or v1's page-rounded `i64::MAX`) or unreadable text.
pub fn headroom(limit: &str, usage: &str, stat: Option<&str>, inactive: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    if limit >= 1 << 62 {
        return None;
    }
    let usage: u64 = usage.trim().parse().ok()?;
    let cache = stat
        .and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == inactive).then(|| v.trim().parse::<u64>().ok())?
            })
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(cache)))
}
