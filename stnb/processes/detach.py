"""Detaching a forked rank from the Jupyter kernel it was forked from: it inherits IPython's shell, the
comm manager and tqdm's notebook bars, which would send messages on the kernel's sockets ("attempted to
send message from fork"). The parent relays output and progress to the notebook instead.
"""

from __future__ import annotations

import sys
import threading


def detach_from_kernel() -> None:
    """The rank stops being "in a notebook": IPython's shell cleared (``get_ipython()`` -> None), comms inert,
    tqdm.auto the text bar with locks of its own, transformers' notebook progress callback the text one."""
    shell = sys.modules.get("IPython.core.interactiveshell")  # no IPython imported: no shell to clear
    try:
        InteractiveShell = getattr(shell, "InteractiveShell", None)
        if InteractiveShell is not None and InteractiveShell.initialized():
            inst = InteractiveShell.instance()
            type(inst).clear_instance()
            InteractiveShell.clear_instance()
    except Exception:
        pass
    comm = sys.modules.get("comm")
    if comm is not None and hasattr(comm, "_create_comm") and hasattr(comm, "_get_comm_manager"):
        # ipykernel points comm.create_comm at kernel comms, which send "comm_open" on the
        # kernel's sockets (an ipywidgets widget does on creation); in a rank they must be inert
        comm.create_comm = comm._create_comm
        comm.get_comm_manager = comm._get_comm_manager
    if "tqdm" in sys.modules:
        try:
            import tqdm.std

            # tqdm's monitor thread does not exist in the fork, but the lock it may have held at
            # fork time was copied locked: give the rank fresh locks. Its multiprocessing lock is one
            # semaphore shared with the launching process and every rank it ever forked: a rank killed
            # while drawing a bar (the Stop button, the stall watchdog, the out-of-memory killer) left it
            # held for good, and every later rank of that kernel waited on it at its first bar. A rank
            # writes to its own log, so it needs no lock shared with other processes: none.
            tqdm.std.TqdmDefaultWriteLock.th_lock = threading.RLock()
            tqdm.std.TqdmDefaultWriteLock.mp_lock = None
            classes = [tqdm.std.tqdm]
            while classes:  # every bar class's own lock (tqdm.auto's, a notebook's) is made again
                cls = classes.pop()
                cls.__dict__.get("_lock") is not None and delattr(cls, "_lock")
                classes += cls.__subclasses__()
            tqdm.std.tqdm.monitor = None

            std, std_range = tqdm.std.tqdm, tqdm.std.trange
            notebook_classes = []
            for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
                mod = sys.modules.get(name)
                if mod is not None and getattr(mod, "tqdm", None) is not std:
                    notebook_classes.append(getattr(mod, "tqdm"))
            notebook_ranges = [getattr(sys.modules.get(n), "trange", None)
                               for n in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")]
            for mod in list(sys.modules.values()):
                d = getattr(mod, "__dict__", None)
                if not d:
                    continue
                for attr in ("tqdm", "trange"):
                    val = d.get(attr)
                    if val is not None and (val in notebook_classes or (attr == "trange" and val in notebook_ranges
                                                                          and val is not std_range)):
                        d[attr] = std if attr == "tqdm" else std_range
            for name in ("tqdm.auto", "tqdm.autonotebook"):
                mod = sys.modules.get(name)
                if mod is not None:
                    mod.tqdm, mod.trange = std, std_range
        except Exception:
            pass
    tr = sys.modules.get("transformers.trainer")
    if tr is not None:
        try:
            from transformers.trainer_callback import ProgressCallback

            tr.DEFAULT_PROGRESS_CALLBACK = ProgressCallback
        except Exception:
            pass
