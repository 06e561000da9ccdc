//! Parameter-efficient fine-tuning as Hugging Face PEFT defines it: LoRA adapters read from
//! and written as PEFT's adapter directories (`adapter_config.json` and
//! `adapter_model.safetensors`), matched to a model's linear layers by PEFT's own naming
//! rules, and merged into the base weights as `merge_and_unload()` does.

mod adapter;
mod config;
mod plan;
mod reader;
mod run;
mod target;
mod write;

pub use adapter::{
    AdapterWeights, LoraFactors, PeftSource, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
};
pub use config::{LoraConfig, LoraInit, TargetModules};
pub use plan::{freeze_rules, plan};
pub use run::{is_adapter_param, PeftRun};
pub use target::{Adapter, LinearSite};
pub use write::merge_into;
