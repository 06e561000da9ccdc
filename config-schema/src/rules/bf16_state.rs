//! `bf16.bf16_master_weights_and_grads` and `bf16.bf16_optimizer_states`: DeepSpeed's
//! conditions (bf16 on, ZeRO stages 1-3, optimizer states only with bf16 master weights, bf16
//! master weights with f32 optimizer states only with the optimizer offloaded to the CPU; bf16
//! states stay on the GPU or go to the CPU), plus ferrozero's own: the NVMe optimizer keeps its
//! state in f32.

use super::{report, Violation};
use crate::diagnostic::DiagnosticKind;
use crate::model::{AutoOr, Config, OffloadDevice};
use crate::reader::Cx;

const MASTER: &str = "bf16.bf16_master_weights_and_grads";
const STATES: &str = "bf16.bf16_optimizer_states";

fn conflict(cx: &mut Cx<'_>, path: &str, message: &str, help: &str, note: String) {
    report(
        cx,
        Violation {
            kind: DiagnosticKind::Conflict,
            path,
            message: message.into(),
            help: Some(help.into()),
            notes: vec![note],
        },
    );
}

pub(super) fn check_bf16_state(cx: &mut Cx<'_>, c: &Config) {
    let b = &c.bf16;
    let (master, states) = (b.bf16_master_weights_and_grads, b.bf16_optimizer_states);
    if !master && !states {
        return;
    }
    let path = if master { MASTER } else { STATES };
    if b.enabled != AutoOr::Value(true) {
        conflict(
            cx,
            path,
            "bf16 optimizer values need bf16 training",
            "set `bf16.enabled = true`",
            format!("bf16.enabled = {:?}", b.enabled).to_lowercase(),
        );
        return;
    }
    if states && !master {
        conflict(
            cx,
            STATES,
            "bf16_optimizer_states requires bf16_master_weights_and_grads",
            "set `bf16.bf16_master_weights_and_grads = true` as well",
            "bf16.bf16_master_weights_and_grads = false".into(),
        );
        return;
    }
    let stage = c.zero_optimization.stage;
    if stage == 0 {
        conflict(
            cx,
            path,
            "bf16 master weights are only supported with ZeRO stage 1, 2 or 3",
            "set `zero_optimization.stage` to 1, 2 or 3",
            "zero_optimization.stage = 0".into(),
        );
    }
    let device = c
        .zero_optimization
        .offload_optimizer
        .as_ref()
        .map_or(OffloadDevice::None, |o| o.device);
    if device == OffloadDevice::Nvme {
        conflict(
            cx,
            path,
            "bf16 master weights cannot be combined with optimizer state on NVMe: ferrozero's \
             NVMe optimizer keeps f32 master weights and moments",
            "use `offload_optimizer.device = \"cpu\"` or `\"none\"`: the host and device \
             steps keep bf16 ones",
            "zero_optimization.offload_optimizer.device = \"nvme\"".into(),
        );
    } else if !states && device != OffloadDevice::Cpu {
        conflict(
            cx,
            MASTER,
            "bf16 master weights with f32 optimizer states need the optimizer offloaded to the CPU",
            "set `zero_optimization.offload_optimizer.device = \"cpu\"`, or \
             `bf16.bf16_optimizer_states = true` as well",
            "zero_optimization.offload_optimizer.device = \"none\"".into(),
        );
    }
}
