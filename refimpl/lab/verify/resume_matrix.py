"""The layout matrix's resume pass: every layout resumes from a checkpoint another layout wrote.

A sharded checkpoint (refimpl.lab.checkpoint.sharded_checkpoint) is written as the writer's pieces (its
tp slices, its stages, its ZeRO/FSDP flat ranges) and read as the reader's: a bug in either
half lives in one pairing of a writer's sharding with a reader's. So the pass pairs layouts:

    pairs = resume_pairs(cover.layouts)      # each layout writes; the next one of its kind reads
    outcomes = run_resumed(pairs)            # the reader's run, judged against single's

The writer trains the first of the matrix's steps and checkpoints it (`WRITTEN_AT`); the reader,
under its own layout and world size, finds the checkpoint, trains the rest, and is held to the
matrix's gate against single's uninterrupted run (float64: losses and every weight at 1e-9;
refimpl.lab.verify.matrix_run). A reader that found no checkpoint is wrong, not equal. Two layouts
pair only if a resumed run may change between them (the same model, batch and precision:
refimpl.lab.checkpoint.run_checkpoint.RUN_KEYS); `resume_pairs` chains each group of those in a cycle,
so every layout of the group is written once and read once, each time under another layout.
Writers run one launch per world size, then readers one per world size: four to six launches.
"""
from __future__ import annotations

import os
import tempfile

from refimpl.lab.config import lab_config
from refimpl.lab.twins.base import through_dcp
from refimpl.lab.verify.layout_matrix import Layout, refusal
from refimpl.lab.verify.matrix_run import LAYOUT_TIMEOUT, Outcome, reference_key, run_one_world
from refimpl.mesh import LayoutError
from refimpl.registry import strategy_class
from refimpl.train import validate

WRITTEN_AT = 1      # the writer's step count: the reader trains the rest (layout_matrix.STEPS)


def resumable(layout: Layout) -> bool:
    """A float64 layout the launcher accepts with --checkpoint-dir (bf16 is judged at bf16's gate,
    not 1e-9)."""
    if layout["precision"] != "float64" or refusal(layout) is not None:
        return False
    try:
        validate(lab_config(layout.config()).with_(checkpoint_dir=os.path.join(tempfile.gettempdir(),
                                                                   "refimpl-none-here")))
    except LayoutError:
        return False
    return True


def resume_pairs(layouts: list[Layout]) -> list[tuple[Layout, Layout]]:
    """(writer, reader) pairs: within each group of layouts a run may resume across (the same
    single reference, the same format: PyTorch's twins write torch.distributed.checkpoint's,
    refimpl.lab.checkpoint.dcp_checkpoint), each layout's checkpoint read by the next one, the last's
    by the first. A group of one reads its own (save and restore, no resharding)."""
    groups: dict[tuple, list[Layout]] = {}
    for layout in filter(resumable, layouts):
        dcp = through_dcp(strategy_class(layout["strategy"]))
        groups.setdefault((reference_key(layout.config()), dcp), []).append(layout)
    return [(group[i], group[(i + 1) % len(group)])
            for group in groups.values() for i in range(len(group))]


def run_resumed(pairs: list[tuple[Layout, Layout]], *,
                layout_timeout: float = LAYOUT_TIMEOUT) -> list[Outcome]:
    """Each pair's reader outcome (its `written_by` the writer); a writer that was not equal to
    single over its own steps is that pair's outcome instead."""
    with tempfile.TemporaryDirectory(prefix="refimpl-resume-") as tmp:
        where = [os.path.join(tmp, str(k)) for k in range(len(pairs))]
        writes = [lab_config(w.config()).with_(steps=WRITTEN_AT, checkpoint_every=WRITTEN_AT, checkpoint_dir=d)
                  for (w, _), d in zip(pairs, where)]
        written = _by_world([w for w, _ in pairs], writes, layout_timeout)
        reads = [lab_config(r.config()).with_(checkpoint_dir=d) for (_, r), d in zip(pairs, where)]
        read = _by_world([r for _, r in pairs], reads, layout_timeout)
    out = []
    for (writer, _), w, r in zip(pairs, written, read):
        o = r if w.status == "equal" else w
        o.written_by = writer if o is r else None
        if o is w:
            o.detail = f"(writing) {o.detail}"
        out.append(o)
    return out


def _by_world(layouts: list[Layout], cfgs: list, layout_timeout: float) -> list[Outcome]:
    """matrix_run's launches, one per world size, each layout running its cfg."""
    outcomes: dict[int, Outcome] = {}
    worlds: dict[int, list[int]] = {}
    for i, layout in enumerate(layouts):
        worlds.setdefault(layout["world"], []).append(i)
    for world, indices in sorted(worlds.items()):
        ran = run_one_world([layouts[i] for i in indices], world, layout_timeout,
                             [cfgs[i] for i in indices])
        outcomes.update(zip(indices, ran))
    return [outcomes[i] for i in range(len(layouts))]
