"""refimpl.lab.source: the notebooks' "the mechanism, from the core" cells point into the core."""
import pytest

from refimpl.lab import source
from refimpl.parallel.dp.naive import NaiveDataParallel


def test_show_prints_a_core_function_with_its_file_and_line(capsys):
    text = source.show(NaiveDataParallel.sync_gradients)
    assert text.startswith("# refimpl/parallel/dp/naive.py:")
    assert "dist.all_reduce(p.grad" in text and text in capsys.readouterr().out


def test_show_refuses_what_the_lab_defines():
    with pytest.raises(ValueError, match="outside refimpl's core"):
        source.show(source.where)
