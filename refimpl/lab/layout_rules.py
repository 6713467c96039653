"""The rules a run's flags and layout must keep, checked in the launching process before any rank
starts: each broken rule raises LayoutError with one line naming it (the CLI exits 2 on it).

`check_run` is what the lab's loop plug-in (refimpl.lab.loop.LabExtras.validate, registered under
"refimpl.loop") runs for refimpl.train.validate, before the strategy's own `validate`. The
mechanisms themselves refuse what they cannot cut (a head count tp does not divide, ...), with a
plainer error and inside a rank; these rules say it first, and in the CLI's words.
"""
from __future__ import annotations

import math

import torch

from refimpl.config import DTYPES
from refimpl.mesh import LayoutError
from refimpl.parallel.pp import schedules as pp
from refimpl.parallel.pp.stage import partition
from refimpl.parallel.tp.attention import kv_split
from refimpl.registry import entry_of

COLLECTIVES = ("torch", "refimpl")
AXIS_NAMES = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}


def check_run(cfg, strategy) -> None:
    """Every shared rule of `cfg` (a TrainConfig, its shorthand resolved); `strategy`: the class
    that runs it (refimpl.registry), whose traits say what it composes with."""
    check_shorthand(cfg)
    check_values(cfg)
    check_layout(cfg)
    check_model_parallel(cfg, strategy)
    check_options(cfg, strategy)     # last, as the strategy's own validate once did them


def check_shorthand(cfg) -> None:
    """A shorthand (`tp`, `pp-1f1b`, `ep`, ..., refimpl.registry) has >= 2 ranks on its axis, and
    runs its own schedule."""
    entry = entry_of(cfg.strategy)
    if entry.axis is not None and getattr(cfg, entry.axis) < 2:
        raise LayoutError(f"--strategy {cfg.strategy} puts on {entry.axis} the ranks the other axes "
                          f"leave, and they leave {getattr(cfg, entry.axis)} of --nproc {cfg.nproc}: "
                          f"{AXIS_NAMES[entry.axis]} parallelism needs >= 2")
    if entry.schedule is not None and cfg.schedule != entry.schedule:
        raise LayoutError(f"--strategy {cfg.strategy} runs the {entry.schedule} schedule; "
                          f"drop --schedule {cfg.schedule}")


def check_values(cfg) -> None:
    """Each flag's own range."""
    positive = {"steps": cfg.steps, "nproc": cfg.nproc, "global-batch": cfg.global_batch,
                "micro-batches": cfg.micro_batches, "layers": cfg.model.n_layers,
                "d-model": cfg.model.d_model, "heads": cfg.model.n_heads,
                "vocab": cfg.model.vocab_size, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
                "ep": cfg.ep, "replicas": cfg.replicas, "virtual-stages": cfg.virtual_stages}
    for flag, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"--{flag} must be a positive integer (got {value!r})")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise LayoutError(f"--lr must be a finite number > 0 (got {cfg.lr!r})")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise LayoutError(f"weight decay must be finite and >= 0 (got {cfg.weight_decay!r})")
    if cfg.model.n_experts < 0:
        raise LayoutError(f"--experts must be >= 0 (got {cfg.model.n_experts})")
    if not 1 <= cfg.seq_len <= cfg.model.seq_len:
        raise LayoutError(f"--seq-len must be in [1, {cfg.model.seq_len}] (got {cfg.seq_len})")
    check_numerics(cfg)
    if cfg.collectives not in COLLECTIVES:
        raise LayoutError(f"--collectives must be one of {', '.join(COLLECTIVES)} "
                          f"(got {cfg.collectives!r})")
    if isinstance(cfg.checkpoint_every, bool) or not isinstance(cfg.checkpoint_every, int) \
            or cfg.checkpoint_every < 0:
        raise LayoutError(f"--checkpoint-every must be an integer >= 0 (got {cfg.checkpoint_every!r})")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise LayoutError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")


def check_options(cfg, strategy) -> None:
    """--nproc within the strategy's world sizes; every `--set key=value` one of its options
    (refimpl.config.Option), with a value it accepts."""
    if cfg.nproc < strategy.min_world_size:
        raise LayoutError(f"strategy {strategy.name!r} needs --nproc >= {strategy.min_world_size}")
    if strategy.max_world_size is not None and cfg.nproc > strategy.max_world_size:
        raise LayoutError(f"strategy {strategy.name!r} runs on at most {strategy.max_world_size} "
                          f"process(es), got --nproc {cfg.nproc}")
    unknown = set(cfg.options) - set(strategy.options)
    if unknown:
        known = ", ".join(sorted(strategy.options)) or "none"
        raise LayoutError(f"strategy {strategy.name!r} has no option(s) {sorted(unknown)}; "
                          f"known: {known}")
    for key, value in cfg.options.items():
        check_option(key, strategy.options[key], value)


def check_option(key: str, option, value) -> None:
    if option.kind is bool and not isinstance(value, bool):
        raise LayoutError(f"--set {key} must be true or false (got {value!r})")
    if option.kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or (option.kind is int and value != int(value)):
            raise LayoutError(f"--set {key} must be a{'n integer' if option.kind is int else ' number'}"
                              f" (got {value!r})")
        if option.positive and not value > 0:
            raise LayoutError(f"--set {key} must be > 0 (got {value!r})")
    if option.choices and value not in option.choices:
        raise LayoutError(f"--set {key} must be one of {', '.join(map(str, option.choices))} "
                          f"(got {value!r})")


def check_numerics(cfg) -> None:
    """The dtype, the mixed precision and the device."""
    if cfg.mixed_precision not in ("fp32", "bf16"):
        raise LayoutError(f"--mixed-precision must be fp32 or bf16 (got {cfg.mixed_precision})")
    if cfg.dtype not in DTYPES:
        raise LayoutError(f"--dtype must be one of {', '.join(DTYPES)} (got {cfg.dtype!r})")
    if cfg.dtype == "float64" and cfg.mixed_precision != "fp32":
        raise LayoutError(f"--dtype float64 computes in float64: drop --mixed-precision {cfg.mixed_precision}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise LayoutError(f"device must be auto, cpu or cuda (got {cfg.device})")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise LayoutError("device cuda asked for, but torch sees no GPU on this machine")


def check_layout(cfg) -> None:
    """The grid fills --nproc, and every data-parallel rank takes equal rows of the batch."""
    if cfg.global_batch % cfg.micro_batches:
        raise LayoutError(f"global batch {cfg.global_batch} must be a positive multiple of "
                          f"--micro-batches {cfg.micro_batches}")
    per_replica = cfg.replicas * cfg.pp * cfg.cp * cfg.tp
    if cfg.nproc % per_replica:
        raise LayoutError(f"--nproc {cfg.nproc} must be a multiple of pp x cp x tp = {per_replica}"
                          + (f" (x {cfg.replicas} replicas)" if cfg.replicas > 1 else ""))
    cfg.dims.validate(cfg.nproc)
    dp = cfg.dims.dp
    if cfg.global_batch % (dp * cfg.micro_batches):
        raise LayoutError(f"global batch {cfg.global_batch} must be a multiple of {dp} data-"
                          f"parallel rank(s) x --micro-batches {cfg.micro_batches} "
                          f"(= {dp * cfg.micro_batches}): every rank takes equal rows")


def check_model_parallel(cfg, strategy) -> None:
    """The model-parallel rules: cp's chunks, the experts, tp's cuts, the pipeline's."""
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        raise LayoutError(f"--seq-len {cfg.seq_len} must be divisible by 2 x cp = {2 * cfg.cp}: "
                          "ring attention cuts each sequence into 2·cp equal chunks")
    check_moe(cfg.model, cfg.dims.ep)
    if cfg.dims.ep > 1 and not strategy.experts_over_edp:
        # a strategy that sums every gradient over dp x cp: expert 0's into expert 2's weights
        raise LayoutError(f"--ep {cfg.dims.ep}: strategy {cfg.strategy!r} would sum different "
                          "experts' gradients over dp x cp (use ep, dp-naive, dp, zero1/2/3 or fsdp)")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise LayoutError("--sequence-parallel needs --tp > 1 (it splits what tensor parallelism "
                          "leaves replicated)")
    if cfg.tp > 1:
        # under cp a rank holds s/cp tokens: those are what sequence parallelism splits over tp
        problem = (tp_layout_problem(cfg.model, cfg.tp, cfg.seq_len,
                                     cfg.sequence_parallel and cfg.cp == 1)
                   or tp_cp_layout_problem(cfg.seq_len, cfg.tp, cfg.cp, cfg.sequence_parallel))
        if problem:
            raise LayoutError(problem)
    check_pipeline(cfg, strategy)


def check_pipeline(cfg, strategy) -> None:
    """A pipeline's layout (--pp, --schedule, --virtual-stages); `strategy`, the class that runs it,
    must run on a pipeline's stages."""
    v = cfg.virtual_stages
    if cfg.pp == 1:
        if v != 1 or cfg.schedule:
            raise LayoutError("--schedule / --virtual-stages need a pipeline: --pp >= 2")
        return
    if not strategy.on_a_pipeline:
        raise LayoutError(f"--pp {cfg.pp}: strategy {cfg.strategy!r} does not run on pipeline "
                          "stages (ours do: dp-naive, dp, zero1, zero2, zero3, fsdp and the tp, "
                          "ep, pp-* shorthands; PyTorch's: torch-fsdp2-tp, torch-pp-*)")
    schedule = pp.pipeline_schedule(cfg)
    pp.check_layout(cfg.pp, cfg.micro_batches, schedule, v)
    partition(cfg.model.n_layers, cfg.pp * pp.chunks_per_rank(schedule, v))
    if cfg.model.tie_embeddings:
        raise LayoutError("--pp needs untied embeddings: the head and the embedding sit on different stages")
    if pp.schedules()[schedule].split and cfg.activation_checkpointing:
        raise LayoutError(f"{schedule} records each layer's input for the deferred W: not with --checkpointing")



BALANCE = ("aux", "bias", "none")
SCOPES = ("batch", "sequence")       # capacity_scope: what C and the aux loss's f_i count over


def check_moe(cfg, ep: int = 1) -> None:
    """The MoE layer's options (a GPTConfig's) and its expert-parallel layout."""
    if cfg.n_experts == 0:
        if ep > 1:
            raise LayoutError(f"expert parallelism (ep = {ep}) needs --experts E > 0")
        return
    if cfg.n_experts < 0:
        raise LayoutError(f"--experts must be >= 0 (got {cfg.n_experts})")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise LayoutError(f"--top-k must be in [1, --experts = {cfg.n_experts}] (got {cfg.top_k})")
    if not cfg.capacity_factor > 0:
        raise LayoutError(f"--capacity-factor must be > 0 (got {cfg.capacity_factor})")
    if cfg.balance not in BALANCE:
        raise LayoutError(f"--set balance must be one of {', '.join(BALANCE)} (got {cfg.balance!r})")
    if cfg.capacity_scope not in SCOPES:
        raise LayoutError(f"--set capacity_scope must be one of {', '.join(SCOPES)} "
                          f"(got {cfg.capacity_scope!r})")
    for key in ("aux_alpha", "bias_gamma"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise LayoutError(f"--set {key} must be a number >= 0 (got {value!r})")
    if cfg.n_experts % ep:
        raise LayoutError(f"--experts {cfg.n_experts} must be divisible by ep = {ep}: "
                          f"every rank of the ep group holds E/ep experts")


def tp_layout_problem(cfg, tp: int, seq_len: int | None = None,
                      sequence_parallel: bool = False) -> str | None:
    """One line naming the constraint a model config (GPTConfig) breaks for this tp, or None."""
    if cfg.n_heads % tp:
        return f"--tp {tp} must divide the number of attention heads ({cfg.n_heads})"
    # the heads fix a 4h GELU MLP's width, but not SwiGLU's: its own check
    width = cfg.swiglu_hidden if cfg.arch == "llama" else cfg.mlp_ratio * cfg.d_model
    if width % tp:
        return f"--tp {tp} must divide the MLP width ({width})"
    if cfg.arch == "llama":
        try:
            kv_split(cfg.kv_heads, tp)
        except ValueError as e:
            return str(e)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        return f"--sequence-parallel needs --seq-len ({seq_len}) divisible by --tp {tp}"
    return None


def tp_cp_layout_problem(seq_len: int, tp: int, cp: int, sequence_parallel: bool) -> str | None:
    """One line naming what a tp x cp layout breaks, or None."""
    if cp > 1 and sequence_parallel and (seq_len // cp) % tp:
        return (f"--sequence-parallel with --cp {cp} needs the s/cp = {seq_len // cp} tokens a cp "
                f"rank holds divisible by --tp {tp} (the tp ranks split them)")
    return None
