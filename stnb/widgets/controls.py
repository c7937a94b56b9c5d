"""The Panel's widgets, one small builder per concern: the strategy picker, the sizes, the strategies'
knobs, the per-rank progress bars, and a plotly figure in an output widget.

The picker and the knobs come from the strategy registry (``stnb.strategies``): a strategy's label,
its availability here, and for each of its ``knobs`` (TrainConfig fields) a widget made from the
field's type and default, with the values the strategy lists in ``choices`` as a drop-down. A strategy
added to the registry appears with its knobs without a change here.
"""

from __future__ import annotations

import dataclasses
import json

import ipywidgets as W

from .. import strategies
from ..config import TrainConfig
from ..errors import ConfigError
from ..models import MINILM, TINY

WIDE = {"description_width": "initial"}


def with_class(widget, css: str):
    widget.add_class(css)
    return widget


def html_output(css: str, value: str = ""):
    """An HTML widget (the Panel's outputs: validation, status, error, table, advice...)."""
    return with_class(W.HTML(value=value), css)


def int_box(description: str, value: int, css: str, width: str, lo: int = 1, hi: int = 10_000_000):
    return with_class(W.BoundedIntText(value=value, min=lo, max=hi, description=description, style=WIDE,
                                       layout=W.Layout(width=width)), css)


# ---- the strategy ----------------------------------------------------------------------------

def strategy_label(name: str, availability: dict) -> str:
    """'fsdp · FSDP (ZeRO-3)', or with why it cannot run here."""
    s = strategies.get(name)
    info = availability[name]
    text = name if s.label == name else f"{name} · {s.label}"
    return text if info["runnable"] else f"{text} (not runnable here: {info['reason']})"


def default_strategy(asked: str, availability: dict) -> str:
    """``asked`` when it runs here, else the first runnable strategy that is not the baseline."""
    if availability.get(asked, {}).get("runnable"):
        return asked
    base = strategies.baseline_name()
    return next((s for s in strategies.names() if availability[s]["runnable"] and s != base), base)


def strategy_picker(asked: str, availability: dict):
    """Every registered strategy, those that cannot run here marked with the reason."""
    return with_class(W.Dropdown(options=[(strategy_label(s, availability), s) for s in strategies.names()],
                                 value=default_strategy(asked, availability), description="strategy",
                                 style=WIDE, layout=W.Layout(width="640px")), "stnb-strategy")


# ---- sizes -----------------------------------------------------------------------------------

def processes_box(value: int):
    return int_box("processes", value, "stnb-processes", "170px", hi=1024)


def batch_controls(value: int, override: bool, show_override: bool):
    """The per-device batch, and (a build function) the box that makes it replace the function's own."""
    batch = int_box("per-device batch", value, "stnb-batch", "210px", hi=1_000_000)
    box = with_class(W.Checkbox(value=override, description="override", indent=False,
                                tooltip="replace per_device_train_batch_size in your training arguments "
                                        "(reported in RunResult.overridden_args)",
                                layout=W.Layout(width="100px", display=None if show_override else "none")),
                     "stnb-batch-override")
    return batch, box


def recipe_controls(config):
    """stnb's recipe: the model and the steps."""
    model = with_class(W.Combobox(value=config.model, options=[TINY, MINILM], ensure_option=False,
                                  description="model", placeholder="tiny, minilm, a hub id or a folder",
                                  style=WIDE, layout=W.Layout(width="360px")), "stnb-model")
    return model, int_box("steps", config.steps, "stnb-steps", "150px")


def run_button(on_click):
    button = with_class(W.Button(description="Run", button_style="primary", icon="play",
                                 tooltip="train once with these settings", layout=W.Layout(width="120px")),
                        "stnb-run")
    button.on_click(lambda _b: on_click())
    return button


# ---- the strategies' knobs -------------------------------------------------------------------

@dataclasses.dataclass
class Knob:
    """One TrainConfig field a strategy owns, as a widget; ``value()`` reads it back (ConfigError when the
    text is not a value of the field's type)."""
    name: str
    widget: object
    kind: type
    optional: bool

    def value(self):
        v = self.widget.value
        if self.kind is bool or isinstance(self.widget, W.Dropdown):
            return v
        text = str(v).strip()
        if not text:
            if self.optional:
                return None
            raise ConfigError(f"{self.name}: give a value")
        try:
            return json.loads(text) if self.kind is dict else self.kind(text)
        except ValueError as e:
            raise ConfigError(f"{self.name}={text!r} is not a {self.kind.__name__} ({e})") from None


def field_type(name: str) -> tuple[type, bool]:
    """(base type, may be None) of a TrainConfig field, from its annotation ('int | None' -> (int, True))."""
    from ..cli_options import base_type

    annotation = str({f.name: f.type for f in dataclasses.fields(TrainConfig)}[name])
    return base_type(annotation), "None" in annotation.replace(" ", "").split("|")


def knob(name: str, value, help_text: str = "") -> Knob:
    """A widget for knob ``name`` holding ``value``: a drop-down of the values a strategy lists for it, a
    checkbox for a flag, else a text box (empty: the field's None; a dict as JSON)."""
    kind, optional = field_type(name)
    choices = next((s.choices[name] for s in strategies.all_strategies() if name in s.choices), None)
    common = dict(description=name, style=WIDE, tooltip=help_text)
    if choices is not None:
        if value not in choices and not (optional and value is None):
            raise ConfigError(f"{name}={value!r}: choose one of {', '.join(map(repr, choices))}")
        options = ([("default", None)] if optional else []) + [(str(c), c) for c in choices]
        widget = W.Dropdown(options=options, value=value, layout=W.Layout(width="220px"), **common)
    elif kind is bool:
        widget = W.Checkbox(value=bool(value), indent=False, layout=W.Layout(width="220px"), **common)
    else:
        text = "" if value is None else json.dumps(value) if kind is dict else str(value)
        widget = W.Text(value=text, placeholder="default" if optional else "",
                        layout=W.Layout(width="360px" if kind is dict else "220px"), **common)
    widget.add_class("stnb-knob")
    widget.add_class(f"stnb-knob-{name}")
    return Knob(name, widget, kind, optional)


def knob_controls(config) -> dict:
    """{field: Knob} for every knob of every registered strategy (a field two strategies share, like the
    DDP knobs of ddp and zero1, is one widget), each holding ``config``'s value."""
    from ..cli_options import HELP

    names = dict.fromkeys(k for s in strategies.all_strategies() for k in s.knobs)
    return {k: knob(k, getattr(config, k), HELP.get(k, "")) for k in names}


def show_knobs(all_knobs: dict, strategy: str) -> None:
    """Only the chosen strategy's knobs are visible."""
    own = strategies.get(strategy).knobs
    for k in all_knobs.values():
        k.widget.layout.display = None if k.name in own else "none"


# ---- progress and figures --------------------------------------------------------------------

def progress_rows(n: int, steps: int) -> tuple[list, list, list]:
    """(bars, labels, rows): one bar and one label per rank, ``steps`` long until the ranks report theirs."""
    bars, labels, rows = [], [], []
    for r in range(n):
        bars.append(W.IntProgress(value=0, min=0, max=steps, description=f"rank {r}", style=WIDE,
                                  layout=W.Layout(width="320px")))
        labels.append(W.Label(value=f"rank {r}: starting"))
        rows.append(with_class(W.HBox([bars[-1], labels[-1]]), "stnb-progress-rank"))
    return bars, labels, rows


def show_figure(output, figure, text: str) -> None:
    """A plotly figure in an output widget, stored as JSON (the plotly mimetype), ``text`` as its plain form."""
    import plotly.io as pio

    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(json.loads(figure.to_json()))
    bundle["text/plain"] = text
    output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
