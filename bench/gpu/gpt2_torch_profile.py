"""PyTorch's GPT-2 step under its own profiler: the Chrome trace of a few steps after warm-up,
for kernel_table.py. The model, data and step are gpt2_torch.py's (imported from beside this
file), so the kernels are those of the run whose tokens/s the session reports.
  python3 gpt2_torch_profile.py --mode compile --trace /tmp/compile.json [gpt2_torch.py's shape flags]
"""
import argparse, os, sys, time
import torch

sys.path[:0] = [os.environ.get("GPT2_TORCH_DIR", "."), os.path.dirname(os.path.abspath(__file__))]
from gpt2_torch import GPT  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["eager", "compile"], default="compile")
p.add_argument("--trace", required=True)
p.add_argument("--device", default="cuda")
p.add_argument("--layers", type=int, default=12)
p.add_argument("--d-model", type=int, default=768)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--steps", type=int, default=3)
a = p.parse_args()
torch.backends.cuda.matmul.allow_tf32 = True
torch.manual_seed(0)
dev = torch.device(a.device)
model = GPT(a).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
fn = torch.compile(model) if a.mode == "compile" else model
data = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def step(b):
    b = b.to(dev, non_blocking=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = fn(b[:, :-1], b[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


for i in range(a.warmup):
    step(data[i])
sync()
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
with torch.profiler.profile(activities=acts) as prof:
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(data[a.warmup + i])
    sync()
    wall = time.perf_counter() - t0
prof.export_chrome_trace(a.trace)
print(f"profiled {a.mode}: {a.steps} steps, {1e3 * wall / a.steps:.2f} ms per step under the profiler", flush=True)
