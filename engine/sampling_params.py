"""Per-request sampling parameters, with the names and meanings vLLM and OpenAI users know.

Validation happens once, in `__post_init__`, so everything downstream (sampler, detokenizer,
engine) can trust the values. Ranges:

* `temperature >= 0` (finite). No upper bound: vLLM accepts any non-negative value, and a cap
  such as OpenAI's 2.0 is an ingress policy, not an engine one. Below `SAMPLING_EPS` the request
  is greedy (dividing by a near-zero temperature would overflow the logits anyway).
* `top_p` in (0, 1]; `top_k` is 0 or -1 (off) or >= 1; `min_p` in [0, 1].
* `presence_penalty`, `frequency_penalty` in [-2, 2] (OpenAI's range); `repetition_penalty > 0`
  (1 = off).
* `max_tokens >= 1`; `logprobs` None or 0..20 (0 = only the sampled token's logprob);
  `prompt_logprobs` None or 0..20 (vLLM's name: a log-prob record for every prompt position).
* `logit_bias`: {token id >= 0: bias}, each bias clamped to [-100, 100] as OpenAI does; the
  engine checks the ids against its vocabulary when the request is added.
* `n` in [1, MAX_N]: samples of the prompt. The engine runs each as a request of its own
  (`for_sample(i)`: n = 1 and sample i's seed, see `sample_seed`); the siblings share the
  prompt's K/V blocks (`EngineCore.add_request(..., fork_of=...)`).
* `timeout`, `max_queue_time_s`: None or seconds in (0, MAX_DEADLINE_S], counted from the
  request's arrival: the request ends with finish reason "timeout" at `timeout`, or at
  `max_queue_time_s` if it was not scheduled by then (the scheduler evicts it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fairbatch.engine.structured import GrammarSpec

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
SAMPLING_EPS = 1e-5  # temperatures below this are greedy; penalties this close to neutral are off
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 16  # samples of one prompt
MAX_DEADLINE_S = 86_400.0  # the longest timeout / max_queue_time_s (a day)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, step: int) -> int:
    """The generator seed for decoding step `step` (0-based output index) of a request.

    A 63-bit mix of both ints (splitmix64), so nearby (seed, step) pairs get unrelated streams.
    Any Python int is accepted; seeds are taken modulo 2**64 (so -1 and 2**64 - 1 agree).
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64) >> 1


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 keeps it (so n = 1
    and sample 0 of n > 1 agree), sample i >= 1 gets `derive_seed(seed, -i)` (negative steps,
    which no decoding step uses). None stays None: unseeded samples draw independently."""
    if seed is None or index == 0:
        return seed
    return derive_seed(seed, -index)


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raise ValueError naming `name` unless lo <= value <= hi (lo < value if lo_open), finite."""
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class LoRARequest:
    """What a request names to run under a LoRA adapter: a name (the adapter's identity in the
    engine: its pool slot and prefix-cache salt) and the PEFT directory it is loaded from."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"a LoRA adapter name must be a non-empty string, got {self.name!r}")
        if not (isinstance(self.path, str) and self.path):
            raise ValueError(f"a LoRA adapter path must be a non-empty string, got {self.path!r}")


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    `stop` is normalized to a list of non-empty strings and `stop_token_ids` to a list of ints,
    so readers never see None or a bare string.
    """

    n: int = 1  # number of samples (completions) of the prompt, 1..MAX_N
    max_tokens: int = 16  # upper bound on generated tokens
    temperature: float = 1.0  # 0 (or < SAMPLING_EPS) = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    seed: int | None = None  # makes sampling reproducible and batch-independent (see sampler)
    stop: list[str] | str | None = None  # stop strings, cut from the output text
    # extra stop tokens, besides EOS; the one that stops it is in token_ids, not in the text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # keep generating past EOS tokens
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output
    logprobs: int | None = None  # return the sampled token's logprob and the top-N
    # for every prompt token after the first: its logprob under the model and the top-N
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling
    include_stop_str_in_output: bool = False  # keep the matched stop string (or token) in the text
    skip_special_tokens: bool = True  # drop special tokens from the output text
    # the output must match this grammar (a JSON schema; engine/structured.py)
    structured_output: GrammarSpec | None = None
    timeout: float | None = None  # seconds from arrival to the end, then "timeout"
    max_queue_time_s: float | None = None  # seconds from arrival to the first scheduled token
    # run under this LoRA adapter (None: the base model); carried with the request wherever it
    # goes (a resubmission, a move), like the grammar above
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_range("temperature", float(self.temperature), 0.0, math.inf)
        _check_range("top_p", float(self.top_p), 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int (-1 or 0 = off, or >= 1), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        _check_range("min_p", float(self.min_p), 0.0, 1.0)
        _check_range("presence_penalty", float(self.presence_penalty), -2.0, 2.0)
        _check_range("frequency_penalty", float(self.frequency_penalty), -2.0, 2.0)
        rp = float(self.repetition_penalty)
        if not (math.isfinite(rp) and rp > 0.0):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {rp!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None:
            lp = self.logprobs
            if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {lp!r}"
                )

        if self.prompt_logprobs is not None:
            lp = self.prompt_logprobs
            if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {lp!r}"
                )
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for t, b in dict(self.logit_bias).items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                    raise ValueError(f"logit_bias values must be finite numbers, got {b!r}")
                bias[t] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
            self.logit_bias = bias or None

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")

        for name in ("timeout", "max_queue_time_s"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{name} must be a number of seconds or None, got {value!r}")
                _check_range(name, float(value), 0.0, MAX_DEADLINE_S, lo_open=True)

        so = self.structured_output
        if so is not None and not isinstance(so, GrammarSpec):
            raise ValueError(f"structured_output must be a GrammarSpec or None, got {so!r}")
        if self.lora is not None and not isinstance(self.lora, LoRARequest):
            raise ValueError(f"lora must be a LoRARequest or None, got {self.lora!r}")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` (0 <= index < n) run as a request of its own:
        these with n = 1 and the sample's seed (`sample_seed`)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index must be in [0, {self.n}), got {index}")
        return dataclasses.replace(self, n=1, seed=sample_seed(self.seed, index))

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (after penalties): temperature ~ 0."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty changes the logits."""
        return (
            abs(self.presence_penalty) >= SAMPLING_EPS
            or abs(self.frequency_penalty) >= SAMPLING_EPS
            or abs(self.repetition_penalty - 1.0) >= SAMPLING_EPS
        )

    @property
    def uses_top_k(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0 - SAMPLING_EPS

    @property
    def uses_min_p(self) -> bool:
        return self.min_p >= SAMPLING_EPS
