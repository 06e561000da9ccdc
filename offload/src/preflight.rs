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

/// The locked-memory limits of this process, as [`memlock_fix`] reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemlockLimits {
    /// Soft limit in bytes (`None`: unlimited).
    pub soft: Option<u64>,
    /// Hard limit in bytes (`None`: unlimited).
    pub hard: Option<u64>,
}

/// Why `need` locked bytes do not fit the limits, and the exact lines that fix it: the shell
/// (`ulimit -l` takes KiB), `/etc/security/limits.conf` for `user`, a systemd unit, Docker,
/// or the config.
pub fn memlock_fix(need: u64, limits: MemlockLimits, user: &str, who: &str) -> String {
    let kib = need.div_ceil(1024);
    let show = |v: Option<u64>| match v {
        None => "unlimited".to_string(),
        Some(b) => format!("{} ({b} bytes)", human(b)),
    };
    let shell = match limits.hard {
        Some(h) if h < need => format!(
            "ulimit -l {kib}                       (needs the hard limit raised first: it is {})",
            show(limits.hard)
        ),
        _ => format!("ulimit -l {kib}"),
    };
    format!(
        "pin_memory = true needs {} ({need} bytes) of locked memory for {who}, but RLIMIT_MEMLOCK \
         is {} soft / {} hard. Raise it before starting, with one of:\n\
         \x20 shell, this session:                 {shell}\n\
         \x20 /etc/security/limits.conf (login):   {user} soft memlock {kib}\n\
         \x20                                      {user} hard memlock {kib}\n\
         \x20 systemd unit, [Service] section:     LimitMEMLOCK={need}\n\
         \x20 docker run:                          --ulimit memlock={need}:{need}\n\
         or set pin_memory = false (pageable buffers, slower device transfers), or \
         pin_memory_fallback = true in the offload section to fall back to them when the \
         limit is too low",
        human(need),
        show(limits.soft),
        show(limits.hard)
    )
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
    fn the_memlock_message_gives_the_exact_lines_that_fix_it() {
        let need = 3 * 1024 * 1024 + 1;
        let limits = MemlockLimits {
            soft: Some(8 << 20 >> 4),
            hard: Some(8 << 20),
        };
        let msg = memlock_fix(need, limits, "alice", "2 ranks on this machine");
        assert!(
            msg.starts_with(
                "pin_memory = true needs 3.0 MiB (3145729 bytes) of locked memory for 2 ranks on this machine"
            ),
            "{msg}"
        );
        assert!(
            msg.contains("is 512.0 KiB (524288 bytes) soft / 8.0 MiB (8388608 bytes) hard"),
            "{msg}"
        );
        // KiB, rounded up, for ulimit and limits.conf; bytes for systemd and docker.
        assert!(msg.contains("ulimit -l 3073\n"), "{msg}");
        assert!(msg.contains("alice soft memlock 3073"), "{msg}");
        assert!(msg.contains("alice hard memlock 3073"), "{msg}");
        assert!(msg.contains("LimitMEMLOCK=3145729"), "{msg}");
        assert!(msg.contains("--ulimit memlock=3145729:3145729"), "{msg}");
        assert!(msg.contains("pin_memory = false") && msg.contains("pin_memory_fallback = true"));
        // A hard limit below the need: ulimit alone cannot do it, and the message says so.
        let low = MemlockLimits {
            soft: Some(64 << 10),
            hard: Some(64 << 10),
        };
        let msg = memlock_fix(need, low, "alice", "1 rank on this machine");
        assert!(msg.contains("needs the hard limit raised first"), "{msg}");
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
