//! `ferrozero checkpoint`: inspect a sharded checkpoint, or consolidate it into one
//! Hugging Face-named safetensors file or a model directory `from_pretrained` loads.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use ferrozero_runtime::engine::checkpoint::{
    checkpoint_adapter, consolidate, consolidate_dir, export_adapter, export_merged,
    CheckpointReader, ConsolidateReport, OutputDType, Tag,
};
use ferrozero_runtime::nn::weights::ExportReport;

/// Arguments.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Tag, step, world size, stage, parameters, sizes and checksum status (exit 1 if a file
    /// fails verification).
    Inspect {
        /// Checkpoint directory (holding `latest` and one directory per tag).
        dir: PathBuf,
        /// Tag to inspect instead of the one `latest` names.
        #[arg(long)]
        tag: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write the full parameters, one parameter at a time, to one safetensors file (an output
    /// ending in `.safetensors`) or to a model directory as `save_pretrained` writes it
    /// (`config.json` and tokenizer files when the run had them, weights in one file or in
    /// shards with `model.safetensors.index.json`).
    Consolidate {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Output file (`*.safetensors`) or model directory (any other path).
        #[arg(short, long)]
        output: PathBuf,
        /// Largest weight file of a model directory, in bytes or with a decimal unit (`5GB`,
        /// `200MB`, `10kB`), as Hugging Face's `max_shard_size`.
        #[arg(long, default_value = "5GB", value_parser = parse_size)]
        max_shard_size: u64,
        /// Output dtype.
        #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
        dtype: DTypeArg,
        /// Tag to consolidate instead of the one `latest` names.
        #[arg(long)]
        tag: Option<String>,
        /// A LoRA run's checkpoint: write the model with its adapters merged in instead of
        /// the PEFT adapter directory.
        #[arg(long)]
        merge: bool,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
}

fn tag(t: Option<String>) -> Tag {
    t.map_or(Tag::Latest, Tag::Named)
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let result = match args.command {
        Command::Inspect { dir, tag: t, json } => inspect(&dir, &tag(t), json),
        Command::Consolidate {
            dir,
            output,
            max_shard_size,
            dtype,
            tag: t,
            merge,
        } => {
            let d = match dtype {
                DTypeArg::F32 => OutputDType::F32,
                DTypeArg::Bf16 => OutputDType::Bf16,
            };
            let lora = CheckpointReader::open(&dir, &tag(t.clone()))
                .and_then(|r| checkpoint_adapter(&r))
                .map(|a| a.is_some());
            let single = output.extension().is_some_and(|e| e == "safetensors");
            if let (Ok(true), false) = (&lora, single) {
                return lora_export(&dir, &tag(t), &output, d, (merge, max_shard_size));
            }
            if merge {
                eprintln!("error: --merge needs a LoRA run's checkpoint and a directory output");
                return ExitCode::from(2);
            }
            if single {
                consolidate(&dir, &tag(t), &output, d)
                    .map(|r| report_consolidate(&output, &r))
                    .map_err(|e| e.to_string())
            } else {
                consolidate_dir(&dir, &tag(t), &output, d, max_shard_size)
                    .map(|r| report_dir(&output, &r))
                    .map_err(|e| e.to_string())
            }
        }
    };
    result.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })
}

/// A LoRA run's checkpoint out: the PEFT adapter directory, or with `merge` the merged model.
fn lora_export(
    dir: &std::path::Path,
    t: &Tag,
    out: &std::path::Path,
    d: OutputDType,
    (merge, max_shard): (bool, u64),
) -> ExitCode {
    let r = match merge {
        true => export_merged(dir, t, out, d, max_shard).map(|r| report_dir(out, &r)),
        false => export_adapter(dir, t, out, d).map(|n| {
            println!(
                "wrote a PEFT adapter directory {} ({n} tensors)",
                out.display()
            );
            ExitCode::SUCCESS
        }),
    };
    r.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })
}

fn report_consolidate(out: &std::path::Path, r: &ConsolidateReport) -> ExitCode {
    println!(
        "wrote {} ({} tensors, {} parameters, {} bytes); peak RSS {}",
        out.display(),
        r.tensors,
        r.elements,
        r.bytes,
        peak_rss().map_or("unknown".into(), |kb| format!(
            "{:.1} MiB",
            kb as f64 / 1024.0
        ))
    );
    ExitCode::SUCCESS
}

fn report_dir(out: &std::path::Path, r: &ExportReport) -> ExitCode {
    println!(
        "wrote model directory {}: {} ({} bytes of weights){}",
        out.display(),
        r.weight_files.join(", "),
        r.total_size,
        match r.other_files.is_empty() {
            true => String::new(),
            false => format!(", {}", r.other_files.join(", ")),
        }
    );
    if !r.other_files.iter().any(|f| f == "config.json") {
        eprintln!(
            "warning: the checkpoint carries no config.json (the run did not start from a model \
             directory); add one before loading with from_pretrained"
        );
    }
    ExitCode::SUCCESS
}

/// `5GB`, `200MB`, `10kB` or plain bytes; decimal units, as Hugging Face's `max_shard_size`.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 5GB, 200MB or 1000000"))?;
    let scale = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(format!("`{s}`: unit `{unit}` is not one of B, kB, MB, GB")),
    };
    match n.checked_mul(scale) {
        Some(0) | None => Err(format!("`{s}` is not a positive size that fits in 64 bits")),
        Some(b) => Ok(b),
    }
}

/// Peak resident set size of this process in KiB (Linux).
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn inspect(dir: &std::path::Path, tag: &Tag, json: bool) -> Result<ExitCode, String> {
    let r = CheckpointReader::open(dir, tag).map_err(|e| e.to_string())?;
    let m = r.meta();
    let status: Vec<Result<(), String>> = (0..m.world_size)
        .map(|q| r.verify_file(q).map_err(|e| e.to_string()))
        .collect();
    let ok = status.iter().all(Result::is_ok);
    let files: Vec<serde_json::Value> = m
        .files
        .iter()
        .zip(&status)
        .map(|(f, s)| {
            serde_json::json!({
                "name": f.name, "bytes": f.bytes, "crc32c": format!("{:08x}", f.crc32c),
                "status": s.as_ref().map_or_else(|e| e.clone(), |()| "ok".into()),
            })
        })
        .collect();
    let params: Vec<serde_json::Value> = m
        .groups
        .iter()
        .flat_map(|g| &g.slots)
        .map(|s| serde_json::json!({"name": s.name, "shape": s.shape}))
        .collect();
    let total: u64 = m.files.iter().map(|f| f.bytes).sum();
    let mut out = String::new();
    if json {
        let v = serde_json::json!({
            "tag": m.tag, "step": m.step, "data_position": m.data_position,
            "world_size": m.world_size, "stage": m.stage, "param_dtype": m.param_dtype,
            "has_master": m.has_master, "moments": m.moments,
            "parameters": m.parameter_count(), "groups": m.groups.len(),
            "bytes": total, "files": files, "tensors": params, "verified": ok,
        });
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
    } else {
        out = text(&r, &files, params.len(), total);
    }
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The human-readable `inspect` report.
fn text(r: &CheckpointReader, files: &[serde_json::Value], tensors: usize, total: u64) -> String {
    let m = r.meta();
    let mut out = String::new();
    let _ = writeln!(out, "checkpoint {} (tag {})", r.tag_dir().display(), m.tag);
    let _ = writeln!(out, "  step {}, data position {}", m.step, m.data_position);
    let _ = writeln!(
        out,
        "  saved by {} ranks at ZeRO stage {}",
        m.world_size, m.stage
    );
    let _ = writeln!(
        out,
        "  {} parameters in {} tensors, {} groups; params {}{}, {} moments",
        m.parameter_count(),
        tensors,
        m.groups.len(),
        m.param_dtype,
        if m.has_master { " + fp32 master" } else { "" },
        m.moments
    );
    let _ = writeln!(out, "  {} bytes in {} shard files:", total, m.files.len());
    for f in files {
        let _ = writeln!(
            out,
            "    {} {} bytes crc32c {}: {}",
            f["name"].as_str().unwrap_or(""),
            f["bytes"],
            f["crc32c"].as_str().unwrap_or(""),
            f["status"].as_str().unwrap_or("")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use ferrozero_config::{Format, ResolveContext};
    use ferrozero_runtime::comm::local::run_ranks;
    use ferrozero_runtime::engine::Engine;
    use ferrozero_runtime::nn::gpt2;

    use super::*;

    /// A tiny GPT-2 checkpoint saved by 2 ranks at stage 2.
    fn save(dir: &Path) {
        let src = r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#;
        let loaded = ferrozero_config::parse(src, Format::Json, "test.json").unwrap();
        let cfg = loaded.config.resolve(&ResolveContext::new(2)).unwrap();
        run_ranks(2, Duration::from_secs(30), |comm| {
            let model = gpt2::build(&gpt2::Gpt2Config::preset("tiny")?)?;
            Engine::new(model, cfg.clone(), comm)?.save_checkpoint(dir, "t", 5)?;
            Ok(())
        })
        .unwrap();
    }

    fn code(c: ExitCode) -> String {
        format!("{c:?}")
    }

    #[test]
    fn inspect_passes_a_good_checkpoint_and_flags_a_corrupt_one() {
        let dir = tempfile_dir();
        save(&dir);
        assert_eq!(
            code(inspect(&dir, &Tag::Latest, true).unwrap()),
            code(ExitCode::SUCCESS)
        );
        assert_eq!(
            code(inspect(&dir, &Tag::Latest, false).unwrap()),
            code(ExitCode::SUCCESS)
        );
        let file = dir.join("t/rank-00001.safetensors");
        let mut b = std::fs::read(&file).unwrap();
        let last = b.len() - 1;
        b[last] ^= 4;
        std::fs::write(&file, b).unwrap();
        assert_eq!(
            code(inspect(&dir, &Tag::Latest, false).unwrap()),
            code(ExitCode::from(1))
        );
        let missing = inspect(&dir, &Tag::Named("nope".into()), false).unwrap_err();
        assert!(missing.contains("nope"), "{missing}");
        let out = dir.join("m.safetensors");
        let r = consolidate(&dir, &Tag::Latest, &out, OutputDType::Bf16).unwrap_err();
        assert!(r.to_string().contains("rank-00001"), "{r}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn consolidate_writes_every_parameter() {
        let dir = tempfile_dir();
        save(&dir);
        let out = dir.join("model.safetensors");
        let r = consolidate(&dir, &Tag::Latest, &out, OutputDType::F32).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), r.tensors);
        assert!(
            st.names().iter().any(|n| n.contains("wte")),
            "{:?}",
            st.names()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("ferrozero-cli-ckpt-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}
