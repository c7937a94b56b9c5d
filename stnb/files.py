"""Writing a file so that readers see the old content or the new, never half of it."""

from __future__ import annotations

import json
import os
import tempfile

#: the file stnb writes beside every checkpoint it completed (``stnb.checkpoints``)
MANIFEST = "stnb-checkpoint.json"


def write_atomic(target, text: str | bytes, mode: int = 0o644, on_open_error=None) -> None:
    """Write ``text`` (str or bytes) to a temporary file beside ``target``, fsync it, give it ``mode`` and
    rename it over ``target``. On any failure the temporary file is removed and ``target`` is
    untouched. ``on_open_error(OSError) -> Exception`` turns a failure to create the temporary
    file (a read-only or missing folder) into the caller's own error type."""
    target = os.fspath(target)
    name = os.path.basename(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=os.path.dirname(target) or ".")
    except OSError as e:
        if on_open_error is None:
            raise
        raise on_open_error(e) from e
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def shown(path) -> str:
    """``path`` as stnb prints it: relative to the working directory when inside it (a notebook's folder),
    ``~/...`` when inside the home folder, else as given. What stnb returns (``ExportedScript.path``, a
    job's paths) stays absolute; only the printed text leaves the machine's layout out."""
    path = os.path.abspath(os.fspath(path))
    cwd, home = os.getcwd(), os.path.expanduser("~")
    for root, prefix in ((cwd, ""), (home, "~" + os.sep)):
        if root != os.sep and (path == root or path.startswith(root.rstrip(os.sep) + os.sep)):
            rel = os.path.relpath(path, root)
            return prefix + rel if rel != "." else (prefix.rstrip(os.sep) or ".")
    return path


def manifest(path) -> dict:
    """The manifest stnb wrote beside a checkpoint ({} for one written without stnb)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
