//! A LoRA config applied to a model: the adapters it puts on the model's linear layers, and
//! what trains, as PEFT decides it: the adapters and `modules_to_save`, every other
//! parameter frozen.

use super::config::{LoraConfig, LoraInit};
use super::target::LinearSite;
use crate::nn::freeze::Freeze;
use crate::nn::layers::{AdapterSpec, Adapters};
use crate::nn::Init;
use crate::Result;

/// The adapters `cfg` puts on a model whose linear layers are `sites` (architecture `arch`,
/// for errors), and the freeze rules PEFT's `get_peft_model` implies.
pub fn plan(cfg: &LoraConfig, sites: &[LinearSite], arch: &str) -> Result<(Adapters, Freeze)> {
    let mut adapters = Adapters::default();
    for a in cfg.adapters(sites, arch)? {
        let init_a = match cfg.init {
            // `kaiming_uniform_(a=√5)` on `[r, in]`: bound √(6 / ((1 + 5)·in)) = 1/√in.
            LoraInit::Kaiming => Init::Uniform {
                bound: 1.0 / (a.site.in_features as f32).sqrt(),
            },
            LoraInit::Gaussian => Init::Normal {
                std: 1.0 / a.r as f32,
            },
        };
        let spec = AdapterSpec {
            r: a.r,
            scale: a.scaling,
            dropout: cfg.dropout,
            init_a,
        };
        adapters.insert(a.site.name.clone(), spec);
    }
    Ok((adapters, freeze_rules(cfg)?))
}

/// Everything frozen but the adapters' factors and the parameters of `modules_to_save`
/// (any module whose name ends in one of them, as PEFT matches them).
pub fn freeze_rules(cfg: &LoraConfig) -> Result<Freeze> {
    let mut rules = vec![
        "*".to_string(),
        "!*.lora_A.weight".into(),
        "!*.lora_B.weight".into(),
    ];
    rules.extend(cfg.modules_to_save.iter().map(|m| format!("!*{m}.*")));
    Freeze::new(&rules)
}
