"""``Collectives``: what each training step sends, per rank: every collective call, its kind and its bytes.

For the run's training (``on_train_begin`` to ``on_train_end``) the rank's ``torch.distributed`` collective
functions (``all_reduce``, ``all_gather``, ``all_gather_into_tensor`` and ``all_gather_single``,
``reduce_scatter_tensor`` and ``reduce_scatter_single``, ``broadcast``, ``scatter``, ``all_to_all``, the
object collectives, ``barrier``, point-to-point ``send``/``recv``...) and the functional
collectives DTensor uses (``torch.distributed._functional_collectives``: FSDP2's gradient-norm clipping) are
wrapped: each call is counted under its kind with the bytes of the tensors this rank hands it (its input;
0 for ``barrier``, None for the object collectives, whose pickled size is not known). Who calls them: DDP's
gradient buckets through the communication hook stnb registers (``allreduce_hook`` and the others call
``dist.all_reduce``), FSDP2's all-gathers and reduce-scatters (``all_gather_single`` /
``reduce_scatter_single`` in torch 2.13, counted as ``all_gather_into_tensor`` / ``reduce_scatter_tensor``:
one kind per operation), sentence-transformers' gathered negatives
(``torch.distributed.nn.all_gather``, whose backward is an all-to-all, on gloo a ``scatter`` per rank), the
trainer's loss gathers for logging. Only the package's own names are wrapped, so a collective built from
another (``all_gather_object`` calls ``all_gather`` inside ``distributed_c10d``) counts once, as itself.

A call between a step's begin and end counts in that step (``steps``: one dict per step, kind ->
``{"count", "bytes"}``); the rest (the first step's verification, logging after a step, evaluation) in
``outside_steps``. Not seen: collectives C++ issues itself (DDP's reducer when no Python hook is
registered: ``STNB_TIME_SPLIT=off``; DDP's buffer broadcast; DeepSpeed's own communication layer when it
does not go through ``torch.distributed``'s Python functions), which ``method`` says.
"""

from __future__ import annotations

import functools
import inspect
import threading

from .base import Instrument

#: torch.distributed's collectives and which argument is the tensor (or tensors) this rank hands them
DIST = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
        "_all_gather_base": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1, "_reduce_scatter_base": 1,
        "all_to_all": 1, "all_to_all_single": 1, "gather": 0, "scatter": 0, "barrier": None,
        "all_reduce_coalesced": 0, "all_gather_object": None, "broadcast_object_list": None,
        "gather_object": None, "scatter_object_list": None, "all_gather_single": 1, "reduce_scatter_single": 1,
        "all_gather_coalesced": 1, "send": 0, "isend": 0, "recv": 0, "irecv": 0, "batch_isend_irecv": 0,
        "monitored_barrier": None, "send_object_list": None, "recv_object_list": None}
#: the functional collectives (``torch.distributed._functional_collectives``): the first argument
FUNCTIONAL = {"all_reduce": 0, "all_gather_tensor": 0, "reduce_scatter_tensor": 0, "broadcast": 0,
              "all_to_all_single": 0, "all_reduce_coalesced": 0}
#: one kind per operation: torch's older names counted under the current ones
KIND = {"_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
        "all_gather_tensor": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor"}
OBJECTS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
           "recv_object_list"}


def tensor_bytes(x) -> int:
    """Bytes of a tensor, or of every tensor in a list (a point-to-point op's tensor; 0 for anything else)."""
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    if hasattr(x, "tensor") and hasattr(x, "op"):  # dist.P2POp
        return tensor_bytes(x.tensor)
    size = getattr(x, "element_size", None)
    return x.numel() * size() if size is not None and hasattr(x, "numel") else 0


class Collectives(Instrument):
    """Counts this rank's collective calls per training step (and outside the steps), by kind and bytes."""

    after = ("FirstStepChecks", "TimeSplit")  # a step's count opens after the first step's checks (their calls
    # are not the step's) and closes after the time split's step end

    def __init__(self):
        self.steps: list = []          # per step: {kind: {"count", "bytes"}}
        self.outside: dict = {}        # calls outside any step
        self._current = None           # the open step's dict (None between steps)
        self._saved: list = []         # (module, name, original) to put back
        self._lock = threading.Lock()  # DDP's hook may call from the autograd thread

    # ---- wrapping --------------------------------------------------------------------------------

    def _count(self, kind: str, nbytes) -> None:
        with self._lock:
            into = self._current if self._current is not None else self.outside
            rec = into.setdefault(kind, {"count": 0, "bytes": 0})
            rec["count"] += 1
            rec["bytes"] = None if nbytes is None or rec["bytes"] is None else rec["bytes"] + nbytes

    def _wrap(self, module, name: str, arg, kind: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        try:  # the input's name, for calls that pass it by keyword (FSDP2: reduce_scatter_single(output=, input=))
            given = list(inspect.signature(original).parameters)[arg] if arg is not None else None
        except (TypeError, ValueError, IndexError):
            given = None

        @functools.wraps(original)
        def counted(*args, **kw):
            if name in OBJECTS:
                nbytes = None
            elif arg is None:
                nbytes = 0
            else:
                nbytes = tensor_bytes(args[arg] if len(args) > arg else kw.get(given))
            self._count(kind, nbytes)
            return original(*args, **kw)

        counted.__stnb_counted__ = original
        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def start(self) -> None:
        """Wrap the collectives (once)."""
        if self._saved:
            return
        import torch.distributed as dist

        for name, arg in DIST.items():
            self._wrap(dist, name, arg, KIND.get(name, name))
        try:
            from torch.distributed import _functional_collectives as funcol
        except ImportError:  # pragma: no cover - torch without functional collectives
            return
        for name, arg in FUNCTIONAL.items():
            self._wrap(funcol, name, arg, KIND.get(name, name))

    def stop(self) -> None:
        """Put every wrapped function back."""
        while self._saved:
            module, name, original = self._saved.pop()
            setattr(module, name, original)

    # ---- the trainer's callbacks ------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kw):
        self.start()

    def on_step_begin(self, args, state, control, **kw):
        with self._lock:
            self._current = {}

    def on_step_end(self, args, state, control, **kw):
        with self._lock:
            if self._current is not None:
                self.steps.append(self._current)
            self._current = None

    def on_train_end(self, args, state, control, **kw):
        self.stop()

    def report(self) -> dict:
        self.stop()  # training ended early: nothing stays wrapped
        return {"collectives": {"steps": self.steps, "outside_steps": self.outside,
                                "method": "torch.distributed's collective functions and the functional collectives "
                                          "wrapped in the rank (bytes: the tensors this rank hands each call); "
                                          "not seen: what C++ issues itself (DDP's reducer without a Python comm "
                                          "hook, its buffer broadcast)"}}

