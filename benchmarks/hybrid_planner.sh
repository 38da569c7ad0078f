#!/usr/bin/env bash
# The command behind docs/hybrid_planner.md, "Results", README's seed-003 three-way table and
# benchmarks/results/hybrid_three_way.md (+ hybrid_three_way_curves.png): seed-003 GridWorld layout, seeds 1-3,
# 800 training episodes each, greedy evaluation over 50 episodes, SmolLM2-135M planner.
# Published (resources / steps / goal rate / return, mean ± std over seeds):
#   pure LLM, SmolLM2 every step (T = 0 / T = 1)   0.00 / 0.18   20.0 / 19.5   0% / 8%       -1.00 / -0.56
#   pure RL (controller alone)                     2.00 ± 0.00   11.0 ± 0.0    100%          4.45 ± 0.00
#   hybrid (SmolLM2 planner)                       2.00 ± 0.00   11.0 ± 0.0    100%          4.45 ± 0.00  (1.00 planner calls / episode)
#   hybrid (oracle planner)                        2.00 ± 0.00   16.7 ± 4.0    67% ± 47      3.17 ± 1.54  (1.67 planner calls / episode)
#   seed 1 training run: 65 LLM forwards for 1821 plans (the rest from the plan cache).
# Machine: 2-core x86_64 CPU, torch 2.13.0+cpu, shared with other jobs (load average 5-26): 3262 s for the
# whole benchmark.
# hybrid_three_way.py runs algorithms/hybrid_planner.py --planner none|oracle|llm through benchmarks/run.py
# (resumable: rerunning skips finished runs) under benchmarks/runs/hybrid, and itself writes the table and curves.
#   bash benchmarks/hybrid_planner.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python benchmarks/hybrid_three_way.py

# BabyAI GoToLocal, minigrid's BabyAIBot as the oracle planner (benchmarks/results/hybrid_three_way_babyai.md):
# one seed, 400 episodes; 1334 s for the SmolLM2 hybrid on the 2-core CPU.
python benchmarks/hybrid_three_way.py --env-id babyai-gotolocal --seeds 1 --total-episodes 400 \
    "--extra-args=--learning-rate 3e-4 --max-subgoals 1 --eval-every 0" --runs-dir benchmarks/runs/hybrid_babyai \
    --output benchmarks/results/hybrid_three_way_babyai --no-pure-llm
