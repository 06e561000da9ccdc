//! `ferrozero checkpoint`: inspect a sharded checkpoint, or consolidate it into one
//! Hugging Face-named safetensors file.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use ferrozero_runtime::engine::checkpoint::{
    consolidate, CheckpointReader, ConsolidateReport, OutputDType, Tag,
};

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
    /// Write the full parameters to one safetensors file, one parameter at a time.
    Consolidate {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        /// Output dtype.
        #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
        dtype: DTypeArg,
        /// Tag to consolidate instead of the one `latest` names.
        #[arg(long)]
        tag: Option<String>,
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
            dtype,
            tag: t,
        } => {
            let d = match dtype {
                DTypeArg::F32 => OutputDType::F32,
                DTypeArg::Bf16 => OutputDType::Bf16,
            };
            consolidate(&dir, &tag(t), &output, d)
                .map(|r| report_consolidate(&output, &r))
                .map_err(|e| e.to_string())
        }
    };
    result.unwrap_or_else(|e| {
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
