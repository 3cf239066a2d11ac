"""Layered vLLM environments: one shared dependency layer, vLLM alone per release.

Every release other than the three full builds of ``env.SUPPORTED_VERSIONS``
(0.10.0 through 0.33.x, four-part versions too) is built as

- ``<root>/.shared/<pins-sha256[:12]>/``: torch 2.13.0 CPU and every pin of
  ``pins.txt`` (``pip install --no-deps --target``), built once per pins file
  and shared by every layered env of that root;
- ``<root>/<version>/``: a venv without pip holding only ``vllm==VERSION``
  (``--no-deps``, downloaded into ``<root>/.wheels`` and deleted once
  installed), a ``.pth`` file putting the shared layer after its own
  site-packages, and the marker of ``env.MARKER``.

vLLM's CUDA kernels (``*.so`` under ``vllm/``: ``_C``, ``_moe_C``, the flash
attention builds; about 1 GB of a 1.3 GB wheel) are removed: nothing loads
them on a CPU-only machine and the driver only runs the scheduler (Python).
The build is checked before it counts: its Python must import
``vllm.v1.core.sched.scheduler`` under torch 2.13.0, else the release is
refused with vLLM's own error, in one line.

Nothing half-built is left behind: the env is assembled in a temporary folder
beside its final place and renamed into it only once checked; any failure
(pip's, a missing release on PyPI, a full disk) removes it and raises
``VLLMEnvError`` with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.candidates.vllm.dedupe import share_with_finished_envs
from harness.candidates.vllm.env import (MARKER, PINS_FILE, TORCH_VERSION, VLLMEnvError, _lock, _run,
                                         _pins_sha256, envs_roots, read_pins, strip_cuda_kernels)

#: Free space a layered build needs, in GB (the wheel ~0.45, vLLM unpacked
#: ~1.3 before its CUDA kernels go; the shared layer ~1.1 once); read at each
#: build from HARNESS_VLLM_MIN_FREE_GB.
MIN_FREE_GB = 3.0


def _min_free_gb() -> float:
    try:
        return float(os.environ.get("HARNESS_VLLM_MIN_FREE_GB", MIN_FREE_GB))
    except ValueError:
        raise VLLMEnvError("HARNESS_VLLM_MIN_FREE_GB must be a number of GB") from None
SHARED = ".shared"
WHEELS = ".wheels"
_PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _pip(args: list[str], log_path: Path, what: str) -> None:
    """``python -m pip ARGS`` with the harness's own interpreter (``env._run``)."""
    _run([sys.executable, "-m", "pip", *args], log_path, what)


def _check_space(root: Path, need_gb: float) -> None:
    free = shutil.disk_usage(root).free / 1e9
    if free < need_gb:
        raise VLLMEnvError(f"no space left for a vLLM env under {root}: {free:.1f} GB free, "
                           f"a build needs {need_gb:.1f} GB (HARNESS_VLLM_MIN_FREE_GB)")


def _remove_leftovers(folder: Path, prefix: str) -> None:
    """Remove ``folder/PREFIX<pid>`` folders: what a killed build of the same
    env or layer left (about 1 GB for a layer). The caller holds that build's
    lock, so no live builder owns one. Regression: they were never removed."""
    for stale in folder.glob(f"{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)


def du_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (each hard-linked file once)."""
    seen, total = set(), 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def shared_layer(root: Path, *, log: Callable[[str], None]) -> Path:
    """The shared dependency layer of ``root`` for the current pins (torch
    2.13.0 CPU + ``pins.txt``), built once under a lock. Returns its folder."""
    target = root / SHARED / _pins_sha256()[:12]
    with _lock("shared-layer"):
        if (target / ".complete").exists():
            return target
        _check_space(root, _min_free_gb())
        tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
        _remove_leftovers(target.parent, f".tmp-{target.name}-")
        tmp.mkdir(parents=True)
        log_path = root / "shared-layer.build.log"
        log_path.write_text(f"building the shared layer at {target}\n")
        try:
            log(f"shared layer: installing torch=={TORCH_VERSION} (CPU) and "
                f"{len(read_pins())} pinned dependencies ...")
            t0 = time.monotonic()
            _pip(["install", "-q", "--no-deps", "--no-compile", "--target", str(tmp),
                  f"torch=={TORCH_VERSION}", "-r", str(PINS_FILE)], log_path, "shared layer")
            # torch and most pins are byte for byte those of a full env already built.
            linked = share_with_finished_envs(tmp, [tmp], [root, *envs_roots()], marker=MARKER)
            (tmp / ".complete").write_text(json.dumps({"pins_sha256": _pins_sha256(),
                                                       "torch": TORCH_VERSION}) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
            log(f"shared layer: done in {time.monotonic() - t0:.0f} s ({du_bytes(target) / 1e9:.2f} GB, "
                f"{linked / 1e9:.2f} GB of it hard-linked to other envs)")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


_PROBE = ("import importlib.metadata as m, torch, vllm.v1.core.sched.scheduler as s; "
          "print(m.version('vllm'), torch.__version__)")


def build_layered(version: str, root: Path, *, log: Callable[[str], None]) -> Path:
    """Build ``version``'s layered env in ``root`` (the caller holds the
    version's lock and found it not ready); return its Python. Raises
    VLLMEnvError (one line) and leaves nothing behind on any failure."""
    root.mkdir(parents=True, exist_ok=True)
    _check_space(root, _min_free_gb())
    started = time.monotonic()
    target = root / version
    tmp = root / f".tmp-{version}-{os.getpid()}"
    _remove_leftovers(root, f".tmp-{version}-")
    log_path = root / f"{version}.build.log"
    log_path.write_text(f"building vLLM {version} (layered) at {target}\n")
    wheels = root / WHEELS
    try:
        wheels.mkdir(exist_ok=True)
        # The release first: one missing on PyPI fails before any layer is built.
        log(f"downloading vllm=={version} ...")
        _pip(["download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(wheels),
              f"vllm=={version}"], log_path, f"downloading vllm=={version}")
        shared = shared_layer(root, log=log)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True,
                       capture_output=True)
        site = tmp / "lib" / _PY / "site-packages"
        log(f"installing vllm=={version} over the shared layer ...")
        _pip(["install", "-q", "--no-deps", "--no-compile", "--no-index", "--find-links",
              str(wheels), "--target", str(site), f"vllm=={version}"], log_path,
             f"installing vllm=={version}")
        stripped = strip_cuda_kernels(site)
        for wheel in wheels.glob(f"vllm-{version}-*.whl"):
            wheel.unlink()  # 0.3-0.5 GB each: a rebuild downloads it again
        (site / "zz-sched-harness-shared.pth").write_text(f"{shared}\n")
        python = tmp / "bin" / "python"
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True,
                               cwd=root, env={k: v for k, v in os.environ.items()
                                              if k != "PYTHONPATH"}, timeout=300)
        found = (probe.stdout.strip().splitlines() or [""])[-1].split()
        if probe.returncode != 0 or not found or found[0] != version:
            tail = (probe.stderr.strip().splitlines() or [f"prints {probe.stdout.strip()[-200:]!r}"])[-1]
            raise VLLMEnvError(f"vLLM {version} does not run with torch {TORCH_VERSION} CPU and "
                               f"the pinned dependencies: {tail[:240]}")
        own = du_bytes(tmp)
        (tmp / MARKER).write_text(json.dumps({
            "version": version, "pins_sha256": _pins_sha256(), "torch": TORCH_VERSION,
            "layout": "layered", "shared_layer": str(shared),
            "cuda_kernels_removed_bytes": stripped, "own_bytes": own,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "build_s": round(time.monotonic() - started, 1)}, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        for wheel in wheels.glob(f"vllm-{version}-*.whl"):
            wheel.unlink()
        if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
            raise VLLMEnvError(f"building vLLM {version} failed: no space left on device "
                               f"under {root}") from None
        if isinstance(exc, subprocess.CalledProcessError):
            raise VLLMEnvError(f"building vLLM {version} failed: {exc}") from None
        raise
    log(f"vLLM {version} env built in {time.monotonic() - started:.0f} s: {target} "
        f"({own / 1e9:.2f} GB of its own; CUDA kernels removed: {stripped / 1e9:.2f} GB)")
    return target / "bin" / "python"
