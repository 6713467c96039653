"""The module-level wrappers on models unlike refimpl's GPT, each against plain training, run in
one launch per world size (start-up costs more than all the checks together).

Two small models carry every case the wrappers must handle:
  TiedNet   a weight tied between two layers, a frozen parameter, a buffer; MSE; AdamW
  SpareNet  a parameter the forward never uses (inside a used layer), a layer it never calls, a
            frozen layer, a buffer; Huber loss; SGD with momentum
Every check trains a rank's rows of the same global batches and compares the whole model with
plain training on the whole batch (`plain_run`, in the same process). PyTorch's twins (DDP,
ZeroRedundancyOptimizer, fully_shard) run the same checks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.lab.measure.host_memory import host_state
from refimpl.launch import device_for
from refimpl.parallel.dp import DataParallel
from refimpl.parallel.fsdp import FullyShard
from refimpl.parallel.zero import ShardedOptimizer

STEPS, ROWS, D = 3, 12, 6          # 12 rows: 2 and 3 ranks take equal shares


class TiedNet(nn.Module):
    def __init__(self, h: int = 10):
        super().__init__()
        self.inp = nn.Linear(D, h)
        self.first = nn.Linear(h, h)
        self.last = nn.Linear(h, h)
        self.last.weight = self.first.weight                  # tied: one parameter, two layers
        self.head = nn.Linear(h, 1)
        self.offset = nn.Parameter(torch.randn(h), requires_grad=False)     # a fixed parameter
        self.register_buffer("scale", torch.rand(h) + 0.5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.first(h) * self.scale + self.offset)
        return self.head(torch.tanh(self.last(h)))


class SpareNet(nn.Module):
    def __init__(self, h: int = 10):
        super().__init__()
        self.a = nn.Linear(D, h)
        self.a.unused = nn.Parameter(torch.randn(3))          # in a used layer, never used
        self.spare = nn.Linear(h, h)                           # never called
        self.frozen = nn.Linear(h, h).requires_grad_(False)
        self.b = nn.Linear(h, 2)
        self.register_buffer("shift", torch.randn(h))

    def forward(self, x):
        return self.b(torch.relu(self.frozen(torch.tanh(self.a(x)) + self.shift)))


CASES = {   # model, loss, optimizer class and its settings, the names the checks look at
    "tied": (TiedNet, F.mse_loss, torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}, 1),
    "spare": (SpareNet, F.smooth_l1_loss, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 2),
}
FROZEN = {"tied": ["offset"], "spare": ["frozen.weight", "frozen.bias"]}
UNUSED = {"tied": [], "spare": ["a.unused", "spare.weight", "spare.bias"]}


def batches(case: str, dtype, device, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = CASES[case][4]
    return [(torch.randn(ROWS, D, generator=g, dtype=dtype).to(device),
             torch.randn(ROWS, out, generator=g, dtype=dtype).to(device)) for _ in range(steps)]


def build(case: str, seed: int, dtype, device) -> nn.Module:
    torch.manual_seed(seed)
    return CASES[case][0]().to(device, dtype)


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def plain_run(case: str, dtype, device, steps: int = STEPS, grouped: bool = False):
    """The reference: one process, the whole batch, the plain optimizer."""
    model = build(case, 0, dtype, device)
    _, loss_fn, opt_cls, kw, _ = CASES[case]
    opt = in_two_groups(opt_cls, model, kw) if grouped else opt_cls(model.parameters(), **kw)
    losses = []
    for x, y in batches(case, dtype, device, steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def rel_err(state: dict, ref: dict) -> float:
    """Relative distance of two state dicts taken as one vector each (every key of `ref`)."""
    diff = torch.cat([(state[k].double().cpu() - v.double().cpu()).reshape(-1) for k, v in ref.items()])
    whole = torch.cat([v.double().cpu().reshape(-1) for v in ref.values()])
    return (diff.norm() / whole.norm()).item()


def train(case, model, opt, rank, world, dtype, device, *, finish, micro=1, no_sync=None,
          cast=None, group=None):
    """A rank's loop: its rows of each global batch, in `micro` micro-batches (the earlier ones
    under `no_sync`), the gradient synchronisation, the step. Returns the global mean losses
    (over `group`, default the world, of `world` ranks)."""
    loss_fn = CASES[case][1]
    losses = []
    for x, y in batches(case, dtype, device):
        xs, ys = rows(x, rank, world).chunk(micro), rows(y, rank, world).chunk(micro)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            ctx = no_sync() if (no_sync is not None and i < micro - 1) else _null()
            with ctx:
                out = model(xm if cast is None else xm.to(cast))
                loss = loss_fn(out.to(dtype), ym) / micro
                loss.backward()
            total += loss.detach().double()
        finish()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summary(case, full_state: dict, losses, ref_model, ref_losses, frozen_before, grads: dict):
    ref = ref_model.state_dict()
    return {"weights": rel_err(full_state, ref),
            "losses": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "frozen_unchanged": all(torch.equal(full_state[n].cpu(), frozen_before[n].cpu())
                                    for n in FROZEN[case]),
            "unused_grad_empty": all(g is None or not g.any() for n, g in grads.items()
                                     if n in UNUSED[case])}


def check_data_parallel(rank, world, case, dtype, device, *, twin=False, micro=1):
    ref_model, _, ref_losses = plain_run(case, dtype, device)
    model = build(case, rank, dtype, device)     # seeded per rank: the broadcast must fix it
    _, _, opt_cls, kw, _ = CASES[case]
    if twin:
        wrapped = DDP(model, find_unused_parameters=bool(UNUSED[case]))
        finish, no_sync = (lambda: None), wrapped.no_sync
        communicated = None
    else:
        wrapped = DataParallel(model, bucket_mb=0.0002)       # ~200 bytes: several buckets
        finish, no_sync = wrapped.finish_gradient_synchronization, wrapped.no_sync
        communicated = [s.name for b in wrapped.bucket_sets for s in b.layout.slots]
    frozen_before = {n: ref_model_initial(case, dtype, device)[n] for n in FROZEN[case]}
    opt = opt_cls(wrapped.parameters(), **kw)
    losses = train(case, wrapped, opt, rank, world, dtype, device, finish=finish, micro=micro,
                   no_sync=no_sync)
    grads = {n: p.grad for n, p in model.named_parameters()}
    out = summary(case, model.state_dict(), losses, ref_model, ref_losses, frozen_before, grads)
    if communicated is not None:
        out["frozen_communicated"] = any(n in communicated for n in FROZEN[case])
        out["tied_slots"] = sum(n in ("first.weight", "last.weight") for n in communicated)
        out["buckets"] = sum(len(b.buckets) for b in wrapped.bucket_sets)
    return out


def ref_model_initial(case, dtype, device) -> dict:
    return build(case, 0, dtype, device).state_dict()


def in_two_groups(make, model: nn.Module, kw: dict):
    """`make(params, **kw)` over all but the last child's parameters, then add_param_group with
    the last child's at half the learning rate."""
    last = {id(p) for p in list(model.children())[-1].parameters()}
    opt = make([p for p in model.parameters() if id(p) not in last], **kw)
    opt.add_param_group({"params": [p for p in model.parameters() if id(p) in last],
                         "lr": kw["lr"] / 2})
    return opt


def sharded(opt_cls, model: nn.Module, kw: dict, partition: str, group=None, offload=False):
    """ShardedOptimizer over `model`'s parameters: the tensors partition in two groups
    (`in_two_groups`), the flat one in one (its shard mixes parameters)."""
    if partition == "flat":
        return ShardedOptimizer(model.parameters(), opt_cls, group=group, partition="flat",
                                offload=offload, **kw)
    return in_two_groups(lambda ps, **k: ShardedOptimizer(ps, opt_cls, group=group, **k), model, kw)


def check_sharded_optimizer(rank, world, case, dtype, device, *, twin=False, partition="tensors",
                            offload=False):
    flat = partition == "flat"
    ref_model, ref_opt, ref_losses = plain_run(case, dtype, device, grouped=not flat)
    model = build(case, 0, dtype, device)
    _, _, opt_cls, kw, _ = CASES[case]
    if twin:
        wrapped = DDP(model, find_unused_parameters=bool(UNUSED[case]))
        opt = in_two_groups(lambda ps, **k: ZeroRedundancyOptimizer(ps, optimizer_class=opt_cls, **k),
                            model, kw)
        finish = lambda: None    # noqa: E731
    else:
        wrapped = DataParallel(model)
        opt = sharded(opt_cls, model, kw, partition, offload=offload)
        finish = wrapped.finish_gradient_synchronization
    frozen_before = {n: ref_model_initial(case, dtype, device)[n] for n in FROZEN[case]}
    losses = train(case, wrapped, opt, rank, world, dtype, device, finish=finish)
    grads = {n: p.grad for n, p in model.named_parameters()}
    out = summary(case, model.state_dict(), losses, ref_model, ref_losses, frozen_before, grads)
    if twin:
        return out
    # This rank holds only its partition's state; the state dict is the whole of it, as the
    # plain optimizer's, and it loads into a ShardedOptimizer over another number of ranks.
    whole = opt.state_dict()
    out["state_share"] = state_elements(opt.local.state.values()) / state_elements(
        whole["state"].values())
    ref_state = ref_opt.state_dict()
    out["state_dict_err"] = max(
        (torch.as_tensor(whole["state"][i][k]).double() - torch.as_tensor(v).double().cpu()).abs().max().item()
        for i, s in ref_state["state"].items() for k, v in s.items())
    out["state_dict_keys_match"] = sorted(whole["state"]) == sorted(ref_state["state"])
    if flat:
        out["elements"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out["final"] = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        held = host_state(opt)
        out["host_state"] = (held.params, held.grads, held.optimizer)
        out["master_on_host"] = (opt.master.device.type == "cpu"
                                 and opt.master.data_ptr() != opt.shard.data_ptr())
    sub = dist.new_group(list(range(world - 1)))      # every rank calls new_group
    if rank < world - 1:
        out["resumed"] = resume_on(sub, rank, world - 1, case, dtype, device, model.state_dict(),
                                   whole, partition)
    return out


def check_flat_state_moves(rank, world, case, dtype, device) -> dict:
    """partition="flat": the state ranks 0 and 1 save loads on all `world` ranks and into a plain
    optimizer, and each continues as plain training's next step does."""
    _, loss_fn, opt_cls, kw, _ = CASES[case]
    pair = dist.new_group([0, 1])                     # every rank calls new_group
    saved = [None, None]
    if rank < 2:
        model = build(case, 0, dtype, device)
        wrapped = DataParallel(model, group=pair)
        opt = sharded(opt_cls, model, kw, "flat", group=pair)
        train(case, wrapped, opt, rank, 2, dtype, device,
              finish=wrapped.finish_gradient_synchronization, group=pair)
        saved = [{k: v.cpu().clone() for k, v in model.state_dict().items()}, opt.state_dict()]
    dist.broadcast_object_list(saved, src=0)
    weights, whole = saved
    resumed = resume_on(dist.group.WORLD, rank, world, case, dtype, device, weights, whole, "flat")
    # the plain optimizer last: torch's load_state_dict keeps the step counts it is handed, and
    # its step then adds to them in place
    ref_model, _, _ = plain_run(case, dtype, device, steps=STEPS + 1)
    plain = build(case, 0, dtype, device)
    plain.load_state_dict(weights)
    plain_opt = opt_cls(plain.parameters(), **kw)
    plain_opt.load_state_dict(whole)
    x, y = batches(case, dtype, device, STEPS + 1)[-1]
    loss_fn(plain(x), y).backward()
    plain_opt.step()
    return {"resumed": resumed, "plain": rel_err(plain.state_dict(), ref_model.state_dict())}


def state_elements(states) -> int:
    """Elements of an optimizer's per-parameter state tensors (not the scalar step counts)."""
    return sum(t.numel() for s in states for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def resume_on(group, rank, world, case, dtype, device, weights, whole_state, partition) -> float:
    """One more step on `world` ranks from the saved weights and optimizer state, against plain
    training's 4th step."""
    ref_model, _, _ = plain_run(case, dtype, device, steps=STEPS + 1, grouped=partition != "flat")
    again = build(case, 0, dtype, device)
    again.load_state_dict(weights)
    _, loss_fn, opt_cls, kw, _ = CASES[case]
    wrapped = DataParallel(again, group=group)
    opt = sharded(opt_cls, again, kw, partition, group=group)
    opt.load_state_dict(whole_state)
    x, y = batches(case, dtype, device, STEPS + 1)[-1]    # the next global batch of the stream
    loss_fn(wrapped(rows(x, rank, world)), rows(y, rank, world)).backward()
    wrapped.finish_gradient_synchronization()
    opt.step()
    return rel_err(again.state_dict(), ref_model.state_dict())


def check_fully_shard(rank, world, case, dtype, device, *, twin=False, units=None,
                      compute_dtype=None):
    ref_model, _, ref_losses = plain_run(case, dtype, device)
    model = build(case, 0, dtype, device)
    _, _, opt_cls, kw, _ = CASES[case]
    frozen_before = {n: ref_model_initial(case, dtype, device)[n] for n in FROZEN[case]}
    out = {}
    if twin:
        shared = {id(model.first.weight)} if case == "tied" else set()
        for _, child in model.named_children():   # a tied weight stays with the root, as ours
            if any(p.requires_grad for p in child.parameters()) and \
                    not any(id(p) in shared for p in child.parameters()):
                fully_shard(child)
        wrapped = fully_shard(model)
        finish = lambda: None    # noqa: E731
    else:
        wrapped = FullyShard(model, units=units, compute_dtype=compute_dtype)
        finish = wrapped.finish_gradient_synchronization
        sharded = [s.name for u in wrapped.units for s in u.flat.slots]
        out["frozen_communicated"] = any(n in sharded for n in FROZEN[case])
        out["local_share"] = (sum(p.numel() for p in wrapped.parameters())
                              / sum(p.numel() for p in ref_model.parameters() if p.requires_grad))
        out["unit_numels"] = [u.flat.numel for u in wrapped.units]
    opt = opt_cls(wrapped.parameters(), **kw)
    losses = train(case, wrapped, opt, rank, world, dtype, device, finish=finish, cast=compute_dtype)
    if twin:
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in model.state_dict().items()}
        grads = {n: p.grad for n, p in model.named_parameters()}
    else:
        full = wrapped.full_state_dict()
        out["names_match"] = sorted(full) == sorted(ref_model.state_dict())
        grads = {}
        for u in wrapped.units:                       # the shards' gradients, per name
            g = u.master.grad
            for s in u.flat.slots:
                lo = max(s.offset - u.rank * u.flat.shard_numel, 0)
                hi = min(s.offset + s.numel - u.rank * u.flat.shard_numel, u.flat.shard_numel)
                grads[s.name] = None if g is None else g[lo:hi] if hi > lo else g[:0]
    out.update(summary(case, full, losses, ref_model, ref_losses, frozen_before, grads))
    return out


def bad_uses(rank, world, device) -> dict[str, str]:
    """What each misuse raises, as text (one line each, checked by the test)."""
    said = {}

    def catch(key, fn):
        try:
            fn()
            said[key] = "no error"
        except (ValueError, RuntimeError) as e:
            said[key] = str(e)

    m = nn.Linear(2, 2).to(device)
    DataParallel(m)
    catch("dp_twice", lambda: DataParallel(m))
    catch("dp_of_dp", lambda: DataParallel(DataParallel(nn.Linear(2, 2).to(device))))
    catch("fsdp_of_dp", lambda: FullyShard(m))
    other = "meta" if device.type == "cpu" else "cpu"
    catch("dp_device", lambda: DataParallel(nn.Linear(2, 2, device=other)))
    catch("fsdp_device", lambda: FullyShard(nn.Sequential(nn.Linear(2, 2, device=other))))
    catch("zero_device", lambda: ShardedOptimizer(nn.Linear(2, 2, device=other).parameters(),
                                                  torch.optim.SGD, lr=0.1))
    two = nn.Linear(2, 2).to(device)
    catch("flat_groups", lambda: ShardedOptimizer(
        [{"params": [two.weight]}, {"params": [two.bias], "lr": 0.05}], torch.optim.SGD,
        partition="flat", lr=0.1))
    catch("tensors_offload", lambda: ShardedOptimizer(two.parameters(), torch.optim.SGD,
                                                      offload=True, lr=0.1))
    only_first = dist.new_group([0])                  # every rank calls new_group
    if rank > 0:
        catch("dp_group", lambda: DataParallel(nn.Linear(2, 2).to(device), group=only_first))
        catch("fsdp_group", lambda: FullyShard(nn.Sequential(nn.Linear(2, 2).to(device)),
                                               group=only_first))
        catch("zero_group", lambda: ShardedOptimizer(nn.Linear(2, 2).to(device).parameters(),
                                                     torch.optim.SGD, group=only_first, lr=0.1))
    return said


def every_check(rank: int, world: int) -> dict:
    """Every check of one world size, in one launch."""
    device = device_for(dist.get_backend())
    f64, f32 = torch.float64, torch.float32
    res = {}
    for case in CASES:
        for twin in (False, True):
            tag = "torch" if twin else "ours"
            res["dp", case, tag] = check_data_parallel(rank, world, case, f64, device, twin=twin)
            res["zero", case, tag] = check_sharded_optimizer(rank, world, case, f64, device, twin=twin)
            res["fsdp", case, tag] = check_fully_shard(rank, world, case, f64, device, twin=twin)
        res["zero", case, "ours-flat"] = check_sharded_optimizer(rank, world, case, f64, device,
                                                                 partition="flat")
        if world == 3:
            res["flat_moves", case] = check_flat_state_moves(rank, world, case, f64, device)
    res["zero", "tied", "ours-flat-offload"] = check_sharded_optimizer(
        rank, world, "tied", f64, device, partition="flat", offload=True)
    res["dp", "tied", "ours-no_sync"] = check_data_parallel(rank, world, "tied", f64, device, micro=2)
    res["dp", "tied", "torch-no_sync"] = check_data_parallel(rank, world, "tied", f64, device,
                                                             twin=True, micro=2)
    res["fsdp", "tied", "ours-named-units"] = check_fully_shard(rank, world, "tied", f64, device,
                                                                units=["inp", "head"])
    res["fsdp", "tied", "ours-class-units"] = check_fully_shard(rank, world, "tied", f64, device,
                                                                units=[nn.Linear])
    res["dp", "tied", "ours-fp32"] = check_data_parallel(rank, world, "tied", f32, device)
    res["fsdp", "tied", "ours-fp32"] = check_fully_shard(rank, world, "tied", f32, device)
    res["fsdp", "tied", "ours-bf16"] = check_fully_shard(rank, world, "tied", f32, device,
                                                         compute_dtype=torch.bfloat16)
    res["bad"] = bad_uses(rank, world, device)
    return res
