"""Checks `ferrozero train --peft` against PEFT by hand (CI has no PyTorch): builds a tiny GPT-2
with transformers, fine-tunes LoRA adapters with ferrozero, then loads the adapter directory
with `PeftModel.from_pretrained` and the `--merge` output with `from_pretrained`, and compares
their logits with each other and the adapter's tensors with what PEFT holds.

Run: python3 bench/lora/check_train_export.py FERROZERO_BINARY WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel


def main(binary, work):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(work, exist_ok=True)
    base_dir = os.path.join(work, "base")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=512, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(base_dir)
    shutil.copy(os.path.join(root, "data/shakespeare/tokenizer.json"), base_dir)
    lora = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
            "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True, "bias": "none",
            "modules_to_save": ["ln_f"]}
    with open(os.path.join(work, "adapter_config.json"), "w") as f:
        json.dump(lora, f)
    with open(os.path.join(work, "ds.json"), "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}, f)
    common = [binary, "train", "--model", base_dir, "--data",
              os.path.join(root, "data/shakespeare/input.txt"), "--seq-len", "64", "--no-progress",
              "--no-cache", "--config", os.path.join(work, "ds.json")]
    adapter, merged = os.path.join(work, "adapter"), os.path.join(work, "merged")
    subprocess.run(common + ["--peft", os.path.join(work, "adapter_config.json"), "--steps", "10",
                             "--ranks", "2", "--output", adapter], check=True)
    subprocess.run(common + ["--peft", adapter, "--steps", "0", "--merge", "--output", merged],
                   check=True)
    peft = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base_dir), adapter).eval()
    state = peft.state_dict()
    written = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    for name, want in written.items():
        live = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        if live not in state:
            head, _, leaf = name.rpartition(".")
            live = f"{head}.modules_to_save.default.{leaf}"
        assert torch.equal(state[live], want), name
    plain = GPT2LMHeadModel.from_pretrained(merged).eval()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = peft(input_ids=ids).logits, plain(input_ids=ids).logits
        merged_by_peft = peft.merge_and_unload()(input_ids=ids).logits
    print(f"PEFT loaded {len(written)} tensors, all equal; logits: adapter vs ferrozero's merge "
          f"{(a - b).abs().max():.2e}, PEFT's merge vs ferrozero's {(merged_by_peft - b).abs().max():.2e}")
    assert (a - b).abs().max() < 1e-4 and (merged_by_peft - b).abs().max() < 1e-4


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
