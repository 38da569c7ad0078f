#!/usr/bin/env bash
# The commands behind docs/ppo_gae_agent.md, "Results" (and README's algorithm table).
# Published:
#   1. Memory, SmolLM2-135M, one iteration of 2 GridWorld episodes, OMP_NUM_THREADS=2, peak RSS of the whole process
#      from /usr/bin/time -v (trainable parameters incl. the 577 of the value head / peak RSS):
#        full fine-tune, all 30 layers (--trainable-layers 0)   134,515,585 / 3.30 GiB
#        the same with --gradient-checkpointing                 134,515,585 / 3.19 GiB
#        LoRA r = 16 on all layers                                4,885,057 / 2.30 GiB
#        the same with --gradient-checkpointing                   4,885,057 / 1.59 GiB
#        top 6 layers (the default --trainable-layers 6)         21,241,729 / 1.47 GiB
#        LoRA r = 16 on the top 6 layers                            977,473 / 1.13 GiB
#      (shared machine, load average 5-9: wall times not comparable, not published).
#   2. Learning check on `tiny` (= tests/test_ppo_gae.py::test_ppo_learns_gridworld_on_tiny): success of the 8 sampled
#      episodes (charts/success_rate) per iteration 0.00 0.00 0.12 0.12 0.00 0.38 0.75 0.38 0.38 0.50, i.e. 0.04
#      (iterations 1-3) -> 0.42 (8-10); entropy over the 4 moves 1.36 -> 0.99; explained variance -0.01 to +0.04.
#      74 s CPU time, 14.6 min wall at load ~25 (333 s wall at load ~12 as the test). The variant with
#      --max-episode-steps 12 --update-epochs 2: success 0.00 -> 0.25 (55 s CPU).
#   3. Other environments and modes on `tiny`, one iteration of 2 episodes each: ran to the end (no numbers).
#   4. SmolLM2-135M, 2 iterations of 8 episodes, OMP_NUM_THREADS=2: iteration 1 820 s wall (rollout 523, V_old +
#      pi_ref + bootstrap 150, update 147), sampled success 0.00; iteration 2 292 s (214 / 48 / 30), success 0.50;
#      8 min 45 s CPU time in 18 min 55 s wall (load ~11 falling to ~1). Upper bounds; no idle-machine time.
#   5. SmolLM2-135M learning curve, all defaults, stopped after iteration 10 of 25 (SIGTERM: finishes the iteration,
#      evaluates, saves a checkpoint): sampled success 0.00 -> 0.50-0.62, greedy success 0.00 at iterations 0, 5, 10
#      (benchmarks/results/ppo_gae_agent_gridworld.md, from benchmarks/summarize_run.py RUN --every 16).
#   6. SmolLM2-135M at GRPO's learning rate and batch (--learning-rate 1e-4 --num-episodes 8, 25 iterations): greedy
#      success 1.00 (return 3.50-3.55) at every evaluation from 40 episodes on; 50 s per iteration on average, idle
#      machine (run 2 of benchmarks/results/ppo_gae_agent_gridworld.md).
#   6b. SEEDS="1 2 3": run 6 on seeds 1-3 (current engine): greedy success 1.000 +- 0.000, return 3.533 +- 0.024
#      after 200 episodes (benchmarks/results/ppo_gae_agent_gridworld.md, "Run 2 on seeds 1, 2 and 3").
#   7. BABYAI=1: the same settings on BabyAI GoToRedBall, 24 steps (GLAM's setting; docs/ppo_gae_agent.md "Results"),
#      with both CPU bf16 flags, 25 iterations (200 episodes), alone on the machine: 29.8 min, 62.8 s per iteration;
#      sampled success 0.20 (iterations 1-12) -> 0.28 (13-25), greedy success 0.00 / 0.00 / 0.50 / 0.00 / 0.00 / 0.00
#      at 0 / 40 / 80 / 120 / 160 / 200 episodes (benchmarks/results/ppo_gae_agent_babyai.md). A uniformly
#      forward-biased random policy: 26%. BABYAI_SPEED=1: 2 iterations fp32 vs bf16 side by side (same file).
#      BABYAI_MICROBATCH=1: peak RSS at --micro-batch-size 4 / 2 / 1 (11.84 / 8.44 / 7.00 GB). BABYAI16=1: 16 episodes
#      per iteration, stopped after 10 iterations: sampled success 0.12-0.31, greedy 0.00 / 0.06 / 0.06 (same file).
#   14. BABYAI_SHAPED=1: part 7 for 400 episodes on babyai-gotoredball-shaped (potential-based shaping) and unshaped
#      (the control), seeds 1-3; greedy, and sampled at T = 2, on 50 unseen unshaped episodes (same file).
#   15. PROCEDURAL_SHAPED_ENT_1600=1: part 10's setting trained to 800 and 1,600 episodes, greedy on the held-out test
#      layouts, and sampled at T = 1 after 1,600 (benchmarks/results/grpo_agent_procedural.md).
#   16. PROCEDURAL_SHAPED_ENT_2400=1 (after part 15): its runs continued to 2,400 episodes, tested the same way; both
#      lengths' policies also greedy on 50 unseen train-split layouts (a validation sample).
#   17. PROCEDURAL_SHAPED_ANNEAL=1: part 15's 1,600 episodes with the learning rates decayed linearly to 0
#      (--anneal-lr), tested the same way.
#   18. PROCEDURAL_SHAPED_TOP12=1: part 10's 400 episodes with the top 12 layers trained instead of 6, greedy on the
#      held-out layouts.
#   19. PROCEDURAL_SHAPED_TOP12_1600=1 (after part 18): its runs continued to 800 and 1,600 episodes, tested the same way.
#   20. PROCEDURAL_SHAPED_MASKED=1: part 18 with invalid-action masking (--mask-illegal-actions: only moves no wall or
#      edge blocks), trained and tested so.
#   21. PROCEDURAL_VISITS_MASKED=1: part 20 on the "relative-visits" encoder (the relative text plus how many times
#      the agent has been on its cell and on the cells next to it), trained and tested so.
#   22. PROCEDURAL_MASKED_B16=1: part 20 with 16 layouts per update instead of 8, for as many updates (800 episodes);
#      tested greedy and at T = 1.
#   23. PROCEDURAL_MASKED_B16_1600=1 (after part 22): its runs continued, in a copy, to 1,600 episodes, tested the same
#      way.
#   24. PROCEDURAL_MASKED_FP32=1: part 20 in fp32 (without the two bf16 flags), as a CPU without native bf16 runs it.
#   25. NO_MASK=1 with part 22's and 23's switches: their commands without --mask-illegal-actions (training and tests),
#       in their own directories, the unmasked counterpart (the action space issue 9's target is written for).
# Machine: 2-core x86_64 CPU shared with other jobs (parts 1-5); alone (part 6).
#   bash benchmarks/ppo_gae_agent.sh          # runs under benchmarks/runs/ppo_gae_agent (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/runs/ppo_gae_agent}
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "$OUT is not empty: move it away first (plot.py would count its old runs in the table)" >&2; exit 1
fi
mkdir -p "$OUT/memory"
timed() { local t0=$SECONDS; "$@"; echo "$((SECONDS - t0)) s: $*" | tee -a "$OUT/wall_clock.txt"; }
# Parts 15-17: MODEL at TEMPERATURE (0: greedy) on the unshaped id's 50 held-out test layouts, a row appended to
# DIR/test_NAME.jsonl and the episodes in DIR/test_NAME_episodes_SEED.jsonl; skipped when that episodes file exists.
# Further arguments go to zero_shot.py (part 20: --mask-illegal-actions); TEST_ENV_ID names another encoder's id (part 21).
heldout_test() {  # MODEL DIR NAME SEED TEMPERATURE [FLAGS...]
  [ -f "$2/test_${3}_episodes_$4.jsonl" ] && return 0
  timed python benchmarks/zero_shot.py --model "$1" --env-id "${TEST_ENV_ID:-gridworld-procedural-relative}" --env-kwargs '{"split": "test"}' \
      --temperature "$5" --episodes 50 --output "$2/test_$3.jsonl" --trajectories "$2/test_${3}_episodes_$4.jsonl" "${@:6}"
}
# Parts 17, 18, 20 and 21: the latest run directory of DIR, EXP and SEED (empty if none); the run trained by COMMAND, or
# continued with `--resume` (its saved arguments) when its directory exists (an interrupted run), then summarized
# every EVERY episodes, RUN set to it.
latest_run() {  # DIR EXP SEED
  ls -d "$1/"*"__$2__$3__"* 2>/dev/null | tail -1 || true
}
train_or_resume() {  # DIR EXP SEED EVERY COMMAND...
  RUN=$(latest_run "$1" "$2" "$3")
  if [ -z "$RUN" ]; then timed "${@:5}"; else timed python algorithms/ppo_gae_agent.py --resume "$RUN"; fi
  RUN=$(latest_run "$1" "$2" "$3")
  python benchmarks/summarize_run.py "$RUN" --every "$4"
}
# Parts 4-7b were published with --micro-batch-size 4, the default until session 29 (now 1: part 7e). The update is the
# same at any micro-batch size; the flag keeps their seconds and peak memory reproducible.
MB4=(--micro-batch-size 4)
# --exp-name only labels the rows of the table; each memory run's stdout is kept in a .log next to its
# /usr/bin/time report.

# 1. Memory. The docs give one command with "[--lora-r 16] [--gradient-checkpointing]"; for the last two rows
#    ("the default --trainable-layers 6") docs give only the row text: the same command without --trainable-layers 0.
M=$OUT/memory
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/full.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --trainable-layers 0 --exp-name mem-full --output-dir "$M" | tee "$M/full.log"
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/full_ckpt.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --trainable-layers 0 --gradient-checkpointing --exp-name mem-full-ckpt --output-dir "$M" | tee "$M/full_ckpt.log"
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/lora.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --trainable-layers 0 --lora-r 16 --exp-name mem-lora --output-dir "$M" | tee "$M/lora.log"
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/lora_ckpt.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --trainable-layers 0 --lora-r 16 --gradient-checkpointing --exp-name mem-lora-ckpt --output-dir "$M" | tee "$M/lora_ckpt.log"
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/top6.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --exp-name mem-top6 --output-dir "$M" | tee "$M/top6.log"
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$M/top6_lora.time" python algorithms/ppo_gae_agent.py --total-iterations 1 \
    --num-episodes 2 --max-episode-steps 4 --eval-every 0 --update-epochs 1 --num-minibatches 1 --micro-batch-size 2 \
    --lora-r 16 --exp-name mem-top6-lora --output-dir "$M" | tee "$M/top6_lora.log"
for c in full full_ckpt lora lora_ckpt top6 top6_lora; do
  echo "$c: $(grep -o '[0-9,]* trainable parameters' "$M/$c.log" | head -1), peak RSS" \
       "$(awk '/Maximum resident/ {printf "%.2f GiB", $NF / 1048576}' "$M/$c.time")"
done | tee "$OUT/memory.txt"

# 2. Learning check on tiny, and the variant (docs give only "the same with --max-episode-steps 12 --update-epochs 2")
timed python algorithms/ppo_gae_agent.py --model tiny --seed 1 --total-iterations 10 --num-episodes 8 \
    --update-epochs 1 --num-minibatches 2 --micro-batch-size 4 --learning-rate 1e-3 --value-learning-rate 1e-2 \
    --trainable-layers 0 --beta 0 --temperature 1.0 --eval-every 0 --exp-name tiny-learning-check --output-dir "$OUT"
timed python algorithms/ppo_gae_agent.py --model tiny --seed 1 --total-iterations 10 --num-episodes 8 \
    --update-epochs 2 --num-minibatches 2 --micro-batch-size 4 --learning-rate 1e-3 --value-learning-rate 1e-2 \
    --trainable-layers 0 --beta 0 --temperature 1.0 --eval-every 0 --max-episode-steps 12 \
    --exp-name tiny-learning-check-12steps --output-dir "$OUT"

# 3. docs give only "--model tiny, one iteration of 2 episodes each" plus the flags of each configuration
timed python algorithms/ppo_gae_agent.py --model tiny --total-iterations 1 --num-episodes 2 \
    --env-id workspace --action-mode free --gae-level token --exp-name tiny-workspace --output-dir "$OUT"
timed python algorithms/ppo_gae_agent.py --model tiny --total-iterations 1 --num-episodes 2 \
    --env-id babyai-gotoredball --max-episode-steps 6 --critic separate --exp-name tiny-babyai --output-dir "$OUT"
timed python algorithms/ppo_gae_agent.py --model tiny --total-iterations 1 --num-episodes 2 \
    --action-mode free --trainable-layers 1 --exp-name tiny-free-top1 --output-dir "$OUT"
timed python algorithms/ppo_gae_agent.py --model tiny --total-iterations 1 --num-episodes 2 \
    --action-mode choice --trainable-layers 1 --critic separate --exp-name tiny-choice-separate --output-dir "$OUT"

# 4. SmolLM2-135M, defaults otherwise (top 6 layers, beta = 0.01)
OMP_NUM_THREADS=2 timed python algorithms/ppo_gae_agent.py --total-iterations 2 --num-episodes 8 --eval-every 0 "${MB4[@]}" \
    --exp-name smollm2-2-iterations --output-dir "$OUT"

# 5. SmolLM2-135M, all defaults, checkpointed; the published run was stopped after iteration 10 (kill -TERM), then
#    summarised. `--resume RUN` continues it to iteration 25.
OMP_NUM_THREADS=1 timed python algorithms/ppo_gae_agent.py --checkpoint-every 5 "${MB4[@]}" --exp-name smollm2-defaults --output-dir "$OUT"
python benchmarks/summarize_run.py "$(ls -d "$OUT"/gridworld__smollm2-defaults__* | tail -1)" --every 16

# 6. GRPO's learning rate and batch
timed python algorithms/ppo_gae_agent.py --learning-rate 1e-4 --num-episodes 8 --total-iterations 25 --checkpoint-every 5 \
    "${MB4[@]}" --exp-name lr1e-4 --output-dir "$OUT"
python benchmarks/summarize_run.py "$(ls -d "$OUT"/gridworld__lr1e-4__* | tail -1)" --every 8

if [ -n "${SEEDS:-}" ]; then
  # 6b. Run 2 on several seeds (published: SEEDS="1 2 3", one after the other, alone except where the results file
  #     says otherwise): mean +- std over the seeds, and the greedy-return curve
  #     (in ${OUT}_seeds, beside $OUT: the last plot below would average them with run 6, whose name they share)
  for seed in $SEEDS; do
    timed python algorithms/ppo_gae_agent.py --learning-rate 1e-4 --num-episodes 8 --total-iterations 25 \
        --checkpoint-every 5 --seed "$seed" "${MB4[@]}" --exp-name lr1e-4 --output-dir "${OUT}_seeds"
    python benchmarks/summarize_run.py "$(ls -d "${OUT}_seeds"/gridworld__lr1e-4__"$seed"__* | tail -1)" --every 40
  done
  python benchmarks/plot.py "${OUT}_seeds" --tags eval/success_rate eval/episodic_return charts/success_rate \
      --x-axes episodes --output "${OUT}_seeds/results"
fi

if [ -n "${BABYAI:-}" ]; then
  # 7. GLAM's setting: BabyAI GoToRedBall in choice mode, 24 steps, 8 greedy evaluation episodes on unseen layouts,
  #    a bf16 sampler and bf16 update (docs/ppo_gae_agent.md item 15; this CPU has AMX / AVX512-BF16)
  timed python algorithms/ppo_gae_agent.py --env-id babyai-gotoredball --max-episode-steps 24 --learning-rate 1e-4 \
      --num-episodes 8 --total-iterations 25 --eval-episodes 8 --checkpoint-every 1 --rollout-dtype bfloat16 \
      --update-dtype bfloat16 "${MB4[@]}" --exp-name lr1e-4-bf16 --output-dir "$OUT/babyai"
  python benchmarks/summarize_run.py "$(ls -d "$OUT"/babyai/babyai-gotoredball__lr1e-4-bf16__* | tail -1)" --every 8
fi

if [ -n "${BABYAI_SPEED:-}" ]; then
  # 7b. The same setting for 2 iterations (no evaluation), one configuration after the other: fp32, both bf16 flags,
  #     bf16 with a 1 MiB mmap threshold (common/memory.py), bf16 with malloc_trim(0) every second; peak RSS from
  #     /usr/bin/time -v (published: benchmarks/results/ppo_gae_agent_babyai.md, "fp32 against bf16")
  speed_flags=(--env-id babyai-gotoredball --max-episode-steps 24 --learning-rate 1e-4 --num-episodes 8
               --total-iterations 2 --eval-every 0 "${MB4[@]}" --output-dir "$OUT/babyai_speed")
  bf16=(--rollout-dtype bfloat16 --update-dtype bfloat16)
  trim='import ctypes, runpy, sys, threading, time
libc = ctypes.CDLL(None)
threading.Thread(target=lambda: [libc.malloc_trim(0) or time.sleep(1) for _ in iter(int, 1)], daemon=True).start()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")'
  for config in fp32 bf16 bf16_mmap1m bf16_trim; do
    case $config in
      fp32) cmd=(python algorithms/ppo_gae_agent.py "${speed_flags[@]}") ;;
      bf16) cmd=(python algorithms/ppo_gae_agent.py "${speed_flags[@]}" "${bf16[@]}") ;;
      bf16_mmap1m) cmd=(env MALLOC_MMAP_THRESHOLD_=1048576 python algorithms/ppo_gae_agent.py "${speed_flags[@]}" "${bf16[@]}") ;;
      bf16_trim) cmd=(python -c "$trim" algorithms/ppo_gae_agent.py "${speed_flags[@]}" "${bf16[@]}") ;;
    esac
    OMP_NUM_THREADS=2 /usr/bin/time -v "${cmd[@]}" --exp-name "$config" 2>&1 | tee "$OUT/babyai_speed_$config.log" \
        | grep -E "^iter|Maximum resident"
  done
fi

if [ -n "${BABYAI_MICROBATCH:-}" ]; then
  # 7c. The bf16 setting for 2 iterations at --micro-batch-size 4 / 2 / 1, one after the other (the update is the same;
  #     only its memory and speed change). Published: benchmarks/results/ppo_gae_agent_babyai.md, "Where the memory
  #     goes" (there the peak was read from /proc every second; here from /usr/bin/time -v)
  for mb in 4 2 1; do
    OMP_NUM_THREADS=2 /usr/bin/time -v python algorithms/ppo_gae_agent.py --env-id babyai-gotoredball \
        --max-episode-steps 24 --learning-rate 1e-4 --num-episodes 8 --total-iterations 2 --eval-every 0 \
        --rollout-dtype bfloat16 --update-dtype bfloat16 --micro-batch-size "$mb" --exp-name "mb$mb" \
        --output-dir "$OUT/babyai_microbatch" 2>&1 | tee "$OUT/babyai_microbatch_$mb.log" | grep -E "^iter|Maximum resident"
  done
fi

if [ -n "${BABYAI16:-}" ]; then
  # 7d. Twice the episodes per iteration (16), one episode per forward/backward, 16 greedy evaluation episodes every 5
  #     iterations. Published (stopped after 10 of 20 iterations, 160 episodes): benchmarks/results/ppo_gae_agent_babyai.md
  timed python algorithms/ppo_gae_agent.py --env-id babyai-gotoredball --max-episode-steps 24 --learning-rate 1e-4 \
      --num-episodes 16 --total-iterations 20 --eval-every 5 --eval-episodes 16 --checkpoint-every 1 \
      --rollout-dtype bfloat16 --update-dtype bfloat16 --micro-batch-size 1 --exp-name b16-mb1 --output-dir "$OUT/babyai16"
  python benchmarks/summarize_run.py "$(ls -d "$OUT"/babyai16/babyai-gotoredball__b16-mb1__* | tail -1)" --every 1
fi

if [ -n "${GRIDWORLD_MICROBATCH:-}" ]; then
  # 7e. Why the default is 1: GridWorld, fp32 defaults, 8 episodes x 2 iterations at --micro-batch-size 4 then 1, then
  #     again in the other order. Published (docs/ppo_gae_agent.md, session 29): update 29.8 / 30.4 s at 4 against
  #     28.6 / 29.2 s at 1, peak RSS 3.34 / 3.34 GB against 2.53 / 2.56 GB, identical logged losses.
  for mb in 4 1 1 4; do
    OMP_NUM_THREADS=2 /usr/bin/time -v python algorithms/ppo_gae_agent.py --num-episodes 8 --total-iterations 2 \
        --eval-every 0 --micro-batch-size "$mb" --exp-name "mb$mb" --output-dir "$OUT/gridworld_microbatch" 2>&1 \
        | grep -E "^iter|Maximum resident"
  done
fi

if [ -n "${PROCEDURAL_RELATIVE:-}" ]; then
  # 8. Held-out procedural layouts with the egocentric encoder (issue 9's target; GRPO's attempt is in
  #    benchmarks/grpo_agent.sh). Published (benchmarks/results/grpo_agent_procedural.md; stopped by SIGTERM after
  #    iteration 50 = 400 episodes, then `--resume RUN --total-iterations 50` saved the model): greedy goal rate 16% on
  #    the 50 test layouts (untrained 8%).
  timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative --learning-rate 1e-4 --num-episodes 8 \
      --total-iterations 70 --rollout-dtype bfloat16 --update-dtype bfloat16 --checkpoint-every 5 --save-model \
      --eval-every 10 --exp-name proc_rel --output-dir "$OUT/proc_rel"
  RUN=$(ls -d "$OUT"/proc_rel/gridworld-procedural-relative__proc_rel__1__* | tail -1)
  python benchmarks/summarize_run.py "$RUN" --every 80
  timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
      --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --output "$OUT/proc_rel/greedy.jsonl"
fi

if [ -n "${PROCEDURAL_SHAPED:-}" ]; then
  # 9. Part 8 with potential-based reward shaping (gridworld-procedural-relative-shaped: +0.2 per step along a shortest
  #    path, -0.2 per step away; seed 003 §3.2), 50 iterations = 400 episodes on seeds 1-3, then seed 1 resumed to
  #    100 iterations; every model evaluated greedily on the unshaped id (same goal rate, returns on the usual scale).
  #    Published (benchmarks/results/grpo_agent_procedural.md, "With potential-based reward shaping"): held-out test
  #    goal rate 60% (seed 1, 400 episodes), 58% (seed 1, 800 episodes), 24% (seed 2, collapsed early), 38%
  #    (seed 3); untrained 8%, unshaped part 8 16%.
  for seed in 1 2 3; do
    timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
        --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 --checkpoint-every 5 \
        --save-model --eval-every 10 --seed "$seed" --exp-name proc_rel_shaped --output-dir "$OUT/proc_rel_shaped"
  done
  for seed in 1 2 3 1; do
    RUN=$(ls -d "$OUT"/proc_rel_shaped/gridworld-procedural-relative-shaped__proc_rel_shaped__${seed}__* | tail -1)
    if [ -f "$OUT/proc_rel_shaped/seed$seed.done" ]; then  # the second visit of seed 1: 50 more iterations first
      timed python algorithms/ppo_gae_agent.py --resume "$RUN" --total-iterations 100
    fi
    python benchmarks/summarize_run.py "$RUN" --every 80
    for split in test train; do
      timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
          --env-kwargs "{\"split\": \"$split\"}" --temperature 0 --episodes 50 --output "$OUT/proc_rel_shaped/greedy.jsonl"
    done
    touch "$OUT/proc_rel_shaped/seed$seed.done"
  done
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_shaped/greedy.jsonl"
fi
if [ -n "${PROCEDURAL_SHAPED_ENT:-}" ]; then
  # 10. Part 9 with a 5x entropy bonus (--ent-coef 0.05; seed 2 of part 9 lost most of its entropy early), seeds 2, 3,
  #     1 in that order; every model evaluated greedily and seeds 2 and 1 also sampled at T = 1 on the unshaped id's
  #     test split. Published in benchmarks/results/grpo_agent_procedural.md ("An entropy bonus five times larger").
  for seed in 2 3 1; do
    timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
        --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 --checkpoint-every 5 \
        --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --exp-name proc_rel_shaped_ent05 \
        --output-dir "$OUT/proc_rel_shaped_ent05"
    RUN=$(ls -d "$OUT"/proc_rel_shaped_ent05/gridworld-procedural-relative-shaped__proc_rel_shaped_ent05__${seed}__* | tail -1)
    python benchmarks/summarize_run.py "$RUN" --every 80
    temperatures="0"; [ "$seed" = 3 ] || temperatures="0 1"
    for temperature in $temperatures; do
      timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
          --env-kwargs '{"split": "test"}' --temperature "$temperature" --episodes 50 \
          --output "$OUT/proc_rel_shaped_ent05/test.jsonl"
    done
  done
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_shaped_ent05/test.jsonl"
fi

if [ -n "${PROCEDURAL_SHAPED_ENT_LONG:-}" ]; then
  # 11. Part 10's runs continued to 100 iterations (800 episodes): `--resume` (no learning-rate schedule, so this trains
  #     as one 100-iteration run would), then greedy (T = 0) and sampled (T = 1, session 35) on the unshaped id's test
  #     split. Needs part 10's run directories (PROCEDURAL_SHAPED_ENT=1 PROCEDURAL_SHAPED_ENT_LONG=1 bash ...).
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Twice the training"): greedy 68 / 44 / 64%.
  for seed in 2 1 3; do
    RUN=$(ls -d "$OUT"/proc_rel_shaped_ent05/gridworld-procedural-relative-shaped__proc_rel_shaped_ent05__${seed}__* | tail -1)
    timed python algorithms/ppo_gae_agent.py --resume "$RUN" --total-iterations 100
    timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
        --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --output "$OUT/proc_rel_shaped_ent05/test_100.jsonl" \
        --trajectories "$OUT/proc_rel_shaped_ent05/test_100_episodes_$seed.jsonl"
  done
  for seed in 1 2 3; do
    RUN=$(ls -d "$OUT"/proc_rel_shaped_ent05/gridworld-procedural-relative-shaped__proc_rel_shaped_ent05__${seed}__* | tail -1)
    timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
        --env-kwargs '{"split": "test"}' --temperature 1 --episodes 50 \
        --output "$OUT/proc_rel_shaped_ent05/test_100_t1.jsonl" \
        --trajectories "$OUT/proc_rel_shaped_ent05/test_100_t1_episodes_$seed.jsonl"
  done
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_shaped_ent05/test_100.jsonl"
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_shaped_ent05/test_100_t1.jsonl"
  python benchmarks/gridworld_failures.py "$OUT"/proc_rel_shaped_ent05/test_100_episodes_{2,1,3}.jsonl
fi

if [ -n "${PROCEDURAL_SHAPED_BLOCKED:-}" ]; then
  # 12. Part 9 on gridworld-procedural-relative-shaped-blocked: the same shaping, and a move that a wall or the edge
  #     blocks costs -0.2 more (as much as a step away; part 9's greedy failures were mostly the same blocked move
  #     repeated). 50 iterations, seeds 1, 2, 3 in that order, each evaluated greedily on the unshaped id's test split,
  #     its failures classified by benchmarks/gridworld_failures.py.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("A blocked move charged as much as a step away").
  for seed in 1 2 3; do
    timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped-blocked --learning-rate 1e-4 \
        --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 --checkpoint-every 5 \
        --save-model --eval-every 10 --seed "$seed" --exp-name proc_rel_blocked --output-dir "$OUT/proc_rel_blocked"
    RUN=$(ls -d "$OUT"/proc_rel_blocked/gridworld-procedural-relative-shaped-blocked__proc_rel_blocked__${seed}__* | tail -1)
    python benchmarks/summarize_run.py "$RUN" --every 80
    timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
        --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --output "$OUT/proc_rel_blocked/test.jsonl" \
        --trajectories "$OUT/proc_rel_blocked/test_episodes_$seed.jsonl"
  done
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_blocked/test.jsonl"
  timed python benchmarks/zero_shot.py --model smollm2-135m --env-id gridworld-procedural-relative \
      --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --output "$OUT/proc_rel_blocked/untrained.jsonl" \
      --trajectories "$OUT/proc_rel_blocked/untrained_episodes.jsonl"
  python benchmarks/gridworld_failures.py "$OUT"/proc_rel_blocked/untrained_episodes.jsonl \
      "$OUT"/proc_rel_blocked/test_episodes_{1,2,3}.jsonl
fi

if [ -n "${PROCEDURAL_SHAPED_T1:-}" ]; then
  # 13. Part 9 with training rollouts sampled at T = 1 instead of T = 2 (at T = 2 the trained policy stays near uniform
  #     while greedy falls back to the untrained "up" prior on blocked moves; part 12's classifier). 50 iterations,
  #     seeds 1, 2, 3 in that order, each evaluated greedily on the unshaped id's test split, failures classified. Published in benchmarks/results/grpo_agent_procedural.md ("Training at T = 1").
  for seed in 1 2 3; do
    timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
        --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 --checkpoint-every 5 \
        --save-model --eval-every 10 --seed "$seed" --temperature 1.0 --exp-name proc_rel_t1 --output-dir "$OUT/proc_rel_t1"
    RUN=$(ls -d "$OUT"/proc_rel_t1/gridworld-procedural-relative-shaped__proc_rel_t1__${seed}__* | tail -1)
    python benchmarks/summarize_run.py "$RUN" --every 80
    timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id gridworld-procedural-relative \
        --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --output "$OUT/proc_rel_t1/test.jsonl" \
        --trajectories "$OUT/proc_rel_t1/test_episodes_$seed.jsonl"
  done
  python benchmarks/zero_shot.py --table "$OUT/proc_rel_t1/test.jsonl"
  python benchmarks/gridworld_failures.py "$OUT"/proc_rel_t1/test_episodes_{1,2,3}.jsonl
fi

if [ -n "${BABYAI_SHAPED:-}" ]; then
  # 14. Part 7 (BabyAI GoToRedBall, 24 steps, both bf16 flags) for 50 iterations = 400 episodes, seeds 1-3, on
  #     babyai-gotoredball-shaped (potential-based shaping toward the red ball, envs/external.py, w = 0.1; part 9 is
  #     the GridWorld analogue) and, as the control, on the unshaped id; then each model greedy on 50 episodes of the
  #     unshaped id (environment seeds 0-49, never trained on); babyai_failures.py counts their moves. Published in
  #     benchmarks/results/ppo_gae_agent_babyai.md ("With potential-based shaping").
  for seed in 1 2 3; do
    for env_id in babyai-gotoredball-shaped babyai-gotoredball; do
      name=babyai_unshaped; [ "$env_id" = babyai-gotoredball ] || name=babyai_shaped
      timed python algorithms/ppo_gae_agent.py --env-id "$env_id" --max-episode-steps 24 --learning-rate 1e-4 \
          --num-episodes 8 --total-iterations 50 --eval-episodes 8 --checkpoint-every 5 --rollout-dtype bfloat16 \
          --update-dtype bfloat16 --save-model --seed "$seed" --exp-name "$name" --output-dir "$OUT/$name"
      RUN=$(ls -d "$OUT/$name/${env_id}__${name}__${seed}__"* | tail -1)
      python benchmarks/summarize_run.py "$RUN" --every 40
      timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id babyai-gotoredball \
          --env-kwargs '{"max_steps": 24}' --temperature 0 --episodes 50 --output "$OUT/babyai_shaped_test.jsonl" \
          --trajectories "$OUT/$name/test_episodes_$seed.jsonl"
      # the same episodes sampled at the training temperature, as GLAM tests (session 39; seeds 2 and 3 only)
      timed python benchmarks/zero_shot.py --model "$RUN/model" --env-id babyai-gotoredball \
          --env-kwargs '{"max_steps": 24}' --temperature 2 --episodes 50 --output "$OUT/babyai_sampled_test.jsonl" \
          --trajectories "$OUT/$name/test_episodes_T2_$seed.jsonl"
    done
  done
  python benchmarks/zero_shot.py --table "$OUT/babyai_shaped_test.jsonl"
  python benchmarks/zero_shot.py --table "$OUT/babyai_sampled_test.jsonl"
  python benchmarks/babyai_failures.py "$OUT"/babyai_{shaped,unshaped}/test_episodes_[0-9]*.jsonl
  python benchmarks/babyai_failures.py "$OUT"/babyai_{shaped,unshaped}/test_episodes_T2_*.jsonl
fi

if [ -n "${PROCEDURAL_SHAPED_ENT_1600:-}" ]; then
  # 15. Part 10's setting (--ent-coef 0.05) trained to 200 iterations = 1,600 episodes, in one run directory per seed:
  #     100 iterations, greedy on the unshaped id's 50 held-out test layouts (as part 11), then `--resume` to 200 and
  #     the same test. Seeds 2 and 3 were still improving at 800 episodes (part 11). A step whose test file exists is
  #     skipped, and an interrupted training (SIGTERM: checkpoint after the iteration) continues with `--resume`, so
  #     the loop body, run again with the same DIR, picks up where it stopped (session 39 ran it from a copy in
  #     benchmarks/runs/). Published in benchmarks/results/grpo_agent_procedural.md ("1,600 episodes").
  for seed in ${SEEDS_1600:-2 3 1}; do
    DIR="$OUT/proc_rel_ent05_1600"
    RUN=$(ls -d "$DIR"/gridworld-procedural-relative-shaped__proc_rel_ent05_1600__${seed}__* 2>/dev/null | tail -1 || true)
    for total in 100 200; do
      [ -f "$DIR/test_${total}_episodes_$seed.jsonl" ] && continue
      if [ -z "$RUN" ]; then
        timed python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
            --num-episodes 8 --total-iterations "$total" --rollout-dtype bfloat16 --update-dtype bfloat16 \
            --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 \
            --exp-name proc_rel_ent05_1600 --output-dir "$DIR"
        RUN=$(ls -d "$DIR"/gridworld-procedural-relative-shaped__proc_rel_ent05_1600__${seed}__* | tail -1)
      else
        timed python algorithms/ppo_gae_agent.py --resume "$RUN" --total-iterations "$total"
      fi
      python benchmarks/summarize_run.py "$RUN" --every 160
      heldout_test "$RUN/model" "$DIR" "$total" "$seed" 0
    done
    heldout_test "$RUN/model" "$DIR" 200_t1 "$seed" 1  # sampled at T = 1, as part 11 (session 39: seed 2)
  done
  for total in 100 200; do
    if [ -f "$DIR/test_$total.jsonl" ]; then python benchmarks/zero_shot.py --table "$DIR/test_$total.jsonl"; fi
  done
fi
if [ -n "${PROCEDURAL_SHAPED_ENT_2400:-}" ]; then
  # 16. Part 15's run directories continued to 300 iterations = 2,400 episodes (`--resume`, seeds in SEEDS_2400,
  #     default 2: the one that reached 86% at 1,600), then the same greedy and T = 1 tests. Needs part 15's DIR.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("2,400 episodes, seed 2").
  DIR="$OUT/proc_rel_ent05_1600"
  for seed in ${SEEDS_2400:-2}; do
    RUN=$(ls -d "$DIR"/gridworld-procedural-relative-shaped__proc_rel_ent05_1600__${seed}__* | tail -1)
    if [ ! -f "$DIR/test_300_episodes_$seed.jsonl" ]; then  # a step whose test file exists is skipped, as in part 15
      [ -d "$DIR/model_200_seed$seed" ] || cp -r "$RUN/model" "$DIR/model_200_seed$seed"  # the 1,600-episode policy
      timed python algorithms/ppo_gae_agent.py --resume "$RUN" --total-iterations 300
      python benchmarks/summarize_run.py "$RUN" --every 160
    fi
    heldout_test "$RUN/model" "$DIR" 300 "$seed" 0
    heldout_test "$RUN/model" "$DIR" 300_t1 "$seed" 1
    # both policies, 1,600 and 2,400 episodes, greedy on 50 *train-split* layouts never trained on (environment
    # seeds 0-49): a second sample of layouts, to tell a decline from the test set's noise (session 41)
    if [ ! -f "$DIR/validation_$seed.jsonl" ]; then  # rows collected in a .part file, renamed when both are in
      rm -f "$DIR/validation_$seed.jsonl.part"
      for m in "$DIR/model_200_seed$seed" "$RUN/model"; do
        timed python benchmarks/zero_shot.py --model "$m" --env-id gridworld-procedural-relative \
            --env-kwargs '{"split": "train"}' --temperature 0 --episodes 50 --output "$DIR/validation_$seed.jsonl.part"
      done
      mv "$DIR/validation_$seed.jsonl.part" "$DIR/validation_$seed.jsonl"
    fi
  done
fi
if [ -n "${PROCEDURAL_SHAPED_ANNEAL:-}" ]; then
  # 17. Part 15's command to 200 iterations in one go with --anneal-lr: both learning rates fall linearly from their
  #     value at iteration 1 to 0 at iteration 200 (part 16: held-out success fell after 1,600 episodes while the
  #     train layouts kept improving). Then part 15's greedy and T = 1 tests. A seed whose test file exists is skipped;
  #     an interrupted run continues with `--resume` (the schedule is kept: --total-iterations stays 200).
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Learning rates annealed to 0").
  DIR="$OUT/proc_rel_ent05_anneal"
  for seed in ${SEEDS_ANNEAL:-1 3 2}; do
    RUN=$(latest_run "$DIR" proc_rel_ent05_anneal "$seed")
    if [ ! -f "$DIR/test_200_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" proc_rel_ent05_anneal "$seed" 160 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
                --num-episodes 8 --total-iterations 200 --rollout-dtype bfloat16 --update-dtype bfloat16 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --anneal-lr \
                --exp-name proc_rel_ent05_anneal --output-dir "$DIR"
    fi
    heldout_test "$RUN/model" "$DIR" 200 "$seed" 0
    heldout_test "$RUN/model" "$DIR" 200_t1 "$seed" 1
  done
fi
if [ -n "${PROCEDURAL_SHAPED_TOP12:-}" ]; then
  # 18. Part 10's command (400 episodes, --ent-coef 0.05) with --trainable-layers 12: every greedy failure so far
  #     repeats a move the observation lists as blocked (47% of seed 1's greedy moves in part 17), a rule that reads
  #     one line of the text; twice the trained depth tests whether the top 6 layers are too few to learn it. Seeds
  #     in SEEDS_TOP12 (default 1 2 3); a seed whose test file exists is skipped, an interrupted run is resumed.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Twelve trained layers").
  DIR="$OUT/proc_rel_ent05_top12"
  for seed in ${SEEDS_TOP12:-1 2 3}; do
    RUN=$(latest_run "$DIR" proc_rel_ent05_top12 "$seed")
    if [ ! -f "$DIR/test_50_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" proc_rel_ent05_top12 "$seed" 80 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
                --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --trainable-layers 12 \
                --exp-name proc_rel_ent05_top12 --output-dir "$DIR"
    fi
    heldout_test "$RUN/model" "$DIR" 50 "$seed" 0
  done
fi
if [ -n "${PROCEDURAL_SHAPED_TOP12_1600:-}" ]; then
  # 19. Part 18's run directories (12 trained layers, 400 episodes) continued with `--resume` to 100 and then 200
  #     iterations = 800 and 1,600 episodes, part 15's length, with part 15's greedy tests at each and the T = 1 test
  #     at 1,600. Needs part 18's DIR; seeds in SEEDS_TOP12_1600 (default 1 2 3). A step whose test file exists is
  #     skipped; an interrupted run continues (the loop body, run again, picks up where it stopped).
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Twelve trained layers, longer").
  DIR="$OUT/proc_rel_ent05_top12"
  for seed in ${SEEDS_TOP12_1600:-1 2 3}; do
    RUN=$(ls -d "$DIR"/gridworld-procedural-relative-shaped__proc_rel_ent05_top12__${seed}__* | tail -1)
    for total in 100 200; do
      [ -f "$DIR/test_${total}_episodes_$seed.jsonl" ] && continue
      timed python algorithms/ppo_gae_agent.py --resume "$RUN" --total-iterations "$total"
      python benchmarks/summarize_run.py "$RUN" --every 160
      heldout_test "$RUN/model" "$DIR" "$total" "$seed" 0
    done
    heldout_test "$RUN/model" "$DIR" 200_t1 "$seed" 1
  done
fi
if [ -n "${PROCEDURAL_SHAPED_MASKED:-}" ]; then
  # 20. Part 18's command with invalid-action masking (Huang & Ontañón 2022): the policy samples, and is trained,
  #     only over the moves no wall or edge blocks (the ones the observation does not list as blocked), and is tested
  #     so. Repeating a blocked move was the largest greedy failure class (parts 10-18), here removed by construction:
  #     a different action space, published as its own row, not as the unmasked target. Seeds in SEEDS_MASKED
  #     (default 1 2 3); a seed whose test file exists is skipped, an interrupted run is resumed.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Invalid-action masking").
  DIR="$OUT/proc_rel_ent05_top12_masked"
  for seed in ${SEEDS_MASKED:-1 2 3}; do
    RUN=$(latest_run "$DIR" proc_rel_ent05_top12_masked "$seed")
    if [ ! -f "$DIR/test_50_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" proc_rel_ent05_top12_masked "$seed" 80 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
                --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --trainable-layers 12 \
                --mask-illegal-actions --exp-name proc_rel_ent05_top12_masked --output-dir "$DIR"
    fi
    heldout_test "$RUN/model" "$DIR" 50 "$seed" 0 --mask-illegal-actions
  done
fi
if [ -n "${PROCEDURAL_VISITS_MASKED:-}" ]; then
  # 21. Part 20 (masked, 12 trained layers, 400 episodes) on the "relative-visits" encoder: the same text plus "Visits:
  #     here 3, up 1, left 2." (steps spent on this cell and on the cells the unblocked moves lead to). Under the mask,
  #     every greedy failure left in part 20 is a loop between two cells, where the current text repeats but for the
  #     step counter (the earlier turns are in the context, but only comparing them shows the loop); the counts put
  #     the loop into the current text. Trained and tested masked on the visits ids;
  #     layouts, dynamics and rewards are part 20's. Seeds in SEEDS_VISITS (default 1 2 3); a seed whose test file
  #     exists is skipped, an interrupted run is resumed.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Visit counts").
  DIR="$OUT/proc_rel_visits_ent05_top12_masked"
  for seed in ${SEEDS_VISITS:-1 2 3}; do
    RUN=$(latest_run "$DIR" proc_rel_visits_ent05_top12_masked "$seed")
    if [ ! -f "$DIR/test_50_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" proc_rel_visits_ent05_top12_masked "$seed" 80 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-visits-shaped --learning-rate 1e-4 \
                --num-episodes 8 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --trainable-layers 12 \
                --mask-illegal-actions --exp-name proc_rel_visits_ent05_top12_masked --output-dir "$DIR"
    fi
    TEST_ENV_ID=gridworld-procedural-relative-visits heldout_test "$RUN/model" "$DIR" 50 "$seed" 0 --mask-illegal-actions
  done
fi

# Part 25: NO_MASK=1 runs parts 22 and 23 without --mask-illegal-actions, in training and in every test, under
# proc_rel_ent05_top12_b16{,_1600} (the experiment name is the directory's).
if [ -n "${NO_MASK:-}" ]; then MASK=(); B16=proc_rel_ent05_top12_b16; else
  MASK=(--mask-illegal-actions); B16=proc_rel_ent05_top12_masked_b16; fi
if [ -n "${PROCEDURAL_MASKED_B16:-}" ]; then
  # 22. Part 20 (masked, 12 trained layers, 50 iterations) with 16 episodes per iteration instead of 8: every update
  #     sees twice as many layouts, for as many updates, so 800 episodes. Part 20's seed 2, continued to 800 episodes
  #     of 8, fell from 84% to 68% held out: a noisier gradient than the policy can stand at lr 1e-4 is one reading,
  #     and a batch twice as large halves the variance of the gradient estimate. Seeds in SEEDS_MASKED_B16 (default
  #     1 2 3); a seed whose test file exists is skipped, an interrupted run is resumed.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Sixteen layouts per update").
  DIR="$OUT/$B16"
  for seed in ${SEEDS_MASKED_B16:-1 2 3}; do
    RUN=$(latest_run "$DIR" "$B16" "$seed")
    if [ ! -f "$DIR/test_50_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" "$B16" "$seed" 160 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
                --num-episodes 16 --total-iterations 50 --rollout-dtype bfloat16 --update-dtype bfloat16 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --trainable-layers 12 \
                "${MASK[@]}" --exp-name "$B16" --output-dir "$DIR"
    fi
    heldout_test "$RUN/model" "$DIR" 50 "$seed" 0 "${MASK[@]}"
    heldout_test "$RUN/model" "$DIR" 50_t1 "$seed" 1 "${MASK[@]}"  # sampled at T = 1, as parts 15-19
    # 50 other held-out layouts (environment seeds 100000-100049: none of the first 50's layouts), greedy and at T = 1
    heldout_test "$RUN/model" "$DIR" 50_more "$seed" 0 "${MASK[@]}" --seed 1
    heldout_test "$RUN/model" "$DIR" 50_more_t1 "$seed" 1 "${MASK[@]}" --seed 1
  done
fi

if [ -n "${PROCEDURAL_MASKED_B16_1600:-}" ]; then
  # 23. Part 22's runs continued with `--resume` to 100 iterations of 16 = 1,600 episodes, each in a copy of its run
  #     directory (args, checkpoint at 50, events) so part 22's model stays as published. Does the larger batch keep
  #     improving where part 20's batches of 8 fell (84% to 68% on seed 2 from 400 to 800 episodes)? Needs part 22's
  #     DIR; seeds in SEEDS_MASKED_B16_1600 (default 1 2 3); a seed whose test file exists is skipped, an interrupted
  #     run continues from its last checkpoint (the copy is made once).
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Sixteen layouts per update, longer").
  SRC="$OUT/$B16"
  DIR="$OUT/${B16}_1600"
  mkdir -p "$DIR"
  for seed in ${SEEDS_MASKED_B16_1600:-1 2 3}; do
    RUN=$(latest_run "$SRC" "$B16" "$seed")
    [ -n "$RUN" ] || { echo "part 23 needs part 22's run of seed $seed in $SRC (${NO_MASK:+NO_MASK=1 }PROCEDURAL_MASKED_B16=1)" >&2; exit 1; }
    NEW="$DIR/$(basename "$RUN")"
    [ -d "$NEW" ] || { rm -rf "$NEW.copy"; mkdir -p "$NEW.copy"  # renamed when whole: an interrupted copy is redone
                       cp "$RUN"/{args.json,checkpoint.json,checkpoint-000050.pt} "$RUN"/events.* "$NEW.copy/"
                       mv "$NEW.copy" "$NEW"; }
    if [ ! -f "$DIR/test_100_episodes_$seed.jsonl" ]; then
      timed python algorithms/ppo_gae_agent.py --resume "$NEW" --total-iterations 100 --output-dir "$DIR"
      python benchmarks/summarize_run.py "$NEW" --every 160
    fi
    heldout_test "$NEW/model" "$DIR" 100 "$seed" 0 "${MASK[@]}"
    heldout_test "$NEW/model" "$DIR" 100_more "$seed" 0 "${MASK[@]}" --seed 1
    heldout_test "$NEW/model" "$DIR" 100_t1 "$seed" 1 "${MASK[@]}"
    heldout_test "$NEW/model" "$DIR" 100_more_t1 "$seed" 1 "${MASK[@]}" --seed 1
  done
fi

if [ -n "${PROCEDURAL_MASKED_FP32:-}" ]; then
  # 24. Part 20's command without --rollout-dtype/--update-dtype bfloat16: sampler and update in fp32. On a CPU without
  #     native bf16 matmuls (no AVX512/AMX; e.g. an AVX2-only AMD EPYC) the bf16 flags are emulated and a decode step is
  #     25-28x slower (benchmarks/results/decode_step_avx2.md), so fp32 is how such a machine runs the recipe: does it
  #     give part 20's held-out rate? Seeds in SEEDS_MASKED_FP32 (default 1); tested greedy, as part 20.
  #     Published in benchmarks/results/grpo_agent_procedural.md ("Part 20 in fp32").
  DIR="$OUT/proc_rel_ent05_top12_masked_fp32"
  for seed in ${SEEDS_MASKED_FP32:-1}; do
    RUN=$(latest_run "$DIR" proc_rel_ent05_top12_masked_fp32 "$seed")
    if [ ! -f "$DIR/test_50_episodes_$seed.jsonl" ]; then
      train_or_resume "$DIR" proc_rel_ent05_top12_masked_fp32 "$seed" 80 \
          python algorithms/ppo_gae_agent.py --env-id gridworld-procedural-relative-shaped --learning-rate 1e-4 \
                --num-episodes 8 --total-iterations 50 \
                --checkpoint-every 5 --save-model --eval-every 10 --seed "$seed" --ent-coef 0.05 --trainable-layers 12 \
                --mask-illegal-actions --exp-name proc_rel_ent05_top12_masked_fp32 --output-dir "$DIR"
    fi
    heldout_test "$RUN/model" "$DIR" 50 "$seed" 0 --mask-illegal-actions
  done
fi

python benchmarks/plot.py "$OUT" --tags charts/success_rate charts/episodic_return losses/entropy \
    diagnostics/explained_variance perf/rollout_s perf/update_s --x-axes episodes wall --output "$OUT/results"
