"""One replica's data plane: model, sampler, tokenizer, runners and the step loop.

`from fairbatch.engine import LLM, SamplingParams` loads torch; the simulated runner
(`fairbatch.engine.sim_runner`) does not.
"""

from __future__ import annotations

from typing import Any

from fairbatch.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineCore", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the simulated runner) must not pull in torch.
    if name in ("LLM", "RequestOutput"):
        from fairbatch.engine import llm

        return getattr(llm, name)
    if name == "EngineCore":
        from fairbatch.engine.core import EngineCore

        return EngineCore
    if name == "AsyncEngine":
        from fairbatch.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
