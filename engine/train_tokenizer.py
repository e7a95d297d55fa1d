"""Train the tiny byte-level BPE tokenizer shipped in `engine/assets/`.

    python -m fairbatch.engine.train_tokenizer            # rewrite the shipped assets
    python -m fairbatch.engine.train_tokenizer --out-dir /tmp/tok --vocab-size 1024

The training text is `engine/assets/corpus.txt` only, not the repository's source files: the
sources change with every commit, and a tokenizer trained on them would change its ids on every
retrain. A frozen corpus makes the assets reproducible byte for byte (a test checks that), so
tiny checkpoints built on these ids stay valid.

Outputs (HF-compatible, `Tokenizer.from_files` and `PreTrainedTokenizerFast` read them):
  tiny_tokenizer.json         the `tokenizers` model (byte-level BPE, 2048 ids, 4 special tokens)
  tiny_tokenizer_config.json  bos/eos tokens and a ChatML chat template
  tiny_generation_config.json bos/eos ids, the end-of-turn token included as an EOS
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS = ASSETS_DIR / "corpus.txt"
VOCAB_SIZE = 2048

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order

# ChatML. Renders the BOS token itself (Llama-3 style), so a rendered chat prompt is encoded with
# add_special_tokens=False. `raise_exception` is provided by Tokenizer.apply_chat_template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on `texts` (deterministic: same texts, same tokenizer)."""
    tok = Tokenizer(models.BPE())
    # GPT-2/Llama-3 style: regex pre-split, bytes mapped to printable characters, so any string
    # encodes without an unknown token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # add_special_tokens=True prepends BOS, as Llama-3 tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config() -> dict:
    """The tokenizer_config.json contents (HF field names)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config(tok: Tokenizer) -> dict:
    """The generation_config.json contents: both end-of-text and end-of-turn stop generation."""
    return {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)],
    }


def read_corpus(paths: list[Path]) -> list[str]:
    """Paragraphs of the corpus files, in file order (training input, one string each)."""
    texts: list[str] = []
    for path in paths:
        texts.extend(p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip())
    return texts


def write_assets(out_dir: Path, corpus: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train and write the three asset files into `out_dir`; returns the tokenizer."""
    tok = build_tokenizer(read_corpus(corpus), vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tiny_tokenizer.json"), pretty=False)
    for name, content in (
        ("tiny_tokenizer_config.json", tokenizer_config()),
        ("tiny_generation_config.json", generation_config(tok)),
    ):
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return tok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ASSETS_DIR)
    parser.add_argument("--corpus", type=Path, action="append", help="default: assets/corpus.txt")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    tok = write_assets(args.out_dir, args.corpus or [CORPUS], args.vocab_size)
    print(f"wrote {args.out_dir}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
