"""What stnb runs on this machine, strategy by precision, and why it refuses the rest, asked of stnb's own rules.

Nothing here restates a rule: each cell is ``TrainConfig(strategy, mixed_precision, device).validate()`` (the
strategy's availability on these GPUs, its own refusals, the GPUs' compute capability, the ranks this machine
holds), with the strategy's default number of processes. docs/gpu.md's Colab / Kaggle table is ``markdown`` of
a simulated 1x T4 and 2x T4 (``tests/test_gpu_sim.py::test_the_t4_table_is_what_stnbs_rules_say``).
"""

from __future__ import annotations

import re

BEGIN, END = "<!-- what-runs -->", "<!-- /what-runs -->"
PRECISIONS = ("no", "fp16", "bf16")
LABELS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def what_runs(device: str = "cuda", precisions=PRECISIONS) -> dict:
    """{(strategy, precision): None where stnb runs it on this machine, else the reason it refuses it}: the first
    refusal ``TrainConfig.validate`` gives (its model and data, the same for every cell, are not resolved)."""
    from stnb import strategies
    from stnb.config import TrainConfig
    from stnb.errors import StnbError

    out = {}
    for s in strategies.all_strategies():
        for p in precisions:
            try:
                config = TrainConfig(strategy=s.name, model="tiny", device=device, mixed_precision=p)
                config.validate(check_resources=False)
                config.check_hardware()  # what validate() checks next, before the model and data
                out[s.name, p] = None
            except StnbError as e:  # ConfigError / StrategyUnavailable: the refusal users see
                out[s.name, p] = str(e)
    return out


def markdown(machines: dict, variants: dict | None = None) -> str:
    """One table for ``{label: what_runs()}``: a row per strategy, a column per machine and precision, each cell
    'runs' or 'refused (n)', the reasons numbered below it; then, for each of ``variants`` ({what differs:
    {label: what_runs() there}}), the cells whose verdict it changes."""
    reasons = []
    strategies = list(dict.fromkeys(s for cells in machines.values() for s, _ in cells))
    heads = [(label, p) for label, cells in machines.items() for p in dict.fromkeys(p for _, p in cells)]

    def verdict(why):
        if why is None:
            return "runs"
        if why not in reasons:
            reasons.append(why)
        return f"refused ({reasons.index(why) + 1})"

    lines = ["| strategy | " + " | ".join(f"{label}: {LABELS.get(p, p)}" for label, p in heads) + " |",
             "| --- |" + " --- |" * len(heads)]
    lines += [f"| `{s}` | " + " | ".join(verdict(machines[label][s, p]) for label, p in heads) + " |"
              for s in strategies]
    notes = []
    for what, there in (variants or {}).items():
        changed = {}  # (strategy, label, verdict there) -> precisions
        for label, cells in machines.items():
            for s, p in changes(cells, there[label]):
                v = verdict(there[label][s, p])
                changed.setdefault((s, label, v if v == "runs" else f"is {v}"), []).append(LABELS.get(p, p))
        notes.append(f"{what}: " + ("; ".join(f"`{s}` on {label} in {' and '.join(ps)} {v}"
                                              for (s, label, v), ps in changed.items()) or "no change") + ".")
    lines += [""] + [f"({i}) {why}" + ("" if why.endswith(".") else ".") for i, why in enumerate(reasons, 1)]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def changes(before: dict, after: dict) -> list:
    """The cells (strategy, precision) whose verdict differs between two ``what_runs``, in ``before``'s order."""
    return [k for k in before if (before[k] is None) != (after.get(k) is None)]


def block(text: str) -> str | None:
    """The text between the markers (``BEGIN`` / ``END``), None without them."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    return m.group(1) if m else None


def refresh(path: str, body: str) -> bool:
    """Write ``body`` between the markers of ``path``; True when it changed."""
    with open(path) as f:
        text = f.read()
    if block(text) is None:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to refresh")
    new = re.sub(re.escape(BEGIN) + r"\n.*?" + re.escape(END), lambda _: f"{BEGIN}\n{body}{END}", text, flags=re.S)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text
