# docs: docs/lats.md
"""Language Agent Tree Search (Zhou et al. 2023, LATS; seed 000 eq. 12.8), with a ReAct baseline.

For each task (an environment seed) a search tree is grown over the agent's actions. One iteration:
  1. selection: from the root, descend by UCB1 (eq. 12.8): V(s) + c * sqrt(ln N(parent) / N(s));
  2. expansion: at the leaf, k candidate actions are sampled from the LLM at temperature > 0 and each
     is executed on a restored copy of the leaf's environment state (`snapshot()` / `restore()`);
  3. evaluation: each new child gets V = lambda * LLM value + (1 - lambda) * environment reward, the LLM
     value being P("Yes") to "Will the agent succeed from here?";
  4. simulation: from the best new child a greedy rollout runs to a terminal state or the depth limit;
  5. back-propagation: the rollout's (normalised) return is added to N and W of every ancestor;
  6. reflection: a failed trajectory (terminal, no success) yields a one-sentence lesson for later prompts.
The search stops at the first success the environment's verifier confirms, or when the iteration or
token budget is spent; then the answer is the path of most visited children. No weights are updated.

`--mode react` is the baseline: plain ReAct episodes (the shared rollout engine; the first greedy, the
next sampled) until one succeeds or the same per-task token budget is spent, so both are compared at
matched cost (tokens = prompt tokens processed + tokens generated; see docs/lats.md for the rule).

Usage:
    python algorithms/lats.py                                          # smollm2-135m, GridWorld, choice mode, CPU
    python algorithms/lats.py --mode react                             # the ReAct baseline, same budget and tasks
    python algorithms/lats.py --model tiny --num-tasks 1 --iterations 2 # seconds, for a smoke test
    python algorithms/lats.py --env-id codegen --env-level 1 --k 3     # code with hidden tests (free text)
    python algorithms/lats.py --device cuda                            # one GPU

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id whose environment has snapshot()/restore()).

Where this departs from the paper / seed:
- The LLM value is P(Yes) / (P(Yes) + P(No)) of the first answer token, not a generated 0-1 number: a 135M model
  rarely writes a parseable number. The environment part of the blend is the path's return divided by
  `--reward-scale` and clipped to [0, 1] (the verifier's value at terminal states).
- V(s) in eq. 12.8 is W(s) / N(s); unvisited children (UCB1 = +inf) are tried in the order of their evaluation
  (LATS's code scores them by it instead, which starved siblings with a noisy 135M value).
- Simulated steps are not added to the tree; the first step's scores are cached in the child.
- Reflection "prunes similar branches" only as: failed terminal children and nodes whose children are all dead are
  never selected again; identical actions are merged at expansion. At most one lesson per iteration.
- GridWorld runs in `choice` mode (k distinct action names sampled without replacement from the LLM's distribution
  over the names, no written thought); `--action-mode free` samples text instead.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.nn.functional as F
import tyro

import envs
from common.chat import ChatFormat
from common.distributed import print0, seed_everything
from common.models import load_model, resolve_device, save_model
from common.records import Trajectory, Turn, write_jsonl
from common.rollout import RolloutConfig, RolloutEngine, decode_weight_layout, sample_from_logits, score_candidates
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, sampling, task seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the model used (unchanged: nothing is trained) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """environment id (`gridworld`, `codegen`, `workspace`, ...) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""

    # Algorithm specific arguments
    mode: Literal["lats", "react"] = "lats"
    """`lats`: tree search; `react`: ReAct episodes resampled until the token budget is spent (the baseline)"""
    env_level: int = 0
    """passed to the environment as `level=` (codegen 1-3, workspace 1-5); 0 keeps the environment's default"""
    num_tasks: int = 8
    """tasks (environment seeds seed*1000 + i) to solve; both modes see the same ones"""
    token_budget: int = 12000
    """per task: no new LATS iteration / ReAct episode starts once this many tokens were used (0: no limit)"""
    iterations: int = 30
    """LATS: at most this many select-expand-evaluate-simulate iterations per task"""
    k: int = 3
    """LATS: candidate actions sampled per expansion (distinct ones are kept)"""
    exploration_c: float = 1.0
    """the c of UCB1 (eq. 12.8)"""
    value_lambda: float = 0.5
    """V = lambda * LLM value + (1 - lambda) * environment reward (normalised)"""
    reward_scale: float = 0.0
    """the environment part of V is clip(return / reward_scale, 0, 1); 0: 5 for gridworld*, 1 otherwise"""
    max_depth: int = 20
    """depth budget of the tree (seed: 10-20 steps); deeper nodes are not expanded"""
    rollout_depth: int = 8
    """simulation: greedy steps at most from the evaluated child"""
    reflect: bool = True
    """after an iteration that reached a failed terminal state, a one-sentence lesson for later expansion prompts"""
    max_reflections: int = 3
    """lessons kept (the most recent ones)"""
    reflection_tokens: int = 32
    """cap on generated tokens per lesson"""
    action_mode: Literal["auto", "free", "choice"] = "auto"
    """`choice`: sample action names (needs action_names); `free`: sample text; `auto`: choice when possible"""
    choice_token_norm: bool = True
    """TWOSOME normalisation of multi-token action names (by token count)"""
    temperature: float = 1.0
    """sampling temperature of expansions and of ReAct's resampled episodes (the first ReAct episode is greedy)"""
    top_p: float = 1.0
    """nucleus sampling of expansions and ReAct episodes"""
    max_turn_tokens: int = 160
    """free mode: cap on generated tokens per action (codegen needs ~150; GridWorld free text ~16)"""
    react_batch: int = 4
    """ReAct: episodes sampled together in one batch (accounting still stops at the budget, in order)"""
    max_total_tokens: int = 4096
    """ReAct: cap on an episode's whole token sequence"""


# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--num-tasks", "1", "--iterations", "2", "--k", "2", "--max-depth", "4", "--rollout-depth", "2",
                   "--reflection-tokens", "4"]
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/invalid_action_rate",
               "perf/tokens_per_task", "perf/generated_tokens_per_task", "perf/llm_calls", "perf/task_s",
               "perf/rollout_tokens_per_s", "diagnostics/iterations", "diagnostics/tree_nodes",
               "diagnostics/root_visits", "diagnostics/reflections", "eval/success_rate", "eval/episodic_return",
               "eval/tokens_per_task")
VALUE_QUESTION = "\n\nQuestion: will the agent succeed at this task from here? Answer Yes or No."
REFLECT_SYSTEM = "You review a failed attempt at a task and give one short lesson for the next attempt."


def validate_args(args: Args):
    problems = []
    for name in ("num_tasks", "iterations", "k", "max_depth", "max_turn_tokens", "react_batch", "reflection_tokens"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.token_budget < 0 or args.rollout_depth < 0 or args.max_reflections < 0 or args.reward_scale < 0:
        problems.append("--token-budget, --rollout-depth, --max-reflections and --reward-scale must be >= 0")
    if not 0 <= args.value_lambda <= 1 or args.exploration_c < 0:
        problems.append("--value-lambda must be in [0, 1] and --exploration-c >= 0")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        problems.append("--temperature must be > 0 (expansion samples) and --top-p in (0, 1]")
    if problems:
        raise SystemExit("lats.py: " + "; ".join(problems))


# ---- the tree: pure functions, tested against hand-computed values ----------------------------------
@dataclass(eq=False)
class Node:
    parent: Node | None = None
    action_ids: list[int] = field(default_factory=list)  # the sampled ids (token-in/token-out)
    action_logprobs: list[float] = field(default_factory=list)
    action_text: str = ""
    ended_with_eos: bool = False
    obs: str = ""  # the observation this node's action led to (the root: the first observation)
    reward: float = 0.0  # step reward of the action into this node
    ret: float = 0.0  # return from the root to here
    valid: bool = True
    terminal: bool = False
    termination: str = ""
    snapshot: object = None  # env.snapshot() after the action
    depth: int = 0
    children: list[Node] = field(default_factory=list)
    expanded: bool = False
    visits: int = 0  # N(s)
    value_sum: float = 0.0  # W(s): sum of back-propagated returns
    value_est: float = 0.0  # the evaluation V(s) (LLM value blended with the environment's)
    dead: bool = False  # failed terminal, or every child dead: never selected again
    cache: dict = field(default_factory=dict)  # LLM outputs at this node: "scores", "samples", "value"

    @property
    def value(self) -> float:
        """V(s) of eq. 12.8: the mean back-propagated return, or the evaluation before any visit."""
        return self.value_sum / self.visits if self.visits else self.value_est

    def path(self) -> list[Node]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


def ucb1(node: Node, c: float) -> float:
    """Eq. 12.8: V(s) + c * sqrt(ln N(parent) / N(s)); an unvisited node is +infinity (tried first)."""
    if node.visits == 0:
        return math.inf
    return node.value + c * math.sqrt(math.log(max(node.parent.visits, 1)) / node.visits)


def select(root: Node, c: float) -> Node:
    """Descend from the root through expanded nodes, taking the live child of highest UCB1; ties (unvisited
    children) go to the higher evaluation V(s), then to the first."""
    node = root
    while node.expanded and not node.terminal:
        live = [ch for ch in node.children if not ch.dead]
        if not live:
            break
        node = max(live, key=lambda ch: (ucb1(ch, c), ch.value_est))
    return node


def backpropagate(node: Node, value: float):
    """N += 1 and W += value for the node and every ancestor (LATS step 5)."""
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent


def mark_dead(node: Node):
    """A dead node is never selected; a parent whose children are all dead dies too (branch pruning)."""
    node.dead = True
    parent = node.parent
    if parent is not None and all(ch.dead for ch in parent.children):
        mark_dead(parent)


def most_visited_path(root: Node) -> list[Node]:
    """The answer when no success was found: follow the most visited child (then the higher V) to a leaf."""
    path = [root]
    while path[-1].children:
        path.append(max(path[-1].children, key=lambda ch: (ch.visits, ch.value)))
    return path


def env_value(ret: float, scale: float) -> float:
    """The environment's part of V: the return so far, normalised to [0, 1]."""
    return min(max(ret / scale, 0.0), 1.0)


# ---- LLM calls, every one counted: prompt tokens processed + tokens generated ------------------------
class LM:
    """Thin KV-cache helpers over a causal LM, with token and call accounting."""

    def __init__(self, model, tokenizer, generator: torch.Generator | None = None):
        self.model, self.tokenizer, self.chat, self.generator = model, tokenizer, ChatFormat(tokenizer), generator
        self.body, self.head = model.get_decoder(), model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.chat.eos_id
        self.calls = self.prompt_tokens = self.generated_tokens = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    def _forward(self, rows: list[list[int]], cache=None, attn=None):
        """Append left-padded rows to `cache`; returns (logits at each row's last token, cache, attention mask)."""
        from transformers import DynamicCache

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
        mask = mask.to(self.device)
        attn = mask if attn is None else torch.cat([attn, mask], 1)
        cache = DynamicCache() if cache is None else cache
        pos = (attn.cumsum(1) - 1).clamp(min=0)[:, -width:]
        hidden = self.body(input_ids=ids.to(self.device), attention_mask=attn, position_ids=pos, past_key_values=cache,
                           use_cache=True).last_hidden_state
        return self.head(hidden[:, -1]).float(), cache, attn

    @torch.no_grad()
    def start(self, ids: list[int]) -> dict:
        """A batch-1 session: the prompt encoded into a KV cache."""
        self.calls += 1
        self.prompt_tokens += len(ids)
        logits, cache, attn = self._forward([ids])
        return {"logits": logits, "cache": cache, "attn": attn}

    @torch.no_grad()
    def extend(self, session: dict, ids: list[int]):
        self.prompt_tokens += len(ids)
        session["logits"], session["cache"], session["attn"] = self._forward([ids], session["cache"], session["attn"])

    @torch.no_grad()
    def score(self, session: dict, candidates: list[list[int]], token_norm: bool) -> torch.Tensor:
        """Log-softmax over the candidate actions' joint log-probs after the session's prompt ([K])."""
        scores = score_candidates(self.model, session["cache"], session["attn"], session["logits"], candidates, token_norm)
        return F.log_softmax(scores[0], -1)

    @torch.no_grad()
    def sample(self, session: dict, n: int, max_new: int, temperature: float, top_p: float = 1.0):
        """n continuations of the session's prompt in one batch (the session is left as it was).

        Returns [(token ids, their log-probs, ended with EOS)]; T = 0 is greedy.
        """
        from transformers import DynamicCache

        cache = DynamicCache()  # a row-repeated copy: the session's cache stays reusable
        for i, layer in enumerate(session["cache"].layers):
            cache.update(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), i)
        attn, logits = session["attn"].repeat_interleave(n, 0), session["logits"].repeat_interleave(n, 0)
        out, done = [([], []) for _ in range(n)], [False] * n
        for step in range(max_new):
            token, logp = sample_from_logits(logits, temperature, top_p, self.generator)
            for i in range(n):
                if not done[i]:
                    out[i][0].append(int(token[i]))
                    out[i][1].append(float(logp[i]))
                    self.generated_tokens += 1
                    done[i] = int(token[i]) == self.chat.eos_id
            if all(done) or step == max_new - 1:
                break
            logits, cache, attn = self._forward([[] if done[i] else [out[i][0][-1]] for i in range(n)], cache, attn)
        return [(ids, lps, bool(ids) and ids[-1] == self.chat.eos_id) for ids, lps in out]

    @torch.no_grad()
    def yes_prob(self, prompts: list[list[int]]) -> list[float]:
        """P(Yes) / (P(Yes) + P(No)) of the first answer token, for a batch of prompts (one forward)."""
        self.calls += 1
        self.prompt_tokens += sum(len(p) for p in prompts)
        logits, _, _ = self._forward(prompts)
        yes, no = self.chat.encode("Yes")[0], self.chat.encode("No")[0]
        return torch.softmax(logits[:, [yes, no]], -1)[:, 0].tolist()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.chat.eos_id])


# ---- one task's search ------------------------------------------------------------------------------
class Search:
    """LATS on one task: an environment, the LM, the tree, the lessons. See the module docstring."""

    def __init__(self, args: Args, lm: LM, env, seed: int, action_mode: str, scale: float):
        self.args, self.lm, self.env, self.mode, self.scale = args, lm, env, action_mode, scale
        obs, info = env.reset(seed=seed)
        self.root = Node(obs=obs, snapshot=env.snapshot(), expanded=False)
        self.lessons: list[str] = []
        self.success_steps: list[Node] | None = None  # the verified success path, once found
        self.candidates = [lm.chat.encode(name) for name in env.action_names] if action_mode == "choice" else None

    def context(self, path: list[Node], suffix: str = "", lessons: bool = True) -> list[int]:
        """Prompt ids for the state at the end of `path`: system (+ lessons), then every action and observation."""
        chat, system = self.lm.chat, self.env.system_prompt
        if lessons and self.lessons:
            system += "\nLessons from earlier failed attempts:\n" + "\n".join(f"- {x}" for x in self.lessons)
        ids = chat.prompt_ids(system, path[0].obs + (suffix if len(path) == 1 else ""))
        for node in path[1:]:
            ids = ids + node.action_ids + chat.next_turn_ids(node.obs + (suffix if node is path[-1] else ""),
                                                             node.ended_with_eos)
        return ids

    def propose(self, node: Node, session: dict | None, n: int, temperature: float):
        """n candidate actions at `node`: (ids, log-probs, ended_with_eos, env action). Scores are cached."""
        if self.mode == "choice":
            if "scores" not in node.cache:
                session = session or self.lm.start(self.context(node.path()))
                node.cache["scores"] = self.lm.score(session, self.candidates, self.args.choice_token_norm)
            scores = node.cache["scores"]
            if temperature == 0:
                picks = [int(scores.argmax())]
            else:
                probs = torch.softmax(scores / temperature, -1)
                picks = torch.multinomial(probs, min(n, len(probs)), replacement=False, generator=self.lm.generator).tolist()
            return [(self.candidates[a], [float(scores[a])] + [0.0] * (len(self.candidates[a]) - 1), False, a) for a in picks]
        session = session or self.lm.start(self.context(node.path()))
        out = self.lm.sample(session, n, self.args.max_turn_tokens, temperature, self.args.top_p)
        return [(ids, lps, eos, self.lm.decode(ids)) for ids, lps, eos in out]

    def step(self, node: Node, proposal) -> Node:
        """Execute one proposed action from `node`'s state (restored) and return the child it leads to."""
        ids, lps, eos, action = proposal
        self.env.restore(node.snapshot)
        obs, reward, terminated, truncated, info = self.env.step(action)
        child = Node(parent=node, action_ids=ids, action_logprobs=lps, ended_with_eos=eos, obs=obs, reward=reward,
                     ret=node.ret + reward, valid=bool(info.get("action_valid", True)), depth=node.depth + 1,
                     action_text=self.env.action_names[action] if self.mode == "choice" else action,
                     terminal=terminated or truncated, snapshot=self.env.snapshot())
        child.termination = info.get("termination", "truncated" if truncated else "")
        if not child.terminal and child.depth >= self.args.max_depth:
            child.terminal, child.termination = True, "truncated"
        return child

    def expand(self, node: Node) -> list[Node]:
        """LATS step 2: k sampled actions, duplicates merged; cached, so a node is expanded once."""
        if node.expanded:
            return node.children
        if "samples" not in node.cache:
            node.cache["samples"] = self.propose(node, None, self.args.k, self.args.temperature)
        seen = set()
        for proposal in node.cache["samples"]:
            key = proposal[3] if self.mode == "choice" else proposal[3].strip()
            if key not in seen:
                seen.add(key)
                node.children.append(self.step(node, proposal))
        node.expanded = True
        return node.children

    def evaluate(self, children: list[Node]):
        """LATS step 3: V = lambda * P(Yes) + (1 - lambda) * env value; terminal states: the verifier's value."""
        pending = [ch for ch in children if not ch.terminal and "value" not in ch.cache]
        if pending and self.args.value_lambda > 0:
            for ch, p in zip(pending, self.lm.yes_prob([self.context(ch.path(), VALUE_QUESTION) for ch in pending])):
                ch.cache["value"] = p
        for ch in children:
            env_v = env_value(ch.ret, self.scale)
            lam = 0.0 if ch.terminal else self.args.value_lambda
            ch.value_est = lam * ch.cache.get("value", 0.0) + (1 - lam) * env_v

    def simulate(self, node: Node) -> tuple[float, list[Node]]:
        """LATS step 4: greedy rollout from `node` (new nodes, not added to the tree); returns (value, steps)."""
        steps, current, session = [], node, None
        for _ in range(self.args.rollout_depth):
            if current.terminal:
                break
            if session is None:
                session = self.lm.start(self.context(current.path()))
            proposal = self.propose(current, session, 1, 0.0)[0]
            child = self.step(current, proposal)  # linked to its parent for its path, never listed in children
            steps.append(child)
            if not child.terminal:
                self.lm.extend(session, child.action_ids + self.lm.chat.next_turn_ids(child.obs, child.ended_with_eos))
            current = child
        return env_value(current.ret, self.scale), steps

    def reflect(self, path: list[Node]):
        """LATS step 6 (reflection): one short lesson from a failed path, kept for later expansion prompts."""
        tail = "\n".join(f"Action: {n.action_text.strip()[:200]}\nResult: {n.obs[-300:]}" for n in path[1:][-4:])
        user = f"Task:\n{path[0].obs[-600:]}\n\nAttempt (last steps):\n{tail}\n\nIn one sentence, what should be done differently?"
        session = self.lm.start(self.lm.chat.prompt_ids(REFLECT_SYSTEM, user))
        ids, _, _ = self.lm.sample(session, 1, self.args.reflection_tokens, 0.0)[0]
        lesson = " ".join(self.lm.decode(ids).split())
        if lesson:
            self.lessons = (self.lessons + [lesson])[-self.args.max_reflections:]

    def run(self) -> int:
        """Iterate until a verified success, the iteration cap, the token budget, or a dead root."""
        args, iterations = self.args, 0
        while iterations < args.iterations and not self.root.dead and self.success_steps is None:
            if args.token_budget and self.lm.tokens >= args.token_budget:
                break
            iterations += 1
            leaf = select(self.root, args.exploration_c)
            children = self.expand(leaf)
            self.evaluate(children)
            for ch in children:
                if ch.termination == "success":  # the verifier confirmed it: stop here
                    backpropagate(ch, ch.value_est)
                    self.success_steps = ch.path()
                    return iterations
                if ch.terminal:
                    mark_dead(ch)
            live = [ch for ch in children if not ch.dead]
            # step 6 reflects on a failed trajectory, one that reached a terminal state without success (the
            # simulation's, else an expanded child's; a rollout cut by --rollout-depth has not failed): <= 1 lesson
            failed = next((ch.path() for ch in children if ch.terminal), None)  # a success returned above
            if live:
                best = max(live, key=lambda ch: ch.value_est)
                value, steps = self.simulate(best)
                backpropagate(best, value)
                if steps and steps[-1].termination == "success":
                    self.success_steps = best.path() + steps
                    return iterations
                failed = best.path() + steps if steps and steps[-1].terminal else failed
            else:
                backpropagate(leaf, max((ch.value_est for ch in children), default=0.0))
            if failed and args.reflect and args.max_reflections > 0:
                self.reflect(failed)
        return iterations

    def answer(self) -> list[Node]:
        return self.success_steps or most_visited_path(self.root)


def tree_size(node: Node) -> int:
    return 1 + sum(tree_size(ch) for ch in node.children)


def record(chat: ChatFormat, env, path: list[Node], seed: int, env_id: str) -> Trajectory:
    """The answer path as a shared trajectory record (prompt without lessons; actions as sampled ids)."""
    ids = chat.prompt_ids(env.system_prompt, path[0].obs)
    mask, lps = [0] * len(ids), [0.0] * len(ids)
    for node in path[1:]:
        ids, mask, lps = ids + node.action_ids, mask + [1] * len(node.action_ids), lps + node.action_logprobs
        if node is not path[-1]:
            seg = chat.next_turn_ids(node.obs, node.ended_with_eos)
            ids, mask, lps = ids + seg, mask + [0] * len(seg), lps + [0.0] * len(seg)
    turns = [Turn(action_text=n.action_text, observation=n.obs, reward=n.reward, action_valid=n.valid,
                  num_action_tokens=len(n.action_ids)) for n in path[1:]]
    last = path[-1]
    termination = last.termination if last.termination in envs.TERMINATIONS else "truncated"
    return Trajectory(token_ids=ids, source_mask=mask, behavior_logprobs=lps, policy_version=0, turns=turns, rewards={},
                      return_=last.ret, termination=termination, env_version=getattr(env, "env_version", ""),
                      task_id=str(getattr(env, "task_id", "")), seed=seed, env_id=env_id,
                      prompt_length=mask.index(1) if 1 in mask else len(mask))


def react_task(args: Args, engine: RolloutEngine, env_id: str, env_kwargs: dict, seed: int, generator):
    """ReAct at a token budget: episodes (the first greedy, then sampled in batches) until one succeeds or
    the budget is spent. An episode counts only if it started before the budget ran out, in order, so batching
    changes no count, only speed and, sampled, which draws each row gets (the same distribution). Returns (the
    counted episodes, tokens, generated tokens)."""
    counted, tokens, generated, first = [], 0, 0, True
    while True:
        n = 1 if first else args.react_batch
        engine.config.temperature = 0.0 if first else args.temperature
        trajs = engine.run([envs.make(env_id, **env_kwargs) for _ in range(n)], [seed] * n, env_id, generator=generator)
        first = False
        for t in trajs:
            if args.token_budget and tokens >= args.token_budget:
                return counted, tokens, generated
            counted.append(t)
            tokens += len(t.token_ids)  # every prompt/observation token processed once (KV cache) + every sampled one
            generated += t.num_policy_tokens
            if t.success:
                return counted, tokens, generated
        if not args.token_budget and len(counted) >= args.iterations:
            return counted, tokens, generated


if __name__ == "__main__":
    args = tyro.cli(Args)
    validate_args(args)
    device = resolve_device(args.device)
    if args.mode == "react" and args.exp_name == "lats":
        args.exp_name = "lats_react"  # the baseline's runs are told apart in TensorBoard without a flag
    run_name = make_run_name(args.env_id, args.exp_name, args.seed)
    env_kwargs = {"level": args.env_level} if args.env_level else {}
    try:
        probe = envs.make(args.env_id, **env_kwargs)  # fail fast on a bad --env-id, before loading a model
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id / --env-level: {e}")
    has_names = bool(getattr(probe, "action_names", None))
    action_mode = ("choice" if has_names else "free") if args.action_mode == "auto" else args.action_mode
    if action_mode == "choice" and not has_names:
        raise SystemExit(f"--action-mode choice needs an environment with action_names; {args.env_id} has none")
    scale = args.reward_scale or (5.0 if args.env_id.startswith("gridworld") else 1.0)

    seed_everything(args.seed, args.torch_deterministic)
    model, tokenizer = load_model(args.model, device, seed=args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    tracker = Tracker(os.path.join(args.output_dir, run_name), {**vars(args), "resolved_action_mode": action_mode,
                                                                 "resolved_reward_scale": scale})
    engine = RolloutEngine(model, tokenizer, RolloutConfig(
        action_mode=action_mode, temperature=args.temperature, top_p=args.top_p, max_turn_tokens=args.max_turn_tokens,
        max_total_tokens=args.max_total_tokens, choice_token_norm=args.choice_token_norm))
    print0(f"run {run_name}: {args.mode} with {args.model} on {args.env_id} ({action_mode} mode), "
           f"{args.num_tasks} tasks, budget {args.token_budget or 'unlimited'} tokens/task")

    start, answers = time.time(), []
    successes, token_counts = [], []
    for task in range(args.num_tasks):
        seed, t0 = args.seed * 1000 + task, time.time()
        lm = LM(model, tokenizer, generator)
        if args.mode == "lats":
            search = Search(args, lm, envs.make(args.env_id, **env_kwargs), seed, action_mode, scale)
            with decode_weight_layout(model):  # a few rows per forward: MKL is faster input-major (common/rollout.py)
                iterations = search.run()
            traj = record(lm.chat, search.env, search.answer(), seed, args.env_id)
            tokens, generated, calls = lm.tokens, lm.generated_tokens, lm.calls
            extra = {"diagnostics/tree_nodes": tree_size(search.root), "diagnostics/root_visits": search.root.visits,
                     "diagnostics/reflections": len(search.lessons)}
        else:
            counted, tokens, generated = react_task(args, engine, args.env_id, env_kwargs, seed, generator)
            traj = next((t for t in counted if t.success), counted[-1])
            iterations, calls, extra = len(counted), len(counted), {}
        task_s = time.time() - t0
        answers.append(traj)
        successes.append(float(traj.success))
        token_counts.append(tokens)
        tracker.scalars({
            "charts/episodic_return": traj.return_,
            "charts/success_rate": float(np.mean(successes)),  # running, over the tasks so far
            "charts/episode_length": traj.num_steps,
            "charts/invalid_action_rate": traj.invalid_actions / max(traj.num_steps, 1),
            "perf/tokens_per_task": tokens, "perf/generated_tokens_per_task": generated, "perf/llm_calls": calls,
            "perf/task_s": task_s, "perf/rollout_tokens_per_s": tokens / max(task_s, 1e-9),
            "diagnostics/iterations": iterations, **extra}, task + 1)
        print0(f"task {task + 1}/{args.num_tasks} seed {seed} | {traj.termination} | return {traj.return_:.2f} "
               f"| {iterations} {'iterations' if args.mode == 'lats' else 'episodes'} | {tokens} tokens "
               f"({generated} generated) | {task_s:.1f}s | success so far {np.mean(successes):.2f}")
    tracker.trajectories(answers, args.num_tasks)
    write_jsonl(os.path.join(args.output_dir, run_name, "answers.jsonl"), answers)
    summary = {"eval/success_rate": float(np.mean(successes)), "eval/tokens_per_task": float(np.mean(token_counts)),
               "eval/episodic_return": float(np.mean([t.return_ for t in answers]))}
    tracker.scalars(summary, args.num_tasks)
    print0(f"{args.mode}: success {summary['eval/success_rate']:.2f} | return {summary['eval/episodic_return']:.2f} "
           f"| {summary['eval/tokens_per_task']:.0f} tokens/task")

    if args.save_model:  # no weights are updated: the model searched with, for the record
        save_model(model, tokenizer, path := os.path.join(args.output_dir, run_name, "model"))
        print0(f"model saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {os.path.join(args.output_dir, run_name)}")
    tracker.close()
