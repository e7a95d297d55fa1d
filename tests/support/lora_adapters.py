"""PEFT LoRA adapters for the embedded tiny model (engine/tiny.py), written offline: the same
shapes as its Llama, random lora_B so the adapter changes the output."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_adapter(path: Path, seed: int, r: int = 8, targets: list[str] | None = None) -> str:
    import peft
    import torch
    import transformers

    from fairbatch.engine.tiny import tiny_config
    from fairbatch.engine.tokenizer import Tokenizer

    c = tiny_config(Tokenizer.tiny().vocab_size)
    hf = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(hf)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets or ALL_TARGETS)
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(str(path))
    return str(path)
