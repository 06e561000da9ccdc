//! The small Hugging Face architectures the estimator and size-only device tests train, and
//! the toy token stream they feed them, so that every sweep means the same model by a name.

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_runtime::nn::freeze::Freeze;
use ferrozero_runtime::nn::peft::{self, LoraConfig};
use ferrozero_runtime::nn::{gpt2, llama, Batch, Model};

/// Rows per micro-batch.
pub const MICRO: usize = 2;
/// The token ids fed: below every model's vocabulary.
pub const VOCAB: usize = 64;

/// A model of the sweeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Which {
    Gpt2,
    Llama,
    /// Llama with LoRA on every linear layer, the base frozen (PEFT's rules).
    LlamaLora,
    /// As `LlamaLora` with `lora_dropout` 0.1: the adapters' dropout masks are buffers too.
    LlamaLoraDropout,
    /// GPT-2 with its embeddings and first block frozen: backward stops above them.
    Gpt2BottomFrozen,
    /// GPT-2 wide enough (width 256, vocabulary 4096) that its buffers pass the CUDA
    /// allocator's 1 MiB small-block limit: large segments, splits and the cache's best fit
    /// are exercised too, where the tiny models fit one small segment.
    Gpt2Wide,
}

/// The model `which` names, freshly built.
pub fn build(which: Which) -> Model {
    match which {
        Which::Gpt2 => gpt2::build(&gpt2::Gpt2Config::preset("tiny").unwrap()).unwrap(),
        Which::Llama => llama::build(&llama::LlamaConfig::preset("tiny").unwrap()).unwrap(),
        Which::LlamaLora => lora_llama(r#""lora_dropout": 0.0"#),
        Which::LlamaLoraDropout => lora_llama(r#""lora_dropout": 0.1"#),
        Which::Gpt2BottomFrozen => {
            let f = Freeze::new(&["transformer.w?e.weight", "transformer.h.0.*"]).unwrap();
            build(Which::Gpt2).freeze(f).unwrap()
        }
        Which::Gpt2Wide => {
            let cfg = gpt2::Gpt2Config {
                n_embd: 256,
                n_head: 4,
                vocab_size: 4096,
                ..gpt2::Gpt2Config::preset("tiny").unwrap()
            };
            gpt2::build(&cfg).unwrap()
        }
    }
}

/// The tiny Llama with rank-4 adapters on every linear layer (`dropout`: the JSON member).
fn lora_llama(dropout: &str) -> Model {
    let cfg = llama::LlamaConfig::preset("tiny").unwrap();
    let json = format!(
        r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, {dropout},
            "target_modules": "all-linear"}}"#
    );
    let lora = LoraConfig::from_json(&json, "test").unwrap();
    let sites = llama::linear_sites(&cfg);
    let (adapters, frozen) = peft::plan(&lora, &sites, "llama").unwrap();
    llama::build_with(&cfg, &adapters)
        .unwrap()
        .freeze(frozen)
        .unwrap()
}

/// Rank `rank`'s micro-batches of step `step` under `cfg`, rows of `seq` tokens below
/// [`VOCAB`] ([`super::runs::toy_batches`]).
pub fn batches(cfg: &ResolvedConfig, seq: usize, step: usize, rank: usize) -> Vec<Batch> {
    super::runs::toy_batches(cfg, (VOCAB, seq), step, rank)
}

/// This process's resident memory (`VmRSS`), in bytes.
pub fn resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// One test at a time, for tests that read the whole process's resident memory (a test's
/// models on other threads would show in it).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}
