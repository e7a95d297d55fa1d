"""Structured output: constrain a request's tokens to a JSON schema with xgrammar.

A request asks for it with `SamplingParams.structured_output = GrammarSpec(...)`. The spec is
plain data (the schema's JSON text), so it pickles with the request when it moves between
replicas; everything built from it lives here, on one engine:

* Compiled grammars, one per distinct schema text, in a bounded LRU cache. Compiling runs on
  one background thread, never in the step: a request whose grammar is still compiling is held
  here (not yet in the scheduler) and joins the batch when its grammar is ready, so the batch
  never waits for it (`submit`, `admit_ready`).
* One `xgrammar.GrammarMatcher` per running request: the grammar state after its output so
  far. That state is a function of the output tokens alone, so a request that arrives without
  a matcher (imported from another replica, resubmitted after a replica death) gets one by
  replaying its output tokens. Swap and recompute keep the request's tokens and so its matcher.
* The masks of one step: each constrained row's matcher fills its row of one bitmask, then one
  `xgrammar.apply_token_bitmask_inplace` call sets every disallowed logit of those rows to -inf
  (`mask`, called by the runner before the sampler). The sampler then picks only allowed
  tokens; logprobs of such rows describe the masked logits (as in vLLM).
* After each step the matchers accept their row's new token (`advance`). A request ends with
  "stop" when its grammar is complete and allows no further token but a stop token (EOS); a
  grammar that is complete but may go on (a number that could take more digits) lets the
  model choose between EOS and more.

JSON layout: schemas compile with `any_whitespace=False`, so the output is JSON in xgrammar's
default layout (`", "` and `": "` separators, properties in schema order). A random or weak
model given free whitespace tends to emit whitespace until max_tokens; vLLM offers the same
switch (`disable_any_whitespace`). In that layout no raw control character (bytes 0x00-0x1f)
can appear in valid JSON, so tokens containing one are masked out of every constrained row as
well: xgrammar 0.2.9 allows them inside strings with `minLength`/`maxLength` (its character
class there is `[^"\\\r\n]`), which would make the output invalid JSON.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine (distinct schemas)
IDLE_WAIT_S = 0.02  # how long an idle step waits for a grammar before returning
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be: JSON valid against `json_schema` (its JSON text).

    The text is the cache key, and its property order is the output's."""

    json_schema: str

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, Mapping):
            raise ValueError("a JSON schema must be an object")
        return cls(json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(JSON_OBJECT_SCHEMA)


def _xgr():
    try:
        import xgrammar  # imported on first use: it takes a second or more (transformers)
    except ImportError:
        raise ImportError(
            "structured output needs xgrammar: pip install 'fairbatch[structured]'"
        ) from None
    return xgrammar


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")


def _message(e: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix ("[time] file.cc:line: ")."""
    return _LOG_PREFIX.sub("", str(e).strip())[:500]


@functools.lru_cache(maxsize=256)
def schema_error(json_schema: str) -> str | None:
    """None when xgrammar can build a grammar from the schema text, else its message. Needs no
    tokenizer: the API calls it to answer 400 before a request is admitted."""
    try:
        _xgr().Grammar.from_json_schema(json_schema, any_whitespace=False)
    except Exception as e:
        return _message(e)
    return None


def vocab_type_of(tokenizer_json: str) -> Any:
    """xgrammar's vocabulary type of a `tokenizers` JSON: byte-level BPE (GPT-2 style byte
    alphabet: a ByteLevel decoder or pre-tokenizer), byte fallback (SentencePiece style:
    `<0x0A>` byte tokens, a ByteFallback decoder), else raw strings."""
    xgr = _xgr()
    spec = json.loads(tokenizer_json)

    def types(node: Any) -> set[str]:
        if not isinstance(node, dict):
            return set()
        found = {node.get("type")}
        for key in ("decoders", "pretokenizers"):
            for child in node.get(key) or ():
                found |= types(child)
        return found

    decoder = types(spec.get("decoder"))
    if "ByteLevel" in decoder or "ByteLevel" in types(spec.get("pre_tokenizer")):
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(tokenizer_json: str) -> bool:
    """SentencePiece-style tokenizers put "▁" before the first word (Metaspace prepend)."""
    spec = json.loads(tokenizer_json)
    pre = spec.get("pre_tokenizer") or {}
    norm = json.dumps(spec.get("normalizer"))
    meta = pre.get("type") == "Metaspace" and pre.get("prepend_scheme", "always") != "never"
    return meta or '"Prepend"' in norm


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the engine's tokenizer (our `Tokenizer`, over `tokenizers`): each
    id's vocabulary string, the model's vocab size (the logits' width; ids past the tokenizer's
    are never allowed), and the stop tokens. Added special tokens get an empty string, which
    xgrammar never allows (their text would vanish from the output), except as stop tokens."""
    xgr = _xgr()
    backend = tokenizer.backend
    n = min(tokenizer.vocab_size, vocab_size)
    vocab = [backend.id_to_token(i) or "" for i in range(n)]
    for tid, added in backend.get_added_tokens_decoder().items():
        if added.special and tid < n:
            vocab[tid] = ""
    text = backend.to_str()
    return xgr.TokenizerInfo(
        vocab,
        vocab_type_of(text),
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=_adds_prefix_space(text),
    )


@dataclass
class _Held:
    request: Any  # scheduler Request, not yet added
    grammar: concurrent.futures.Future
    admit: Callable[[], Any]  # adds it to the scheduler (add or import)


class StructuredOutput:
    """One engine's grammars, held requests and matchers (used only on the engine thread)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        scheduler: Any,
        *,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        if tokenizer is None or not stop_token_ids:
            raise ValueError("structured output needs the engine's tokenizer and an EOS token")
        xgr = _xgr()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is off: this one is keyed by the schema and bounded in entries.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.scheduler = scheduler
        self.held: dict[str, _Held] = {}  # insertion order = admission order
        self.matchers: dict[str, Any] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._staging = None  # the bitmask's way to a CUDA device, made on first use
        self._probe = xgr.allocate_token_bitmask(1, vocab_size)
        self._stop_words = self._probe.clone().zero_()
        for t in stop_token_ids:
            self._stop_words[0, t // 32] |= _bit(t % 32)
        # tokens no JSON output of ours may contain (see the module docstring)
        self._json_safe = self._probe.clone().fill_(-1)
        for t, piece in enumerate(self.info.decoded_vocab):
            if any(b < 0x20 for b in piece):
                self._json_safe[0, t // 32] &= ~_bit(t % 32)
        self.num_compiled = 0

    # ---- grammars ---------------------------------------------------------------------------

    def compiled(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """The compiled grammar of `spec` (a future: compiling, or done), least recently used
        ones evicted past the cache size."""
        key = spec.json_schema
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, json_schema: str) -> Any:
        try:
            grammar = self._compiler.compile_json_schema(json_schema, any_whitespace=False)
        except Exception as e:
            raise ValueError(f"the JSON schema cannot be compiled: {_message(e)}") from None
        self.num_compiled += 1
        return grammar

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, request: Any, admit: Callable[[], Any], *, after: str | None = None) -> None:
        """Admit `request` (call `admit`, start its matcher) now if its grammar is compiled,
        else hold it until `admit_ready` finds the grammar ready. `after`: a request that must
        be admitted first (the parent of a forked sample). Raises ValueError when the request
        cannot run: a schema that does not compile, output tokens the grammar rejects, or what
        `admit` raises (for a held request: the scheduler's checks, made here first)."""
        rid = request.request_id
        grammar = self.compiled(request.sampling_params.structured_output)
        if grammar.done() and after not in self.held:
            matcher = self._matcher(grammar.result(), request.output_token_ids)
            admit()
            self.matchers[rid] = matcher
            return
        if rid in self.held or rid in self.scheduler.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        limit = self.scheduler.max_model_len
        if request.num_tokens >= limit:
            raise ValueError(f"prompt has {request.num_tokens} tokens; the limit is {limit - 1}")
        self.held[rid] = _Held(request, grammar, admit)

    def admit_ready(self, idle: bool) -> list[str]:
        """Admit the held requests whose grammar is ready, in arrival order; returns the ids of
        those that cannot run (their stream ends with an error). `idle`: nothing else to run,
        so wait a little for a grammar instead of returning at once (no busy loop)."""
        if not self.held:
            return []
        if idle:
            pending = [h.grammar for h in self.held.values()]
            concurrent.futures.wait(
                pending, IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
        failed = []
        for rid, h in list(self.held.items()):
            if not h.grammar.done():
                continue
            del self.held[rid]
            try:
                self.matchers[rid] = self._matcher(h.grammar.result(), h.request.output_token_ids)
                h.admit()
            except Exception:
                self.matchers.pop(rid, None)
                failed.append(rid)
        return failed

    def _matcher(self, grammar: Any, output_token_ids: Sequence[int]) -> Any:
        matcher = self._xgr.GrammarMatcher(grammar)
        for token in output_token_ids:  # a moved or resubmitted request: replay its output
            if not matcher.accept_token(token):
                raise ValueError("the request's output tokens do not match its grammar")
        return matcher

    def take(self, request_id: str) -> Any:
        """Forget the request: returns it if it was held (never admitted), else None."""
        self.matchers.pop(request_id, None)
        h = self.held.pop(request_id, None)
        return None if h is None else h.request

    # ---- the step ---------------------------------------------------------------------------

    def mask(self, logits: Any, requests: Sequence[Any]) -> Any:
        """Set the disallowed logits of every constrained row to -inf (rows: `requests`, the
        step's sampling requests in logits order). One bitmask, one apply call for the step."""
        if not self.matchers:
            return logits
        matchers = self.matchers
        rows = [i for i, r in enumerate(requests) if r.request_id in matchers]
        if not rows:
            return logits
        num_rows = logits.shape[0]
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = self._xgr.allocate_token_bitmask(2 * num_rows, self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        for i in rows:
            matchers[requests[i].request_id].fill_next_token_bitmask(bitmask, i)
        bitmask &= self._json_safe
        if len(rows) < num_rows:
            # Rows without a grammar allow every token, so the mask covers the whole batch
            # and xgrammar needs no row list (on CUDA it would copy one over, blocking).
            bitmask[[i for i, r in enumerate(requests) if r.request_id not in matchers]] = -1
        if logits.dtype != _float32():
            logits = logits.float()
        if logits.device.type != "cpu":
            # pinned and non-blocking (a pageable copy makes the host wait)
            bitmask = self._staging_for(logits.device).upload([bitmask])[0]
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)
        return logits

    def _staging_for(self, device: Any) -> Any:
        from fairbatch.engine.staging import Staging

        if self._staging is None or self._staging.device != device:
            self._staging = Staging(device)
        return self._staging

    def advance(self, new_tokens: Mapping[str, int], finished: Mapping[str, str]) -> dict:
        """Feed each constrained request its new token. Returns `finished` plus the requests
        whose grammar is now done ("stop"; the scheduler is told), without the finished ones'
        matchers."""
        out = dict(finished)
        matchers = self.matchers
        for rid, token in new_tokens.items():
            matcher = matchers.get(rid)
            if matcher is None:
                continue
            reason = out.get(rid)
            if reason == "length":  # its last token: if it completes the grammar, a "stop"
                if matcher.accept_token(token) and (matcher.is_terminated() or self._done(matcher)):
                    out[rid] = "stop"
                continue
            if reason is not None:
                continue
            if not matcher.accept_token(token) or matcher.is_terminated() or self._done(matcher):
                self.scheduler.finish_request(rid, _stopped())
                out[rid] = "stop"
        for rid in out:
            matchers.pop(rid, None)
        if len(matchers) > len(self.scheduler.requests):  # ended elsewhere (a stop string)
            for rid in [r for r in matchers if r not in self.scheduler.requests]:
                del matchers[rid]
        return out

    def _done(self, matcher: Any) -> bool:
        """Complete, and nothing but a stop token may follow."""
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._probe, 0)
        return not bool((self._probe & self._json_safe & ~self._stop_words).any())


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a signed int32 value (bit 31 is the sign)."""
    return (1 << k) - (1 << 32 if k == 31 else 0)


def _float32() -> Any:
    import torch

    return torch.float32


def _stopped() -> Any:
    from fairbatch.scheduler import RequestStatus

    return RequestStatus.FINISHED_STOPPED
