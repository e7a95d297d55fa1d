"""What one step charges: tenants by rate, and, serving LoRA, each (tenant, adapter) flow.

Every running request is one decode token of its tenant's rate (the policy counts the step,
`Policy.charge_decode_step`) less the requests that sampled nothing; prompt tokens are charged
once, when first computed (a recompute after preemption is not the tenant's doing). Serving
LoRA, the same tokens are charged per flow (`Policy.charge_flows`), which takes a walk over
the running requests that an engine without adapters is spared.
"""

from __future__ import annotations

from collections import Counter

from fairbatch.scheduler.request import Request

Flow = tuple[str, str | None]  # (tenant, adapter name or None)


class StepCharges:
    def __init__(self, running: list[Request], sampled: dict[str, int], flows: bool) -> None:
        self.prefill: dict[str, int] = {}
        self.flow_prefill: dict[Flow, int] | None = None  # None: no flows charged
        self.flow_decode: Counter[Flow] = Counter()
        if not flows:
            self.missed = Counter(r.tenant for r in running if r.request_id not in sampled)
            return
        self.missed, self.flow_prefill = Counter(), {}
        for r in running:  # one walk, as the line above does
            if r.request_id in sampled:
                self.flow_decode[(r.tenant, r.lora_name)] += 1
            else:
                self.missed[r.tenant] += 1

    def prompt(self, request: Request) -> None:
        """Count the prompt tokens `request` computed for the first time."""
        new_prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        charged = request.num_prompt_charged
        if new_prompt > charged:
            t = request.tenant
            self.prefill[t] = self.prefill.get(t, 0) + new_prompt - charged
            if self.flow_prefill is not None:
                flow = (t, request.lora_name)
                self.flow_prefill[flow] = self.flow_prefill.get(flow, 0) + new_prompt - charged
            request.num_prompt_charged = new_prompt

    def charge(self, policy) -> None:
        """Charge the step's prompt tokens and flows; the decode step was charged at once."""
        if self.prefill:
            policy.charge_step(self.prefill, {})
        if self.flow_prefill is not None and (self.flow_prefill or self.flow_decode):
            policy.charge_flows(self.flow_prefill, self.flow_decode)
