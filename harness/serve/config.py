"""Our ``EngineConfig`` as vLLM engine arguments (offline ``LLM(...)``) and ``vllm serve`` flags.

The names are vLLM's (``vllm/engine/arg_utils.py`` ``EngineArgs``): most fields carry
over under the same name; ``num_gpu_blocks`` is ``num_gpu_blocks_override`` and
``policy`` is ``scheduling_policy``. A field the serving path cannot give vLLM
(speculative decoding, parallelism, the simulated KV connector, encoder inputs,
deferred frees) is refused when it is not at its default: ``ServeConfigError``
names it. ``async_scheduling`` is passed on (vLLM's ``AsyncScheduler``, 2 batches in
flight), but on CPU vLLM forces it off: the offline runner keeps it on for testing
(``cpu_async.py``), the server path only with ``SCHED_HARNESS_CPU_ASYNC=1``. The fields only our virtual clock and scripted
model read (``step_fixed_s``, ``step_per_token_s``, ``draft_acceptance_*``) pass.

CPU rules (``../shared/notes/vllm-cpu-serving.md``): the CPU attention backend wants
a block size that is a multiple of 32 (vLLM's GPU default is 16), so the serving
commands default ``block_size`` to 32 and refuse other sizes on CPU;
``gpu_memory_utilization`` is a share of CPU RAM there (0.1 works; the pool is set
by ``num_gpu_blocks_override``); async scheduling is forced off on CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from reference.config import EngineConfig

#: Our name -> vLLM's EngineArgs name.
VLLM_NAMES = {
    "num_gpu_blocks": "num_gpu_blocks_override",
    "block_size": "block_size",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_scheduled_tokens": "max_num_scheduled_tokens",
    "policy": "scheduling_policy",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "watermark": "watermark",
    "scheduler_reserve_full_isl": "scheduler_reserve_full_isl",
}
#: Set to 1 to let the server path force async scheduling on on CPU (testing only).
ENV_CPU_ASYNC = "SCHED_HARNESS_CPU_ASYNC"
#: Fields only the harness reads (the virtual clock, the scripted model).
HARNESS_ONLY = ("step_fixed_s", "step_per_token_s", "draft_acceptance_rate", "draft_acceptance_pattern")
#: The CPU serving block size (a multiple of 32 is required by CPU_ATTN).
CPU_BLOCK_SIZE = 32
#: Share of CPU RAM vLLM may reserve on CPU (0.92, the GPU default, fails).
CPU_MEMORY_UTILIZATION = 0.1


class ServeConfigError(ValueError):
    """A config the serving path cannot run; the message is one line."""


def check_servable(config: EngineConfig, *, cpu: bool = True, offline: bool = True) -> None:
    """Raise ServeConfigError if ``config`` sets something vLLM cannot be given here.

    ``async_scheduling`` on a CPU server (``offline`` False) needs
    ``SCHED_HARNESS_CPU_ASYNC=1``: vLLM forces it off there and does not support it."""
    if config.async_scheduling and cpu and not offline and os.environ.get(ENV_CPU_ASYNC) != "1":
        raise ServeConfigError(f"async_scheduling=true: vLLM forces async scheduling off on CPU "
                               f"(CpuPlatform.check_and_update_config); use --offline, or set "
                               f"{ENV_CPU_ASYNC}=1 to force it on for testing (unsupported by vLLM)")
    default = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name in VLLM_NAMES or f.name in HARNESS_ONLY or f.name == "async_scheduling":
            continue
        if getattr(config, f.name) != getattr(default, f.name):
            raise ServeConfigError(f"{f.name}={getattr(config, f.name)!r} cannot be served by this "
                                   f"command (supported: {', '.join(VLLM_NAMES)})")
    if cpu and config.block_size % CPU_BLOCK_SIZE:
        raise ServeConfigError(f"block_size={config.block_size}: vLLM's CPU attention backend needs a "
                               f"multiple of {CPU_BLOCK_SIZE} (--set block_size={CPU_BLOCK_SIZE})")


def engine_args(config: EngineConfig, *, seed: int = 0, cpu: bool = True,
                offline: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(model, **args)`` (vLLM's ``EngineArgs`` names).

    Always: ``skip_tokenizer_init`` (token-id prompts, no tokenizer),
    ``enforce_eager``, ``async_scheduling`` as the config says (False unless set:
    vLLM's GPU default is on), ``seed``; on CPU ``gpu_memory_utilization`` 0.1.
    Raises ServeConfigError (``check_servable``; ``offline``: the in-process runner).
    """
    check_servable(config, cpu=cpu, offline=offline)
    args: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True,
                            "async_scheduling": bool(config.async_scheduling), "seed": int(seed)}
    if cpu:
        args["gpu_memory_utilization"] = CPU_MEMORY_UTILIZATION
    for ours, theirs in VLLM_NAMES.items():
        value = getattr(config, ours)
        if value is None:
            continue
        args[theirs] = value
    return args


def serve_flags(config: EngineConfig, *, seed: int = 0, cpu: bool = True) -> list[str]:
    """The same as ``engine_args`` as ``vllm serve`` command-line flags
    (``--name-with-dashes VALUE``; booleans as ``--x`` / ``--no-x``)."""
    out: list[str] = []
    for key, value in engine_args(config, seed=seed, cpu=cpu, offline=False).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out
