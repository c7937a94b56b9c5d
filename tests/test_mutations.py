"""The mutation check (tests/mutations.py): every fault in the table, put into a scratch copy of
stnb, makes the test named for that behaviour fail. The unmutated tests pass in the ordinary run of
the suite; a mutant whose tests fail for another reason (collection error, a test that is not
named) does not count as caught."""

from __future__ import annotations

import os

import pytest

import mutations


@pytest.fixture(scope="module", autouse=True)
def copies_import_their_own_stnb(tmp_path_factory):
    root = mutations.copy_repo(str(tmp_path_factory.mktemp("probe") / "repo"))
    where = mutations.where_stnb_comes_from(root)
    assert where.startswith(root + os.sep), f"a copy imports stnb from {where!r}, not from itself"


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.id)
def test_anchor_is_in_the_code(m):
    mutations.check_anchors(m)  # a stale mutation is an error, never a silent pass


def _marks(m):
    if m.pending:
        return [pytest.mark.xfail(strict=True, reason=f"pending {m.pending}")]
    return []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("m", [pytest.param(m, id=m.id, marks=_marks(m)) for m in mutations.MUTATIONS])
def test_mutation_is_caught(m):
    out = mutations.run_mutation(m)
    print(f"{m.id}: exit {out.returncode}, failed {out.failed}, {out.seconds:.0f} s")
    assert out.caught, (f"mutation {m.id!r} ({m.fault}) survived: {', '.join(m.tests)} "
                        f"exited {out.returncode}, failed {out.failed}\n{out.output[-4000:]}")
