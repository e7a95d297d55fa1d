"""Shared by the chat tests: a tool definition, and transformers' own tokenizer over the tiny
model's tokenizer file (the reference for chat template rendering)."""

from __future__ import annotations

from typing import Any

from fairbatch.engine.tokenizer import ASSETS_DIR

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
