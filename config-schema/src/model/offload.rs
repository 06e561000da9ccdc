//! `offload_param` and `offload_optimizer`.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::Serialize;

use crate::parse::Node;
use crate::reader::{off, to_choice, to_f64, to_str, to_uint, Cx, Support, TableReader};

/// Where offloaded state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// Not offloaded.
    #[default]
    None,
    /// Host memory.
    Cpu,
    /// NVMe files under `nvme_path`.
    Nvme,
}

/// `offload_param` / `offload_optimizer`: where one kind of state lives. Both tables accept the
/// same keys, as in DeepSpeed; a key that does not apply to a table is ignored there.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadSection {
    /// Where the state lives.
    pub device: OffloadDevice,
    /// Directory for NVMe swap files (required with `device = "nvme"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_path: Option<PathBuf>,
    /// Page-lock the host buffers (faster device transfers). Buffers locked with `mlock` (the
    /// NVMe swap pool) are limited by `ulimit -l`, checked at `initialize`, which raises the
    /// soft limit up to the hard one when that suffices; a GPU driver's page-locking is not
    /// charged against that limit, only against host RAM.
    pub pin_memory: bool,
    /// ferrozero's own key: when the locked-memory limit cannot hold the pinned buffers, use
    /// pageable buffers with a warning instead of refusing to start.
    pub pin_memory_fallback: bool,
    /// Swap buffers in the pool; unset = DeepSpeed's default (5 for parameters, 4 for optimizer state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_count: Option<u64>,
    /// Elements per parameter swap buffer.
    pub buffer_size: u64,
    /// Elements of parameters kept in host memory at most (parameters on NVMe).
    pub max_in_cpu: u64,
    /// Prefetch optimizer state reads ahead of use. ferrozero's NVMe optimizer step always
    /// reads ahead; `false` with NVMe is ignored with a warning.
    pub pipeline_read: bool,
    /// Write optimizer state back behind use. ferrozero's NVMe optimizer step always writes
    /// behind; `false` with NVMe is ignored with a warning.
    pub pipeline_write: bool,
    /// Initialise optimizer state directly in its offload location (a start-up speed option;
    /// `true` is ignored with a warning).
    pub fast_init: bool,
    /// Fraction of optimizer state offloaded (stage 3 only below 1.0). ferrozero offloads all
    /// of it: a smaller ratio is ignored with a warning (memory placement only).
    pub ratio: f64,
}

impl Default for OffloadSection {
    fn default() -> Self {
        OffloadSection {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            pin_memory_fallback: false,
            buffer_count: None,
            buffer_size: 100_000_000,
            max_in_cpu: 1_000_000_000,
            pipeline_read: false,
            pipeline_write: false,
            fast_init: false,
            ratio: 1.0,
        }
    }
}

const DEVICES: &[(&str, OffloadDevice)] = &[
    ("none", OffloadDevice::None),
    ("cpu", OffloadDevice::Cpu),
    ("nvme", OffloadDevice::Nvme),
];

const SUPPORT: &[(&str, Support)] = &[
    (
        "pipeline",
        Support::Ignored("deprecated in DeepSpeed; use `pipeline_read` and `pipeline_write`"),
    ),
    (
        "super_offload",
        Support::IgnoredUnless(off::is_false, "SuperOffload (for Grace Hopper superchips) is not implemented; the optimizer state is offloaded as usual"),
    ),
    (
        "cpuadam_cores_perc",
        Support::Ignored("ferrozero's CPU optimizer runs on rayon's threads (RAYON_NUM_THREADS)"),
    ),
];

/// Reads one offload section.
pub(crate) fn read_offload(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<OffloadSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = OffloadSection::default();
    let s = OffloadSection {
        device: t
            .get(cx, "device", &[], |cx, p, n| to_choice(cx, p, n, DEVICES))
            .unwrap_or(d.device),
        nvme_path: t.get(cx, "nvme_path", &[], |cx, p, n| {
            to_str(cx, p, n).map(PathBuf::from)
        }),
        pin_memory: t.bool(cx, "pin_memory", d.pin_memory),
        pin_memory_fallback: t.bool(cx, "pin_memory_fallback", d.pin_memory_fallback),
        buffer_count: t.get(cx, "buffer_count", &[], to_uint),
        buffer_size: t.uint(cx, "buffer_size", d.buffer_size),
        max_in_cpu: t.uint(cx, "max_in_cpu", d.max_in_cpu),
        pipeline_read: t.bool(cx, "pipeline_read", d.pipeline_read),
        pipeline_write: t.bool(cx, "pipeline_write", d.pipeline_write),
        fast_init: t.bool(cx, "fast_init", d.fast_init),
        ratio: t.get(cx, "ratio", &[], to_f64).unwrap_or(d.ratio),
    };
    warn_ignored(cx, &t, &s);
    t.finish(cx, SUPPORT);
    Some(s)
}

/// Keys ferrozero reads but does not act on at some values: warned there, naming what
/// ferrozero does instead.
fn warn_ignored(cx: &mut Cx<'_>, t: &TableReader<'_>, s: &OffloadSection) {
    let nvme = s.device == OffloadDevice::Nvme;
    // Keys DeepSpeed defines for the other section only (it rejects them here).
    let (other, foreign): (&str, &[&str]) = if t.path.ends_with("offload_param") {
        (
            "offload_optimizer",
            &["pipeline_read", "pipeline_write", "fast_init", "ratio"],
        )
    } else {
        ("offload_param", &["buffer_size", "max_in_cpu"])
    };
    for key in foreign {
        let path = t.key_path(key);
        cx.ignored_if_set(&path, format!("`{key}` applies to `{other}` only"));
    }
    let here = |key: &str| !foreign.contains(&key);
    let checks: [(&str, bool, &str); 4] = [
        (
            "pipeline_read",
            nvme && !s.pipeline_read,
            "ferrozero's NVMe optimizer step always reads the next tile ahead",
        ),
        (
            "pipeline_write",
            nvme && !s.pipeline_write,
            "ferrozero's NVMe optimizer step always writes tiles behind",
        ),
        (
            "fast_init",
            s.fast_init,
            "a start-up speed option of DeepSpeed's NVMe swapper",
        ),
        (
            "ratio",
            s.ratio < 1.0,
            "ferrozero offloads all of the optimizer state (where it lives, not what is computed)",
        ),
    ];
    for (key, ignored, why) in checks {
        let path = t.key_path(key);
        if ignored && here(key) {
            cx.ignored_if_set(&path, why);
        }
    }
}
