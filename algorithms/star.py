# docs: docs/star.md
"""STaR: Self-Taught Reasoner (Zelikman et al. 2022; seed 000, "STaR", eq. 12.5).

Each outer iteration k: (1) for every problem x_i of a fixed training set D, sample a rationale z_i and
an answer y_hat_i from the current model with a few-shot scratchpad prompt; (2) keep those with
y_hat_i = y*_i (D_pass); (3) for the failures, *rationalise*: sample z_i^rat ~ pi(.|x_i, y*_i) with the
correct answer given as a hint, keep it if it reaches y*_i, and store it *without* the hint in the
prompt (D_rationalized); (4) fine-tune on D_pass u D_rationalized by SFT, eq. 12.5:
theta_{k+1} = argmin -sum log pi(z, y | x), starting again from the base model (as the paper does);
(5) repeat. The solve rate on D (sampled) and on held-out test-split problems (greedy) is logged per
outer iteration: seed 000's p_0 -> p_1 -> ... curve.

Usage:
    python algorithms/star.py                                          # smollm2-135m, 1-2 digit addition, CPU (see docs)
    python algorithms/star.py --model tiny --outer-iterations 2 --num-problems 4 --eval-problems 2  # seconds
    python algorithms/star.py --env-id wordproblems --env-level 1      # templated word problems
    python algorithms/star.py --no-restart-from-base                   # continue training M_k instead
    python algorithms/star.py --device cuda --num-problems 512 --eval-problems 256 --outer-iterations 5
    python algorithms/star.py --checkpoint-every 1                    # then, after a crash or Ctrl-C:
    python algorithms/star.py --resume runs/<run> --outer-iterations 5  # continue (and extend) that run
    torchrun --nproc_per_node 2 algorithms/star.py --model tiny --outer-iterations 2 --num-problems 4 --eval-problems 2
    torchrun --nproc_per_node 8 algorithms/star.py --fsdp --model <path>   # layers sharded over the ranks (FSDP2)

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id whose environment has `problem`, `answer`,
`reference_solution`, `hint_prompt(answer)` and ends a correct episode with termination `success`).

Where this departs from the paper / seed:
- The few-shot prompt is built from the environment's own reference solutions (`--num-shots`
  exemplars, from train-split seeds no training problem uses), written as earlier user/assistant chat
  turns; the rationalisation prompt's exemplars carry their hint as well (the paper marks the correct answer
  in its rationalisation exemplars). Training examples keep the plain prompt (no hint anywhere), so training
  and evaluation see the same prompt.
- Rationalisations that repeat the hint ("the correct answer is ...") are dropped (`--filter-hint-leaks`),
  and so are rationales cut by `--max-new-tokens` (`--require-eos`): both would teach the wrong thing.
- SFT runs a fixed number of steps per outer iteration, growing by `--sft-steps-growth` (the paper: 40
  steps, +20% per iteration), on the top `--trainable-layers` layers; the paper trains the whole model.
- The training set is a few dozen generated problems, not a dataset of thousands.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist

import envs
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, all_reduce_sum, clip_grad_norm, dist_info, finish_distributed, full_tensors,
                                gathered, global_loss_denominator, init_distributed, is_sharded, print0,
                                rank_param_divergence, seed_everything, shard_layers)
from common.models import load_model, resolve_device, save_model, train_top_layers
from common.records import Trajectory
from common.rollout import RolloutConfig, RolloutEngine, policy_logprobs
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, sampling, which problems form the training set)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the final model (Hugging Face format) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "arithmetic"
    """single-answer task family (`arithmetic`, `wordproblems`) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (fine-tuned weights, RNG states, counters) every N outer iterations and at the end; 0: never.
    Ctrl-C (or SIGTERM) always finishes the outer iteration and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    env_level: int = 1
    """difficulty passed to the environment as `level=` (arithmetic 1: 1-2 digit operands; 0: the env's default)"""
    outer_iterations: int = 3
    """STaR outer iterations (generate, filter, rationalise, fine-tune)"""
    num_problems: int = 48
    """size of the training set D (train-split problems, the same every outer iteration)"""
    eval_problems: int = 32
    """held-out (test-split) problems for the greedy solve rate, before training and after each iteration"""
    num_shots: int = 4
    """few-shot exemplars (the env's reference solutions) in the system prompt; 0 keeps the env's own prompt"""
    rationalize: bool = True
    """rationalise failures with the correct answer as a hint (off: STaR without rationalisation)"""
    restart_from_base: bool = True
    """fine-tune from the base model every outer iteration (the paper); off: continue from the last model"""
    filter_hint_leaks: bool = True
    """drop rationalisations whose text repeats the hint ("The correct answer is ...")"""
    require_eos: bool = True
    """keep only rationales that ended by themselves (EOS) within --max-new-tokens"""
    temperature: float = 0.5
    """sampling temperature for rationales (direct and rationalisation); evaluation is greedy"""
    top_p: float = 1.0
    """nucleus sampling for rationales"""
    max_new_tokens: int = 96
    """cap on a rationale's tokens (a 2-digit scratchpad with its answer line is about 50 SmolLM2 tokens)"""
    sft_steps: int = 12
    """SFT steps in the first outer iteration"""
    sft_steps_growth: float = 1.2
    """multiply the SFT step count by this each outer iteration (the paper: +20%)"""
    sft_batch_size: int = 8
    """examples per SFT step (sampled without replacement, reshuffled each pass over the kept set)"""
    micro_batch_size: int = 4
    """examples per forward/backward (gradient accumulation; memory only, the update is the same)"""
    learning_rate: float = 1e-4
    """AdamW learning rate of the SFT (a fresh optimizer every outer iteration)"""
    trainable_layers: int = 6
    """fine-tune only the top N transformer layers and the final norm (0, or at least the layer count: all)"""
    lora_r: int = 0
    """LoRA rank (peft) on the fine-tuned layers' projections, base frozen; 0: fine-tune the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    fsdp: bool = False
    """torchrun: shard the decoder layers' weights, gradients and AdamW state over the ranks (PyTorch FSDP2); the
    weights are gathered whole for sampling (as in grpo_agent.py)"""


# the flags --resume lets differ from the saved run
RESUMABLE = {"outer_iterations", "checkpoint_every", "save_model", "resume", "output_dir"}
# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes. The test
# environment passes a reply with probability ~1/2, so a random model has examples to keep and train on.
SMOKE_TEST_ARGS = ["--env-id", "tests.test_star:CoinFlipArithmetic", "--outer-iterations", "2", "--num-problems", "6",
                   "--eval-problems", "2", "--num-shots", "1", "--max-new-tokens", "4", "--sft-steps", "2",
                   "--sft-batch-size", "4", "--no-require-eos"]
LOGGED_TAGS = ("charts/success_rate", "charts/episodic_return", "charts/invalid_action_rate", "charts/episode_length",
               "charts/kept_direct", "charts/kept_rationalized", "charts/rationalization_rate", "charts/train_set_size",
               "losses/sft_loss", "losses/sft_loss_last", "diagnostics/hint_leaks_dropped",
               "diagnostics/cut_rationales_dropped", "perf/generate_s", "perf/rationalize_s", "perf/sft_s",
               "perf/eval_s", "perf/rollout_tokens_per_s", "eval/success_rate", "eval/invalid_action_rate")


def validate_args(args: Args):
    problems = []
    for name in ("outer_iterations", "num_problems", "max_new_tokens", "sft_batch_size", "micro_batch_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("eval_problems", "num_shots", "sft_steps", "trainable_layers", "env_level", "checkpoint_every", "lora_r"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.sft_steps_growth <= 0:
        problems.append("--sft-steps-growth must be > 0")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        problems.append("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.learning_rate <= 0:
        problems.append("--learning-rate must be > 0")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if problems:
        raise SystemExit("star.py: " + "; ".join(problems))


def make_env(args: Args, split: str = "train"):
    kwargs = {"split": split, **({"level": args.env_level} if args.env_level else {})}
    return envs.make(args.env_id, **kwargs)


EXEMPLAR_SEED = 1 << 45  # few-shot exemplars come from seeds far away from every problem seed used below


def few_shot_prompt(env, num_shots: int, chat, hint: bool = False) -> tuple[str, str]:
    """The rationale generator's few-shot prompt (STaR, sec. 3.1) as (system message, turns to prepend).

    The system message is the env's instructions and answer format; each exemplar is a past user turn (a
    problem's observation) and assistant turn (the env's reference rationale), written with the chat
    template's own separators (they encode to the template's special tokens, as `ChatFormat.next_turn_ids`
    does), so a chat model sees worked answers in the place where its answer goes. With `hint=True` each
    exemplar question carries the hint too, as the paper's rationalisation prompt marks the correct answer
    in its exemplars: the model sees how a hint is used."""
    head = env.system_prompt.split("\nExample:")[0]  # the env's instructions, without its one worked example
    turns = ""
    for i in range(num_shots):
        obs, _ = env.reset(seed=EXEMPLAR_SEED + i)
        obs = f"{obs}\n{env.hint_prompt(env.answer)}" if hint else obs
        turns += f"{obs}{chat.after_user}{env.reference_solution}{chat.after_action}"
    return head, turns


class PromptedEnv:
    """Wraps an env: its system prompt becomes `system_prompt`, the first observation is preceded by the
    few-shot turns `shots`, and with `hint=True` followed by the rationalisation hint `env.hint_prompt(env.answer)`
    (the y* of eq. 12.5's z^rat ~ pi(.|x, y*)). Everything else (step, verifier, info) is the wrapped env's."""

    def __init__(self, env, system_prompt: str, shots: str = "", hint: bool = False):
        self.env, self.system_prompt, self.shots, self.hint = env, system_prompt, shots, hint

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        return self.shots + (f"{obs}\n{self.env.hint_prompt(self.env.answer)}" if self.hint else obs), info

    def step(self, action):
        return self.env.step(action)


def rationale_ids(traj: Trajectory) -> list[int]:
    """The token ids the model sampled (z and the answer line y, plus EOS if it stopped), exactly as sampled."""
    (start, end), = traj.policy_token_spans()  # one attempt: one span, at the end
    return traj.token_ids[start:end]


def sft_example(prompt_ids: list[int], sampled: Trajectory) -> Trajectory:
    """One (x, z, y) of eq. 12.5 as a record, token-in/token-out: `prompt_ids` (the prompt *without* the hint)
    followed by the rationale's ids as sampled (under the hint prompt, for a rationalisation). The loss mask
    covers the rationale only; the log-probs are the sampler's (not used by the SFT loss)."""
    z = rationale_ids(sampled)
    z_lp = [lp for lp, m in zip(sampled.behavior_logprobs, sampled.source_mask) if m]
    return Trajectory(token_ids=list(prompt_ids) + z, source_mask=[0] * len(prompt_ids) + [1] * len(z),
                      behavior_logprobs=[0.0] * len(prompt_ids) + z_lp, policy_version=sampled.policy_version,
                      turns=sampled.turns, rewards=sampled.rewards, return_=sampled.return_,
                      termination=sampled.termination, env_version=sampled.env_version, task_id=sampled.task_id,
                      seed=sampled.seed, env_id=sampled.env_id, prompt_length=len(prompt_ids))


def keep(traj: Trajectory, eos_id: int, require_eos: bool, hint_text: str | None = None) -> tuple[bool, str]:
    """STaR's filter: keep a rationale only if its answer is right (y_hat = y*); (kept, why not)."""
    if not traj.success:
        return False, "wrong"
    if require_eos and rationale_ids(traj)[-1] != eos_id:
        return False, "cut"
    if hint_text is not None and hint_text.lower() in traj.turns[0].action_text.lower():
        return False, "leak"
    return True, ""


HINT_LEAK = "correct answer is"  # the hint's own words (envs/reasoning.py hint_prompt); a rationale repeating them leaks it


def sft_loss(model, batch: list[Trajectory], num_tokens: int) -> torch.Tensor:
    """Eq. 12.5: -sum log pi(z, y | x) over the rationale tokens, divided by the step's rationale-token count
    `num_tokens` (so micro-batches add up to the full step's token mean)."""
    units = policy_logprobs(model, batch, "free")
    return -(units.logprobs * units.mask).sum() / max(num_tokens, 1e-8)


def solve_stats(trajs: list[Trajectory]) -> dict[str, float]:
    n = max(len(trajs), 1)
    return {"success_rate": sum(t.success for t in trajs) / n,
            "episodic_return": float(np.mean([t.return_ for t in trajs])) if trajs else 0.0,
            "invalid_action_rate": sum(t.invalid_actions for t in trajs) / n,
            "episode_length": float(np.mean([t.num_policy_tokens for t in trajs])) if trajs else 0.0}


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "star.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, world = init_distributed(device)  # torchrun: each rank generates for its share of the problems
    if args.num_problems % world or args.eval_problems % world:
        raise SystemExit(f"star.py: --num-problems and --eval-problems must be divisible by the {world} processes")
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.outer_iterations < resumed["counters"]["iteration"]:
        raise SystemExit(f"--outer-iterations {args.outer_iterations}: the checkpoint is at iteration "
                         f"{resumed['counters']['iteration']} already")
    try:  # fail fast on a bad --env-id (or an env without STaR's interface), before loading a model
        probe = make_env(args)
        probe.reset(seed=0)
        _ = (probe.problem, probe.answer, probe.reference_solution, probe.hint_prompt(probe.answer))
        if args.eval_problems:
            make_env(args, "test")
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        raise SystemExit(f"--env-id: {e}")

    seed_everything(args.seed, args.torch_deterministic)
    model, tokenizer = load_model(args.model, device, torch.float32 if args.lora_r == 0 else None, seed=args.seed)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha)  # top layers + norm, or LoRA
    if world > 1:  # identical weights on every rank (LoRA's initialisation draws random numbers)
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    fsdp_layers = shard_layers(model) if args.fsdp else []  # (FSDP replaces the layers' parameters by their shards)
    params = [p for p in model.parameters() if p.requires_grad]
    # the base model M_0, restored before each outer iteration's SFT (only what SFT changes needs keeping)
    base_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    sample_gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank)
    py_rng = random.Random(args.seed + 1000 * rank)

    engine = RolloutEngine(model, tokenizer, RolloutConfig(action_mode="free", temperature=args.temperature,
                                                           top_p=args.top_p, max_turn_tokens=args.max_new_tokens))
    chat = engine.chat
    system, shots, hint_shots = make_env(args).system_prompt, "", ""
    if args.num_shots:  # x_i's prompt; the rationalisation prompt's exemplars also carry their hint
        system, shots = few_shot_prompt(make_env(args), args.num_shots, chat)
        hint_shots = few_shot_prompt(make_env(args), args.num_shots, chat, hint=True)[1]
    greedy = RolloutConfig(**{**vars(engine.config), "temperature": 0.0})
    # D: a fixed training set (train split), and held-out problems (test split), identified by their seeds
    train_seeds = [args.seed * 1_000_003 + i for i in range(args.num_problems)][rank::world]  # this rank's share
    eval_seeds = [(1 << 40) + args.seed * 1_000_003 + i for i in range(args.eval_problems)][rank::world]

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: {args.model} on {args.env_id} (level {args.env_level or 'default'}), "
           f"{args.num_problems} training / {args.eval_problems} held-out problems, {args.outer_iterations} iterations")
    start = time.time()

    def run(seeds, hint=False, split="train", config=None):
        """Sample one rationale per problem (batched, free mode); returns (trajectories, seconds, tokens/s)."""
        engine.config = config or engine.config
        t0 = time.time()
        wrapped = [PromptedEnv(make_env(args, split), system, hint_shots if hint else shots, hint) for _ in seeds]
        with gathered(fsdp_layers):  # FSDP: whole weights, as ranks' samples differ in length (a collective: a rank
            # with nothing to sample joins it too)
            trajs = [] if not seeds else engine.run(wrapped, seeds, args.env_id, policy_version=iteration - 1,
                                                    generator=sample_gen)
        engine.config = sampling
        seconds = time.time() - t0
        return trajs, seconds, sum(len(t.token_ids) for t in trajs) / max(seconds, 1e-9)

    def evaluate(step):
        if not args.eval_problems:
            return
        trajs, seconds, _ = run(eval_seeds, split="test", config=greedy)
        stats = all_reduce_mean(solve_stats(trajs))  # equal shares: the mean of the ranks' rates
        tracker.scalars({"eval/success_rate": stats["success_rate"], "eval/invalid_action_rate":
                         stats["invalid_action_rate"], "perf/eval_s": seconds}, step)
        print0(f"eval @ iter {step} | held-out solve rate {stats['success_rate']:.3f} "
               f"| no answer {stats['invalid_action_rate']:.2f} | {seconds:.0f}s")

    sampling, iteration, first_iteration, sft_steps = engine.config, 0, 1, float(args.sft_steps)
    generators = {"sample": sample_gen, "python": py_rng}
    if resumed:  # the fine-tuned weights (M_0 was kept above), every RNG, and the counters
        ckpt.restore(resumed, model, generators=generators)
        first_iteration, sft_steps = resumed["counters"]["iteration"] + 1, resumed["counters"]["sft_steps"]
        print0(f"resumed from {run_dir} at iteration {first_iteration - 1}")
    else:
        evaluate(0)  # p_0 on held-out problems: the few-shot base model
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this outer iteration, save a checkpoint, exit
    for iteration in range(first_iteration, args.outer_iterations + 1):
        # ---- (1) generate: z_i, y_hat_i ~ M_{k-1}(. | x_i) with the few-shot prompt ----
        direct, generate_s, tok_s = run(train_seeds)
        prompts = {t.seed: t.token_ids[: t.prompt_length] for t in direct}  # x_i without any hint
        # ---- (2) filter: D_pass = {(x, z, y*) : y_hat = y*} ----
        drops = {"wrong": 0, "cut": 0, "leak": 0}  # why rationales were not kept (direct and rationalised)
        examples, failed = [], []
        for t in direct:
            ok, why = keep(t, chat.eos_id, args.require_eos)
            if ok:
                examples.append(sft_example(prompts[t.seed], t))
            else:
                failed.append(t.seed)
                drops[why] += 1
        kept_direct = len(examples)
        # ---- (3) rationalise the failures: z_rat ~ M_{k-1}(. | x_i, y*_i), kept if it reaches y*_i, trained
        # on WITHOUT the hint: the prompt ids are x_i's from (1), the rationale ids are those sampled ----
        rationalize_s, hinted = 0.0, []
        # under FSDP every rank samples (within a collective gather) if any rank has a failure to rationalise
        any_failed = all_reduce_sum({"n": len(failed)})["n"] > 0 if fsdp_layers else bool(failed)
        if args.rationalize and any_failed:
            hinted, rationalize_s, _ = run(failed, hint=True)
            for t in hinted:
                ok, why = keep(t, chat.eos_id, args.require_eos, HINT_LEAK if args.filter_hint_leaks else None)
                if ok:
                    examples.append(sft_example(prompts[t.seed], t))
                else:
                    drops[why] += 1
        kept_rationalized = len(examples) - kept_direct

        # ---- (4) fine-tune on D_pass u D_rationalized (eq. 12.5), from the base model M_0 by default ----
        t1 = time.time()
        if args.restart_from_base:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in base_state:
                        p.copy_(base_state[n])
        total_examples = all_reduce_sum({"n": len(examples)})["n"]  # every rank steps if any rank kept one
        steps = round(sft_steps) if total_examples else 0
        sft_steps *= args.sft_steps_growth
        losses = []
        if steps:
            optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
            order: list[int] = []
            micro_batches = math.ceil(min(args.sft_batch_size, len(examples)) / args.micro_batch_size)
            if fsdp_layers:  # a sharded layer's forward/backward is collective: every rank runs as many as the busiest
                most = torch.tensor(micro_batches, device=device)
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
            model.train()
            for step in range(steps):
                batch = []
                while len(batch) < min(args.sft_batch_size, len(examples)):  # passes over the kept set, reshuffled
                    if not order:
                        order = py_rng.sample(range(len(examples)), len(examples))
                    batch.append(examples[order.pop()])
                # torchrun: the global token count / world, so averaged gradients = one process on every rank's batch
                num_tokens = global_loss_denominator(sum(e.num_policy_tokens for e in batch))
                optimizer.zero_grad(set_to_none=False)
                total = 0.0
                for i in range(0, len(batch), args.micro_batch_size):
                    loss = sft_loss(model, batch[i: i + args.micro_batch_size], num_tokens)
                    loss.backward()
                    total += loss.item()
                for _ in range(int(most) - micro_batches if fsdp_layers else 0):
                    (sft_loss(model, direct[:1], 1) * 0).backward()  # a zero-weight pass, to join the collectives
                if world > 1:  # a rank without examples adds zero gradients; all ranks take the same step
                    for p in (p for p in params if not is_sharded(p)):  # FSDP reduce-scattered the sharded ones
                        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                        dist.all_reduce(p.grad)
                        p.grad /= world
                    total = all_reduce_sum({"loss": total})["loss"] / world
                clip_grad_norm(params, args.max_grad_norm)  # FSDP: the norm over every rank's slices
                optimizer.step()
                losses.append(total)
            model.eval()
        sft_s = time.time() - t1

        # ---- logging: p_{k-1} on D (sampled, before this iteration's SFT), what was kept, the SFT ----
        stats = all_reduce_mean(solve_stats(direct))
        n = args.num_problems
        counts = all_reduce_sum({"direct": kept_direct, "rationalized": kept_rationalized, "failed": len(failed),
                                 "leak": drops["leak"], "cut": drops["cut"]})  # over all ranks' problems
        kept_direct, kept_rationalized, drops = int(counts["direct"]), int(counts["rationalized"]), counts
        scalars = {
            **{f"charts/{k}": v for k, v in stats.items()},
            "charts/kept_direct": kept_direct,
            "charts/kept_rationalized": kept_rationalized,
            "charts/rationalization_rate": kept_rationalized / max(counts["failed"], 1),
            "charts/train_set_size": total_examples,
            "losses/sft_loss": float(np.mean(losses)) if losses else 0.0,
            "losses/sft_loss_first": losses[0] if losses else 0.0,
            "losses/sft_loss_last": losses[-1] if losses else 0.0,
            "diagnostics/sft_steps": steps,
            "diagnostics/hint_leaks_dropped": drops["leak"],
            "diagnostics/cut_rationales_dropped": drops["cut"],
            "perf/generate_s": generate_s,
            "perf/rationalize_s": rationalize_s,
            "perf/sft_s": sft_s,
            "perf/rollout_tokens_per_s": tok_s,
        }
        if world > 1:  # every rank took the same averaged steps: their weights must agree exactly
            scalars["diagnostics/rank_param_divergence"] = rank_param_divergence(params)
        tracker.scalars(scalars, iteration)
        tracker.trajectories(direct[:1] + hinted[:1], iteration)
        print0(f"iter {iteration}/{args.outer_iterations} | train solve rate {stats['success_rate']:.3f} ({n} problems) "
               f"| kept {kept_direct} direct + {kept_rationalized} rationalised of {int(counts['failed'])} failures "
               f"| sft {steps} steps, loss {scalars['losses/sft_loss']:.3f} -> {scalars['losses/sft_loss_last']:.3f} "
               f"| {generate_s + rationalize_s + sft_s:.0f}s (generate {generate_s:.0f}, rationalise "
               f"{rationalize_s:.0f}, sft {sft_s:.0f})")
        # ---- (5) M_k on held-out problems: p_k ----
        evaluate(iteration)
        stop = interrupt.should_stop()
        if ckpt.due(iteration, last=iteration == args.outer_iterations) or stop:  # (a fresh optimizer each iteration)
            ckpt.save({"iteration": iteration, "sft_steps": sft_steps}, model, generators=generators, tracker=tracker)
            print0(f"checkpoint saved in {run_dir} (iteration {iteration})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if args.save_model and rank == 0:
        path = os.path.join(run_dir, "model")
        save_model(model, tokenizer, path, weights)  # with LoRA: the adapter only
        print0(f"model saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if world > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
