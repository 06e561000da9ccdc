//! `initialize`'s host checks with injected figures (never this machine's): the memlock check
//! counts only what `mlock` locks, and a device run's page-locked plus pageable host memory
//! is checked against the host's RAM and cgroup limit, naming every figure.

mod common;

use common::config;
use ferrozero_config::resolved::{OffloadTarget, Precision, ResolvedConfig, ZeroStage};
use ferrozero_config::Device;
use ferrozero_offload::sys::MemlockLimit;
use ferrozero_runtime::backend::Rope;
use ferrozero_runtime::engine::estimate::{estimate, Estimate};
use ferrozero_runtime::engine::host_limits::{
    check_host_ram, headroom, memlock_verdict, HostRam, HostRamNeed, MemlockVerdict,
};
use ferrozero_runtime::engine::EngineBuilder;
use ferrozero_runtime::nn::llama::{self, LlamaConfig};
use ferrozero_runtime::nn::Model;

const KIB64: u64 = 64 << 10;

/// Two layers whose accumulators (14 MiB each in bf16) pass the registration threshold.
fn model() -> Model {
    llama::build(&LlamaConfig {
        hidden_size: 1024,
        intermediate_size: 1024,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10000.0),
        vocab_size: 64,
        max_position_embeddings: 8,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        qkv_bias: false,
        sliding_window: None,
        attention_dropout: 0.0,
    })
    .expect("a valid Llama")
}

/// Stage 3 on a GPU with the optimizer and the parameters in host memory, `pin_memory` on.
fn gpu_offload() -> ResolvedConfig {
    let mut c = config(ZeroStage::Stage3, 1, 1, 1, Precision::Bf16);
    c.device = Device::Cuda(None);
    for off in [&mut c.zero.offload_optimizer, &mut c.zero.offload_param] {
        off.target = OffloadTarget::Cpu;
        off.pin_memory = true;
    }
    c
}

fn est(c: &ResolvedConfig) -> Estimate {
    estimate(&model(), c, 1, 8).unwrap()
}

/// The device's registrations are not charged against RLIMIT_MEMLOCK: with pin_memory on
/// and everything in host memory, a 64 KiB limit (a container's default) still fits.
#[test]
fn registered_bytes_do_not_count_against_memlock() {
    let e = est(&gpu_offload());
    assert!(e.page_locked.total() > 0, "{:?}", e.page_locked);
    assert!(e.pinned_host_bytes > KIB64, "DeepSpeed's pinned figure");
    assert_eq!(e.mlocked_host_bytes, 0);
    let v = memlock_verdict(
        e.mlocked_host_bytes,
        MemlockLimit::Bytes(KIB64),
        Some(KIB64),
    );
    assert_eq!(v, MemlockVerdict::Fits);
    // The same on the CPU path: offloaded state is ordinary host memory there.
    let mut cpu = gpu_offload();
    cpu.device = Device::Cpu;
    assert_eq!(est(&cpu).mlocked_host_bytes, 0);
}

/// What is mlocked (the NVMe optimizer's buffer pool under pin_memory) is counted, whole
/// buffers of the engine's rule, and decides the memlock verdict.
#[test]
fn the_nvme_pool_is_mlocked_and_checked() {
    // The parameters stay in host memory: the NVMe step writes them there (a GPU run with
    // them on the device fails at its first step, and so does its estimate).
    let mut c = gpu_offload();
    c.zero.offload_optimizer.target = OffloadTarget::Nvme("/nvme".into());
    c.zero.offload_optimizer.buffer_count = 3;
    c.zero.sub_group_size = 1 << 20;
    let e = est(&c);
    // Three tiles of 1M parameters, f32 master and two moments, page-aligned.
    assert_eq!(e.mlocked_host_bytes, (3 * 12) << 20);
    let need = e.mlocked_host_bytes;
    let soft = MemlockLimit::Bytes(KIB64);
    assert_eq!(
        memlock_verdict(need, soft, Some(KIB64)),
        MemlockVerdict::Refuse
    );
    assert_eq!(memlock_verdict(need, soft, None), MemlockVerdict::Raise);
    assert_eq!(
        memlock_verdict(need, soft, Some(need)),
        MemlockVerdict::Raise
    );
    assert_eq!(
        memlock_verdict(need, MemlockLimit::Unlimited, None),
        MemlockVerdict::Fits
    );
    c.zero.offload_optimizer.pin_memory = false;
    assert_eq!(est(&c).mlocked_host_bytes, 0);
}

/// Page-locked and pageable bytes together, a buffer both in the host ledger and registered
/// (parameter store, host checkpoints, snapshots) counted once.
#[test]
fn host_ram_need_counts_each_buffer_once() {
    let e = est(&gpu_offload());
    let p = e.page_locked;
    let need = HostRamNeed::of(&e, 2);
    assert_eq!(need.page_locked, 2 * p.total());
    assert_eq!(need.parameters, 2 * p.parameters);
    assert_eq!(need.optimizer_side, 2 * p.staging);
    assert_eq!(
        need.total(),
        2 * (e.host_total_bytes() + p.staging + p.ring),
        "{e:?}"
    );
}

fn ram(mem_available: u64, cgroup_headroom: Option<u64>) -> HostRam {
    HostRam {
        mem_available,
        cgroup_headroom,
    }
}

/// Over the host's RAM: refused, naming each figure and the keys that move them; close: a
/// warning; with room: nothing. The cgroup's headroom binds when it is the smaller.
#[test]
fn host_ram_decisions_name_the_figures() {
    let e = est(&gpu_offload());
    let need = HostRamNeed::of(&e, 1);
    let total = need.total();
    let err = check_host_ram(&need, 1, &ram(total - 1, None))
        .unwrap_err()
        .to_string();
    for part in [
        format!("need {}", ferrozero_offload::sys::human(total)),
        format!("({total} bytes)"),
        format!("({} bytes) page-locked", need.page_locked),
        format!("({} bytes) pageable", need.pageable),
        format!("MemAvailable {}", ferrozero_offload::sys::human(total - 1)),
        "offload_param.device".into(),
        "offload_optimizer.device".into(),
        "pin_memory does not change this figure".into(),
        "RLIMIT_MEMLOCK".into(),
    ] {
        assert!(err.contains(&part), "{part:?} missing from: {err}");
    }
    let err = check_host_ram(&need, 1, &ram(10 * total, Some(total / 2)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("cgroup's limit leaves"), "{err}");
    let close = check_host_ram(&need, 1, &ram(total + total / 20, None)).unwrap();
    assert!(close.is_some_and(|w| w.contains("usable")));
    assert_eq!(
        check_host_ram(&need, 1, &ram(2 * total, Some(2 * total))).unwrap(),
        None
    );
}

/// `initialize` refuses a GPU run whose host memory does not fit the injected figures,
/// before any device is opened.
#[test]
fn initialize_refuses_a_device_run_over_host_ram() {
    let src = "device = \"cuda\"\ntrain_micro_batch_size_per_gpu = 1\n\
               [bf16]\nenabled = true\n\
               [optimizer]\ntype = \"AdamW\"\nparams.lr = 1e-4\n\
               [zero_optimization]\nstage = 3\n\
               [zero_optimization.offload_optimizer]\ndevice = \"cpu\"\npin_memory = true\n\
               [zero_optimization.offload_param]\ndevice = \"cpu\"\npin_memory = true\n";
    let loaded = ferrozero_config::parse(src, ferrozero_config::Format::Toml, "gpu.toml")
        .expect("a valid config");
    let err = EngineBuilder::new(model())
        .config(loaded.config)
        .host_ram(ram(1 << 20, None))
        .build()
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.starts_with("configuration: host memory: 1 rank(s) on this machine need"),
        "{err}"
    );
    assert!(err.contains("page-locked by the device"), "{err}");
    assert!(
        err.contains("MemAvailable 1.0 MiB (1048576 bytes)"),
        "{err}"
    );
}

/// A cgroup's files: v2's `max` and v1's page-rounded `i64::MAX` are no limit; reclaimable
/// page cache is not counted as used.
#[test]
fn cgroup_headroom_from_its_files() {
    let stat = "anon 100\ninactive_file 300\nactive_file 5\n";
    assert_eq!(
        headroom("max\n", "5000\n", Some(stat), "inactive_file"),
        None
    );
    assert_eq!(
        headroom("9223372036854771712\n", "5000", None, "total_inactive_file"),
        None
    );
    assert_eq!(
        headroom("10000\n", "5000\n", Some(stat), "inactive_file"),
        Some(5300)
    );
    assert_eq!(headroom("10000", "5000", None, "inactive_file"), Some(5000));
    assert_eq!(
        headroom("4000", "5000", Some(stat), "inactive_file"),
        Some(0)
    );
    assert_eq!(headroom("garbage", "5000", None, "inactive_file"), None);
}
