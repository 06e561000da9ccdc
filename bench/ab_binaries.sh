#!/usr/bin/env bash
# Training throughput of two builds of train_gpt, alternated ROUNDS times on the same work so a
# noisy machine hits both alike: the GPT of ../shared/bench/gpt_ab.sh (6x384, 6 heads, vocab
# 4096, seq 128, micro-batch 8 per rank, tied head, AdamW), 12 steps of which the first 2 are
# not counted. Prints each side's median tokens/s per mode and the ratio NEW/OLD.
# Usage: bash bench/ab_binaries.sh OLD/train_gpt NEW/train_gpt [single|ddp|z3 ...]
# Env: ROUNDS=5
set -euo pipefail
OLD=$1; NEW=$2; shift 2
ROUNDS=${ROUNDS:-5}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -c "import random,struct; r=random.Random(0); open('$W/tokens.bin','wb').write(struct.pack('<%dH'%(1<<20),*[r.randrange(4096) for _ in range(1<<20)]))"
echo '{"model_type":"gpt2","n_layer":6,"n_head":6,"n_embd":384,"vocab_size":4096,"n_positions":128,"layer_norm_epsilon":1e-5,"activation_function":"gelu_new","resid_pdrop":0.0,"embd_pdrop":0.0,"attn_pdrop":0.0}' > "$W/model.json"
run() {  # binary ranks stage -> median tokens/s over steps 3..12
  echo "{\"train_micro_batch_size_per_gpu\":8,\"gradient_accumulation_steps\":1,\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"lr\":3e-4,\"betas\":[0.9,0.95],\"weight_decay\":0.1}},\"zero_optimization\":{\"stage\":$3}}" > "$W/c.json"
  rm -f "$W/m.jsonl"
  "$1" --config "$W/c.json" --ranks "$2" --model-config "$W/model.json" --data "$W/tokens.bin" \
    --seq-len 128 --steps 12 --no-progress --metrics "$W/m.jsonl" >/dev/null 2>&1
  python3 -c "import json,statistics,sys; m=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]; print(statistics.median(x['tokens_per_s'] for x in m[2:]))" "$W/m.jsonl"
}
for mode in ${*:-single ddp z3}; do
  case $mode in single) args="1 0";; ddp) args="2 0";; z3) args="2 3";; *) echo "unknown mode $mode"; exit 2;; esac
  a=(); b=()
  for _ in $(seq "$ROUNDS"); do a+=("$(run "$OLD" $args)"); b+=("$(run "$NEW" $args)"); done
  python3 - "$mode" "${a[*]}" "${b[*]}" <<'PY'
import json,statistics,sys
mode,a,b=sys.argv[1],[float(x) for x in sys.argv[2].split()],[float(x) for x in sys.argv[3].split()]
ma,mb=statistics.median(a),statistics.median(b)
print(json.dumps({"bench":"ab_binaries","mode":mode,"old_tokens_per_s":round(ma,1),"new_tokens_per_s":round(mb,1),"ratio_new_over_old":round(mb/ma,3),"old_runs":a,"new_runs":b}))
PY
done
