"""The Panel's widgets, one small builder per concern: the strategy picker, the sizes, the strategies'
knobs, the per-rank progress bars, and a plotly figure in an output widget.

The picker and the knobs come from the strategy registry (``stnb.strategies``): a strategy's label,
its availability here, and for each of its ``options`` (``stnb.strategies.Option``) a widget made from the
option's type and default, with its ``choices`` as a drop-down and its help as the tooltip. A strategy
added to the registry appears with its options without a change here.
"""

from __future__ import annotations

import dataclasses
import json

import ipywidgets as W

from .. import strategies
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
    """One strategy option (``stnb.strategies.Option``), as a widget; ``value()`` reads it back (ConfigError when the
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


def knob(name: str, value) -> Knob:
    """A widget for strategy option ``name`` holding ``value``: a drop-down of the values it takes, a checkbox
    for a flag, else a text box (empty: None; a dict as JSON); its help text as the tooltip."""
    from ..cli_options import base_type

    o = strategies.options()[name]
    kind, optional = base_type(o.type), "None" in o.type.replace(" ", "").split("|")
    choices = o.choices or None
    common = dict(description=name, style=WIDE, tooltip=o.help)
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
    """{option: Knob} for every option of every registered strategy (one two strategies share, like DDP's
    options of ddp and zero1, is one widget), each holding ``config``'s value."""
    return {name: knob(name, getattr(config, name)) for name in strategies.options()}


def show_knobs(all_knobs: dict, strategy: str) -> None:
    """Only the chosen strategy's options are visible."""
    own = strategies.get(strategy).options
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
