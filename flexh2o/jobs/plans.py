"""A job's plan per block shape: the batch and placement each (prompt_len, gen_len) runs at.

The weights are placed once, when the job's engine loads, by the plan for the job's longest
block. After that a block of short prompts needs far less cache than the longest one, so a
planned job (no --gpu-batch-size or placement given) asks the cost model again for each distinct
block shape, with the weights as placed and the same capacities: the batch and the cache and
activation placement may differ per shape. Each shape is searched once and its plan reused. A job
given its batch and placement runs every block at them (FixedPlan).
"""

from dataclasses import replace

from flexh2o.planning.search import search


class FixedPlan:
    """Every block at the policy the job was given; a block short of its batch (the last of a
    sampling setting) in gpu-batches just large enough for its records, so that no more than
    num_gpu_batches - 1 filler sequences are computed."""

    def __init__(self, policy):
        self.policy = policy

    def batch_for(self, prompt_len: int, gen_len: int) -> int:
        return self.policy.batch_size

    def policy_for(self, prompt_len: int, gen_len: int, records: int):
        if records >= self.policy.batch_size:
            return self.policy
        return replace(self.policy, gpu_batch_size=-(-records // self.policy.num_gpu_batches))


class SearchedPlans:
    """The cost model's best policy per block shape, the weights kept where `loaded` put them.

    limits: the capacities the job's first plan was searched under (measured before the weights
    loaded: what is free now would count them twice); a policy with nothing on disk has no offload
    store, so its shapes keep their cache off the disk too."""

    def __init__(self, spec, loaded, profile, limits: dict, dtype: str, max_batch: int | None):
        self.spec, self.loaded, self.profile, self.dtype, self.max_batch = spec, loaded, profile, dtype, max_batch
        uses_disk = any(loaded.disk_percent(kind) > 0 for kind in ("w", "cache"))
        self.limits = limits if uses_disk else {**limits, "disk": 0}
        self.plans: dict = {}

    @property
    def searched(self) -> int:
        return len(self.plans)

    def _plan(self, prompt_len: int, gen_len: int, records: int | None = None):
        key = (prompt_len, gen_len, records)
        if key not in self.plans:
            plan = search(self.spec, prompt_len, gen_len, self.profile, self.limits, self.loaded, dtype=self.dtype,
                          max_batch=self.max_batch, total_batch=records,
                          weight_shares=[(self.loaded.w_gpu_percent, self.loaded.w_cpu_percent)])
            self.plans[key] = None if plan is None else replace(plan.policy, **weight_fields(self.loaded))
        return self.plans[key]

    def batch_for(self, prompt_len: int, gen_len: int) -> int:
        policy = self._plan(prompt_len, gen_len)
        return self.loaded.batch_size if policy is None else policy.batch_size

    def policy_for(self, prompt_len: int, gen_len: int, records: int):
        """The policy of a block of `records` records at this shape: the shape's plan, or, for a block
        short of its batch (the last of a length), the plan for exactly its records."""
        policy = self._plan(prompt_len, gen_len)
        if policy is not None and records < policy.batch_size:
            policy = self._plan(prompt_len, gen_len, records) or policy
        return self.loaded if policy is None else policy


def weight_fields(policy) -> dict:
    """What a loaded engine's weights are fixed at."""
    return {"w_gpu_percent": policy.w_gpu_percent, "w_cpu_percent": policy.w_cpu_percent,
            "compress_weight": policy.compress_weight}


def use_plan(engine, plans, prompt_len: int, gen_len: int, records: int):
    """Sets `engine` to the policy `plans` gives a block of `records` records at this shape (what may
    change on a loaded engine); returns that policy."""
    policy = plans.policy_for(prompt_len, gen_len, records)
    if policy is not engine.policy:
        engine.use_policy(**{f: getattr(policy, f) for f in engine.BLOCK_FIELDS})
    return policy
