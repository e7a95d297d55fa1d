"""`reasoning_parser` (`deepseek_r1`, `qwen3`): a reasoning model's thinking comes back apart from
its answer.

DeepSeek-R1 and the models distilled from it (Qwen2 and Llama checkpoints) think first and then
answer: their chat templates end the prompt with `<think>`, so the output is the reasoning up to
`</think>`, then the answer (a leading `<think>` in the output is dropped too). vLLM's
`--reasoning-parser deepseek_r1` splits it the same way. The reasoning is returned as the
message's `reasoning_content` (the field DeepSeek's own API uses) and streamed as
`delta.reasoning_content`; what follows `</think>` is the content, and with `tool_choice: "auto"`
the calls are read from it (deployments/api/tool_parsers.py). An output without `</think>` is all
reasoning, with content null, as in vLLM. A request with a grammar (`response_format`, a forced
tool call) is not split: the grammar holds from its first token, so there is no thinking.

`qwen3` (vLLM's name) differs where Qwen3 does: the hybrid models write `<think>` themselves
when they think, so only an output that opens with `<think>` is split; one that does not is
the answer, all content (as vLLM's parser returns an output without think tags). With
`chat_template_kwargs: {"enable_thinking": false}` the template closes an empty think block in
the prompt and nothing is split (vLLM's parser reads the same kwarg). A template that opens the
block in the prompt (Qwen3's Thinking-2507 models end it with `<think>`) makes the output start
inside the thinking, as with deepseek_r1; one that closes it there (any prompt ending `</think>`)
leaves nothing to split. See `mode`.

Streamed, text that may be the start of `</think>` is held until it is known; log-probs go out
with the text they score, as with tool calls.

`usage.completion_tokens_details.reasoning_tokens` counts the output tokens up to the one that
completes `</think>` (all of them when it never comes), from the engine's deltas as they were
made, one token each, before the stream interval merges them.
"""

from __future__ import annotations

from typing import Any

from fairbatch.deployments.api.schemas import finish_reason
from fairbatch.deployments.api.tool_parsers import split_at

PARSERS = ("deepseek_r1", "qwen3")

# How one output is split (`mode`): "open" starts inside the thinking (a leading <think> is
# dropped), "tag" thinks only when the output opens with <think>, "off" is all content.
MODES = ("open", "tag", "off")


def mode(parser: str | None, template_kwargs: dict[str, Any] | None, prompt: str) -> str | None:
    """The split of a chat reply under the app's `reasoning_parser` (None: no parser), from the
    request's `chat_template_kwargs` and the rendered prompt text."""
    if parser is None:
        return None
    if parser == "deepseek_r1":
        return "open"  # (its templates end the prompt with <think>)
    if (template_kwargs or {}).get("enable_thinking") is False:  # as the template tests it
        return "off"
    end = prompt.rstrip()
    if end.endswith(ReasoningSplit.END):  # the prompt closed the block: no thinking follows
        return "off"
    return "open" if end.endswith(ReasoningSplit.START) else "tag"


class ReasoningSplit:
    """One request's output -> `reasoning_content`, then the content `inner` makes of the rest
    (a tool-call converter, or None for plain content)."""

    START, END = "<think>", "</think>"

    def __init__(self, inner: Any = None, mode: str = "open") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.inner = inner
        self.mode = mode
        self.thinking = mode != "off"  # before </think>
        self.skipped = mode == "off"  # no thinking in this output: it is all content
        self.opened = False  # past where a leading <think> would be
        self.buf = ""  # held text
        self.reasoning: list[str] = []  # the reasoning that went out
        self.records: list[Any] = []  # log-prob records of held text
        self._counted = 0  # output tokens up to the one that completes </think>
        self._tail: str | None = ""  # the counted text's end (None: </think> was seen)

    @property
    def reasoning_tokens(self) -> int:
        """Output tokens up to the one that completes </think> (all of them when it never
        comes); 0 where the output did not think."""
        return 0 if self.skipped else self._counted

    def count(self, text: str, num_tokens: int) -> None:
        """Count one engine delta (its text and number of tokens) toward `reasoning_tokens`:
        every delta until, and with, the one whose text completes </think>."""
        if self._tail is None:
            return
        self._counted += num_tokens
        seen = self._tail + text
        self._tail = None if self.END in seen else seen[-(len(self.END) - 1) :]

    def _think(self, final: bool) -> tuple[str, str]:
        """(reasoning that goes out now, text after </think>) from the held text."""
        if not self.opened:
            head = self.buf
            if head.startswith(self.START):
                self.buf, self.opened = head[len(self.START) :], True
            elif final or not self.START.startswith(head):
                self.opened = True
                if self.mode == "tag":  # it answers without thinking: all content
                    self.thinking, self.skipped, self.buf = False, True, ""
                    return "", head
            else:
                return "", ""  # (still a start of <think>)
        out, rest = split_at(self.buf, self.END, final)
        if rest is None:
            self.buf = self.buf[len(out) :]
            return out, ""
        self.thinking, self.buf = False, ""
        return out, rest[len(self.END) :]

    def delta(
        self, text: str, reason: str | None, records: list[Any] | None = None
    ) -> tuple[dict, str | None, list[Any]]:
        """The chat delta, finish_reason and log-prob records to send with it, for the next
        piece of output (`reason`: the engine's, None while it runs)."""
        final = reason is not None
        self.records.extend(records or [])
        thought, after = "", text
        if self.thinking:
            self.buf += text
            thought, after = self._think(final)
        delta: dict[str, Any] = {}
        if thought:
            self.reasoning.append(thought)
            delta["reasoning_content"] = thought
        if self.thinking and not final:  # nothing past </think> yet
            if self.buf:
                return delta, None, []
            given, self.records = self.records, []
            return delta, None, given
        held, self.records = self.records, []
        if self.inner is None:
            if after:
                delta["content"] = after
            return delta, finish_reason(reason), held
        inner, finish, given = self.inner.delta(after, reason, held)
        return {**delta, **inner}, finish, given

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole reply's message and finish_reason."""
        after = text
        if self.thinking:
            self.buf += text
            thought, after = self._think(final=True)
            self.reasoning.append(thought)
        if self.thinking:  # never closed: all reasoning, no content
            message, finish = {"role": "assistant", "content": None}, finish_reason(reason)
        elif self.inner is None:
            message, finish = {"role": "assistant", "content": after}, finish_reason(reason)
        else:
            message, finish = self.inner.message(after, reason)
        message["reasoning_content"] = "".join(self.reasoning) or None
        return message, finish
