//! `data_types`: DeepSpeed's per-tensor-kind dtypes. `grad_accum_dtype` chooses what
//! micro-step gradients are summed into (the training precision, or fp32 in a half-precision
//! run); `param_dtype` may only restate the training precision, as DeepSpeed asserts; and
//! `buffer_dtype` may only keep buffers in fp32, since ferrozero's rotary tables are f32.

use schemars::JsonSchema;
use serde::Serialize;

use super::CommDataType;
use crate::parse::{Kind, Node};
use crate::reader::{to_choice, Cx, TableReader};

/// DeepSpeed's `DtypeEnum` spellings of the three floating dtypes.
const DTYPES: &[(&str, CommDataType)] = &[
    ("fp32", CommDataType::Fp32),
    ("float32", CommDataType::Fp32),
    ("float", CommDataType::Fp32),
    ("torch.float32", CommDataType::Fp32),
    ("fp16", CommDataType::Fp16),
    ("float16", CommDataType::Fp16),
    ("half", CommDataType::Fp16),
    ("torch.float16", CommDataType::Fp16),
    ("bf16", CommDataType::Bf16),
    ("bfloat16", CommDataType::Bf16),
    ("bfloat", CommDataType::Bf16),
    ("torch.bfloat16", CommDataType::Bf16),
];

/// `data_types`: the dtypes of gradient accumulation, parameters and buffers; unset keys
/// follow the training precision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DataTypes {
    /// The dtype micro-step gradients are accumulated in between optimizer steps: the
    /// training precision (unset: bf16 in a bf16 run, fp16 in an fp16 run), or `"fp32"` for
    /// f32 accumulators in a half-precision run (each reduced micro-step gradient is widened
    /// and added in f32; the accumulator takes twice the bytes). Any other dtype is an error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_accum_dtype: Option<CommDataType>,
    /// The parameters' dtype; it must be the training precision's, which it is anyway
    /// (DeepSpeed asserts the same).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param_dtype: Option<CommDataType>,
    /// The dtype module buffers are cast to; only `"fp32"` (what ferrozero's rotary tables
    /// are) is accepted, since casting them would change the model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_dtype: Option<CommDataType>,
}

/// One dtype name, `null` being unset.
fn dtype(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<CommDataType> {
    if matches!(node.kind, Kind::Null) {
        return None;
    }
    to_choice(cx, path, node, DTYPES)
}

/// Reads `data_types`.
pub(crate) fn read_data_types(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<DataTypes> {
    let mut t = TableReader::new(cx, path, node)?;
    let d = DataTypes {
        grad_accum_dtype: t.get(cx, "grad_accum_dtype", &[], dtype),
        param_dtype: t.get(cx, "param_dtype", &[], dtype),
        buffer_dtype: t.get(cx, "buffer_dtype", &[], dtype),
    };
    t.finish(cx, &[]);
    Some(d)
}
