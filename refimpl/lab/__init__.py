"""The lab: everything that instruments, checks, varies or drives the core (../../README.md, "Layout").

    verify/      equivalence with `single`, the layout matrix, the bisector, the dry run
    plan/        the planner (`python -m refimpl plan`)
    measure/     sweeps and measurements the notebooks and benchmarks run (collectives, bubbles, MFU,
                 CUDA memory, ceilings)
    checkpoint/  checkpoint conversions
    twins/       PyTorch's twins (torch-*), --strategy names through the registry's plug-in seam
    faults/      notebook 10's bugs on purpose (--set fault=NAME), picked through the same seam
    plots/, tb_plugin/, cli.py, env.py   figures, TensorBoard's rank timeline, `python -m refimpl`

The lab imports the core; the core (refimpl/ outside this folder) never imports the lab
(tests/test_imports.py)."""
