"""What the Panel shows, as HTML strings: pure functions of the results and the settings, no ipywidgets.

Each function takes plain data (a TrainConfig, RunResults, an exception, a rank's progress) and
returns the HTML one of the Panel's widgets displays, so a test can read what a user would see
without a kernel or a browser.
"""

from __future__ import annotations

import traceback
from html import escape

from ..errors import LaunchError, StnbError

CSS = """<style>
.stnb-table { border-collapse: collapse; font-size: 12px; }
.stnb-table th, .stnb-table td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right;
  white-space: nowrap; line-height: 1.4; }
.stnb-table th { vertical-align: bottom; }
.stnb-table td:first-child, .stnb-table th:first-child { text-align: left; }
.stnb-table tr.stnb-unrunnable td { color: #888; font-style: italic; }
</style>"""

RED, GREEN = "#b00020", "#2e7d32"
EMPTY_TABLE = "<i>no runs yet: press Run</i>"
# (column, tooltip) of the results table
COLUMNS = (("run", "label used in the plots"), ("strategy", ""), ("ranks", "processes (world size)"),
           ("batch/device", "per-device batch size"), ("global batch", "samples per optimizer step"),
           ("model", ""), ("device", ""), ("samples/s", "steady-state throughput"),
           ("speedup", "over the 'single' run of the same model"), ("peak MiB", "largest peak over the ranks"),
           ("final loss", ""), ("verified", "stnb checked the strategy did what it claims"), ("status", ""))


def num(v, spec: str, suffix: str = "") -> str:
    """``v`` formatted with ``spec``; an en dash for a missing or NaN value."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "–"
    if f != f:
        return "–"
    return format(f, spec) + suffix


# ---- settings --------------------------------------------------------------------------------

def header_html(profile: str, device: str, max_processes: int) -> str:
    return (f"<b>stnb</b> · profile <code>{escape(profile)}</code> · device <code>{escape(device)}</code> · "
            f"up to {max_processes} rank(s) here")


def build_info(build_name: str) -> str:
    return (f"training: your build function <code>{escape(build_name)}</code> (model, data, loss, steps and "
            "training arguments are in it)")


def strategy_help(strategy) -> str:
    """The chosen strategy's title (name, ZeRO stage, summary) and its own options."""
    knobs = f" · options: {', '.join(strategy.options)}" if strategy.options else ""
    return f'<span style="color:#555;font-size:12px">{escape(strategy.title())}{escape(knobs)}</span>'


def asked(config) -> str:
    """The strategy and its options set away from their defaults: 'deepspeed (stage=3)'."""
    from ..strategies import get

    knobs = [f"{k}={v!r}" for k, v in get(config.strategy).given(config).items()]
    return escape(config.strategy + (f" ({', '.join(knobs)})" if knobs else ""))


def problem_html(text: str) -> str:
    return f'<span style="color:{RED}">&#9888; {escape(text)}</span>'


def recipe_ready(config) -> str:
    """What stnb's recipe will run: strategy, ranks, batch, model, steps."""
    return (f'<span style="color:{GREEN}">{asked(config)} on {config.world_size()} rank(s) × '
            f"{config.per_device_batch_size} per device = global batch {config.global_batch_size()} · model "
            f"{escape(config.model)} · {config.steps} steps</span>")


def build_ready(config, build_name: str, batch: int | None) -> str:
    """What a build function will run; ``batch``: the Panel's override, None for the function's own."""
    ws = config.world_size()
    text = (f"{batch} per device (override) = global batch {batch * ws}" if batch is not None else
            "your per_device_train_batch_size per device")
    return (f'<span style="color:{GREEN}">{asked(config)} on {ws} rank(s) × {text} · '
            f"{escape(build_name)}()</span>")


# ---- a run -----------------------------------------------------------------------------------

def running_html(config) -> str:
    return (f"<b>running</b> {asked(config)} on {config.world_size()} rank(s); "
            "the kernel is busy until the run ends")


def done_html(result, seconds: float) -> str:
    return (f"<b>done</b> in {seconds:.1f} s: {escape(result.strategy)}, "
            f"{result.samples_per_second or 0:,.1f} samples/s, verified {result.verified}")


def progress_text(state, total: int) -> str:
    """One rank's progress line: state, step, last loss, and how long it has been quiet."""
    loss = f" · loss {state.loss:.4f}" if state.loss is not None else ""
    wait = f" · quiet {state.seconds_since_progress:.0f} s" if state.seconds_since_progress > 10 else ""
    return f"rank {state.rank}: {state.state} · step {int(state.step)}/{total}{loss}{wait}"


def error_html(e: BaseException) -> str:
    """An error block: its kind and first line, the rest (rank logs, a bug's traceback) folded away."""
    text = str(e)
    first, _, rest = text.partition("\n")
    if isinstance(e, LaunchError) and e.logs:
        tails = "\n".join(f"--- rank {r} (last lines) ---\n" + "\n".join(log.splitlines()[-15:])
                          for r, log in sorted(e.logs.items()) if log.strip())
        rest = (rest + "\n" + tails).strip()
    elif not isinstance(e, (StnbError, KeyboardInterrupt)):
        rest = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    details = ""
    if rest.strip():
        details = (f"<details><summary>details</summary><pre style='white-space:pre-wrap;font-size:11px'>"
                   f"{escape(rest)}</pre></details>")
    return (f'<div class="stnb-error-text" style="color:{RED};border-left:3px solid {RED};padding-left:8px">'
            f"<b>{escape(type(e).__name__)}</b>: {escape(first)}{details}</div>")


def rank_logs(logs: dict) -> str:
    """The last 30 non-empty lines of each rank's output, folded away ('' when they printed nothing)."""
    parts = []
    for r, log in sorted((logs or {}).items()):
        lines = [ln for ln in log.splitlines() if ln.strip()][-30:]
        if lines:
            parts.append(f"[rank {r}]\n" + "\n".join(lines))
    if not parts:
        return ""
    return ("<details><summary>output of the last run's ranks</summary><pre style='font-size:11px;"
            f"max-height:240px;overflow:auto'>{escape(chr(10).join(parts))}</pre></details>")


# ---- results ---------------------------------------------------------------------------------

def results_table(results: list) -> str:
    """One row per run (RunResults or their dicts): the comparison table's columns, unrunnable rows greyed."""
    if not results:
        return EMPTY_TABLE
    from ..plots import comparison_table

    rows = []
    for _, r in comparison_table(results).iterrows():
        ok = r["status"] == "ok"
        peak = max(r["peak_memory_bytes"]) / 2**20 if r["peak_memory_bytes"] else None
        cells = [r["label"], r["strategy"], r["world_size"], r["per_device_batch_size"], r["global_batch_size"],
                 r["model_name"], r["device"], num(r["samples_per_second"], ",.1f"), num(r["speedup"], ".2f", "x"),
                 num(peak, ",.0f"), num(r["losses"][-1] if r["losses"] else None, ".4f"),
                 r["verified"] if ok else "", r["status"] if ok else f"{r['status']}: {r['reason']}"]
        tds = "".join(f"<td>{escape(str(c))}</td>" for c in cells)
        rows.append(f'<tr class="{"stnb-ok" if ok else "stnb-unrunnable"}">{tds}</tr>')
    head = "".join(f'<th title="{escape(t)}">{escape(h)}</th>' for h, t in COLUMNS)
    return (f'{CSS}<div style="overflow-x:auto;max-width:100%"><table class="stnb-table"><thead><tr>{head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div>')


def has_time_split(result) -> bool:
    """The run measured where its steps' time went (CPU ranks; not on CUDA, not for an unrunnable row)."""
    from ..plots.timesplit import means

    return bool(means(result).get("step"))


def time_split_html(result) -> str:
    """Where the last run's step time went: each part's share of the step, and what to change
    (``stnb.plots.timesplit.advice``)."""
    from ..plots.timesplit import LABELS, PARTS, advice, means

    name = f"{escape(result.strategy)} ×{result.world_size}"
    m = means(result)
    if not m.get("step"):
        return f"<b>Where the time went</b> ({name}): {escape(advice(result))}"
    shares = " · ".join(f"{escape(LABELS[p])} {m[p] / m['step']:.0%}" for p in PARTS
                        if m.get(p) and m[p] / m["step"] >= 0.005)  # what rounds to 0% is left out
    return (f"<b>Where the time went</b> ({name}, {1e3 * m['step']:.1f} ms per step): {shares}<br>"
            f"{escape(advice(result))}")
