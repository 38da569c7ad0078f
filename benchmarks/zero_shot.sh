#!/usr/bin/env bash
# The commands behind benchmarks/results/zero_shot_families.md: smollm2-135m zero-shot (no training),
# 50 episodes per environment family (workspace: 10 per level, 50 over its five levels), sampled at
# temperature 1. Grid-like environments are played in `choice` mode (a distribution over the action names),
# text environments in `free` mode (generated text).
# Each line appends one JSON result to the .jsonl; `zero_shot.py --table` renders the markdown table.
# Then the same choice-mode environments under a uniformly random policy (benchmarks/results/zero_shot_random.md).
#   bash benchmarks/zero_shot.sh            # about an hour on 2 idle CPU cores (not timed end to end)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/zero_shot_families.jsonl}
run() { python benchmarks/zero_shot.py --model smollm2-135m --batch-size 25 --output "$OUT" "$@"; }
: > "$OUT"
run --episodes 50 --env-id gridworld --action-mode choice
# step caps (optimal: FrozenLake 6, CliffWalking 13, Taxi <= 20 steps; BabyAI GoToRedBall a few) keep contexts short
run --episodes 50 --env-id frozenlake --action-mode choice --env-kwargs '{"max_steps": 20}'
run --episodes 50 --env-id taxi --action-mode choice --env-kwargs '{"max_steps": 30}'
run --episodes 50 --env-id cliffwalking --action-mode choice --env-kwargs '{"max_steps": 30}'
run --episodes 50 --env-id babyai-gotoredball --action-mode choice --env-kwargs '{"max_steps": 24}'
run --episodes 50 --env-id arithmetic --action-mode free --max-turn-tokens 64
run --episodes 50 --env-id wordproblems --action-mode free --max-turn-tokens 96
run --episodes 50 --env-id codegen --action-mode free --max-turn-tokens 192
run --episodes 50 --env-id codegen-humaneval --action-mode free --max-turn-tokens 256
for level in 1 2 3 4 5; do
  run --episodes 10 --env-id workspace --action-mode free --max-turn-tokens 96 --env-kwargs "{\"level\": $level}"
done
if python -c "import textworld" 2>/dev/null; then  # optional: pip install -r requirements-textworld.txt
  run --episodes 50 --env-id textworld --action-mode free --max-turn-tokens 16
fi
python benchmarks/zero_shot.py --table "$OUT" > benchmarks/results/zero_shot_families.md

# The uniform-random reference for the environments with action names (no LM; ~3 min in all): how often plain
# exploration reaches a goal, and an episode within 10% of the optimal return (issue 9's learning target).
# (Not $RANDOM: that is bash's own random-number variable.)
RANDOM_JSONL=${RANDOM_OUT:-benchmarks/results/zero_shot_random.jsonl}
random_policy() { python benchmarks/zero_shot.py --model random --output "$RANDOM_JSONL" "$@"; }
: > "$RANDOM_JSONL"
random_policy --episodes 20000 --env-id gridworld
random_policy --episodes 2000 --env-id frozenlake --env-kwargs '{"max_steps": 20}'
random_policy --episodes 2000 --env-id taxi --env-kwargs '{"max_steps": 30}'
random_policy --episodes 2000 --env-id cliffwalking --env-kwargs '{"max_steps": 30}'
random_policy --episodes 2000 --env-id babyai-gotoredball --env-kwargs '{"max_steps": 24}'
python benchmarks/zero_shot.py --table "$RANDOM_JSONL" > benchmarks/results/zero_shot_random.md
