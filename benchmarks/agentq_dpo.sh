#!/usr/bin/env bash
# The command behind docs/agentq_dpo.md, "Results" (and README's algorithm table): AgentQ on the seed-003
# GridWorld with SmolLM2-135M, choice mode, seed 1, 3 small iterations (2 trees x 4 simulations of <= 12 steps),
# defaults otherwise (k = 2 sampled at T = 2, c = 1, min Q-gap 0.1, beta = 0.1, lr 1e-4, 4 DPO epochs, top 6 layers).
# Published, iterations 0 / 1 / 2 / 3:
#   greedy success (eval/success_rate, 1 episode)      0.00 / 0.00 / 0.00 / 0.00
#   greedy return (eval/episodic_return)               -1.00 / 0.00 / 0.00 / 0.00
#   search success (charts/success_rate)                 -  / 0.00 / 0.00 / 0.12
#   search return (charts/episodic_return)               -  / -0.23 / 0.15 / 0.40
#   step-level pairs (charts/num_pairs)                  -  / 4 / 2 / 4
# Machine: 2-core x86_64 CPU shared with other jobs (load average 13-25): 22 min 52 s wall, 2 min 15 s CPU time.
# About 3 min on an idle machine is an estimate from the CPU time, not measured.
#   bash benchmarks/agentq_dpo.sh          # runs under benchmarks/runs/agentq_dpo (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/runs/agentq_dpo}
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "$OUT is not empty: move it away first (plot.py would count its old runs in the table)" >&2; exit 1
fi
mkdir -p "$OUT"
timed() { local t0=$SECONDS; "$@"; echo "$((SECONDS - t0)) s: $*" | tee -a "$OUT/wall_clock.txt"; }

timed python algorithms/agentq_dpo.py --total-iterations 3 --num-tasks 2 --num-simulations 4 --max-depth 12 \
    --eval-episodes 1 --output-dir "$OUT"

python benchmarks/plot.py "$OUT" --tags eval/success_rate eval/episodic_return charts/success_rate \
    charts/episodic_return charts/num_pairs losses/dpo_loss --x-axes episodes wall --output "$OUT/results"
