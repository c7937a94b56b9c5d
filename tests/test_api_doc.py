"""docs/api.md lists every public name (``stnb.__all__``) and every ``python -m stnb`` subcommand, no more."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import stnb
from stnb.__main__ import parser

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _section() -> str:
    text = API.read_text()
    return text[text.index("## Every public name and subcommand"):]


def test_api_doc_lists_every_public_name():
    listed = re.findall(r"^\| `stnb\.(\w+)` \|", _section(), flags=re.M)
    assert len(listed) == len(set(listed)), "a name is listed twice"
    assert sorted(listed) == sorted(stnb.__all__), (
        f"docs/api.md and stnb.__all__ differ: not documented {sorted(set(stnb.__all__) - set(listed))}, "
        f"documented but not public {sorted(set(listed) - set(stnb.__all__))}")


def test_api_doc_lists_every_subcommand():
    [sub] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    listed = re.findall(r"^\| `python -m stnb ([\w-]+)` \|", _section(), flags=re.M)
    assert sorted(listed) == sorted(sub.choices), (
        f"docs/api.md and python -m stnb differ: not documented {sorted(set(sub.choices) - set(listed))}, "
        f"documented but absent {sorted(set(listed) - set(sub.choices))}")
