"""A pytest plugin for vLLM's own test suite, run in a release's env (``harness vllm-tests``).

Loaded with ``-p sched_harness_vllm_tests`` and this folder on ``PYTHONPATH``
(it holds only this module, so nothing else of ours shadows a package); it
imports only the standard library and vLLM, and our recorder by file path.

* Always: vLLM's CPU platform is pinned (the release's env is CPU-only; its
  platform probe finds no device), as ``harness/candidates/vllm/driver.py`` does.
* With ``SCHED_HARNESS_TESTS_RECORD=DIR``: vLLM's ``Scheduler`` and
  ``AsyncScheduler`` (their modules' attributes, which ``tests/v1/core/utils.py``
  and ``SchedulerConfig.get_scheduler_cls`` read) become the recording scheduler
  (``recording_scheduler.py``), before any test module is imported. Every
  scheduler a test builds writes its own recording, ``DIR/<n>.jsonl`` (one line
  per scheduler in ``DIR/manifest.jsonl``: the file, the test's node id, the
  class). At the end of each test the recorders it started are closed (their
  ``end`` record says ``by: driver``: the test stopped driving; the converter
  then claims no end-of-trace rule for requests still live). A configuration
  the recorder refuses runs unrecorded (``SCHED_HARNESS_UNRECORDABLE=run``),
  listed in the manifest with its reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import weakref
from pathlib import Path

ENV_RECORD = "SCHED_HARNESS_TESTS_RECORD"
_RECORDER = Path(__file__).resolve().parent.parent / "recording_scheduler.py"

_state = {"nodeid": None, "n": 0, "live": [], "dir": None}


def _pin_cpu_platform() -> None:
    """vLLM's ``current_platform`` set to its CPU platform, without kernels
    (the scheduler needs none)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # an older layout: leave vLLM's own probe
        return
    platform = CpuPlatform()
    if hasattr(platform, "import_kernels"):
        platform.import_kernels = lambda: None
    platforms._current_platform = platform


def _load_recorder():
    spec = importlib.util.spec_from_file_location("sched_harness_recording_scheduler", _RECORDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _injected(base: type, out: Path, rs) -> type:
    """``base`` (a recording scheduler class) giving each instance its own file."""

    class Injected(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            if "_sched_harness_injected" in self.__dict__:
                # An inner Injected layer (a class deriving from both the injected Scheduler
                # and AsyncScheduler: vLLM's DiffusionAsyncScheduler): one file, one manifest line.
                super().__init__(*args, **kwargs)
                return
            self._sched_harness_injected = True
            _state["n"] += 1
            path = out / f"{_state['n']:05d}.jsonl"
            os.environ[rs.ENV_PATH] = str(path)
            super().__init__(*args, **kwargs)
            rec = self._sched_harness
            entry = {"file": path.name, "nodeid": _state["nodeid"],
                     "cls": "AsyncRecordingScheduler" if getattr(self, "_sched_harness_async", False)
                     else base.__name__}
            if not getattr(rec, "enabled", False):
                entry["unrecorded"] = getattr(rec, "reason", None) or "the recorder did not start"
            else:
                _state["live"].append(weakref.ref(rec))
                written = Path(rec.path)
                if written.name != path.name:  # data parallelism: NAME.dp<rank>.jsonl
                    entry["file"] = written.name
            with open(out / "manifest.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")

    Injected.__name__ = Injected.__qualname__ = base.__name__
    Injected.__module__ = base.__module__
    return Injected


def pytest_configure(config) -> None:
    _pin_cpu_platform()
    target = os.environ.get(ENV_RECORD)
    if not target:
        return
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    _state["dir"] = out
    os.environ.setdefault("SCHED_HARNESS_UNRECORDABLE", "run")
    rs = _load_recorder()
    import vllm.v1.core.sched.async_scheduler as async_mod
    import vllm.v1.core.sched.scheduler as sched_mod

    sync_cls = _injected(rs._build_recording_scheduler(async_scheduling=False), out, rs)
    async_cls = _injected(rs._build_recording_scheduler(async_scheduling=True), out, rs)
    sched_mod.Scheduler = sync_cls
    async_mod.AsyncScheduler = async_cls


def _close_live() -> None:
    for ref in _state["live"]:
        rec = ref()
        if rec is not None:
            rec.close("driver")
    _state["live"].clear()


def pytest_runtest_setup(item) -> None:
    _state["nodeid"] = item.nodeid


def pytest_runtest_teardown(item, nextitem) -> None:
    _close_live()
    _state["nodeid"] = None


def pytest_unconfigure(config) -> None:
    _close_live()
