#!/usr/bin/env bash
# One GPU session's measurements, run on the GPU machine from the repository root after
# bench/gpu/prepare.sh built everything into .gpu/:
#   run(command="bash .gpu/session.sh", carry=[".gpu"], timeout_s=...)
# Phases, in order (name some to run only those; default: all):
#   tests    the real-GPU cases of the CUDA tests, cuBLASLt's epilogues first
#   gpt2     GPT-2 124M bf16, batch 16 x 1024: ferrozero against PyTorch eager and torch.compile
#   stages   the same model at stage 0, stage 3 + optimizer offload, stage 3 + both offloads:
#            every step's loss and gradient norm bitwise
#   offload  a Llama (MHA, 32k vocabulary) at stage 3 with the optimizer on the CPU, 40 GB cap,
#            against DeepSpeed ZeRO-3 offload: tokens/s, model TFLOP/s, host optimizer share,
#            peak host RSS, the estimate against the allocator's peak
#   hf       Llama-3.2-1B's shape against transformers eager and torch.compile
#   profile  GPT-2's step kernel by kernel: ferrozero under Nsight Compute and its own
#            flops_profiler, PyTorch compiled under its profiler, one table per side by kernel
#            family (kernel_table.py); the stage 3 offload step's phases; the 7B preset's estimate
#   lora     GPT-2 124M with LoRA r 16 on every linear layer, the base frozen (bf16, stage 0):
#            ferrozero against PEFT + PyTorch eager and torch.compile (lora_peft.py)
#   ab       GPT-2 stage 0 with and without each backend switch (AB_ENV, default
#            FERROZERO_FUSE_DGELU=0), alternated AB_ROUNDS times (default 2)
# `smoke` is a short first look (tests, a few GPT-2 and Llama offload steps, DeepSpeed's import).
# Every figure is one line of $OUT/summary.txt, written as it comes with the seconds since the
# start, so a run cut short still reports what it had. BUDGET_S (default 480) bounds the whole
# run: each command's timeout is what is left of it, and a phase that cannot fit is skipped.
#
# --dry-run: ferrozero's side of every phase on the CPU with tiny models (and the baselines'
# CPU smoke modes where PyTorch and the scripts are present), from target/release when .gpu/ was
# not prepared: CI runs it to prove the script, its paths and its summary.
set -uo pipefail
G=$(cd "$(dirname "$0")" && pwd)
DRY=0 PHASES=()
for a in "$@"; do
  case $a in
    --dry-run) DRY=1 ;;
    all) PHASES+=(tests gpt2 stages offload hf profile lora) ;;
    tests | gpt2 | stages | offload | hf | profile | lora | ab | smoke) PHASES+=("$a") ;;
    *) echo "session.sh: unknown argument $a (phases: tests gpt2 stages offload hf profile lora ab smoke all; --dry-run)" >&2; exit 2 ;;
  esac
done
[ ${#PHASES[@]} -gt 0 ] || PHASES=(tests gpt2 stages offload hf profile lora)
want() { [[ " ${PHASES[*]} " == *" $1 "* ]]; }

OUT=${OUT:-/tmp/fz-out}; mkdir -p "$OUT"
S=$OUT/summary.txt; : > "$S"
# The device tool brings back 8 files: the summary, and every other log in one archive.
pack() {
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name logs.tgz | tar -czf logs.tgz -T - &&
    find . -type f ! -name summary.txt ! -name logs.tgz -delete)
}
trap pack EXIT
T0=$(date +%s) BUDGET=${BUDGET_S:-480}
now() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(now))); }
note() { echo "[$(now)s] $*" | tee -a "$S"; }
# `lim N`: N seconds, or what is left of the budget if less.
lim() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $((l > 1 ? l : 1)) || echo "$1"; }
# `fits N PHASE`: whether N seconds are left for PHASE; notes the skip otherwise.
fits() { [ "$(left)" -ge "$1" ] && return 0; note "$2: skipped, $(left) s left of $BUDGET (needs $1)"; return 1; }
last_json() { grep '^{' "$1" | tail -1; }

# Binaries: the prepared folder, else this checkout's release build (the dry run in CI).
BIN=$G TESTS=$G/tests
if [ -f "$G/tests.tar.xz" ] && [ ! -d "$TESTS" ]; then
  mkdir -p /tmp/fz-tests && tar -C /tmp/fz-tests -xJf "$G/tests.tar.xz" && TESTS=/tmp/fz-tests/tests
fi
if [ ! -x "$BIN/train_gpt" ]; then BIN=target/release TESTS=; fi
TRAIN=$BIN/train_gpt FZ=$BIN/ferrozero
[ -x "$BIN/examples/train_gpt" ] && TRAIN=$BIN/examples/train_gpt
for b in "$TRAIN" "$FZ"; do [ -x "$b" ] || { note "missing $b: run bench/gpu/prepare.sh (or build the release examples)"; exit 1; }; done
# The baselines: beside the binaries when prepared, else the shared folder beside the checkout.
PY=$G; [ -f "$PY/gpt2_torch.py" ] || PY=../shared/bench/gpu
have_torch() { [ -f "$PY/$1" ] && python3 -c 'import torch' 2>/dev/null; }

export FERROZERO_KERNEL_CACHE=/tmp/fz-kernels RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then
  DEV=cpu
  note "dry run: ferrozero on the CPU with tiny models, binaries from $BIN"
else
  DEV=cuda
  # shellcheck disable=SC1091
  source "$G/device_env.sh" > "$OUT/env.log" 2>&1
  nvidia-smi >> "$OUT/env.log" 2>&1
  grep device_env "$OUT/env.log" | tee -a "$S"
  export FERROZERO_PTXAS=${FERROZERO_PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
  "$FZ" report > "$OUT/report.log" 2>&1; grep -iE "gpu|nvrtc|cuda|cublas" "$OUT/report.log" | head -8 | tee -a "$S"
fi

# DeepSpeed from the carried wheels; its cpu_adam op compiles in the background from the start
# (about two minutes there), so the offload phase finds it built.
ds_ready=0
if [ $DRY = 0 ] && { want offload || want smoke; } && ls "$G"/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$G"/whl/*.whl > "$OUT/ds_install.log" 2>&1 &&
    ds_ready=1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=/tmp/ds-ext
  if [ $ds_ready = 1 ] && want offload; then
    (MAX_JOBS=8 nice python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
      > "$OUT/ds_build.log" 2>&1; echo "exit $?" >> "$OUT/ds_build.log") &
    DS_BUILD=$!
  fi
  note "deepspeed wheels: $([ $ds_ready = 1 ] && echo installed || echo "install failed (ds_install.log)")"
fi

tokens() { # tokens FILE COUNT VOCAB: random ids (seed 0); 4-byte ids in ferrozero's header past u16
  python3 - "$@" <<'PY'
import array, random, struct, sys
path, n, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(0)
a = array.array("H" if vocab <= 65536 else "I", (r.randrange(vocab) for _ in range(n)))
with open(path, "wb") as f:
    if vocab > 65536:
        f.write(b"FZTOKENS" + struct.pack("<II", 4, 0))
    f.write(a.tobytes())
PY
}

# The model shapes: GPT-2 124M and a 1.3B Llama on the GPU, tiny ones in the dry run.
if [ $DRY = 1 ]; then
  GPT2=/tmp/fz-gpt2-tiny.json SEQ=64 MICRO=2 GPT2_VOCAB=512
  echo '{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "n_positions": 64,
    "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attn_pdrop": 0.0}' > $GPT2
  LL=(2 64 2 128 512 32 1) # layers d_model heads ffn vocab seq batch
  TORCH_GPT2=(--device cpu --layers 2 --d-model 64 --heads 2 --vocab 512 --seq 64 --batch 2)
  HF=(--device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 512) HF_T=32 HF_B=2
  STEPS=3 STAGE_STEPS=3 LL_STEPS=3
else
  GPT2=gpt2-124m SEQ=1024 MICRO=16 GPT2_VOCAB=50257
  LL=(${LLAMA_SHAPE:-22 2048 16 5632 32000 2048 1})
  TORCH_GPT2=()
  HF=() HF_T=2048 HF_B=4
  STEPS=${GPT2_STEPS:-25} STAGE_STEPS=${STAGE_STEPS:-8} LL_STEPS=${LL_STEPS:-8}
fi
GPT2_DATA=/tmp/fz-gpt2-tokens.bin
gpt2_data() { [ -f $GPT2_DATA ] || tokens $GPT2_DATA $((1 << 20)) $GPT2_VOCAB; }
base='"train_micro_batch_size_per_gpu": '$MICRO', "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}'
off='{"device": "cpu", "pin_memory": true}'
# `gpt2_run NAME STEPS ZERO_JSON [EXTRA_KEYS]`: ferrozero trains GPT-2; its last JSON line is noted.
gpt2_run() {
  echo "{$base, ${4:+$4, }\"zero_optimization\": $3}" > /tmp/fz-$1.json
  timeout "$(lim 240)" "$TRAIN" --device $DEV --ranks 1 --model-config $GPT2 --config /tmp/fz-$1.json \
    --data $GPT2_DATA --seq-len $SEQ --steps "$2" --no-progress --bench-json --metrics "$OUT/$1.jsonl" \
    > "$OUT/$1.log" 2>&1
  local rc=$?
  note "ferrozero $1: exit $rc $(last_json "$OUT/$1.log")"
  [ $rc = 0 ] || grep -E "Error|error|panicked" "$OUT/$1.log" | head -3 | tee -a "$S"
}

# NVRTC compiles each kernel file at its first use in a process (about 30 s for all on an H200,
# cached on disk): one tiny GPT-2 and one tiny Llama step fill the cache once, so the tests'
# and runs' time limits measure them, not the compiler.
warm_kernels() {
  [ $DRY = 0 ] || return 0
  local m
  for m in tiny llama-tiny; do
    timeout "$(lim 120)" "$TRAIN" --device cuda --ranks 1 --model-config $m --steps 1 --no-progress \
      > "$OUT/warm_$m.log" 2>&1 || note "kernel warm-up ($m): exit $? ($(tail -1 "$OUT/warm_$m.log" | cut -c1-200))"
  done
  note "kernels compiled (NVRTC, cached in $FERROZERO_KERNEL_CACHE)"
}

phase_tests() { # the real-GPU cases only; cuBLASLt's epilogues first
  [ -n "$TESTS" ] && [ -d "$TESTS" ] || { note "tests: no prepared test binaries (prepare.sh builds them)"; return; }
  warm_kernels
  local t n t0 first="cuda_driver_gemm_epilogues cuda_driver_gemm device_matmul_backward cuda_driver_gemm_refusals"
  t0=$(now)
  for n in ${TESTS_ONLY:-$first $(ls "$TESTS" | grep -vxF "${first// /$'\n'}")}; do
    t=$TESTS/$n; [ -x "$t" ] || continue
    fits 10 "test $n" || return
    # TESTS_S bounds the phase, so the training figures keep their time.
    [ $(($(now) - t0)) -lt "${TESTS_S:-100000}" ] || { note "test $n: not started, the phase's ${TESTS_S} s are spent"; continue; }
    if [ $DRY = 1 ]; then # no GPU: count the real-GPU cases it would run
      note "test $n: $("$t" --list real_ cuda_f32 cuda_bf16 2>/dev/null | grep -c ': test$') real-GPU cases"
      continue
    fi
    timeout "$(lim 60)" "$t" --test-threads 4 real_ cuda_f32 cuda_bf16 > "$OUT/test_$n.log" 2>&1
    local rc=$?
    note "test $n: exit $rc ($(grep -E '^test result' "$OUT/test_$n.log" | tail -1)); skipped: $(grep -c '^skipped' "$OUT/test_$n.log")"
    # A test that never finished: which ones (listed, and not reported done)
    [ $rc = 124 ] && "$t" --list real_ cuda_f32 cuda_bf16 2> /dev/null | sed -n 's/: test$//p' |
      while read -r c; do grep -qE "^test $c \.\.\. " "$OUT/test_$n.log" || note "  unfinished: $c"; done
    grep -E -A1 '^test .*FAILED|panicked|failed on' "$OUT/test_$n.log" | grep -v '^--' | cut -c1-400 | head -12 | tee -a "$S"
  done
}

phase_gpt2() {
  gpt2_data
  gpt2_run gpt2_s0 "$STEPS" '{"stage": 0}'
  if have_torch gpt2_torch.py; then
    fits 30 "torch gpt2" || return
    timeout "$(lim 200)" python3 "$PY/gpt2_torch.py" --modes eager,compile --steps "$STEPS" "${TORCH_GPT2[@]}" \
      > "$OUT/gpt2_torch.log" 2>&1
    note "torch gpt2: exit $?"; grep '^{' "$OUT/gpt2_torch.log" | tee -a "$S"
  else
    note "torch gpt2: skipped (no PyTorch or no $PY/gpt2_torch.py)"
  fi
}

phase_stages() { # same world size and device: the same bits at every stage and offload
  gpt2_data
  local s3o='{"stage": 3, "overlap_comm": true, "offload_optimizer": '$off'}'
  local s3op='{"stage": 3, "overlap_comm": true, "offload_optimizer": '$off', "offload_param": '$off'}'
  gpt2_run stage_s0 "$STAGE_STEPS" '{"stage": 0}'
  fits 20 "stage 3 offload" && gpt2_run stage_s3o "$STAGE_STEPS" "$s3o"
  fits 20 "stage 3 param offload" && gpt2_run stage_s3op "$STAGE_STEPS" "$s3op"
  stages_compare s3o s3op
  # A difference on the GPU alone: again with every launch and copy synchronous, which hides
  # a missing order between streams (the same bits then name a race).
  if [ $DRY = 0 ] && grep -q "s3op vs s0.*DIFFERENT" "$S" && fits 20 "s3op, launches blocking"; then
    CUDA_LAUNCH_BLOCKING=1 gpt2_run stage_s3opb "$STAGE_STEPS" "$s3op"
    stages_compare s3opb
  fi
}

stages_compare() { # stages_compare RUN...: each run's steps against stage_s0's, bit for bit
  python3 - "$OUT" "$@" <<'PY' | tee -a "$S"
import json, os, sys
def load(c):
    p = f"{sys.argv[1]}/stage_{c}.jsonl"
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
key = lambda r: [(m["step"], m["loss"], m["grad_norm"]) for m in r if "loss" in m]
s0 = key(load("s0"))
for c in sys.argv[2:]:
    k = key(load(c))
    same = k == s0 and len(k) > 0
    print(f"stages: {c} vs s0 over {len(k)} steps: {'bitwise identical' if same else 'DIFFERENT'}")
    for a, b in list(zip(s0, k))[:3] if not same else []:
        print("  s0", a, c, b)
PY
}

phase_offload() {
  local L=${LL[0]} D=${LL[1]} H=${LL[2]} F=${LL[3]} V=${LL[4]} T=${LL[5]} B=${LL[6]}
  local cfg=/tmp/fz-llama.json data=/tmp/fz-llama-tokens.bin
  python3 - "$cfg" <<PY
import json, sys
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $D,
           "intermediate_size": $F, "num_hidden_layers": $L, "num_attention_heads": $H,
           "num_key_value_heads": $H, "vocab_size": $V, "max_position_embeddings": $T,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "hidden_act": "silu"}, open(sys.argv[1], "w"))
PY
  [ -f $data ] || tokens $data $((T * B * 24)) "$V"
  echo "{\"train_micro_batch_size_per_gpu\": $B, \"gradient_accumulation_steps\": 1, \"gradient_clipping\": 1.0,
    \"bf16\": {\"enabled\": true}, \"device_memory_limit\": \"40GB\", \"wall_clock_breakdown\": true, \"steps_per_print\": 1,
    \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-5, \"betas\": [0.9, 0.95], \"weight_decay\": 0.1}},
    \"activation_checkpointing\": {\"partition_activations\": false},
    \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": true, \"contiguous_gradients\": true, \"offload_optimizer\": $off}}" \
    > /tmp/fz-offload.json
  "$FZ" estimate --model-config $cfg --config /tmp/fz-offload.json --device $DEV --seq-len "$T" --json \
    > "$OUT/offload_estimate.json" 2> "$OUT/offload_estimate.err"
  note "estimate llama ${L}x$D: exit $? $(python3 -c '
import json, sys
e = json.load(open(sys.argv[1])); r = e["per_rank"]
print("params", e["num_params"], "device_bytes", r["device_bytes"], "host_bytes", r["host_bytes"],
      "page_locked", r["page_locked_bytes"], "fits", e["fits"], "overlap", e.get("optimizer_overlap"))' \
    "$OUT/offload_estimate.json" 2>&1 | tail -1)"
  fits 40 "ferrozero llama offload" || return
  timeout "$(lim 240)" "$TRAIN" --device $DEV --ranks 1 --model-config $cfg --config /tmp/fz-offload.json \
    --data $data --seq-len "$T" --steps "$LL_STEPS" --no-progress --bench-json --metrics "$OUT/offload_llama.jsonl" \
    > "$OUT/offload_llama.log" 2>&1
  note "ferrozero llama offload: exit $? $(last_json "$OUT/offload_llama.log")"
  grep -E "Error|panicked|overlap" "$OUT/offload_llama.log" | head -4 | tee -a "$S"
  # The host optimizer's share of a step: its wall time over the step's (the last steps).
  grep -o "time (ms): .*" "$OUT/offload_llama.log" | tail -3 | sed 's/^/  /' | tee -a "$S"
  if [ $DRY = 1 ] || [ $ds_ready = 0 ] || [ -n "${NO_DS:-}" ] || [ ! -f "$PY/ds_offload_llama.py" ]; then
    local smoke=(--device cpu --layers "$L" --d-model "$D" --heads "$H" --ffn "$F" --vocab "$V" --seq "$T" --steps 2)
    if [ $DRY = 1 ] && python3 -c 'import deepspeed' 2>/dev/null && [ -f "$PY/ds_offload_llama.py" ]; then
      timeout "$(lim 120)" python3 "$PY/ds_offload_llama.py" "${smoke[@]}" > "$OUT/offload_ds.log" 2>&1
      note "deepspeed smoke: exit $? $(last_json "$OUT/offload_ds.log")"
    else
      note "deepspeed offload: not run (dry run, smoke, or no DeepSpeed wheels or script)"
    fi
    return
  fi
  [ -n "${DS_BUILD:-}" ] && { wait "$DS_BUILD"; note "deepspeed cpu_adam build: $(tail -1 "$OUT/ds_build.log")"; }
  fits 60 "deepspeed llama offload" || return
  timeout "$(lim 240)" python3 "$PY/ds_offload_llama.py" --layers "$L" --d-model "$D" --heads "$H" --ffn "$F" \
    --vocab "$V" --seq "$T" --batch "$B" --steps "$((LL_STEPS - 2))" --warmup 2 --cap-gb 40 \
    > "$OUT/offload_ds.log" 2>&1
  note "deepspeed llama offload: exit $? $(last_json "$OUT/offload_ds.log")"
}

phase_hf() { # Llama-3.2-1B's shape: transformers (eager, compile) and ferrozero
  local cfg=/tmp/fz-hf-llama.json data=/tmp/fz-hf-tokens.bin torch=1
  have_torch llama_hf_torch.py && python3 -c 'import transformers' 2>/dev/null || torch=0
  HF+=(--seq $HF_T --batch $HF_B)
  if [ $torch = 1 ]; then
    python3 "$PY/llama_hf_torch.py" "${HF[@]}" --write-config $cfg > "$OUT/hf_config.log" 2>&1 || { note "hf: config failed"; return; }
  elif [ $DRY = 1 ]; then # the same tiny shape, written here: ferrozero's side runs without PyTorch
    echo '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
      "hidden_act": "silu"}' > $cfg
  else
    note "hf: skipped (no PyTorch, transformers or $PY/llama_hf_torch.py)"; return
  fi
  local V T=$HF_T B=$HF_B
  V=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' $cfg)
  tokens $data $((T * B * 12)) "$V"
  echo "{\"train_micro_batch_size_per_gpu\": $B, \"gradient_accumulation_steps\": 1, \"gradient_clipping\": 1.0,
    \"bf16\": {\"enabled\": true}, \"zero_optimization\": {\"stage\": 0},
    \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4, \"betas\": [0.9, 0.95], \"weight_decay\": 0.1}}}" > /tmp/fz-hf.json
  fits 30 "ferrozero hf llama" || return
  timeout "$(lim 150)" "$TRAIN" --device $DEV --ranks 1 --model-config $cfg --config /tmp/fz-hf.json --data $data \
    --seq-len "$T" --steps 10 --no-progress --bench-json > "$OUT/hf_ferrozero.log" 2>&1
  note "ferrozero hf llama: exit $? $(last_json "$OUT/hf_ferrozero.log")"
  [ $torch = 1 ] || { note "transformers llama: skipped (no PyTorch or transformers)"; return; }
  fits 40 "transformers llama" || return
  timeout "$(lim 200)" python3 "$PY/llama_hf_torch.py" "${HF[@]}" --modes eager,compile --steps 10 > "$OUT/hf_torch.log" 2>&1
  note "transformers llama: exit $?"; grep '^{' "$OUT/hf_torch.log" | tee -a "$S"
}

phase_profile() { # what stands between GPT-2's step and torch.compile's, kernel by kernel
  gpt2_data
  # ferrozero's own profiler (each operation between two events: its time, not the overlap's)
  gpt2_run prof_fz 4 '{"stage": 0}' '"flops_profiler": {"enabled": true, "profile_step": 3, "module_depth": 1, "output_file": "'"$OUT"'/prof_fz_table.txt"}'
  [ -f "$OUT/prof_fz_table.txt" ] && grep -v "^ *h\.[0-9]" "$OUT/prof_fz_table.txt" | head -"${PROF_LINES:-45}" | sed 's/^/  /' | tee -a "$S"
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | tail -1)
  if [ $DRY = 0 ] && [ -n "$ncu" ] && fits 60 "ncu ferrozero gpt2"; then
    echo "{$base, \"zero_optimization\": {\"stage\": 0}}" > /tmp/fz-ncu.json
    timeout "$(lim 180)" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      --log-file "$OUT/ncu.csv" "$TRAIN" --device cuda --ranks 1 --model-config $GPT2 --config /tmp/fz-ncu.json \
      --data $GPT2_DATA --seq-len $SEQ --steps 3 --no-progress > "$OUT/ncu_run.log" 2>&1
    note "ncu ferrozero gpt2: exit $? ($(grep -c gpu__time_duration "$OUT/ncu.csv" 2> /dev/null) kernels timed)"
    cat "$OUT/ncu.csv" "$OUT/ncu_run.log" > "$OUT/ncu_all.txt" 2> /dev/null
    python3 "$G/kernel_table.py" --ncu "$OUT/ncu_all.txt" --label ferrozero 2>&1 | tee -a "$S"
  else
    note "ncu: not run (dry run, no ncu, or no time)"
  fi
  if have_torch gpt2_torch.py && [ -f "$G/gpt2_torch_profile.py" ]; then
    local m
    for m in ${PROF_MODES-compile eager}; do
      fits 40 "torch profile $m" || break
      GPT2_TORCH_DIR=$PY timeout "$(lim 150)" python3 "$G/gpt2_torch_profile.py" --mode $m --trace "$OUT/torch_$m.json" \
        "${TORCH_GPT2[@]}" > "$OUT/prof_torch_$m.log" 2>&1
      note "torch profile $m: exit $? $(tail -1 "$OUT/prof_torch_$m.log")"
      [ $DRY = 1 ] || python3 "$G/kernel_table.py" --trace "$OUT/torch_$m.json" --steps 3 --label "torch_$m" 2>&1 | tee -a "$S"
    done
  else
    note "torch profile: skipped (no PyTorch or no gpt2_torch.py)"
  fi
  # The stage 3 step with the optimizer on the CPU, phase by phase
  fits 20 "stage 3 offload phases" &&
    gpt2_run prof_s3o "$STAGE_STEPS" '{"stage": 3, "overlap_comm": true, "offload_optimizer": '"$off"'}' \
      '"wall_clock_breakdown": true, "steps_per_print": 1' &&
    grep -o "time (ms): .*" "$OUT/prof_s3o.log" | tail -3 | sed 's/^/  /' | tee -a "$S"
  # The 7B preset on this host: does the optimizer overlap stay on within its memory
  if [ -f configs/llama7b_40gb.toml ]; then
    # (the dry run prices the GPU machine's 128 GiB; there, the host it runs on)
    local host=(); [ $DRY = 1 ] && host=(--host-memory 128GiB)
    "$FZ" estimate --model llama-7b --config configs/llama7b_40gb.toml --device cuda "${host[@]}" \
      > "$OUT/estimate_7b.txt" 2>&1
    note "estimate 7b preset on this host: exit $?"
    head -${EST_LINES:-30} "$OUT/estimate_7b.txt" | sed 's/^/  /' | tee -a "$S"
  fi
}

phase_ab() { # the same run with a backend switch and without, alternated
  gpt2_data
  local i sw=${AB_ENV:-FERROZERO_FUSE_DGELU=0}
  for i in $(seq "${AB_ROUNDS:-2}"); do
    fits 15 "ab round $i" || return
    gpt2_run "ab_base_$i" "$STEPS" '{"stage": 0}'
    (export "${sw?}" && gpt2_run "ab_switch_$i" "$STEPS" '{"stage": 0}')
  done
  note "ab: switch $sw; tokens/s base $(grep -ho '"tokens_per_s":[0-9.]*' "$OUT"/ab_base_*.log | cut -d: -f2 | tr '\n' ' ')switch $(grep -ho '"tokens_per_s":[0-9.]*' "$OUT"/ab_switch_*.log | cut -d: -f2 | tr '\n' ' ')"
}

phase_smoke() { # the first minutes on a new machine: does everything start at all
  TESTS_ONLY=${TESTS_ONLY:-"cuda_driver_gemm_epilogues cuda_driver_gemm device_matmul_backward device_whole_step device_head"} phase_tests
  STEPS=6 phase_gpt2_fz_only
  [ $DRY = 1 ] || LL=(${SMOKE_LLAMA:-4 1024 8 2816 32000 2048 1})
  LL_STEPS=3 NO_DS=1 phase_offload
  python3 -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' \
    > "$OUT/ds_import.log" 2>&1; note "deepspeed import: exit $? $(tail -1 "$OUT/ds_import.log")"
}
phase_lora() { # LoRA on GPT-2's shape: ferrozero's frozen base and adapters against PEFT's
  gpt2_data
  echo '{"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32, "target_modules": "all-linear",
    "lora_dropout": 0.0, "fan_in_fan_out": true}' > /tmp/fz-lora-adapter.json
  echo "{\"train_micro_batch_size_per_gpu\": $MICRO, \"gradient_accumulation_steps\": 1, \"gradient_clipping\": 1.0,
    \"bf16\": {\"enabled\": true}, \"zero_optimization\": {\"stage\": 0},
    \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 2e-4, \"betas\": [0.9, 0.95], \"weight_decay\": 0.1}}}" > /tmp/fz-lora.json
  fits 30 "ferrozero lora" || return
  timeout "$(lim 200)" "$TRAIN" --device $DEV --ranks 1 --model-config $GPT2 --config /tmp/fz-lora.json \
    --data $GPT2_DATA --seq-len $SEQ --steps "$STEPS" --peft /tmp/fz-lora-adapter.json --no-progress --bench-json \
    --metrics "$OUT/lora_fz.jsonl" > "$OUT/lora_fz.log" 2>&1
  note "ferrozero lora: exit $? $(last_json "$OUT/lora_fz.log")"
  if [ -f "$G/lora_peft.py" ] && python3 -c 'import torch, peft, transformers' 2>/dev/null; then
    fits 60 "peft lora" || return
    local shape=(); [ $DRY = 1 ] && shape=(--device cpu --layers 2 --d-model 64 --heads 2 --vocab 512 --seq $SEQ --batch $MICRO)
    timeout "$(lim 240)" python3 "$G/lora_peft.py" --modes eager,compile --steps "$STEPS" "${shape[@]}" \
      > "$OUT/lora_peft.log" 2>&1
    note "peft lora: exit $?"; grep '^{' "$OUT/lora_peft.log" | tee -a "$S"
  else
    note "peft lora: skipped (no PyTorch, PEFT or transformers)"
  fi
}

phase_gpt2_fz_only() { gpt2_data; gpt2_run gpt2_smoke "$STEPS" '{"stage": 0}'; }

# In the order asked (`all`: tests gpt2 stages offload hf).
for p in "${PHASES[@]}"; do
  t=$(now); note "phase $p: start"
  "phase_$p"
  note "phase $p: $(($(now) - t)) s"
done
note "done in $(now) s"
# The dry run is CI's proof of the script: any failed run or differing bits fail it.
if [ $DRY = 1 ] && grep -qE "exit [1-9]|DIFFERENT|missing " "$S"; then
  note "dry run FAILED: $(grep -cE "exit [1-9]|DIFFERENT|missing " "$S") lines above"
  exit 1
fi
