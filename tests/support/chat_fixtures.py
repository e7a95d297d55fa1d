"""Shared by the chat tests: a tool definition, a backend that writes a scripted reply, and
transformers' own tokenizer over the tiny model's tokenizer file (the reference for chat
template rendering)."""

from __future__ import annotations

from typing import Any

from fairbatch.engine.tokenizer import ASSETS_DIR, Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}


class ScriptedReply:
    """A backend that writes `reply` in deltas of `piece` characters, whatever the prompt; it
    keeps each request's params and prompt token ids."""

    def __init__(self, reply: str, piece: int = 3) -> None:
        self.tokenizer = Tokenizer.tiny()
        self.max_model_len = 4096
        self.reply, self.piece = reply, piece
        self.params: list = []
        self.prompts: list[list[int]] = []

    async def generate(
        self, prompt_token_ids, params, *, request_id, tenant, priority, fork_of=None
    ):
        from fairbatch.engine.outputs import RequestDelta

        self.params.append(params)
        self.prompts.append(list(prompt_token_ids))
        text = self.reply
        for i in range(0, len(text), self.piece):
            last = i + self.piece >= len(text)
            yield RequestDelta("r", [1], text[i : i + self.piece], last, "stop" if last else None)

    async def abort(self, request_id: str) -> bool:
        return False


def hf_tiny_tokenizer(chat_template: str) -> Any:
    """`transformers.PreTrainedTokenizerFast` on the tiny tokenizer, with `chat_template`."""
    import transformers

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS_DIR / "tiny_tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    hf.chat_template = chat_template
    return hf
