"""Parallel sampling: sibling samples started on their parent's prompt blocks.

Each sample of an n > 1 request is a request of its own; a sibling added with `fork_of` (the
first sample's id) is held here, outside the scheduler's queues, until that parent's prefill
completes. Then it is forked: it shares the parent's full prompt blocks, gets a copy of the
block holding position L - 1 (L = prompt length), and computes only that last prompt token
itself, which yields its own first logits. Its prompt is charged once, to the parent. Without
a seat or a free block then, or when the parent leaves before its prefill is done, the sibling
is queued as an ordinary request (prefix-cache hits still share blocks).
"""

from __future__ import annotations

from collections.abc import Callable

from fairbatch.kv.manager import KVCacheManager
from fairbatch.scheduler.request import Request


class Forks:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.held: dict[str, list[Request]] = {}  # parent id -> siblings waiting for it
        self.copies: list[tuple[int, int]] = []  # forks' block copies, for the next output
        self.num_forks = 0  # siblings started on their parent's blocks

    def hold(self, parent_id: str, sibling: Request) -> None:
        sibling.fork_of = parent_id
        self.held.setdefault(parent_id, []).append(sibling)

    def remove(self, sibling: Request) -> None:
        """Take a held sibling out (it finished or moved before its parent's prefill)."""
        siblings = self.held[sibling.fork_of]
        siblings.remove(sibling)
        if not siblings:
            del self.held[sibling.fork_of]
        sibling.fork_of = None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def release(
        self,
        parent: Request,
        can_fork: bool,
        num_running: int,
        enqueue: Callable[[Request], None],
    ) -> list[Request]:
        """Release the siblings held for `parent`: forked from its blocks if `can_fork` (its
        prompt is computed) and room allows, else `enqueue`d as ordinary requests. Each
        inherits the prompt tokens charged to the parent, so the tenant pays for the prompt
        once. Returns the forked ones, for the caller to start running (`num_running`: the
        seats taken before them)."""
        forked: list[Request] = []
        for sibling in self.held.pop(parent.request_id, ()):
            sibling.fork_of = None
            sibling.num_prompt_charged = parent.num_prompt_charged
            if can_fork and self._fork(parent, sibling, num_running + len(forked)):
                forked.append(sibling)
            else:
                enqueue(sibling)
        return forked

    def _fork(self, parent: Request, sibling: Request, num_running: int) -> bool:
        """Start `sibling` on its parent's prompt blocks (the parent's prompt is computed):
        positions < L - 1 shared or copied, the last prompt token left for it to compute, so
        that its step yields its own first logits. False (nothing changed) without a seat, a
        free block for the copy, or the prompt log-probs it asks for."""
        if num_running >= self.max_num_seqs:
            return False
        plp = sibling.prompt_logprobs
        if plp is not None and plp.num_missing:
            src = parent.prompt_logprobs
            if src is None or src.num_missing or src.top != plp.top:
                return False  # it computes its prompt itself
        num_tokens = sibling.num_prompt_tokens - 1
        copies = self.kv.fork(parent, sibling, num_tokens)
        if copies is None:
            return False
        if plp is not None and plp.num_missing:
            plp.entries = list(parent.prompt_logprobs.entries)
            plp.num_missing = 0
        self.copies.extend(copies)
        sibling.num_computed_tokens = num_tokens
        sibling.num_cached_tokens = parent.num_cached_tokens
        self.num_forks += 1
        return True

    def check_integrity(self, requests: dict[str, Request]) -> int:
        """Assert the held siblings are consistent; returns how many there are."""
        for parent_id, siblings in self.held.items():
            assert parent_id in requests, f"siblings held for {parent_id!r}, which left"
            assert all(s.fork_of == parent_id for s in siblings), "a held sibling lost its parent"
        return sum(len(siblings) for siblings in self.held.values())
