"""Build and locate per-version vLLM virtual environments (CPU only).

Each supported vLLM version gets its own venv under ``<repo>/.vllm-envs/<version>/``
(override the root with ``HARNESS_VLLM_ENVS``), built the light way that
``shared/notes/vllm-on-cpu.md`` measured: the CPU build of torch, the pinned
dependencies of ``harness/candidates/vllm/pins.txt`` with ``--no-deps``, then vLLM itself
with ``--no-deps`` (about a minute, 2.2 GB). Nothing of the harness is installed
there: ``harness/candidates/vllm/driver.py`` runs under that venv's Python as a standalone
script.

``ensure_env(version)`` builds it if missing (idempotent, under a file lock);
``env_python(version)`` is where its Python is; ``harness vllm-env VERSION`` is
the command-line front end.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

#: Versions whose scheduler the driver supports. 0.33.0 is what the reference
#: mirrors; 0.29.0 and 0.20.2 are older releases the driver also handles (an
#: EngineConfig field the version lacks is refused unless it has that
#: version's behaviour, e.g. ``watermark`` on 0.20.2).
SUPPORTED_VERSIONS = ("0.33.0", "0.29.0", "0.20.2")
TORCH_VERSION = "2.13.0"
PINS_FILE = Path(__file__).with_name("pins.txt")
MARKER = ".harness-env.json"
REPO_ROOT = Path(__file__).resolve().parents[3]


class VLLMEnvError(RuntimeError):
    """A vLLM env that cannot be built or used; the message is one line."""


def check_version(version: str) -> str:
    """``version`` if supported, else VLLMEnvError naming the supported ones."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version or ""):
        raise VLLMEnvError(f"bad vLLM version {version!r}: expected e.g. 0.33.0")
    if version not in SUPPORTED_VERSIONS:
        raise VLLMEnvError(f"vLLM {version} is not supported; supported: "
                           f"{', '.join(SUPPORTED_VERSIONS)}")
    return version


def envs_root() -> Path:
    """Folder holding one venv per version: ``HARNESS_VLLM_ENVS`` if set; else, in a
    checkout, ``<repo>/.vllm-envs``; else (a non-editable install, where the "repo"
    would be site-packages) ``$XDG_CACHE_HOME/sched-harness/vllm-envs`` (default
    ``~/.cache``)."""
    override = os.environ.get("HARNESS_VLLM_ENVS")
    if override:
        return Path(override).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / ".vllm-envs"
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser().resolve() / "sched-harness" / "vllm-envs"


def env_dir(version: str) -> Path:
    return envs_root() / check_version(version)


def env_python(version: str) -> Path:
    """The Python of ``version``'s venv (it may not exist yet: see ``is_ready``)."""
    return env_dir(version) / "bin" / "python"


def _pins_sha256() -> str:
    return hashlib.sha256(PINS_FILE.read_bytes()).hexdigest()


def read_pins() -> list[str]:
    """The pinned requirements, one ``name==version`` per line (comments skipped)."""
    lines = [ln.split("#", 1)[0].strip() for ln in PINS_FILE.read_text().splitlines()]
    return [ln for ln in lines if ln]


def is_ready(version: str) -> bool:
    """True when the venv was built completely with the current pins."""
    marker = env_dir(version) / MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return (data.get("version") == version and data.get("pins_sha256") == _pins_sha256()
            and env_python(version).exists())


@contextmanager
def _lock(version: str):
    root = envs_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{version}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], log_path: Path, what: str) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                if ln.strip() and not ln.startswith("WARNING: Location")]
        last = tail[-1] if tail else "no output"
        raise VLLMEnvError(f"{what} failed (exit {proc.returncode}): {last[:200]} "
                           f"(full log: {log_path})")


def ensure_env(version: str, *, log: Callable[[str], None] | None = None,
               force: bool = False) -> Path:
    """Build ``version``'s venv unless it is ready; return its Python.

    Idempotent and safe against concurrent builders (file lock). ``log``
    receives one progress line per stage. Raises VLLMEnvError on failure
    (the partial venv is left for inspection and rebuilt next time).
    """
    say = log or (lambda _msg: None)
    check_version(version)
    with _lock(version):
        if is_ready(version) and not force:
            say(f"vLLM {version} env ready: {env_dir(version)}")
            return env_python(version)
        target = env_dir(version)
        if target.exists():
            say(f"removing incomplete env {target}")
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        log_path = target.parent / f"{version}.build.log"
        log_path.write_text(f"building vLLM {version} env at {target}\n")
        python = str(target / "bin" / "python")
        started = time.monotonic()
        stages = [
            ("creating venv", [sys.executable, "-m", "venv", str(target)]),
            ("upgrading pip", [python, "-m", "pip", "install", "-q", "-U", "pip"]),
            (f"installing torch=={TORCH_VERSION} (CPU)",
             [python, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"]),
            (f"installing {len(read_pins())} pinned dependencies",
             [python, "-m", "pip", "install", "-q", "--no-deps", "-r", str(PINS_FILE)]),
            (f"installing vllm=={version}",
             [python, "-m", "pip", "install", "-q", "--no-deps", f"vllm=={version}"]),
        ]
        for what, cmd in stages:
            say(f"{what} ...")
            t0 = time.monotonic()
            _run(cmd, log_path, what)
            say(f"{what}: done in {time.monotonic() - t0:.0f} s")
        probe = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
            capture_output=True, text=True)
        found = probe.stdout.strip()
        if probe.returncode != 0 or found != version:
            raise VLLMEnvError(f"vLLM {version} env is broken: installed vllm is "
                               f"{found or 'missing'} ({probe.stderr.strip()[-200:]})")
        (target / MARKER).write_text(json.dumps({
            "version": version, "pins_sha256": _pins_sha256(), "torch": TORCH_VERSION,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "build_s": round(time.monotonic() - started, 1)}, indent=1) + "\n")
        say(f"vLLM {version} env built in {time.monotonic() - started:.0f} s: {target}")
        return env_python(version)
