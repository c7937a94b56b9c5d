"""Print the fault matrix: each failure provoked for real, time to error and orphans measured.

    python tests/fault_matrix.py            # every case
    python tests/fault_matrix.py stall kill # cases whose function name contains a word

Columns: the error stnb raised (type and kind), seconds from the fault to the error (for the
stall and timeout cases: after the limit passed), processes left behind (descendants of this
process, plus rank pids still alive), whether a child process was started at all (refusals
must start none), and whether a normal launch right afterwards, in the same process, works.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import faultcases  # noqa: E402


def main(argv) -> int:
    cases = [c for c in faultcases.CASES if not argv or any(w in c.__name__ for w in argv)]
    outcomes = faultcases.run_all(cases)
    head = ("case", "error raised", "time to error s", "orphans", "children started", "next launch ok")
    rows = []
    for o in outcomes:
        r = o.row()
        t = "-" if r["time_to_error_s"] is None else f"{r['time_to_error_s']:.2f}"
        if o.after_limit and r["time_to_error_s"] is not None:
            t += f" (after the {o.after_limit:g} s limit)"
        rows.append((r["case"], r["error"], t, str(r["orphans"]), "yes" if r["children_started"] else "no",
                     "yes" if r["next_launch_ok"] else f"NO: {o.next_error}"))
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    print()
    for o in outcomes:
        first = str(o.error).splitlines()[0] if o.error else o.note
        print(f"{o.case}: {first[:300]}")
    bad = [o.case for o in outcomes if o.orphans or o.rank_pids_alive or o.next_ok is False]
    if bad:
        print("\nPROBLEMS:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
