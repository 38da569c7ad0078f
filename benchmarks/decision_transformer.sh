#!/usr/bin/env bash
# The commands behind docs/decision_transformer.md, "Results" (and README's algorithm table).
# Published:
#   1. Return conditioning, `--model tiny`, default dataset (300 eps = 0.5 episodes, mean return 2.20, success 0.47),
#      seed 1, final R* sweep (eval/rtg_sweep_target, eval/rtg_sweep_return, eval/rtg_correlation):
#        R*               -1.00   0.36   1.72   3.09   4.45
#        achieved return   1.00   0.00   0.00   3.30   3.35     success 0 0 0 1 1,  corr(R*, achieved) = 0.75
#      Periodic evaluation at R* = 4.45: 3.55 (step 200), -0.00 (step 400), 3.35 (step 600); final action-token
#      loss ~0.35 (accuracy ~0.85). 30 min on the shared 2-core CPU (load average 14-25).
#   2. SmolLM2-135M timing only (not trained to the end): 445 s in all with OMP_NUM_THREADS=2 at load ~12, of
#      which ~300 s for one greedy 20-step evaluation episode, ~15 s per update.
#   3. The DT row of the 3-seed offline benchmark (tiny LM, with section 1's learning rate and batch):
#      benchmarks/results/offline_gridworld_tiny.md, whose command is in benchmarks/cql.sh, section 3.
# Machine: 2-core x86_64 CPU shared with other jobs; no idle-machine time measured.
#   bash benchmarks/decision_transformer.sh     # runs under benchmarks/runs/decision_transformer (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/runs/decision_transformer}
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "$OUT is not empty: move it away first (plot.py would count its old runs in the table)" >&2; exit 1
fi
mkdir -p "$OUT"
timed() { local t0=$SECONDS; "$@"; echo "$((SECONDS - t0)) s: $*" | tee -a "$OUT/wall_clock.txt"; }

# 1. (--exp-name only labels the rows of the table)
timed python algorithms/decision_transformer.py --model tiny --train-steps 600 --learning-rate 1e-3 \
    --minibatch-size 16 --eval-every 200 --exp-name tiny-return-conditioning --output-dir "$OUT/runs"

# 2. docs give only "--train-steps 3 --eval-every 0 --sweep-targets 4.45" with OMP_NUM_THREADS=2 (defaults otherwise)
OMP_NUM_THREADS=2 timed python algorithms/decision_transformer.py --train-steps 3 --eval-every 0 --sweep-targets 4.45 \
    --exp-name smollm2-timing --output-dir "$OUT/runs"

python benchmarks/plot.py "$OUT/runs" --tags eval/episodic_return eval/success_rate eval/rtg_correlation \
    losses/action_loss diagnostics/action_token_accuracy --x-axes episodes wall --output "$OUT/results"
