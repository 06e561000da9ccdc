//! Pre-flight budget check: compares what a run needs (host RAM, locked memory, NVMe space)
//! with what the machine has, before step 1, and refuses with every shortfall and its numbers.
//! DeepSpeed users lose hours to pinned-memory OOMs mid-run; this makes them a start-up error.

use std::path::{Path, PathBuf};

use crate::sys::{self, human, MemlockLimit};
use crate::{Error, Result};

/// What a run needs from the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requirement {
    /// Host RAM in bytes (pageable and locked together).
    pub host_bytes: u64,
    /// Of which locked (pinned) bytes.
    pub locked_bytes: u64,
    /// Swap space needed per directory: (swap directory, bytes).
    pub nvme: Vec<(PathBuf, u64)>,
}

/// What the machine offers, as measured by [`Machine::probe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// `MemAvailable` in bytes.
    pub mem_available: u64,
    /// The locked-memory limit.
    pub memlock: MemlockLimit,
    /// Free bytes per swap directory, in the order of [`Requirement::nvme`].
    pub nvme_free: Vec<(PathBuf, u64)>,
}

impl Machine {
    /// Reads MemAvailable, RLIMIT_MEMLOCK and the free space of each directory in `req`
    /// (its nearest existing ancestor, since swap directories are often created later).
    pub fn probe(req: &Requirement) -> Result<Machine> {
        let nvme_free = req
            .nvme
            .iter()
            .map(|(dir, _)| Ok((dir.clone(), sys::free_space(existing_ancestor(dir))?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Machine {
            mem_available: sys::mem_available()?,
            memlock: sys::memlock_limit(),
            nvme_free,
        })
    }
}

fn existing_ancestor(p: &Path) -> &Path {
    p.ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists())
        .unwrap_or(Path::new("."))
}

/// Compares `req` with `machine`; the error lists every shortfall with both numbers.
pub fn check(req: &Requirement, machine: &Machine) -> Result<()> {
    let mut short = Vec::new();
    if req.host_bytes > machine.mem_available {
        short.push(format!(
            "host RAM: need {} ({} bytes), MemAvailable is {} ({} bytes)",
            human(req.host_bytes),
            req.host_bytes,
            human(machine.mem_available),
            machine.mem_available
        ));
    }
    if let MemlockLimit::Bytes(limit) = machine.memlock {
        if req.locked_bytes > limit {
            short.push(format!(
                "locked memory: need {} ({} bytes) with pin_memory = true, RLIMIT_MEMLOCK is {} \
                 ({limit} bytes); raise `ulimit -l` or set pin_memory = false",
                human(req.locked_bytes),
                req.locked_bytes,
                human(limit)
            ));
        }
    }
    for ((dir, need), (_, free)) in req.nvme.iter().zip(&machine.nvme_free) {
        if need > free {
            short.push(format!(
                "NVMe space in {}: need {} ({need} bytes), {} ({free} bytes) free",
                dir.display(),
                human(*need),
                human(*free)
            ));
        }
    }
    if short.is_empty() {
        Ok(())
    } else {
        Err(Error::Resource(format!(
            "this run does not fit on this machine:\n  {}",
            short.join("\n  ")
        )))
    }
}

/// Probes the machine and checks `req` against it; returns what was measured.
pub fn preflight(req: &Requirement) -> Result<Machine> {
    let machine = Machine::probe(req)?;
    check(req, &machine)?;
    Ok(machine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_lists_every_shortfall_with_numbers() {
        let req = Requirement {
            host_bytes: 32 << 30,
            locked_bytes: 1 << 30,
            nvme: vec![("/swap".into(), 2 << 40)],
        };
        let machine = Machine {
            mem_available: 20 << 30,
            memlock: MemlockLimit::Bytes(8 << 20),
            nvme_free: vec![("/swap".into(), 1 << 40)],
        };
        let msg = check(&req, &machine).unwrap_err().to_string();
        assert!(
            msg.contains("need 32.0 GiB") && msg.contains("MemAvailable is 20.0 GiB"),
            "{msg}"
        );
        assert!(
            msg.contains("RLIMIT_MEMLOCK is 8.0 MiB (8388608 bytes)"),
            "{msg}"
        );
        assert!(msg.contains("NVMe space in /swap: need 2.0 TiB"), "{msg}");
    }

    #[test]
    fn probe_reads_this_machine_and_small_needs_fit() {
        let dir = std::env::temp_dir().join("ferrozero-preflight-not-created");
        let req = Requirement {
            host_bytes: 1 << 20,
            locked_bytes: 4096,
            nvme: vec![(dir, 4096)],
        };
        let m = preflight(&req).unwrap();
        assert!(m.mem_available > 1 << 20);
        assert!(m.nvme_free[0].1 > 4096);
        let huge = Requirement {
            host_bytes: u64::MAX,
            ..req
        };
        assert!(preflight(&huge)
            .unwrap_err()
            .to_string()
            .contains("host RAM"));
    }
}
