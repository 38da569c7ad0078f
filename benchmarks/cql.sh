#!/usr/bin/env bash
# The commands behind docs/cql.md, "Results" (and README's algorithm table). All: seed 1, seed-003 GridWorld,
# 3000 updates, final greedy evaluation (one episode: layout and greedy policy are deterministic).
# Published:
#   1. `--model tiny`, data collected on the fly (200 episodes), final greedy return:
#        data                          cql     bc      filtered-bc
#        suboptimal eps = 0.3 (0.87)   4.45    4.45    4.45 (184 of 200 episodes kept)
#        suboptimal eps = 0.7 (0.16)   0.00    3.15    not run
#        noisy (0.02)                  -1.00   -1.00   3.35 (9 of 200 episodes kept)
#      (CQL on noisy data: 3.00 at update 2000.) About 7 s of CPU time per run.
#   2. SmolLM2-135M, frozen, CQL on a collected eps = 0.4 dataset (200 episodes, 3447 transitions, success 0.69,
#      mean return 3.07): greedy return at updates 0 / 500 / ... / 2500 / 3000 = -1.00 / 4.45 x 5 / 4.35,
#      success 0 then 1 (eval/episodic_return, eval/success_rate).
#      Encoding the 795 states: 3178 s wall (~7 CPU-minutes), training + 7 evaluations: 807 s wall.
# Machine: 2-core x86_64 CPU shared with ~8 other jobs (load average 15-26): the wall times are not meaningful;
# an idle-machine time was not measured. BC / filtered BC with SmolLM2 were not run.
#   3. The 3-seed benchmark of the README's "offline" block (CQL, BC, filtered BC with frozen SmolLM2 features;
#      all four with DT on the tiny LM): benchmarks/results/offline_gridworld.md and offline_gridworld_tiny.md,
#      tables and per-run seconds there (1 run at a time, OMP_NUM_THREADS=1, the other core busy with a GRPO job).
#   bash benchmarks/cql.sh          # runs under benchmarks/runs/cql (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/runs/cql}
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "$OUT is not empty: move it away first (plot.py would count its old runs in the table)" >&2; exit 1
fi
mkdir -p "$OUT"
timed() { local t0=$SECONDS; "$@"; echo "$((SECONDS - t0)) s: $*" | tee -a "$OUT/wall_clock.txt"; }

# 1. tiny. docs give only "--dataset-quality Q --dataset-episodes 200 (--dataset-epsilon as given)", seed 1,
#    "3000 updates (defaults otherwise)" and "one episode" of evaluation; --eval-episodes 1 is written out because
#    the default is now 4 (the same greedy result on this deterministic layout, 4x the evaluation time).
#    --exp-name only labels the rows of the table.
for mode in cql bc filtered-bc; do
  timed python algorithms/cql.py --model tiny --mode "$mode" --dataset-quality suboptimal --dataset-episodes 200 \
      --dataset-epsilon 0.3 --eval-episodes 1 --exp-name "tiny-suboptimal0.3-$mode" --output-dir "$OUT/tiny"
done
for mode in cql bc; do  # filtered-bc at eps = 0.7: not run in the docs
  timed python algorithms/cql.py --model tiny --mode "$mode" --dataset-quality suboptimal --dataset-episodes 200 \
      --dataset-epsilon 0.7 --eval-episodes 1 --exp-name "tiny-suboptimal0.7-$mode" --output-dir "$OUT/tiny"
done
for mode in cql bc filtered-bc; do
  timed python algorithms/cql.py --model tiny --mode "$mode" --dataset-quality noisy --dataset-episodes 200 \
      --eval-episodes 1 --exp-name "tiny-noisy-$mode" --output-dir "$OUT/tiny"
done

# 2. SmolLM2-135M (the default --model) on a collected dataset.
timed python benchmarks/collect_offline.py --env-id gridworld --quality suboptimal --epsilon 0.4 --episodes 200 \
    --seed 1 --output "$OUT/datasets/gridworld_suboptimal.jsonl"
timed python algorithms/cql.py --mode cql --dataset "$OUT/datasets/gridworld_suboptimal.jsonl" --eval-episodes 1 \
    --exp-name smollm2-suboptimal0.4-cql --output-dir "$OUT/smollm2"

python benchmarks/plot.py "$OUT/tiny" "$OUT/smollm2" --tags eval/episodic_return eval/success_rate \
    diagnostics/q_data diagnostics/action_agreement --x-axes episodes wall --output "$OUT/results"

# 3. The benchmark tables (each rewrites its results file; the runs go under benchmarks/runs/, as published).
timed python benchmarks/offline_gridworld.py --algorithms CQL BC 'filtered BC' --workers 1 \
    --runs-dir benchmarks/runs/offline_smollm2 --output benchmarks/results/offline_gridworld.md
timed python benchmarks/offline_gridworld.py --model tiny --workers 1 \
    '--dt-args=--train-steps 600 --learning-rate 1e-3 --minibatch-size 16 --eval-every 200' \
    --runs-dir benchmarks/runs/offline_tiny --output benchmarks/results/offline_gridworld_tiny.md
