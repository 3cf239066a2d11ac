"""Named canonical scenarios: small workloads + configs that exercise one
feature each. Goldens are recordings of them; the mutation self-test runs
every mutant on every scenario.

A scenario is fully determined by its name: same name, same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from reference.config import EngineConfig
from reference.workload import Action, Workload
from workloads import synthetic

# Block size 4 keeps the tables short enough to read in a diff.
_SMALL = dict(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64)


@dataclass(frozen=True)
class Scenario:
    """A named, deterministic (workload, config, seed) triple; ``actions``:
    engine-level events at steps (``reference.workload.Action``), also listed
    in the workload's ``params["actions"]`` so a recording replays them."""

    name: str
    description: str
    config: dict[str, Any]
    workload: dict[str, Any]
    seed: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)
    actions: tuple[Action, ...] = ()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.config)

    def make_workload(self) -> Workload:
        wl = synthetic(**self.workload, seed=self.seed)
        if not self.actions:
            return wl
        return replace(wl, actions=self.actions,
                       params={**wl.params, "actions": [a.to_dict() for a in self.actions]})


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("fcfs-tight", "FCFS on a pool so small that decodes preempt the running tail",
             {**_SMALL, "num_gpu_blocks": 30}, {"num_requests": 60}),
    Scenario("fcfs-roomy", "FCFS with max_num_seqs as the binding limit, no preemption",
             {**_SMALL, "num_gpu_blocks": 200}, {"num_requests": 60}),
    Scenario("priority-tight", "PRIORITY with three levels, preemption by (priority, arrival)",
             {**_SMALL, "num_gpu_blocks": 30, "policy": "priority", "scheduler_reserve_full_isl": False},
             {"num_requests": 60, "priority_levels": 3, "arrival_rate": 40.0}),
    Scenario("prefix-sharing", "half the prompts share a 32-token prefix: prefix hits and shared blocks",
             {**_SMALL, "num_gpu_blocks": 60},
             {"num_requests": 40, "shared_prefix_len": 32, "shared_prefix_fraction": 0.5}),
    Scenario("no-prefix-caching", "prefix caching off: freed blocks go to the head, no hits",
             {**_SMALL, "num_gpu_blocks": 30, "enable_prefix_caching": False,
              "scheduler_reserve_full_isl": False}, {"num_requests": 40}),
    Scenario("chunked-threshold", "long_prefill_token_threshold 8: prefills in chunks of at most 8",
             {**_SMALL, "num_gpu_blocks": 60, "long_prefill_token_threshold": 8}, {"num_requests": 30}),
    Scenario("no-chunked-prefill", "chunked prefill off: a prompt that does not fit the budget waits",
             {**_SMALL, "num_gpu_blocks": 60, "enable_chunked_prefill": False,
              "max_num_batched_tokens": 96}, {"num_requests": 30}),
    Scenario("eos-stop-abort", "EOS stops, aborts in flight and in waiting",
             {**_SMALL, "num_gpu_blocks": 40},
             {"num_requests": 40, "eos_fraction": 0.5, "abort_fraction": 0.3, "arrival_rate": 40.0}),
    Scenario("preemption-heavy", "no full-sequence gate: admissions overcommit, many preemptions",
             {**_SMALL, "num_gpu_blocks": 30, "scheduler_reserve_full_isl": False,
              "watermark": 0.0}, {"num_requests": 60, "arrival_rate": 40.0}),
    Scenario("spec-decode", "3 speculative tokens, 60% draft acceptance, EOS stops, a tight pool",
             {**_SMALL, "num_gpu_blocks": 34, "num_speculative_tokens": 3, "draft_acceptance_rate": 0.6,
              "scheduler_reserve_full_isl": False},
             {"num_requests": 40, "eos_fraction": 0.5, "output_len": (1, 24), "arrival_rate": 30.0}),
    Scenario("spec-decode-priority", "speculative decoding under PRIORITY: give-back drops drafts",
             {**_SMALL, "num_gpu_blocks": 34, "num_speculative_tokens": 2, "draft_acceptance_rate": 0.8,
              "policy": "priority", "scheduler_reserve_full_isl": False},
             {"num_requests": 40, "priority_levels": 3, "output_len": (1, 24), "arrival_rate": 30.0}),
    Scenario("async-tight", "async scheduling (2 batches in flight) on a tight pool: placeholders, "
             "preemption with output in flight (stale output delivered, resume skipped until then)",
             {**_SMALL, "num_gpu_blocks": 30, "async_scheduling": True,
              "scheduler_reserve_full_isl": False},
             {"num_requests": 50, "eos_fraction": 0.3, "arrival_rate": 40.0}),
    Scenario("pipeline-3", "three batches in flight without async scheduling (pipeline-parallel-like)",
             {**_SMALL, "num_gpu_blocks": 40, "pipeline_parallel_size": 3}, {"num_requests": 40}),
    Scenario("async-pipeline-3", "async scheduling with 3 batches in flight: preempted requests wait "
             "for their stale output before they resume",
             {**_SMALL, "num_gpu_blocks": 30, "async_scheduling": True, "pipeline_parallel_size": 3,
              "scheduler_reserve_full_isl": False},
             {"num_requests": 40, "arrival_rate": 40.0}),
    Scenario("prefill-cadence", "prefill_schedule_interval 3: with decodes running, prefill compute "
             "waits for every third executed step (local cadence, capacity guard)",
             {**_SMALL, "num_gpu_blocks": 60, "prefill_schedule_interval": 3},
             {"num_requests": 40, "arrival_rate": 20.0}),
    Scenario("dp2-throttle", "two data-parallel ranks, each its own pool; the coordinator routes to "
             "the least-loaded rank and throttles prefills off every third step",
             {**_SMALL, "num_gpu_blocks": 30, "data_parallel_size": 2, "prefill_schedule_interval": 3},
             {"num_requests": 60, "arrival_rate": 40.0}),
    Scenario("deferred-frees", "async scheduling with deferred, fenced block frees and aborts in flight",
             {**_SMALL, "num_gpu_blocks": 30, "async_scheduling": True,
              "defer_block_free": True, "scheduler_reserve_full_isl": False},
             {"num_requests": 50, "eos_fraction": 0.3, "abort_fraction": 0.3, "arrival_rate": 40.0}),
    Scenario("kv-connector", "a KV-consumer connector holding 80% of the prompt blocks (shared "
             "prefixes too): async loads over 3 steps (WAITING_FOR_REMOTE_KVS), reservations, "
             "promotion, failed loads recomputed, aborts while loading",
             {**_SMALL, "num_gpu_blocks": 60, "kv_connector": True, "kv_store_fraction": 0.8,
              "kv_load_steps": 3, "kv_load_failure_rate": 0.25, "step_fixed_s": 0.05},
             {"num_requests": 40, "shared_prefix_len": 16, "shared_prefix_fraction": 0.5,
              "abort_fraction": 0.4, "arrival_rate": 20.0}),
    Scenario("encoder-inputs", "encoder inputs (six 4-token items per prompt, drawn from 16 distinct "
             "items) under PRIORITY on a tight pool: a one-item encoder budget and an 8-item encoder "
             "cache cut windows before items and skip waiting requests, identical items share cache "
             "entries, evictions oldest first, give-back returns encoder budget",
             {**_SMALL, "num_gpu_blocks": 30, "policy": "priority", "scheduler_reserve_full_isl": False,
              "long_prefill_token_threshold": 12, "max_num_encoder_input_tokens": 4,
              "encoder_cache_size": 32},
             {"num_requests": 60, "priority_levels": 3, "arrival_rate": 80.0, "prompt_len": (1, 32),
              "output_len": (1, 24), "mm_fraction": 1.0, "mm_item_len": 4, "mm_items_per_request": 6,
              "mm_distinct_items": 16}),
]}


#: Scenarios with ``[[actions]]`` (prefix-cache resets, abort sets): run by the
#: mutation self-test beside ``SCENARIOS``, without goldens (the goldens stay the
#: recordings of ``SCENARIOS``). Their hand-written counterparts with exact
#: figures are traces/scenarios/reset-prefix-cache-*.toml.
ACTION_SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("prefix-reset", "prefix sharing with prefix-cache resets: refused while blocks are held "
             "(step 5), forced (reset_running_requests: every running request preempted, tail first) "
             "at steps 12 and 25, and an abort action at step 8",
             {**_SMALL, "num_gpu_blocks": 60},
             {"num_requests": 40, "shared_prefix_len": 32, "shared_prefix_fraction": 0.5},
             actions=(Action(5, "reset_prefix_cache"),
                      Action(8, "abort", request_ids=("r000001", "r000002")),
                      Action(12, "reset_prefix_cache", reset_running_requests=True),
                      Action(25, "reset_prefix_cache", reset_running_requests=True))),
]}
