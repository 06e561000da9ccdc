//! How many cores this node gives the job, for deciding whether its ranks oversubscribe it.

/// The cores this node gives the job: the online CPUs, capped by a cgroup v2 CPU quota.
///
/// Not `available_parallelism`: that is this process's affinity mask, and launchers bind each
/// rank to its own core (`mpirun -n 2` gives each rank one), so every bound rank would look
/// oversubscribed and wait by yielding, which on a busy machine cost a scheduler time slice
/// per collective (measured: 2 MiB all-gathers at 2 processes took ~10 ms instead of ~1).
pub(crate) fn node_cores() -> usize {
    // SAFETY: sysconf reads a system value and has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let online = usize::try_from(online).unwrap_or(1).max(1);
    let quota = std::fs::read_to_string("/sys/fs/cgroup/cpu.max")
        .ok()
        .and_then(|s| cgroup_quota_cores(&s));
    quota.map_or(online, |q| q.min(online))
}

/// Whole cores of a cgroup v2 `cpu.max` line (`"max 100000"`: none; `"150000 100000"`: 2),
/// rounded up so a fractional quota still counts the core it partly gets.
fn cgroup_quota_cores(line: &str) -> Option<usize> {
    let mut it = line.split_whitespace();
    let quota: u64 = it.next()?.parse().ok()?;
    let period: u64 = it.next()?.parse().ok()?;
    (period > 0).then(|| usize::try_from(quota.div_ceil(period)).unwrap_or(1).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_quota_counts_whole_cores_rounded_up() {
        assert_eq!(cgroup_quota_cores("max 100000\n"), None);
        assert_eq!(cgroup_quota_cores("200000 100000\n"), Some(2));
        assert_eq!(cgroup_quota_cores("150000 100000"), Some(2));
        assert_eq!(cgroup_quota_cores("50000 100000"), Some(1));
        assert_eq!(cgroup_quota_cores("100000 0"), None);
        assert_eq!(cgroup_quota_cores(""), None);
    }

    #[test]
    fn a_rank_bound_to_one_core_still_sees_the_node() {
        let before = node_cores();
        // A launcher binds each rank to a core; do the same to a fresh thread.
        let (mask_after, cores_after) = std::thread::spawn(|| {
            // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity get
            // valid pointers to it and its size; pid 0 is the calling thread.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            let mask = std::thread::available_parallelism().map_or(0, usize::from);
            (mask, node_cores())
        })
        .join()
        .unwrap();
        assert_eq!(mask_after, 1, "the thread is bound to one core");
        assert_eq!(
            cores_after, before,
            "the node's cores do not shrink with the binding"
        );
    }
}
