"""Atomic output: a view is written to a temp file beside its target and
renamed over it only when complete, so a reader never sees half a report
and an existing file survives a failed run (as ``harness.trace.writer``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via ``.<name>.<random>.tmp`` in the same
    folder and ``os.replace``; returns the path. Missing parent folders are
    created, as every ``-o`` does (issue 27). Raises OSError (no permission,
    a parent that is a file); the temp file is removed then."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
