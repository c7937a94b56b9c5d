"""Sending the launched function to ranks that do not inherit this process (the spawn start method).

A spawned rank is a fresh interpreter, and plain pickle sends a function by reference: one defined in a
notebook cell lives in ``__main__``, which the rank does not have ("Can't get attribute 'build' on
<module '__main__'>"). cloudpickle sends it by value (code, closure, the globals it reads), as Ray and
Dask do. ``pack`` runs before any rank starts and names what cannot be sent, with the fix; ``unpack``
runs in the rank; ``result_bytes`` sends a spawned rank's return value back, by value where it must.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import types

from ..errors import ConfigError

__all__ = ["pack", "unpack", "result_bytes", "unpicklable_part"]

_MAX_DEPTH = 6


def pack(fn, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` as bytes a spawned rank can load; ConfigError naming the part that
    cannot be pickled (a global or closure variable of a cell-defined function, an argument...)."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:
        label, obj, err = unpicklable_part(_roots(fn, args, kwargs)) or ("the launched call", fn, e)
        raise ConfigError(
            f"start_method='spawn' sends the launched function to every rank pickled (by value when it is "
            f"defined in a notebook cell), and {label} cannot be pickled ({type(obj).__name__}: {err}). "
            "Fix: create that object inside the function the ranks run (for stnb.run(build, ...): inside "
            "build), or pass what it is made from (a path, a name, numbers); on Linux, start_method='fork' "
            "lets the ranks inherit it instead") from None


def unpack(data: bytes):
    """``(fn, args, kwargs)`` in the rank (cloudpickle's output loads with plain pickle)."""
    return pickle.loads(data)


def result_bytes(result, spawned: bool) -> bytes:
    """A rank's return value, pickled for the launching process. Plain pickle (by reference) for a
    forked rank: its classes are the notebook's own, and the notebook gets instances of them. A
    spawned rank knows a class defined in a cell only by value (it came with the function), so what
    plain pickle cannot send from there goes back by value too."""
    try:
        return pickle.dumps(result)
    except Exception:
        if not spawned:
            raise
        import cloudpickle

        return cloudpickle.dumps(result)


def unpicklable_part(roots, depth: int = 0, seen: set | None = None):
    """The innermost ``(label, object, error)`` among ``roots`` (``(label, object)`` pairs) and the
    objects they carry that cloudpickle cannot pickle; None when all of them can be."""
    import cloudpickle

    seen = set() if seen is None else seen
    for label, obj in roots:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            cloudpickle.dumps(obj)
        except Exception as e:
            inner = unpicklable_part(_parts(obj, label), depth + 1, seen) if depth < _MAX_DEPTH else None
            return inner or (label, obj, e)
    return None


def _roots(fn, args, kwargs):
    name = getattr(fn, "__name__", type(fn).__name__)
    yield f"the function {name}", fn
    for i, a in enumerate(args):
        yield f"argument {i + 1} of {name}", a
    for k, v in kwargs.items():
        yield f"argument {k}= of {name}", v


def _parts(obj, label: str):
    """``(label, object)`` for what ``obj`` carries: a function's closure variables, the globals it
    reads (modules excepted) and its defaults; a partial's function and bound arguments; a
    container's items."""
    if isinstance(obj, functools.partial):
        yield f"the function of {label}", obj.func
        for i, a in enumerate(obj.args):
            yield f"argument {i + 1} bound by {label}", a
        for k, v in obj.keywords.items():
            yield f"argument {k}= bound by {label}", v
    elif isinstance(obj, types.FunctionType):
        try:
            free = inspect.getclosurevars(obj)
        except (TypeError, ValueError):  # pragma: no cover - a builtin in disguise
            return
        name = obj.__qualname__
        for k, v in free.nonlocals.items():
            yield f"{k!r} (a variable {name} closes over)", v
        for k, v in free.globals.items():
            if not isinstance(v, types.ModuleType):
                yield f"the global {k!r} (read by {name})", v
        for i, v in enumerate(obj.__defaults__ or ()):
            yield f"default value {i + 1} of {name}", v
        for k, v in (obj.__kwdefaults__ or {}).items():
            yield f"the default of {k}= in {name}", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"item {i} of {label}", v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{label}[{k!r}]", v
