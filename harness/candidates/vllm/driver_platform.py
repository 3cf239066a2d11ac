"""The CPU-only process vLLM is imported into: environment defaults, platform.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM, torch inside
functions) only. Importing this module sets the ``VLLM_*`` (and Hugging Face)
environment defaults the driver needs before vLLM is imported: the V1 model
runner, the CPU target, no usage stats, offline. ``pin_cpu_platform`` makes
vLLM's ``current_platform`` a ``CpuPlatform`` (``vllm/platforms/__init__.py``,
``vllm/platforms/cpu.py``) whatever the machine has.
"""

from __future__ import annotations

import os

# The V2 model runner lists resumed requests in scheduled_new_reqs; both
# layouts are normalised. Set explicitly (the default depends on Triton).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"0.33.0+cpu"`` -> ``(0, 33, 0)``: the release's numbers, local part dropped."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def pin_cpu_platform() -> None:
    """Make vLLM's ``vllm.platforms._current_platform`` a ``CpuPlatform``
    (what ``vllm.platforms.current_platform`` resolves to on a CPU-only
    machine); kernels it cannot load are not loaded (the scheduler needs
    none)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    import torch

    if hasattr(platform, "import_kernels") and \
            not hasattr(getattr(torch._C, "_cpu", None), "_is_avx512_supported"):
        # Feature probe: some releases (0.17.1) pick their CPU kernels with
        # torch._C._cpu._is_avx512_supported, which torch 2.13.0 lacks. The
        # scheduler needs no kernel (layered envs ship none), so the
        # platform loads none.
        platform.import_kernels = lambda: None
    platforms._current_platform = platform
