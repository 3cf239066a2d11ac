"""Testing only: keep vLLM's async scheduling on on a CPU (runs in the serving env).

STANDALONE: standard library and vLLM only; imported by path from
``offline_runner.py`` (its own folder is on ``sys.path``) and run as a script
to start ``vllm.entrypoints.openai.api_server`` with the patch in place::

    python harness/serve/cpu_async.py --model DIR ...   # the api_server's flags

vLLM's ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``)
sets ``scheduler_config.async_scheduling = False`` ("async scheduling is not
required on CPU"). ``keep_async_scheduling_on_cpu`` wraps it so that a config
that asked for async scheduling keeps it: the EngineCore then builds the
``--scheduler-cls`` given (``AsyncRecordingScheduler``) with 2 batches in
flight (``VllmConfig.max_concurrent_batches``). vLLM does not support this on
CPU; ``../shared/notes/vllm-cpu-serving.md`` saw it run with tokens unchanged.
"""

from __future__ import annotations

import runpy
import sys

#: The environment variable that lets ``serve-record`` (the server path) force
#: async scheduling on on a CPU; the offline runner needs no permission.
ENV_ALLOW = "SCHED_HARNESS_CPU_ASYNC"


def keep_async_scheduling_on_cpu() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` so that it leaves
    ``scheduler_config.async_scheduling`` as the config asked (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_sched_harness_keeps_async", False):
        return
    inner = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        asked = bool(vllm_config.scheduler_config.async_scheduling)
        inner(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform._sched_harness_keeps_async = True


def main() -> None:
    """``vllm.entrypoints.openai.api_server`` with ``sys.argv[1:]``, patched."""
    keep_async_scheduling_on_cpu()
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
