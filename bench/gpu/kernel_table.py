"""One training step's GPU kernel time, by kernel family and by kernel, from either side's trace.

ferrozero's side comes from Nsight Compute (`ncu --csv --metrics gpu__time_duration.sum`, every
kernel of a few steps): one step is cut out of the sequence between the ends of two consecutive
optimizer runs (the last kernels of every step), so the table is exactly one step whatever ran
before the first. PyTorch's side comes from its profiler's Chrome trace of `--steps` steps (CUPTI
kernel records), divided by the step count. Both print the same families, so the two tables
compare line by line:
  python3 kernel_table.py --ncu ncu.csv --label ferrozero
  python3 kernel_table.py --trace trace.json --steps 3 --label torch_compile
"""
import argparse, collections, csv, json, re, sys

FAMILIES = [  # first match wins: optimizer and loss names hold "norm" and "softmax", cuDNN's
    # attention kernels "sm90_" and cuBLASLt's separate epilogue passes no GEMM word
    ("optimizer", r"adam|lion|sgd_multi|multi_tensor|foreach|lpnorm|clip_grad|sum_squares|unscale"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp"),
    ("attention", r"attention|attn|flash|fmha|sdpa"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|triton_tem|(^|_)mm(_|$)|addmm|bmm|colsum|epilogue::|splitkreduce"),
    ("norm", r"layernorm|rmsnorm|layer_norm|rms_norm"),
    ("embedding", r"embedding|position_|index_select|indexselect|embedding_dense"),
    ("memory", r"memcpy|memset|fill_|cast_|copy"),
]


def family(name):
    n = name.lower()
    for f, pat in FAMILIES:
        if re.search(pat, n):
            return f
    return "elementwise/other"


def ncu_kernels(path):
    """(name, ns) in launch order from ncu's CSV, whatever else the log holds."""
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no ncu CSV header")
    rows = [r for r in csv.DictReader(lines[start:]) if r.get("Metric Name") == "gpu__time_duration.sum"]
    scale = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
    return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1)) for r in rows]


def one_step(ks):
    """The kernels between the ends of the last two optimizer runs."""
    is_opt = [family(n) == "optimizer" and re.search(r"adam|lion|sgd_multi", n.lower()) for n, _ in ks]
    ends = [i for i in range(len(ks)) if is_opt[i] and (i + 1 == len(ks) or not is_opt[i + 1])]
    if len(ends) < 2:
        sys.exit(f"need two whole steps of kernels, found {len(ends)} optimizer runs in {len(ks)} kernels")
    return ks[ends[-2] + 1 : ends[-1] + 1]


def trace_kernels(path):
    ev = json.load(open(path))
    ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
    return [(e["name"], e["dur"] * 1e3) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def table(ks, steps, label, top):
    fam, by = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    for n, ns in ks:
        fam[family(n)][0] += ns; fam[family(n)][1] += 1
        short = re.sub(r"\(.*", "", n)[:90]
        by[short][0] += ns; by[short][1] += 1
    total = sum(v[0] for v in fam.values())
    ms = lambda ns: ns / steps / 1e6
    print(f"kernels {label}: {ms(total):.2f} ms of kernel time per step, {len(ks) / steps:.0f} kernels")
    for f, (ns, c) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
        print(f"  {label:<14} {f:<18} {ms(ns):8.2f} ms {100 * ns / total:5.1f}% {c / steps:6.0f} kernels")
    for n, (ns, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {label:<12} {ms(ns):8.3f} ms {c / steps:5.0f}x  {n}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ncu"), p.add_argument("--trace")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--label", default="run")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.ncu:
        table(one_step(ncu_kernels(a.ncu)), 1, a.label, a.top)
    elif a.trace:
        table(trace_kernels(a.trace), a.steps, a.label, a.top)
    else:
        sys.exit("--ncu CSV or --trace JSON")
