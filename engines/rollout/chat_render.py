"""A model's chat template as token ids for multi-turn rollouts: the first prompt from messages and tool
schemas, then each observation as the template's delta tokens, never a re-tokenized conversation.

The delta of a tool (or user) message is computed once per message list against a dummy conversation: the
template renders [user, assistant] and [user, assistant, *new messages] with a generation prompt; the ids
after the dummy assistant's end-of-turn token (the EOS the policy samples) are what the engine is fed next.
Glue the template writes after that EOS (ChatML's newline after `<|im_end|>`) belongs to the observation, so
it is neither lost at a turn boundary (verl #6501) nor trained on.

A template that rewrites history (Qwen3's thinking dropped from earlier turns) is not prefix-preserving: the
start-up check (`prefix_preserving`) says so and the caller takes the configured path (refuse, or a new
training row per turn, whose prompt is the whole conversation rendered again).

Non-goal: parsing tool calls (`rlstages.engines.tools`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

_DUMMY = [{"role": "user", "content": "dummy question"}, {"role": "assistant", "content": "dummy answer"}]

TOOL_PREAMBLE = (
    "You can call these tools. To call one, write\n<tool_call>\n"
    '{{"name": <tool name>, "arguments": <a JSON object>}}\n</tool_call>\n'
    "and wait for its result before you answer. Tools:\n{schemas}"
)


class TemplateError(ValueError):
    """The chat template cannot render a multi-turn conversation token-exactly."""


class ChatRenderer:
    """Token ids of a tokenizer's chat template for a conversation that grows by observations.

    `eos_ids`: the ids that end a policy turn (the delta is cut after the last of them in the dummy render).
    Tool schemas reach the template as `tools=`; a template that ignores them (SmolLM2's ChatML) gets them in
    the system turn instead (`TOOL_PREAMBLE`), so the policy always sees its tools.
    """

    def __init__(self, tokenizer: Any, eos_ids: set[int], system_prompt: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("multi-turn rollouts need a chat template (data.chat_template or the tokenizer's)")
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.system_prompt = system_prompt
        self._deltas: dict[str, list[int]] = {}

    def _text(self, messages: Sequence[Message], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = list(tools)
        return str(self.tokenizer.apply_chat_template(list(messages), **kwargs))

    def encode(self, text: str) -> list[int]:
        """Ids of rendered template text (the template writes its own special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def messages_with_tools(self, messages: Sequence[Message], tools: Sequence[dict]) -> list[Message]:
        """The messages with the system prompt first and, when the template ignores `tools=`, the tool schemas
        in the system turn."""
        out = [dict(m) for m in messages]
        if self.system_prompt and (not out or out[0].get("role") != "system"):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        if tools and self._text(out, tools, True) == self._text(out, None, True):
            preamble = TOOL_PREAMBLE.format(schemas="\n".join(json.dumps(t, sort_keys=True) for t in tools))
            if out and out[0].get("role") == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{preamble}"
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] = ()) -> list[int]:
        """The first prompt: messages (after `messages_with_tools`) rendered with a generation prompt."""
        return self.encode(self._text(self.messages_with_tools(messages, tools), tools, True))

    def conversation_ids(self, messages: Sequence[Message], tools: Sequence[dict] = ()) -> list[int]:
        """A whole conversation rendered again with a generation prompt (a new training row's prompt)."""
        return self.prompt_ids(messages, tools)

    def observation_ids(self, new_messages: Sequence[Message]) -> list[int]:
        """The ids that follow a policy turn's EOS when `new_messages` (tool results, a user turn) are added,
        ending with the next assistant turn's generation prompt."""
        key = json.dumps(list(new_messages), sort_keys=True)
        if key not in self._deltas:
            self._deltas[key] = self._delta(new_messages)
        return list(self._deltas[key])

    def _delta(self, new_messages: Sequence[Message]) -> list[int]:
        base = self.encode(self._text(_DUMMY, None, False))
        full = self.encode(self._text([*_DUMMY, *new_messages], None, True))
        cut = max((i for i, t in enumerate(base) if t in self.eos_ids), default=-1) + 1
        if cut == 0:
            raise TemplateError("the chat template ends an assistant turn without an EOS token: turns cannot be cut")
        if full[:cut] != base[:cut]:
            raise TemplateError("the chat template renders the dummy conversation differently once a tool turn follows")
        return full[cut:]

    def prefix_preserving(self) -> bool:
        """Whether a conversation's render up to an assistant turn's EOS stays a prefix when turns are added
        (false for templates that rewrite earlier turns, such as dropping their thinking)."""
        first = [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nLet me check."},
        ]
        later = [*first, {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
        try:
            short = self.encode(self._text(first, None, False))
            long = self.encode(self._text(later, None, False))
        except Exception:  # a template that refuses the tool role cannot run multi-turn tools either
            return False
        cut = max((i for i, t in enumerate(short) if t in self.eos_ids), default=-1) + 1
        return cut > 0 and long[:cut] == short[:cut]
