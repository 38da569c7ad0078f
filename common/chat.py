"""Token-in/token-out chat formatting: a conversation only ever grows by appending token ids.

Re-rendering the whole history with `apply_chat_template` and re-tokenising it every turn can change
the ids of earlier turns (BPE merges across boundaries, templates that rewrite old turns); PPO trained
on such sequences optimises tokens the model never sampled (seed 001, "token-in/token-out"). Instead we
read, once, the strings the tokenizer's own chat template puts *between* messages, and tokenise only
the new pieces: the first prompt, and after each action the wrapper around the next observation.
The sampled ids are kept as they were sampled; decoded text is for the environment's parser only.
"""

from __future__ import annotations

_SYS, _USER, _ACT, _USER2 = "\x01SYS\x01", "\x01USER\x01", "\x01ACT\x01", "\x01USER2\x01"


class ChatFormat:
    """Splits a chat template into the fixed strings around system/user/assistant contents."""

    def __init__(self, tokenizer):
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; token-in/token-out needs one")
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        eos = tokenizer.eos_token
        render = lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
        first = render([{"role": "system", "content": _SYS}, {"role": "user", "content": _USER}])
        longer = render([{"role": "system", "content": _SYS}, {"role": "user", "content": _USER},
                         {"role": "assistant", "content": _ACT}, {"role": "user", "content": _USER2}])
        if _SYS not in first:
            raise ValueError("the chat template drops the system message; prepend it to the first user turn instead")
        if not longer.startswith(first + _ACT):
            raise ValueError("the chat template rewrites earlier turns when a turn is appended; "
                             "token-in/token-out training would train on tokens that were never sampled")
        self.prompt_template = first  # contains _SYS and _USER
        between = longer[len(first) + len(_ACT):]
        # `after_action`: what closes the assistant turn and opens the next user turn, e.g.
        # "<|im_end|>\n<|im_start|>user\n"; `after_user`: "<|im_end|>\n<|im_start|>assistant\n".
        self.after_action, self.after_user = between.split(_USER2)
        # When the policy itself sampled the end-of-turn token, that token is part of the action.
        self.closes_with_eos = eos is not None and self.after_action.startswith(eos)
        self._after_action_no_eos = self.after_action[len(eos):] if self.closes_with_eos else self.after_action

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, system: str, user: str) -> list[int]:
        """System prompt + first observation + the assistant header the model continues from."""
        return self.encode(self.prompt_template.replace(_SYS, system).replace(_USER, user))

    def next_turn_ids(self, observation: str, action_ended_with_eos: bool) -> list[int]:
        """Ids appended after an action: close the turn (unless the policy sampled EOS), observation, header."""
        close = self._after_action_no_eos if action_ended_with_eos else self.after_action
        return self.encode(close + observation + self.after_user)
