"""Will it fit? One step of refimpl's own code for one rank of a full-size layout, on one CPU.

    result = dry_run(LabConfig(strategy="zero1", nproc=64, tp=8, pp=4, model=...), rank=0)
    python -m refimpl dryrun --model 70b --nproc 64 --tp 8 --pp 4 --strategy zero1 --rank 0 --json

Nobody here has 64 GPUs, but PyTorch can run the code of rank r of a 64-rank run anyway: a tensor
on the `meta` device has its shape, dtype and strides and no storage, so a 65B-parameter model
costs nothing to build, and the `fake` process-group backend
(torch.testing._internal.distributed.fake_pg) lets this one process be rank r of a world of any
size: its collectives return at once, leaving their outputs as they were (no values, so nothing
is lost). torchtitan's COMM_MODE=fake_backend is the same idea on one real GPU.

Why `meta` and not FakeTensorMode (what this file used first; every figure came out the same on
the 22 layouts of the tests and refimpl.lab.plan.against_dryrun.GRID, before and after): a fake
tensor is a Python subclass, so every op, and every read of its device from C++ (`prim.device`,
two thirds of the ~50k calls of a 70B step), goes through Python; meta tensors are a C++
backend, and only the ops' own shape rules are Python. That halved the time, and
refimpl.lab.verify.fast_meta, shorter rules for the slowest of those, halved what was left.
The cost of `meta` is that a tensor made on another device is real: the rank is built and run
inside `torch.device("meta")` (factories without a device land on meta; the train code asks
launch.device_for("fake"), which says meta), and `OnMeta` raises as soon as an op makes a real
tensor of more than a few bytes while the rank is built (the tests' small layouts take the same
code paths first, where such a tensor costs nothing).

What runs is exactly the real run's rank (refimpl.train.setup_rank: the model-parallel transforms,
then the strategy's placement) and a real step of it, measured once every state a step leaves
behind exists (`strategy.train_step`: every micro-batch's forward and backward in the schedule's
order, the data-parallel sync, the optimizer; see `prime_optimizers`). What comes
back is what the train CLI reports for that rank, by category -- params, grads, optimizer,
activations_peak (autograd's saved tensors, refimpl.lab.instrument.activations), and `peak`, the most
bytes alive at any moment of the step (refimpl.lab.measure.live_memory.LiveBytes: the model states, and every
storage an op creates, until it is freed) -- and `comm`: every collective this rank called, bytes per
op per axis of the grid (the labels' convention, refimpl.lab.instrument.labels: the whole message). Before the
step, `build_peak`: the most bytes alive while the strategy placed the rank's tensors (the
reference and the transforms are shapes only, in a real run too: refimpl.lab.rank_build.values), and
`built`, what that left; a rank's peak over its life is the larger of build_peak and peak.

The batch is the only thing not from the loop: `synthetic_batch` draws its noise with a
data-dependent count, which a meta tensor cannot have, and token values change no memory figure,
so the dry run feeds random ids of the batch's shape. bf16 autocast is refused: PyTorch has no
autocast for `meta`, and without it the figures would silently be fp32's.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch
import torch.distributed as dist

from refimpl.config import TrainConfig
from refimpl.lab.instrument.activations import ActivationTracker, activation_exclusions
from refimpl.lab.instrument.model_state import model_state
from refimpl.lab.loop import setup_rank
from refimpl.lab.measure.live_memory import LiveBytes
from refimpl.lab.predict.presets import get_model
from refimpl.lab.verify.fast_meta import fast_meta_kernels
from refimpl.lab.verify.on_meta import OnMeta, values_not_drawn
from refimpl.mesh import LayoutError
from refimpl.model import Batch, GPTConfig
from refimpl.seam import current_name
from refimpl.train import validate

# The collectives refimpl's code calls through torch.distributed (as `dist.X`, through refimpl.seam,
# looked up at call time), and which argument is "the message" (refimpl.lab.instrument.labels' convention).
MESSAGE_ARG = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather_into_tensor": 0,
               "reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_gather": 0,
               "isend": 0, "irecv": 0, "send": 0, "recv": 0}
# The axes a group can be, most specific first: a dp x cp group with cp = 1 is the dp group.
AXIS_ORDER = ("tp", "cp", "pp", "dp", "dp_cp", "ep", "edp")


def preset_config(name: str, cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the planner preset `name`'s shape (refimpl.lab.predict.presets) as its model and its
    full sequence length. The global batch stays `cfg`'s: one micro-batch per pipeline stage in
    flight is what memory depends on, not the preset's thousand sequences (see `default_batch`).
    A mixture of experts is built as `moe_form` says."""
    shape, _ = get_model(name)
    model = GPTConfig(vocab_size=shape.vocab_size, seq_len=shape.seq_len, d_model=shape.d_model,
                      n_heads=shape.n_heads, n_layers=shape.n_layers,
                      tie_embeddings=shape.tied_embeddings, **moe_form(name, shape))
    return cfg.with_(model=model, seq_len=shape.seq_len)


def moe_form(name: str, shape) -> dict:
    """The architecture fields of GPTConfig for a preset: none for a dense GPT-2-shaped one,
    Llama's own block (arch, key/value heads, SwiGLU width) for a dense Llama, and for a
    mixture of experts the MoE fields (its name says so). refimpl builds its own
    block (refimpl.model: LayerNorm, multi-head attention, GELU experts of width mlp_ratio * h),
    so a Mixtral preset (SwiGLU, grouped-query attention) runs in that form, as the 70b preset is
    Llama 2 in it: experts of width round(ffn_hidden / h) * h (Mixtral 8x7B: 16384, not 14336),
    E, top_k and capacity_factor the preset's. Capacity per sequence (capacity_scope=sequence):
    the batch scope refuses data parallelism with micro-batches (refimpl.lab.moe_scope), which
    `default_batch` always has for pp > 1."""
    if not shape.n_experts:
        # a dense Llama preset runs Llama's own block (refimpl.model.parts): SwiGLU of its width,
        # its key/value heads, rotary positions
        return (dict(arch="llama", n_kv_heads=shape.kv_heads, ffn_hidden=shape.mlp_width)
                if shape.block == "llama" else {})
    ratio = round(shape.mlp_width / shape.d_model)
    if ratio < 1:
        raise LayoutError(f"--model {name}: experts of width {shape.mlp_width} < d_model "
                          f"{shape.d_model}: refimpl's MLP width is an integer multiple of it")
    return dict(mlp_ratio=ratio, n_experts=shape.n_experts, top_k=shape.top_k,
                capacity_factor=shape.capacity_factor, capacity_scope="sequence")


def default_batch(cfg: TrainConfig) -> TrainConfig:
    """Micro-batches of one sequence, as many as 1F1B keeps in flight on the first stage (pp of
    them; Narayanan et al. 2021 §2.2): memory is then that of the preset's full batch (more
    micro-batches change no figure: each is freed before the next past those pp starts) at a
    fraction of the time, which is ~0.3 ms per op on fake tensors."""
    return cfg.with_(global_batch=cfg.dims.dp * cfg.pp, micro_batches=cfg.pp)


def dry_run(cfg: TrainConfig, rank: int = 0, step: bool = True) -> dict:
    """One training step of rank `rank` of `cfg`'s layout on fake tensors and a fake process group.

    Returns {"rank", "world_size", "n_params", "memory": {params, grads, optimizer,
    activations_peak, total, peak, held, build_peak, built} (bytes, this rank), "comm": {axis:
    {op: bytes}}, "calls": {axis: {op: count}}}. `build_peak`: the most bytes alive while the
    rank was built (refimpl.train.setup_rank), `built`: what it held then. `step=False`: only
    build the rank (memory: build_peak and built), in a fraction of the time. Raises
    LayoutError (one line) for a layout the real run would refuse."""
    layout = validate(cfg)
    cfg = layout.cfg            # a shorthand's axes filled in (refimpl.registry)
    if not 0 <= rank < cfg.nproc:
        raise LayoutError(f"--rank must be in [0, {cfg.nproc - 1}] (got {rank})")
    if dist.is_initialized():
        raise RuntimeError("dry_run starts its own (fake) process group: none may be running")
    if cfg.mixed_precision == "bf16":
        raise LayoutError("the dry run computes on the meta device, which has no bf16 autocast: "
                          "use --mixed-precision fp32")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg.nproc)
    try:
        with torch.device("meta"), fast_meta_kernels():
            with OnMeta() as made, values_not_drawn():
                # What the rank's device holds while it is built, before any step:
                # `build_peak`. The reference and the transforms are shapes only in a real run
                # too (meta, refimpl.lab.rank_build.values); only the strategy's placement allocates.
                building = LiveBytes()
                ctx, strategy, n_params = setup_rank(rank, cfg.nproc, layout, placing=building)
                build_peak, built = building.peak, building.current
                if not step:
                    return {"rank": rank, "world_size": cfg.nproc, "n_params": n_params,
                            "memory": {"build_peak": int(build_peak), "built": int(built)}}
                ids = torch.randint(cfg.model.vocab_size, (cfg.global_batch, cfg.seq_len + 1))
                batch = Batch(ids[:, :-1], ids[:, 1:])
                # The train CLI's peak is a step after the first: before it, AdamW's m and v do
                # not exist (torch creates them in its first step), nor, in some strategies, the
                # gradients. The optimizer's states are made directly (prime_optimizers: a few
                # ops per tensor instead of a whole step); a measured step that still leaves more
                # alive than it began with (gradients autograd created, a lazily made buffer)
                # was a warm-up, and the next one is measured instead.
                prime_optimizers(strategy)
            for _ in range(2):
                tracker = ActivationTracker(exclude=activation_exclusions(strategy))
                live = LiveBytes(made.alive())
                held = live.current
                with recording_collectives(ctx.mesh) as comm, live, tracker:
                    strategy.train_step(batch)
                if live.current <= held:
                    break
                made.add(live.storages())   # what the warm-up left is held next
            state = model_state(strategy)
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "world_size": cfg.nproc, "n_params": n_params,
            "layout": {"dp": cfg.dims.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
                       "strategy": cfg.strategy, "micro_batches": cfg.micro_batches,
                       "global_batch": cfg.global_batch, "seq_len": cfg.seq_len},
            "memory": {"params": int(state.params), "grads": int(state.grads),
                       "optimizer": int(state.optimizer), "activations_peak": int(tracker.peak),
                       "total": int(state.total + tracker.peak), "peak": int(live.peak),
                       "held": int(held),    # alive as the step began: states, the batch
                       "build_peak": int(build_peak), "built": int(built)},
            "comm": {axis: dict(ops) for axis, ops in comm["bytes"].items()},
            "calls": {axis: dict(ops) for axis, ops in comm["calls"].items()}}


def prime_optimizers(strategy) -> None:
    """Create the states a first optimizer step creates, without the step: the strategy's
    optimizer (a sharded one, refimpl.parallel.zero.ShardedOptimizer, steps its shard) steps once
    on zero gradients where a parameter has none, which are then removed again. On fake tensors
    the values it writes are no values."""
    optimizer = getattr(strategy, "optimizer", None)
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if p.grad is None]
    for p in missing:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in missing:
        p.grad = None


@contextlib.contextmanager
def recording_collectives(mesh):
    """Count every torch.distributed collective called inside: bytes of its message and calls,
    per op, per axis of `mesh` (the axis whose ranks the call's group holds)."""
    axes = {}
    for axis in reversed(AXIS_ORDER):   # the most specific name wins for a shared group
        ranks = mesh.ranks(axis) if axis in mesh._ranks else []
        if len(ranks) > 1:
            axes[tuple(ranks)] = axis
    # the all-to-all is expert parallelism's own collective: where ep's group is dp's (ep = dp),
    # it goes under ep, and the dp group's gradient syncs stay under dp
    ep_ranks = tuple(mesh.ranks("ep")) if "ep" in mesh._ranks else ()
    out = {"bytes": defaultdict(lambda: defaultdict(int)),
           "calls": defaultdict(lambda: defaultdict(int))}
    # each call is counted under refimpl's name of the op, whichever name the installed torch
    # gives it (refimpl.seam: reduce_scatter_single is reduce_scatter_tensor)
    current = {name: current_name(name) for name in MESSAGE_ARG}
    originals = {current[name]: getattr(dist, current[name]) for name in MESSAGE_ARG}

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
            axis = axes.get(ranks, "world") if ranks else "world"
            if name == "all_to_all_single" and ranks == ep_ranks:
                axis = "ep"
            message = args[MESSAGE_ARG[name]] if len(args) > MESSAGE_ARG[name] else None
            if isinstance(message, (list, tuple)):   # all_gather's list of outputs
                nbytes = sum(t.numel() * t.element_size() for t in message)
            else:
                nbytes = message.numel() * message.element_size() if message is not None else 0
            out["bytes"][axis][name] += int(nbytes)
            out["calls"][axis][name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in MESSAGE_ARG:
        setattr(dist, current[name], wrap(name, originals[current[name]]))
    try:
        yield out
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def add_arguments(parser) -> None:
    """`dryrun` takes the train flags plus these (refimpl.lab.cli builds it from train's)."""
    parser.add_argument("--model", default=None,
                        help="a planner preset (refimpl.lab.predict.presets: 70b, gpt3-175b, ...)")
    parser.add_argument("--rank", type=int, default=0, help="the rank of the grid to run")


def main_from_args(args, config_from_args) -> int:
    """`python -m refimpl dryrun <train flags> [--model PRESET] --rank R [--json]`."""
    import json
    import sys

    try:
        cfg = config_from_args(args).with_(device="cpu", record_memory=False, profile=False)
        if args.model is not None:
            cfg = preset_config(args.model, cfg)
            # the train defaults (batch 8, 1 micro-batch) left as they are: 1F1B's (default_batch)
            if (args.global_batch, args.micro_batches) == (8, 1):
                cfg = default_batch(cfg)
        result = dry_run(cfg, rank=args.rank)
    except (LayoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"rank {result['rank']} of {result['world_size']} ({result['layout']}):")
    for key, value in result["memory"].items():
        print(f"  {key:17s} {value / 2**30:10.2f} GiB")
    for axis, ops in result["comm"].items():
        print(f"  comm {axis:5s} " + ", ".join(f"{op} {b / 2**20:.1f} MiB" for op, b in ops.items()))
    return 0
