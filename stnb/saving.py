"""Saving a trained model, checked: the folder at ``save_to`` holds the trained weights, or nothing.

The model is written to a temporary sibling folder and reloaded from there. The reloaded weights
must equal the trained ones bit for bit (``trained``: a state dict taken from the trained model)
and differ from the initial ones (``initial``: the state dict of the model training started from),
and the reloaded model must encode like the trained one. Only then is the folder renamed into
place; otherwise it is removed and the problems are returned (the run is then not verified).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from .checks import saved_model_problems, state_of


def check_target(save_to: str | None) -> None:
    """Refuse a ``save_to`` that already holds something, before any process starts (stnb never
    overwrites a saved model)."""
    if not save_to:
        return
    from .errors import ConfigError

    target = os.path.abspath(os.path.expanduser(save_to))
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError(f"save_to={save_to!r} already exists and is not empty; stnb never "
                          "overwrites a saved model. Choose a new folder or remove the old one.")


def save_checked(model, target: str, device: str, trained: dict, initial: dict) -> dict:
    """Save ``model`` to ``target`` if it reloads as the trained model. Returns the check:

    {"ok", "saved_to" (None unless ok), "problems", "equals_trained", "differs_from_initial",
    "changed_from_initial", "differing_from_trained", "tensors", "encodes_the_same"}.
    """
    import numpy as np

    from .model_types import load_like, probe

    target = os.path.abspath(os.path.expanduser(target))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".stnb-save-", dir=parent)
    try:
        model.save(tmp)
        reloaded = load_like(model, tmp, device=device, max_seq_length=model.max_seq_length)
        problems, details = saved_model_problems(state_of(reloaded), trained, initial)
        details["encodes_the_same"] = bool(np.allclose(probe(model), probe(reloaded), atol=1e-5))
        if not details["encodes_the_same"]:
            problems.append("the reloaded model does not reproduce the saved model's embeddings")
        saved_to = None
        if not problems:
            if os.path.isdir(target) and not os.listdir(target):
                os.rmdir(target)
            os.replace(tmp, target)
            saved_to = target
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"ok": not problems, "saved_to": saved_to, "problems": problems, **details}
