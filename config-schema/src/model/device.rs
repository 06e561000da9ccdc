//! `device` (ferrozero's own top-level key; DeepSpeed takes the device from its accelerator).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Serialize, Serializer};

use crate::parse::Node;
use crate::reader::{to_str, Cx};

/// Which device the units compute on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// A CUDA GPU when this build has the CUDA backend and the machine has a GPU (the rank's
    /// `LOCAL_RANK`-th), else the CPU.
    #[default]
    Auto,
    /// The host CPU.
    Cpu,
    /// A CUDA GPU: the given ordinal, or the rank's `LOCAL_RANK`-th when none is given.
    Cuda(Option<u32>),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(None) => f.write_str("cuda"),
            Device::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    /// `auto`, `cpu`, `cuda` or `cuda:N` (case-insensitive), as PyTorch writes devices.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "auto" => return Ok(Device::Auto),
            "cpu" => return Ok(Device::Cpu),
            "cuda" | "gpu" => return Ok(Device::Cuda(None)),
            _ => {}
        }
        if let Some(n) = lower.strip_prefix("cuda:") {
            return n
                .parse()
                .map(|n| Device::Cuda(Some(n)))
                .map_err(|_| format!("\"{s}\": the ordinal after \"cuda:\" must be a number"));
        }
        Err(format!(
            "unknown device \"{s}\" (valid: \"auto\", \"cpu\", \"cuda\", \"cuda:N\")"
        ))
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl JsonSchema for Device {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "Device".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"
        })
    }
}

/// Reads `device`.
pub(crate) fn read_device(cx: &mut Cx<'_>, path: &str, node: &Node) -> Option<Device> {
    let s = to_str(cx, path, node)?;
    match s.parse() {
        Ok(d) => Some(d),
        Err(e) => {
            let help = Some("\"auto\" picks a GPU when there is one".to_string());
            cx.invalid(path, node, e, help);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_and_print_as_pytorch_writes_them() {
        for (text, d) in [
            ("auto", Device::Auto),
            ("CPU", Device::Cpu),
            ("cuda", Device::Cuda(None)),
            ("cuda:3", Device::Cuda(Some(3))),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(d));
            assert_eq!(d.to_string().parse::<Device>(), Ok(d));
        }
        assert!("cuda:x".parse::<Device>().unwrap_err().contains("ordinal"));
        assert!("tpu".parse::<Device>().unwrap_err().contains("valid"));
    }
}
