//! What a Slurm allocation says about the job, for `ferrozero launch` run once per node
//! (`srun --ntasks-per-node=1 ferrozero launch -- ...`): nodes, this node's index, the first
//! node's host name (where rank 0 serves the store) and the GPUs or tasks per node.

/// The job as Slurm describes it; every field `None` when its variable is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmJob {
    /// `SLURM_NNODES` (or `SLURM_JOB_NUM_NODES`).
    pub nnodes: Option<usize>,
    /// `SLURM_NODEID`.
    pub node_rank: Option<usize>,
    /// The first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`).
    pub master_addr: Option<String>,
    /// `SLURM_GPUS_ON_NODE`, else the first count of `SLURM_NTASKS_PER_NODE` when it is
    /// above 1 (one task per node means `ferrozero launch` itself is the task).
    pub nproc_per_node: Option<usize>,
}

impl SlurmJob {
    /// Reads the job from `var` (the process environment in production).
    pub fn read(var: impl Fn(&str) -> Option<String>) -> Self {
        let num = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| var(n))
                .and_then(|v| leading_number(&v))
        };
        let list = var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST"));
        let tasks = num(&["SLURM_NTASKS_PER_NODE"]).filter(|&n| n > 1);
        Self {
            nnodes: num(&["SLURM_NNODES", "SLURM_JOB_NUM_NODES"]),
            node_rank: num(&["SLURM_NODEID"]),
            master_addr: list.as_deref().and_then(first_host),
            nproc_per_node: num(&["SLURM_GPUS_ON_NODE"]).or(tasks),
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Self {
        Self::read(|n| std::env::var(n).ok())
    }
}

/// The number a variable starts with (`"4(x2)"` -> 4).
fn leading_number(v: &str) -> Option<usize> {
    let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The first host of a Slurm node list: `gpu[03-05,9],cpu1` -> `gpu03`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..];
        let first: String = inner
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        return (!first.is_empty()).then(|| format!("{prefix}{first}"));
    }
    (!prefix.is_empty()).then(|| prefix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| pairs.iter().find(|p| p.0 == n).map(|p| p.1.to_string())
    }

    #[test]
    fn node_lists_give_their_first_host() {
        assert_eq!(first_host("gpu[03-05,9],cpu1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("node7,node8").as_deref(), Some("node7"));
        assert_eq!(first_host("single").as_deref(), Some("single"));
        assert_eq!(first_host("a[1]").as_deref(), Some("a1"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn a_two_node_gpu_allocation_is_read() {
        let j = SlurmJob::read(env(&[
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NODELIST", "dgx[01-02]"),
            ("SLURM_GPUS_ON_NODE", "8"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ]));
        assert_eq!(
            j,
            SlurmJob {
                nnodes: Some(2),
                node_rank: Some(1),
                master_addr: Some("dgx01".into()),
                nproc_per_node: Some(8),
            }
        );
    }

    #[test]
    fn tasks_per_node_count_only_above_one_and_absent_means_none() {
        let j = SlurmJob::read(env(&[("SLURM_NTASKS_PER_NODE", "4(x2)")]));
        assert_eq!(j.nproc_per_node, Some(4));
        let j = SlurmJob::read(env(&[("SLURM_NTASKS_PER_NODE", "1")]));
        assert_eq!(j.nproc_per_node, None);
        assert_eq!(SlurmJob::read(env(&[])), SlurmJob::default());
    }
}
