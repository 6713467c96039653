"""The planner: a layout -> predicted memory and step time; every layout of a model ranked.

    from refimpl.lab.plan import plan
    plan(n_layers=80, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096,
         global_batch=1024, gpus=64)

models.py    model shapes by name, and Narayanan et al. 2021's published layouts
layout.py    a layout: the axes' sizes, the techniques, which groups stay inside a node
memory.py    one layout's bytes per GPU: model states, activations, a backward's transient
predict.py   one layout's step time term by term, and predict(): memory, time, throughput
search.py    enumerate, predict, rank: plan()
cli.py       `python -m refimpl plan --model 70b --gpus 64`: plan_main(argv)
published.py the planner against published layouts (Narayanan et al. 2021 Table 1 and others)
cpu.py       the layouts that run on a few CPU ranks, predicted for comparison with measured runs
moe.py       what a mixture of experts adds: experts over ep then edp, their activations, all-to-alls
moe_cpu.py   the expert layouts' model-state bytes, predicted beside the loop's on 4 CPU ranks

The GPU presets it predicts with are refimpl.lab.predict.hardware's (the datasheet numbers, re-exported
here); this machine as a preset is measured by refimpl.lab.measure.this_machine.
"""
from refimpl.lab.measure.this_machine import cpu_preset  # noqa: F401
from refimpl.lab.plan.predict import Layout, predict  # noqa: F401
from refimpl.lab.plan.published import compare_with_megatron  # noqa: F401
from refimpl.lab.plan.search import best_per_grid, enumerate_layouts, plan  # noqa: F401
from refimpl.lab.predict.hardware import GPUS, Hardware, get_hardware  # noqa: F401
from refimpl.lab.predict.presets import MODELS, ModelShape, megatron_runs  # noqa: F401
