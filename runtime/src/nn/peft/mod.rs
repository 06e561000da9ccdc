//! Parameter-efficient fine-tuning as Hugging Face PEFT defines it: LoRA adapters read from
//! and written as PEFT's `adapter_config.json`, matched to a model's linear layers by PEFT's
//! own naming rules.

mod config;
mod reader;
mod target;

pub use config::{LoraConfig, LoraInit, TargetModules};
pub use target::{Adapter, LinearSite};
