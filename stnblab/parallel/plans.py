"""What tensor and pipeline parallelism may split, checked before any process starts.

Everything here reads the model's ``config.json`` only (no weights, no process group), so a bad
request is refused with the reason and the fix before ranks are launched:

* the tensor-parallel (TP) plan of each known architecture: which Linear of every encoder layer is
  split column-wise (its output features: Q, K, V, the MLP's first projection) and which row-wise
  (its input features: the attention output, the MLP's second projection), Megatron-LM's layout;
* the TP degree must divide the heads, the hidden size and the MLP's width;
* pipeline (PP) stages must not outnumber the layers; microbatches must divide the batch.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass

from stnb.errors import ConfigError

COLWISE, ROWWISE = "colwise", "rowwise"
STYLES = (COLWISE, ROWWISE, None)  # None: the module stays whole (replicated) on every rank

#: model_type -> (where the encoder layers are, the attention module holding the head count, the plan per layer)
KNOWN = {
    "bert": dict(layers="encoder.layer", attention="attention.self", plan={
        "attention.self.query": COLWISE, "attention.self.key": COLWISE, "attention.self.value": COLWISE,
        "attention.output.dense": ROWWISE, "intermediate.dense": COLWISE, "output.dense": ROWWISE}),
}


@dataclass(frozen=True)
class Shape:
    """The numbers TP and PP need, from config.json."""
    model_type: str
    layers: int
    heads: int
    hidden: int
    intermediate: int


def model_shape(path: str) -> Shape:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    return Shape(model_type=c.get("model_type", "?"), layers=int(c.get("num_hidden_layers", 0)),
                 heads=int(c.get("num_attention_heads", 0)), hidden=int(c.get("hidden_size", 0)),
                 intermediate=int(c.get("intermediate_size", 0)))


def architecture(shape: Shape) -> dict:
    """The TP plan for this architecture, or ConfigError naming what the plan expects."""
    if shape.model_type not in KNOWN:
        expected = "; ".join(f"{t}: each layer under '{a['layers']}.<i>' with modules {sorted(a['plan'])}"
                             for t, a in KNOWN.items())
        raise ConfigError(f"the tensor-parallel plan does not know model_type {shape.model_type!r}. It knows {expected}. "
                          "Fix: use a BERT-style encoder (model='minilm' or 'tiny'), or add the architecture's "
                          "module names to stnblab.parallel.plans.KNOWN")
    return KNOWN[shape.model_type]


def check_tp(shape: Shape, degree: int) -> None:
    """The TP degree must divide every dimension a column-wise / row-wise split cuts."""
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"TP degree must be a positive integer, got {degree!r}")
    architecture(shape)
    for what, n in (("attention heads", shape.heads), ("hidden size", shape.hidden),
                    ("MLP width (intermediate_size)", shape.intermediate)):
        if n % degree:
            fits = [d for d in range(1, n + 1) if n % d == 0 and d <= 16]
            raise ConfigError(f"TP degree {degree} does not divide the model's {what} ({n}): each rank must hold "
                              f"whole heads and equal slices. Fix: use a degree among {fits}")


def layer_plan(shape: Shape, overrides: dict | None = None) -> dict:
    """{'<layer index>.<module>': style} for every encoder layer, with ``overrides`` applied.

    overrides: {pattern: style}, the pattern matched (fnmatch) against '<i>.<module>' names, e.g.
    {'3.*': None} leaves layer 3 whole, {'*.output.dense': 'colwise'} splits the MLP's second
    projection on the wrong dimension. A pattern that matches nothing, or an unknown style, is refused.
    """
    plan = {f"{i}.{name}": style for i in range(shape.layers) for name, style in architecture(shape)["plan"].items()}
    for pattern, style in (overrides or {}).items():
        if style not in STYLES:
            raise ConfigError(f"plan override {pattern!r}: style {style!r} is not one of {list(STYLES)}")
        hits = fnmatch.filter(plan, pattern)
        if not hits:
            raise ConfigError(f"plan override {pattern!r} matches no module; names look like "
                              f"{list(plan)[:6]} ('<layer>.<module>', wildcards allowed)")
        plan.update({h: style for h in hits})
    return plan


def check_pp(shape: Shape, stages: int, batch: int, microbatches: list) -> None:
    """Stages each need at least one layer; every microbatch count must divide the batch (pairs)."""
    if not isinstance(stages, int) or stages < 2:
        raise ConfigError(f"pipeline stages must be an integer >= 2, got {stages!r}")
    if stages > shape.layers:
        raise ConfigError(f"{stages} pipeline stages for a model of {shape.layers} layers: a stage needs at least one "
                          f"layer. Fix: stages <= {shape.layers}")
    for m in microbatches:
        if not isinstance(m, int) or m < 1 or batch % m:
            raise ConfigError(f"{m!r} microbatches do not divide the batch of {batch} pairs: every microbatch must hold "
                              f"the same number of pairs. Fix: use a divisor of {batch}, e.g. "
                              f"{[d for d in range(1, batch + 1) if batch % d == 0][:6]}")


def split_layers(layers: int, stages: int) -> list[range]:
    """Contiguous, as-even-as-possible layer ranges per stage (earlier stages get the extra layer)."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
