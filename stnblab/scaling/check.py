"""The predictor checked on published tables it was not built from: the sentence-transformers docs' 4x V100
rows (``seed``) and NVIDIA DeepLearningExamples' BERT-large fine-tuning on a DGX-1 (``dle``), each predicted
from its own 1-GPU row alone, as an interval.

    python -m stnblab.scaling.check                                 print the table and the assumptions
    python -m stnblab.scaling.check --write-doc docs/scaling.md     refresh the block between the markers
                                                                 (README.md holds the same table)

A row is inside when the published value lies in [low, high]; the error is the all-mid prediction's.
A row outside also says what the one input that explains it would have to be (``seed.would_match``:
never used to predict).
"""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- published-check -->", "<!-- /published-check -->"


def rows() -> tuple:
    """(rows, {table: assumptions}) of both published tables."""
    from . import dle, seed

    st_rows, st_notes = seed.check()
    for r in st_rows:
        r["would_match"] = "" if r["devices"] == 1 or inside(r) else seed.would_match(r["strategy"], r["published"])
    dle_rows, dle_notes = dle.check()
    for r in dle_rows:
        r["would_match"] = ""
    notes = {st_rows[0]["table"]: st_notes}
    notes.update({f"DLE BERT-large, {setup}": a for setup, a in dle_notes})
    return st_rows + dle_rows, notes


def inside(r) -> bool:
    return r["low"] is not None and r["low"] <= r["published"] <= r["high"]


def error(r) -> float:
    return r["predicted"] / r["published"] - 1


def markdown(all_rows) -> str:
    """The table: one line per published row."""
    lines = ["| published table | strategy | devices | published | predicted (low - high) | predicted (mid) | "
             "error (mid) | inside | dominant input | suspect |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in all_rows:
        if r["devices"] == 1:
            lines.append(f"| {r['table']} | {r['strategy']} | 1 | {r['published']:,.6g} | (the input) | "
                         f"{r['predicted']:,.6g} | +0% | - | - | |")
            continue
        need = f" (would need {r['would_match']})" if r["would_match"] else ""
        where = "yes" if inside(r) else f"**no**{need}"
        lines.append(f"| {r['table']} | {r['strategy']} | {r['devices']} | {r['published']:,.6g} | "
                     f"{_fmt(r['low'])} - {_fmt(r['high'])} | {_fmt(r['predicted'])} | {error(r):+.0%} | {where} | "
                     f"{r['dominant'] or '-'} | {r['suspect'] or ''} |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def document(all_rows, notes) -> str:
    """The block between the markers: the table, then each table's assumptions."""
    text = markdown(all_rows)
    for table, assumptions in notes.items():
        text += f"\nAssumptions ({table}):\n\n" + "\n".join(f"- {a}" for a in assumptions) + "\n"
    return text


def refresh(path, table_only=False) -> bool:
    """Rewrite the block between the markers in ``path`` (``table_only``: without the assumptions, as
    README.md holds it). Returns True when it changed."""
    all_rows, notes = rows()
    body = markdown(all_rows) if table_only else document(all_rows, notes)
    path = Path(path)
    text = path.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to refresh")
    new = re.sub(re.escape(BEGIN) + r"\n.*?" + re.escape(END), lambda _: f"{BEGIN}\n{body}{END}", text, flags=re.S)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m stnblab.scaling.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--write-doc", action="append", default=[],
                   help="refresh the block in this markdown file (README.md: the table only)")
    a = p.parse_args(argv)
    all_rows, notes = rows()
    print(document(all_rows, notes))
    for path in a.write_doc:
        changed = refresh(path, table_only=Path(path).name == "README.md")
        print(f"{path}: {'updated' if changed else 'already current'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
