//! DeepSpeed's monitors (`tensorboard`, `csv_monitor`) and communication logger
//! (`comms_logger`), with DeepSpeed's keys and defaults (`deepspeed/monitor/config.py`,
//! `deepspeed/comm/config.py`).

use schemars::JsonSchema;
use serde::Serialize;

use crate::parse::{Kind, Node};
use crate::reader::{to_choice, to_str, Cx, TableReader};

/// `tensorboard` or `csv_monitor`: scalars written under `output_path/job_name/`, indexed by
/// samples seen, with DeepSpeed's names (`Train/Samples/train_loss`, `Train/Samples/lr`,
/// `Train/Samples/loss_scale`) and ferrozero's own (`Train/Samples/grad_norm`,
/// `Train/Samples/tokens_per_second`, memory peaks). TensorBoard gets one event file;
/// the CSV monitor one file per scalar (`Train_Samples_train_loss.csv`, columns
/// `step,train_loss`).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorSection {
    /// Write this monitor's files.
    pub enabled: bool,
    /// The directory the job's directory is created in; empty means the working directory.
    pub output_path: String,
    /// The job's directory name under `output_path`.
    pub job_name: String,
    /// Every rank writes, into `job_name/rank<N>` (ferrozero's own key); otherwise rank 0
    /// alone writes, as in DeepSpeed.
    pub all_ranks: bool,
}

impl Default for MonitorSection {
    fn default() -> Self {
        MonitorSection {
            enabled: false,
            output_path: String::new(),
            job_name: "DeepSpeedJobName".into(),
            all_ranks: false,
        }
    }
}

/// `comms_logger`: counts, bytes, time and bandwidth of every collective, by kind and message
/// size, printed as DeepSpeed's summary table every `steps_per_print` steps and at the end.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CommsLoggerSection {
    /// Time and count the collectives.
    pub enabled: bool,
    /// Log every collective as it completes (rank 0).
    pub verbose: bool,
    /// Record every kind of collective; `false` records only those in `prof_ops`.
    pub prof_all: bool,
    /// Collectives to record when `prof_all` is off, by DeepSpeed's names: `all_reduce`,
    /// `reduce_scatter_tensor`, `all_gather_into_tensor`, `broadcast`, `barrier`.
    pub prof_ops: Vec<String>,
    /// Name each record by its caller too: the name of the thread that issued it (the
    /// training thread or the engine's communication worker).
    pub debug: bool,
}

impl Default for CommsLoggerSection {
    fn default() -> Self {
        CommsLoggerSection {
            enabled: false,
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
        }
    }
}

/// The collectives the logger can record, by DeepSpeed's operation names.
pub const COMM_OPS: &[(&str, &str)] = &[
    ("all_reduce", "all_reduce"),
    ("reduce_scatter_tensor", "reduce_scatter_tensor"),
    ("all_gather_into_tensor", "all_gather_into_tensor"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
];

/// Reads `tensorboard` or `csv_monitor`.
pub(crate) fn read_monitor(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<MonitorSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = MonitorSection::default();
    let string = |cx: &mut Cx<'_>, p: &str, n: &Node| to_str(cx, p, n).map(str::to_string);
    let m = MonitorSection {
        enabled: t.bool(cx, "enabled", d.enabled),
        output_path: t
            .get(cx, "output_path", &[], string)
            .unwrap_or(d.output_path),
        job_name: t.get(cx, "job_name", &[], string).unwrap_or(d.job_name),
        all_ranks: t.bool(cx, "all_ranks", d.all_ranks),
    };
    t.finish(cx, &[]);
    Some(m)
}

/// Reads `comms_logger`; an unknown name in `prof_ops` is an error naming the valid ones.
pub(crate) fn read_comms_logger(
    cx: &mut Cx<'_>,
    path: &str,
    node: &Node,
) -> Option<CommsLoggerSection> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = CommsLoggerSection::default();
    let c = CommsLoggerSection {
        enabled: t.bool(cx, "enabled", d.enabled),
        verbose: t.bool(cx, "verbose", d.verbose),
        prof_all: t.bool(cx, "prof_all", d.prof_all),
        prof_ops: t.get(cx, "prof_ops", &[], read_ops).unwrap_or_default(),
        debug: t.bool(cx, "debug", d.debug),
    };
    t.finish(cx, &[]);
    Some(c)
}

fn read_ops(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Vec<String>> {
    let Kind::Array(items) = &node.kind else {
        cx.wrong_type(path, node, "an array of collective names");
        return None;
    };
    let ops: Vec<Option<&str>> = items
        .iter()
        .enumerate()
        .map(|(i, n)| to_choice(cx, &format!("{path}[{i}]"), n, COMM_OPS))
        .collect();
    ops.into_iter()
        .map(|o| o.map(str::to_string))
        .collect::<Option<Vec<_>>>()
}
