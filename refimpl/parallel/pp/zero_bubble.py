"""Zero bubble's split of the backward pass into B (input gradient) and W (weight gradient).

Qi et al. 2023, sec. 2: for a linear layer Y = X A, the backward pass is two matrix products,
dX = dY A^T (B: the previous stage is waiting for it) and dA = X^T dY (W: nobody waits for it).
ZB-H1 runs B at once and defers W into time that would otherwise be bubble.

How it is done here (our own approach, not PyTorch's `stage_backward_input/weight`):
  * during the forward of a micro-batch, a forward hook on every Linear, LayerNorm, RMSNorm and
    Embedding of the chunk (and tensor parallelism's column/row-parallel linears, through their
    `observe_matmul`, which sees the matmul's own input under sequence parallelism) records
    (module, its input X) and hooks the module's output so that, when the
    gradient dY reaches it, dY is kept too;
  * B is `torch.autograd.grad(output, inputs=[stage input])`: autograd runs only the nodes on the
    path to the input, and inside each node computes only the outputs that path needs, so the
    weight products X^T dY are skipped (and no .grad is touched);
  * W computes every weight gradient from the kept (X, dY) pairs with the layer's own formula
    (no weight is read: dA = dY^T X, LayerNorm's x_hat is recomputed without its affine), and
    hands each one to autograd's own accumulator (`torch.autograd.backward(param, grad)` on the
    leaf), last layer first, so whatever a data-parallel strategy hooked on a parameter's
    gradient runs as it would after a plain backward: DDP's buckets (refimpl.parallel.dp.
    grad_buckets) count it ready, ZeRO-3/FSDP's unit (refimpl.parallel.fsdp.zero3) binds it
    into its flat gradient and reduce-scatters once its last gradient is in.
Between B and W this micro-batch's X's and dY's stay alive: that is why ZB-H1 bounds the micro-
batches in flight (F done, W not yet) by p.

The first piece is the exception. Its input is token ids, so its B has no input gradient to send:
the only thing the split would make there is the embeddings' dY, which only its own W reads, so
splitting costs the hooks, the recomputed x_hat and a second pass over the layers, and defers
nothing another rank waits for. As PyTorch's pipelining does for stage 0, its B then only takes the
gradient of the chunk's output (nothing, or on a one-stage pipeline the loss's own backward to the
logits), and its W is one plain backward from that output: autograd's own products on its own saved
tensors, every hook a data-parallel strategy put on a parameter firing once, as in a plain backward.
Its activations then stay alive until W rather than B (the peak in flight is reached before its
first B on every table here). A chunk with experts keeps the split (its aux loss, which the runner
adds to the output's, does not pass through the output), and so does one holding a parameter that
ZeRO-3/FSDP marked resharded (refimpl.placement.mark_resharded): its unit is freed once its
gradients are in, so a W that reread the weights would find none; the split's W reads no weight
(zero3.py counts on it).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.moe import MoEMLP
from refimpl.model.rmsnorm import RMSNorm
from refimpl.placement import is_resharded

# The layers W has a formula for (weight_grads); a chunk holding a parameter of any other kind is
# refused (`_check_covered`): B skips every weight product, so such a parameter's gradient would
# silently stay zero.
WEIGHT_LAYERS = (nn.Linear, nn.LayerNorm, RMSNorm, nn.Embedding)


class WeightGradRecord:
    """The (module, X, dY) triples of one micro-batch on one chunk, filled during F and B."""

    def __init__(self):
        self.entries: list[list] = []   # [module, X, dY or None]
        self.block_of: dict[int, str] = {}   # id(module) -> its block ("blocks.3", "lm_head")
        self.whole: list = []           # the first piece: [(its output, [.., .., d output from B])]

    def apply(self) -> None:
        """W: accumulate every recorded layer's weight gradient into .grad, then forget X and dY.
        Blocks go last first (the order a plain backward finishes them in, DDP's bucket order);
        a layer run twice in one forward has its gradients summed and accumulated once, so each
        parameter is accumulated once per W, as once per plain backward. Each block's gradients
        enter autograd's engine in one call, not one per layer: a call costs ~0.15 ms of engine
        start-up on a CPU, which per layer was most of what the split schedules lost to 1F1B
        (scripts/bench_pp.py); inside one call the engine picks the order of the block's layers."""
        if self.whole:
            self._accumulate_whole()
        live = [(module, x, dy) for module, x, dy in self.entries if dy is not None]
        first_use = {}              # walking backwards, a layer's first use is its last visit
        for i, (module, _, _) in enumerate(live):
            first_use.setdefault(id(module), i)
        summed: dict[int, list] = {}
        params, grads_in, block = [], [], None
        for i in reversed(range(len(live))):
            module, x, dy = live[i]
            grads = weight_grads(module, x, dy)
            if id(module) in summed:
                grads = [a + b for a, b in zip(summed.pop(id(module)), grads)]
            if i > first_use[id(module)]:
                summed[id(module)] = grads
                continue
            if self.block_of.get(id(module)) != block and params:
                torch.autograd.backward(params, grads_in)   # AccumulateGrad: .grad += g, and its hooks
                params, grads_in = [], []
            block = self.block_of.get(id(module))
            params += [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
            grads_in += grads
        if params:
            torch.autograd.backward(params, grads_in)
        self.entries.clear()

    def _accumulate_whole(self) -> None:
        """The first piece's W: one plain backward from its output, with the gradient B took."""
        for out, entry in self.whole:
            torch.autograd.backward(out, entry[2])
        self.whole.clear()


@dataclass(frozen=True)
class ChunkLayers:
    """What `record_weight_grads` hooks on a chunk, found by `chunk_layers` once per step rather
    than once per forward: the walk over the chunk's modules and parameters is the same for every
    micro-batch."""

    hooked: tuple          # the modules W has a formula for, each given a forward hook
    observed: tuple        # tensor parallelism's linears, which report their matmul (observe_matmul)
    block_of: dict         # id(module) -> its block ("blocks.3", "lm_head")
    plain: bool            # may take a plain backward: no experts, no ZeRO-3/FSDP unit (docstring)
    whole: bool            # the first piece, whose W is the whole backward (module docstring)


def chunk_layers(chunk: nn.Module) -> ChunkLayers:
    """The layers of `chunk` that W covers; raises if a trainable parameter is in none of them."""
    layers = [(name, m) for name, m in chunk.named_modules()
              if isinstance(m, WEIGHT_LAYERS) or hasattr(m, "observe_matmul")]
    _check_covered(chunk, [m for _, m in layers])
    plain = (not any(isinstance(m, MoEMLP) for m in chunk.modules())
             and not any(is_resharded(p) for p in chunk.parameters()))
    return ChunkLayers(hooked=tuple(m for _, m in layers if not hasattr(m, "observe_matmul")),
                       observed=tuple(m for _, m in layers if hasattr(m, "observe_matmul")),
                       block_of={id(m): ".".join(name.split(".")[:2]) for name, m in layers},
                       plain=plain,
                       whole=plain and any(isinstance(m, nn.Embedding) for _, m in layers))


@contextmanager
def record_weight_grads(chunk: nn.Module, record: WeightGradRecord, layers: ChunkLayers | None = None):
    """Forward hooks that fill `record` while the chunk runs one micro-batch's forward; yields the
    list of (entry, tensor) that the first piece's B differentiates with respect to and stores the
    gradient of in entry[2], since it has no input gradient to compute: the chunk's output, or,
    where the first piece keeps the split (module docstring), the embeddings' outputs (their dY).
    `layers`: the chunk's `chunk_layers`, when the caller has them from an earlier forward."""
    layers = chunk_layers(chunk) if layers is None else layers
    embed_outputs = []
    if layers.whole:
        # The first piece: B takes only the output's gradient, W is the whole backward (docstring).
        outputs = []
        handle = chunk.register_forward_hook(lambda module, inputs, output: outputs.append(output))
        try:
            yield embed_outputs
        finally:
            handle.remove()
        if outputs:
            entry = [chunk, None, None]
            record.whole.append((outputs[-1], entry))
            embed_outputs.append((entry, outputs[-1]))   # B stores the output's gradient in entry[2]
        return

    def hook(module, inputs, output):
        entry = [module, inputs[0].detach(), None]
        record.entries.append(entry)
        if isinstance(module, nn.Embedding):
            embed_outputs.append((entry, output))   # B hands their dY over itself
            return

        def keep(grad):
            entry[2] = grad if entry[2] is None else entry[2] + grad
        output.register_hook(keep)

    def observe(module, x, y):      # a tensor-parallel linear: its matmul's own X and Y
        entry = [module, x.detach(), None]
        record.entries.append(entry)

        def keep(grad):
            entry[2] = grad if entry[2] is None else entry[2] + grad
        y.register_hook(keep)

    record.block_of = layers.block_of
    handles = [m.register_forward_hook(hook) for m in layers.hooked]
    for m in layers.observed:
        m.observe_matmul = observe
    try:
        yield embed_outputs
    finally:
        for h in handles:
            h.remove()
        for m in layers.observed:
            m.observe_matmul = None


def _check_covered(chunk: nn.Module, layers: list[nn.Module]) -> None:
    """Every trainable parameter of the chunk belongs to a layer W has a formula for."""
    covered = {id(p) for m in layers for p in m.parameters(recurse=False)}
    for name, p in chunk.named_parameters():
        if p.requires_grad and id(p) not in covered:
            owner = chunk.get_submodule(name.rpartition(".")[0]) if "." in name else chunk
            raise ValueError(f"zero bubble's W has no weight-gradient formula for {name} "
                             f"({type(owner).__name__}): add one to weight_grads")


def weight_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of `module`'s weight (and bias, when it has one) from its input X and its
    output's gradient dY, in the master dtype (under autocast X or dY may be bf16)."""
    dtype = module.weight.dtype
    dy = dy.to(dtype)
    x = x if isinstance(module, nn.Embedding) else x.to(dtype)
    with torch.no_grad():
        if hasattr(module, "observe_matmul"):
            return _tp_linear_grads(module, x, dy)
        if isinstance(module, nn.Linear):
            dy2 = dy.reshape(-1, dy.shape[-1])
            grads = [dy2.t() @ x.reshape(-1, x.shape[-1])]                          # dA = dY^T X
            return grads + ([dy2.sum(0)] if module.bias is not None else [])
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)        # recomputed
            dims = tuple(range(dy.dim() - len(module.normalized_shape)))
            return [(dy * x_hat).sum(dims), dy.sum(dims)]
        if isinstance(module, RMSNorm):
            # y = g · x̂, x̂ = x / rms(x) recomputed as the forward computes it: dg = Σ dY x̂
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            x_hat = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + module.eps)).to(dtype)
            return [(dy * x_hat).reshape(-1, dy.shape[-1]).sum(0)]
        # nn.Embedding: each row of the table receives the dY of every position that read it.
        table = torch.zeros(module.weight.shape, dtype=dtype, device=dy.device)
        return [table.index_add_(0, x.reshape(-1), dy.reshape(-1, dy.shape[-1]))]


def _tp_linear_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """A tensor-parallel linear (refimpl.parallel.tp.layers): dA = dY^T X on its own matmul's X and
    Y, as nn.Linear's. A column-parallel bias is inside that matmul (dY summed); a row-parallel
    bias is added after the reduction, to the rank's own tokens under sequence parallelism: its
    gradient is the sum over this rank's slice of the sequence (the reduce-scatter's backward
    gathered every rank's dY into dy), which the sequence-parallel hook then sums over tp."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    grads = [dy2.t() @ x.reshape(-1, x.shape[-1])]
    if module.bias is None:
        return grads
    if hasattr(module, "input_is_parallel") and module.sequence_parallel:   # row-parallel, SP
        s_local = dy.shape[1] // dist.get_world_size(module.group)
        start = dist.get_rank(module.group) * s_local
        dy = dy[:, start:start + s_local]
    return grads + [dy.reshape(-1, dy.shape[-1]).sum(0)]
