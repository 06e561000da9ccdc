//! CPU binding of the ranks `ferrozero launch` starts. Each local rank is pinned to cores of
//! one NUMA node, the node's cores split evenly among the ranks on it, so that a rank's
//! offload threads (CPU Adam, NVMe reads and writes, host staging) run beside the memory they
//! stream through and ranks do not take each other's cores. Ranks go to nodes in blocks
//! (ranks `0..k` on node 0, the next `k` on node 1, ...), which follows how multi-socket GPU
//! servers number their GPUs; only cores the launcher itself may use are handed out (a
//! Slurm or cgroup limit stays in force). `--no-cpu-bind` turns it off.

use std::path::Path;

use crate::{Error, Result};

/// Where Linux describes NUMA nodes.
pub const NODE_ROOT: &str = "/sys/devices/system/node";

/// Parses a kernel CPU list such as `0-3,8,10-11` into CPU numbers, ascending.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>> {
    let bad = || Error::Invalid(format!("{s:?} is not a CPU list such as 0-3,8"));
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>(), b.parse::<usize>()),
            None => (part.parse::<usize>(), part.parse::<usize>()),
        };
        let (lo, hi) = (lo.map_err(|_| bad())?, hi.map_err(|_| bad())?);
        if lo > hi {
            return Err(bad());
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// The CPUs of every NUMA node under `root` (normally [`NODE_ROOT`]), by node number; empty
/// when the machine does not describe its nodes there.
pub fn numa_nodes(root: &Path) -> Result<Vec<Vec<usize>>> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut nodes: Vec<(usize, Vec<usize>)> = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(n) = name.strip_prefix("node").and_then(|n| n.parse().ok()) else {
            continue;
        };
        let path = e.path().join("cpulist");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?;
        nodes.push((n, parse_cpu_list(&text)?));
    }
    nodes.sort_by_key(|(n, _)| *n);
    Ok(nodes.into_iter().map(|(_, c)| c).collect())
}

/// The cores of each of `nproc` local ranks, given every NUMA node's CPUs and the CPUs the
/// launcher may use (see the module documentation). A node with fewer usable cores than
/// ranks gives each of them all its cores; without node information, `allowed` is one node.
pub fn plan(nodes: &[Vec<usize>], allowed: &[usize], nproc: usize) -> Vec<Vec<usize>> {
    let mut usable: Vec<Vec<usize>> = nodes
        .iter()
        .map(|cpus| {
            cpus.iter()
                .copied()
                .filter(|c| allowed.contains(c))
                .collect()
        })
        .filter(|cpus: &Vec<usize>| !cpus.is_empty())
        .collect();
    if usable.is_empty() {
        usable.push(allowed.to_vec());
    }
    let nn = usable.len();
    let node_of = |r: usize| r * nn / nproc.max(1);
    (0..nproc)
        .map(|r| {
            let k = node_of(r);
            let on_node: Vec<usize> = (0..nproc).filter(|&q| node_of(q) == k).collect();
            let (count, i) = (
                on_node.len(),
                on_node.iter().position(|&q| q == r).unwrap_or(0),
            );
            let cpus = &usable[k];
            if cpus.len() < count {
                return cpus.clone();
            }
            cpus[i * cpus.len() / count..(i + 1) * cpus.len() / count].to_vec()
        })
        .collect()
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it for this process.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(Error::Io {
            context: "reading this process's CPU affinity".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `set` is initialised and every index is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// The affinity mask for `cpus` (CPUs past the mask's size are left out).
pub fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `c` is below CPU_SETSIZE, the set's capacity.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

/// Writes `cpus` compactly, e.g. `0-3,8`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_back() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        for bad in ["a", "3-1", "1-", "0-3,x"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranks_split_their_node_in_blocks() {
        let nodes = vec![(0..8).collect::<Vec<_>>(), (8..16).collect()];
        let all: Vec<usize> = (0..16).collect();
        let p = plan(&nodes, &all, 4);
        assert_eq!(
            p,
            [
                vec![0, 1, 2, 3],
                vec![4, 5, 6, 7],
                vec![8, 9, 10, 11],
                vec![12, 13, 14, 15]
            ]
        );
        // One rank per node takes the whole node; more ranks than nodes share them in blocks.
        assert_eq!(plan(&nodes, &all, 2), [nodes[0].clone(), nodes[1].clone()]);
        // Three ranks on two nodes: ranks 0 and 1 split node 0, rank 2 has node 1.
        let p = plan(&nodes, &all, 3);
        assert_eq!(p, [vec![0, 1, 2, 3], vec![4, 5, 6, 7], nodes[1].clone()]);
    }

    #[test]
    fn only_allowed_cpus_are_handed_out_and_none_is_left_empty() {
        let nodes = vec![(0..4).collect::<Vec<_>>(), (4..8).collect()];
        // A Slurm allocation of CPUs 2-5 only.
        let p = plan(&nodes, &[2, 3, 4, 5], 2);
        assert_eq!(p, [vec![2, 3], vec![4, 5]]);
        // More ranks than cores: each rank gets the whole node rather than nothing.
        let p = plan(&[vec![0, 1]], &[0, 1], 3);
        assert!(p.iter().all(|c| c == &[0, 1]));
        // No node information: the allowed CPUs are one node.
        assert_eq!(plan(&[], &[0, 1, 2, 3], 2), [vec![0, 1], vec![2, 3]]);
    }

    #[test]
    fn this_machine_describes_its_nodes_or_nothing() {
        let nodes = numa_nodes(Path::new(NODE_ROOT)).unwrap();
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        let p = plan(&nodes, &allowed, 2);
        assert!(p
            .iter()
            .all(|c| !c.is_empty() && c.iter().all(|x| allowed.contains(x))));
        assert!(numa_nodes(Path::new("/nonexistent")).unwrap().is_empty());
    }
}
