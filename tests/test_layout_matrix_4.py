"""The layout matrix's pairwise cover, its 4-rank layouts (tests/test_layout_matrix.py has the
rest and says what the cover is): a module of its own, so that the cover's two halves run on both
pytest-xdist workers."""
from __future__ import annotations

import pytest

from refimpl.lab.verify.matrix_run import counts, run_layouts
from tests.test_layout_matrix import pairwise_on

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def test_pairwise_layouts_on_4_ranks_equal_single_or_are_refused():
    layouts = pairwise_on((4,))
    found = counts(run_layouts(layouts))
    print(found)
    assert len(layouts) > 10 and found.ran > 0 and not found.wrong, str(found)
