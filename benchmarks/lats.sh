#!/usr/bin/env bash
# The commands behind docs/lats.md, "Results" (and README's algorithm table): LATS against the ReAct baseline at
# matched token budgets, SmolLM2-135M, seed 1, defaults otherwise (k = 3, c = 1, lambda = 0.5, T = 1, rollout
# depth 8, 3 lessons of <= 32 tokens, --react-batch 4).
# Published (success; tokens per task (generated); work per task; seconds per task, contended):
#   GridWorld B = 6000   LATS   0/4   6253 (0)      4 iterations, 13 nodes     17 s  (session 54, commit 2abed48,
#   GridWorld B = 6000   ReAct  0/4   7089 (120)    6 episodes                 30 s   alone on the 2-core Zen 4
#   GridWorld B = 16000  LATS   0/2   17787 (0)     10 iterations, 31 nodes    45 s   EPYC; lessons only after a
#   GridWorld B = 16000  ReAct  0/2   16528 (280)   14 episodes                54 s   failed terminal state)
#   codegen L1 B = 4000  LATS   0/3   6453 (1155)   2 iterations              415 s  (older code: a lesson after
#   codegen L1 B = 4000  ReAct  0/1   4398 (2664)   6 episodes                986 s   every unsuccessful simulation;
#                                                                  contended; ReAct stopped after task 1)
#   (eval/success_rate, eval/tokens_per_task, perf/generated_tokens_per_task, diagnostics/iterations,
#   diagnostics/tree_nodes, perf/task_s)
# Codegen machine: 2-core x86_64 CPU shared with ~8 other jobs (load average 16-26): the seconds are several times an
# idle machine's (the codegen ReAct run was stopped after its first task, 16 min: its other 2 tasks were never
# measured). The GridWorld rows took 6.9 min in all, alone.
#   bash benchmarks/lats.sh          # runs under benchmarks/runs/lats (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/runs/lats}
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "$OUT is not empty: move it away first (plot.py would count its old runs in the table)" >&2; exit 1
fi
mkdir -p "$OUT"
timed() { local t0=$SECONDS; "$@"; echo "$((SECONDS - t0)) s: $*" | tee -a "$OUT/wall_clock.txt"; }

# --exp-name only labels the rows of the table (the docs' runs used the default names lats / lats_react)
timed python algorithms/lats.py              --num-tasks 4 --token-budget 6000 --exp-name lats-b6000 --output-dir "$OUT"
timed python algorithms/lats.py --mode react --num-tasks 4 --token-budget 6000 --exp-name react-b6000 --output-dir "$OUT"
timed python algorithms/lats.py              --num-tasks 2 --token-budget 16000 --exp-name lats-b16000 --output-dir "$OUT"
timed python algorithms/lats.py --mode react --num-tasks 2 --token-budget 16000 --exp-name react-b16000 --output-dir "$OUT"
timed python algorithms/lats.py              --env-id codegen --env-level 1 --num-tasks 3 --token-budget 4000 \
    --exp-name lats-b4000 --output-dir "$OUT"
# the published row is this command's first task only: the run was stopped after it (the docs' command is kept)
timed python algorithms/lats.py --mode react --env-id codegen --env-level 1 --num-tasks 3 --token-budget 4000 \
    --exp-name react-b4000 --output-dir "$OUT"

python benchmarks/plot.py "$OUT" --tags eval/success_rate eval/episodic_return eval/tokens_per_task \
    perf/generated_tokens_per_task diagnostics/iterations diagnostics/tree_nodes perf/task_s \
    --x-axes episodes wall --output "$OUT/results"
