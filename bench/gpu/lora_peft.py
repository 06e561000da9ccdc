"""The reference side of session.sh's `lora` phase: PEFT + PyTorch (eager, and torch.compile)
training GPT-2 with LoRA adapters, the setup ferrozero's side runs: GPT-2 124M's shape, a
random-token batch of BATCH x SEQ, LoRA r 16, alpha 32 on every linear layer (dropout 0), the
base in bf16 and frozen, the adapters in f32 under bf16 autocast, AdamW (lr 2e-4, betas
0.9/0.95, wd 0.1) with clipping 1.0 over the adapters.

Prints one JSON line per mode: tokens/s over the steps after the first three (compilation and
warm-up), and the peak device bytes (torch.cuda.max_memory_allocated).

Run: python3 bench/gpu/lora_peft.py [--modes eager,compile] [--steps 20] [--device cpu
     --layers 2 --d-model 64 --heads 2 --vocab 512 --seq 64 --batch 2]   (the last: CI's shape)
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel


def model_for(a):
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.d_model, n_layer=a.layers,
                     n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     activation_function="gelu_new")
    cfg._attn_implementation = "sdpa"
    base = GPT2LMHeadModel(cfg).to(device=a.device, dtype=torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    return get_peft_model(base, lora).train()


def run(a, mode):
    torch.manual_seed(0)
    model = model_for(a)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step_model = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator().manual_seed(1)
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    spent, warm = 0.0, 3
    for step in range(a.steps):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).to(a.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
            logits = step_model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= warm:
            spent += time.perf_counter() - t0
    measured = max(a.steps - warm, 1)
    print(json.dumps({
        "bench": "peft_lora", "mode": mode, "steps": a.steps, "loss": round(loss.item(), 4),
        "tokens_per_s": round(a.batch * a.seq * measured / max(spent, 1e-9), 1),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "trainable_params": sum(p.numel() for p in params),
    }), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    for mode in a.modes.split(","):
        run(a, mode)


if __name__ == "__main__":
    main()
