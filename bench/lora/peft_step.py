"""The reference side of the LoRA benchmark: PEFT + PyTorch eager on the CPU, the model, batch,
adapters and optimizer of bench/lora/ab.sh (GPT 6x384, 6 heads, vocab 4096, seq 128, micro-batch
8, tied head; LoRA r 16, alpha 32 on every linear layer, dropout 0; AdamW lr 3e-4, betas
0.9/0.95, wd 0.1 over the adapters, clipping 1.0; f32; random tokens).

Prints one JSON line per step after the first two ({"step", "tokens_per_s"}) and a last line
with the tokens/s over those steps (their tokens over their time, as ferrozero's --bench-json
counts), the median step's, and the process's peak RSS (ru_maxrss).

Run: OMP_NUM_THREADS=2 python3 bench/lora/peft_step.py [--steps 12] [--threads 2]
"""
import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, MICRO = 4096, 128, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=384, n_layer=6, n_head=6,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
    )
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).float()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    rates, spent = [], 0.0
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
        t0 = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if step >= 2:
            rates.append(MICRO * SEQ / dt)
            spent += dt
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "tokens_per_s": round(rates[-1], 1)}))
    trainable = sum(p.numel() for p in params)
    print(json.dumps({
        "bench": "peft_step", "tokens_per_s": round(MICRO * SEQ * len(rates) / spent, 1),
        "median_step_tokens_per_s": round(statistics.median(rates), 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trainable_params": trainable, "threads": args.threads,
    }))


if __name__ == "__main__":
    main()
