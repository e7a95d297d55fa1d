"""Streaming token ids -> text deltas, with stop strings.

Two stages, each holding back text it cannot decide yet:

1. Decoding. Byte-level BPE tokens can end inside a UTF-8 character, and a decoder's output for
   a token can depend on its left context (SentencePiece drops the leading space of a decode).
   So we decode a short window of tokens (vLLM's prefix/read offsets): `window[:read_offset]`
   is context whose text is already out, `window[read_offset:]` is new. The delta is the
   window's text minus the context's text. While the window's text ends in U+FFFD (an
   unfinished character) nothing is emitted and the window grows until the character
   completes; once text is emitted, the new tokens become the next context and older ones are
   dropped. Each step decodes a few tokens, not the whole output: O(1) per token, not O(n).

2. Stop strings. Text that could still turn into a stop string (a suffix that is a proper
   prefix of one) is held back; nothing past a stop string is ever emitted. Among matches the
   one that ends first wins (ties: the longer one), which does not depend on how the text was
   split into deltas. The output ends just before it, or just after it when
   `include_stop_str_in_output`.

Contract: without a stop match, the deltas of `add_token` followed by `finish()` concatenate to
the text of the output tokens decoded after the prompt context. For byte-level BPE (the tiny
tokenizer, Llama-3, Qwen, GPT-2 families) that is exactly `tokenizer.decode(output_ids)`; for
SentencePiece-style decoders it keeps the leading space the prompt context implies, as vLLM
does. With a stop match it is that text cut at the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from fairbatch.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context of the first output token


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # the tokens that end the request: the engine leaves the last one out of the text
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stopped = False  # a stop string matched; further tokens are ignored
        self.stop_reason: str | None = None  # the stop string that matched
        self.num_output_tokens = 0

        # Token window state. Only a short prompt tail is kept, as context.
        ctx = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        ctx_text = self._decode(ctx)
        if ctx_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes could complete it and
            # the context text would change under our feet. Decode the output on its own.
            ctx, ctx_text = [], ""
        self._window = ctx  # context tokens, then the tokens whose text is not out yet
        self._read_offset = len(ctx)  # first token of the window whose text is not out yet
        self._prefix_text = ctx_text  # text of the context, _window[:_read_offset]

        # Stop-string state: decoded text not yet emitted, because it may start a stop string.
        self._held = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    @classmethod
    def resume(
        cls,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        **kwargs: object,
    ) -> IncrementalDetokenizer:
        """A detokenizer in the state it would have after `output_token_ids` were added.

        For a request resumed on another replica: the client already holds the text emitted
        for those tokens, and deltas of later tokens continue it without gap or repeat
        (replaying is deterministic, held-back text included). Costs one pass over the output.
        """
        detok = cls(tokenizer, prompt_token_ids, **kwargs)  # type: ignore[arg-type]
        for token_id in output_token_ids:
            detok.add_token(token_id)
        return detok

    def add_token(self, token_id: int) -> str:
        """Append one output token; returns the text that is now final (possibly "").

        After a stop string matched, tokens are ignored and "" is returned.
        """
        if self.stopped:
            return ""
        self.num_output_tokens += 1
        self._window.append(token_id)
        return self._check_stop(self._decode_delta(final=False), final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of the request (unfinished characters included).

        Call once when the request ends for a reason other than a stop string (EOS, stop token,
        length, abort); returns "" if a stop string already matched.
        """
        if self.stopped:
            return ""
        return self._check_stop(self._decode_delta(final=True), final=True)

    @property
    def output_text_held(self) -> str:
        """Decoded text held back because it might begin a stop string (for debugging)."""
        return self._held

    # -- stage 1: tokens -> text ----------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_delta(self, final: bool) -> str:
        """New text of the tokens after read_offset, "" while it may still change."""
        if self._read_offset == len(self._window):
            return ""
        text = self._decode(self._window)
        # Hold back while the last character is unfinished, or nothing new appeared (a special
        # token skipped, or a token that only affects how the next one decodes).
        if not final and (len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = text[len(self._prefix_text) :]
        # The new tokens become the next context; older tokens are no longer needed.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    # -- stage 2: stop strings ------------------------------------------------------------

    def _check_stop(self, delta: str, final: bool) -> str:
        """Emit what is decided of held + delta: cut at a stop string, hold a possible start."""
        if not self.stop:
            return delta
        if not delta and not final:
            return ""
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop_str = match
            self.stopped, self.stop_reason = True, stop_str
            self._held = ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            return text[:end]
        keep = 0 if final else self._held_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first (ties: starts first), or None."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), start, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        # Only the last max_stop_len - 1 characters can matter; anything before is decided.
        for n in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0
