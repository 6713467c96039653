"""The layout matrix: every layout the CLI accepts on 2, 3, 4 and 8 ranks, each one equal to
`single` or refused before launch with one line.

A hand-picked list of composed layouts tests the pairings someone thought of; a bug lives in the
pairing nobody did (a MoE model under `dp` on a pipeline reported the last stage's loss only,
3.3e-3 away from single, because one copy of the pipeline's runner forgot how the stages' losses
combine). So the layouts are generated, not listed. A layout is one value of every factor below:

    world            2, 3, 4, 8 ranks
    strategy         every --strategy name but single (the data-parallel flavours, the shorthands
                     tp, pp-*, ep, and PyTorch's twins)
    tp, pp, cp       the divisors of the world (dp = world / (pp·cp·tp))
    schedule         with --pp > 1 and a strategy that does not name its own: every schedule
    virtual_stages   under an interleaved schedule: 1 or 2 chunks per rank
    arch             gpt (GPT-2's block) or llama (RMSNorm, SwiGLU, rotary, 2 key/value heads for
                     4 query heads: split by tp 2, shared by two ranks each under tp 4)
    experts          0 (dense) or 4 (top-2, a capacity that drops tokens; Mixtral's under llama)
    balance, capacity_scope, ep     with experts: none / aux / bias, batch / sequence, ep | world
    sequence_parallel, checkpointing, micro_batches (1, 2, 4, 8), collectives (torch, refimpl),
    precision (float64, or bf16 autocast over float32 weights)
    option           the strategy's --set knobs, one at a time (each bool flipped, each choice, a
                     bucket small enough that every parameter gets its own)

A factor that does not apply to a layout (balance of a dense model) is None: it takes no value, so
no two layouts differ by it alone. Every layout runs the smallest model that lets each factor take
each value (`MATRIX_MODEL`: 4 heads for tp 4, 4 blocks for pp 4, 8 tokens for cp 4 and sequence
parallelism over them, 4 experts), 2 steps, a global batch of 96 rows (a multiple of every dp x
micro-batches the grid allows, 3 x 8 included).

What runs where (tests/test_layout_matrix.py): `make test` a pairwise cover (every two factor
values that occur together in some accepted layout occur together in a layout it runs),
`make test-full` a three-wise cover; `python -m refimpl matrix` counts the whole space (accepted,
refused by reason) and runs any strength, or all of it (refimpl.lab.verify.matrix_run).
"""
from __future__ import annotations

import functools
import itertools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.verify.covering import constructed_cover, greedy_cover, tuples, without_redundant
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.parallel.pp.schedules import schedules
from refimpl.registry import NAIVE, entry_of, strategies, strategy_class
from refimpl.train import validate

WORLDS = (2, 3, 4, 8)
# The sizes the matrix model can take on each axis: 4 heads split by tp 1, 2, 4; 4 blocks cut into
# 1-4 stages; 8 tokens into 2·cp chunks for cp 1, 2, 4; 4 experts over ep 1, 2, 4. A size outside
# these is refused for the model's shape alone (tests/test_layout_matrix.py checks one of each).
AXIS_SIZES = {"tp": (1, 2, 4), "pp": (1, 2, 3, 4), "cp": (1, 2, 4), "ep": (1, 2, 4)}
MATRIX_MODEL = GPTConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=4)
SEQ_LEN = 8
LLAMA_KV_HEADS = 2     # --arch llama: grouped-query attention, 2 query heads to a key/value head
EXPERTS = dict(top_k=2, capacity_factor=0.75)   # 4 experts, top-2: some tokens overflow each step
GLOBAL_BATCH, STEPS = 96, 2


@functools.cache     # the cover's search asks for every layout it walks through
def _option_values(strategy: str) -> tuple:
    """The strategy's --set knobs one at a time: ("-", nothing set), then each non-default value
    worth a run: a bool flipped, every other choice, a bucket of 1 KiB (one per parameter)."""
    out: list = [()]
    for key, opt in strategy_class(strategy).options.items():
        if opt.kind is bool:
            out.append(((key, not opt.default),))
        elif opt.choices:
            out += [((key, c),) for c in opt.choices if c != opt.default]
        elif key == "bucket_mb":
            out.append(((key, 2 ** -10),))
    return tuple(out)


@dataclass(frozen=True)
class Factor:
    name: str
    # the values this factor may take given the factors before it (a dict of them); () when the
    # factor does not apply (the layout then holds None for it)
    values: Callable[[dict], tuple]


def _grid_fits(layout: dict, axis: str) -> tuple:
    """The axis's sizes that fit the world beside the axes already chosen."""
    used = 1
    for other in ("tp", "pp", "cp"):
        if other != axis and layout.get(other):
            used *= layout[other]
    return tuple(n for n in AXIS_SIZES[axis] if layout["world"] % (used * n) == 0)


def _pipelined(layout: dict) -> bool:
    return layout["pp"] > 1 or entry_of(layout["strategy"]).axis == "pp"


def _schedules(layout: dict) -> tuple:
    """Every schedule, where there is a pipeline and the strategy does not name its own."""
    if not _pipelined(layout) or entry_of(layout["strategy"]).schedule:
        return ()
    return tuple(schedules())


def _virtual(layout: dict) -> tuple:
    schedule = entry_of(layout["strategy"]).schedule or layout["schedule"]
    return (1, 2) if _pipelined(layout) and schedule in ("interleaved", "interleaved-zb") else ()


def _moe(values: tuple) -> Callable[[dict], tuple]:
    return lambda layout: values if layout["experts"] else ()


FACTORS: tuple[Factor, ...] = (
    Factor("world", lambda _: WORLDS),
    Factor("strategy", lambda _: tuple(s for s in strategies() if s != "single")),
    Factor("tp", lambda lay: _grid_fits(lay, "tp")),
    Factor("pp", lambda lay: _grid_fits(lay, "pp")),
    Factor("cp", lambda lay: _grid_fits(lay, "cp")),
    Factor("schedule", _schedules),
    Factor("virtual_stages", _virtual),
    Factor("arch", lambda _: ("gpt", "llama")),
    Factor("experts", lambda _: (0, 4)),
    Factor("balance", _moe(("none", "aux", "bias"))),
    Factor("capacity_scope", _moe(("batch", "sequence"))),
    Factor("ep", lambda lay: tuple(n for n in AXIS_SIZES["ep"] if lay["world"] % n == 0)
           if lay["experts"] else ()),
    Factor("sequence_parallel", lambda _: (False, True)),
    Factor("checkpointing", lambda _: (False, True)),
    Factor("micro_batches", lambda _: (1, 2, 4, 8)),
    Factor("collectives", lambda _: ("torch", "refimpl")),
    Factor("precision", lambda _: ("float64", "bf16")),
    Factor("option", lambda lay: _option_values(lay["strategy"])),
)
NAMES = tuple(f.name for f in FACTORS)


@dataclass(frozen=True)
class Layout:
    """One point of the matrix: a value (or None) per factor, in FACTORS' order."""
    values: tuple

    def __getitem__(self, name: str):
        return self.values[NAMES.index(name)]

    def config(self) -> TrainConfig:
        """The TrainConfig the CLI builds from `argv()` (tests/test_layout_matrix.py checks so)."""
        get = self.__getitem__
        moe = {}
        if get("experts"):
            moe = dict(n_experts=get("experts"), balance=get("balance"),
                       capacity_scope=get("capacity_scope"), **EXPERTS)
        if get("arch") == "llama":
            moe.update(arch="llama", n_kv_heads=LLAMA_KV_HEADS)
        bf16 = get("precision") == "bf16"
        return LabConfig(
            strategy=get("strategy"), nproc=get("world"), steps=STEPS, global_batch=GLOBAL_BATCH,
            seq_len=SEQ_LEN, model=replace(MATRIX_MODEL, **moe),
            tp=get("tp"), pp=get("pp"), cp=get("cp"), ep=get("ep") or 1, schedule=get("schedule"),
            virtual_stages=get("virtual_stages") or 1,
            sequence_parallel=get("sequence_parallel"),
            activation_checkpointing=get("checkpointing"), micro_batches=get("micro_batches"),
            collectives=get("collectives"), dtype="float32" if bf16 else "float64",
            mixed_precision="bf16" if bf16 else "fp32", options=dict(get("option")),
            return_state=True, device="cpu")

    def argv(self) -> list[str]:
        """The same layout as `python -m refimpl train` flags."""
        get = self.__getitem__
        out = ["--strategy", get("strategy"), "--nproc", str(get("world")), "--steps", str(STEPS),
               "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ_LEN),
               "--layers", str(MATRIX_MODEL.n_layers), "--d-model", str(MATRIX_MODEL.d_model),
               "--heads", str(MATRIX_MODEL.n_heads), "--vocab", str(MATRIX_MODEL.vocab_size),
               "--micro-batches", str(get("micro_batches")), "--collectives", get("collectives")]
        for axis in ("tp", "pp", "cp", "ep"):
            if get(axis) not in (None, 1):
                out += [f"--{axis}", str(get(axis))]
        if get("schedule"):
            out += ["--schedule", get("schedule")]
        if get("virtual_stages") not in (None, 1):
            out += ["--virtual-stages", str(get("virtual_stages"))]
        if get("arch") == "llama":
            out += ["--arch", "llama", "--kv-heads", str(LLAMA_KV_HEADS)]
        if get("experts"):
            out += ["--experts", str(get("experts")), "--top-k", str(EXPERTS["top_k"]),
                    "--capacity-factor", str(EXPERTS["capacity_factor"]),
                    "--set", f"balance={get('balance')}",
                    "--set", f"capacity_scope={get('capacity_scope')}"]
        if get("sequence_parallel"):
            out.append("--sequence-parallel")
        if get("checkpointing"):
            out.append("--checkpointing")
        out += (["--mixed-precision", "bf16"] if get("precision") == "bf16"
                else ["--dtype", "float64"])
        for key, value in get("option"):
            out += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
        return out

    def name(self) -> str:
        """A short label of the values that are not the defaults, e.g. "w4 zero3 pp2 1f1b e4 aux
        sequence ep2 m4"."""
        return " ".join(_label(n, v) for n, v in zip(NAMES, self.values)
                        if v is not None and v != QUIET.get(n, object()))


QUIET = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "virtual_stages": 1, "arch": "gpt", "experts": 0,
         "sequence_parallel": False, "checkpointing": False, "micro_batches": 1,
         "collectives": "torch", "precision": "float64", "option": ()}


def _label(name: str, value) -> str:
    if name == "world":
        return f"w{value}"
    if name in ("sequence_parallel", "checkpointing"):
        return {"sequence_parallel": "+sp", "checkpointing": "+ckpt"}[name]
    if name == "option":
        return ",".join(f"{k}={v}" for k, v in value)
    short = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "virtual_stages": "v",
             "micro_batches": "m", "experts": "e"}
    return f"{short[name]}{value}" if name in short else str(value)


# --- the space -------------------------------------------------------------------------------------

def enumerate_layouts() -> Iterator[Layout]:
    """Every layout of the matrix (accepted or not), factors in order, dependent ones filled."""
    def fill(layout: dict, i: int):
        if i == len(FACTORS):
            yield Layout(tuple(layout[n] for n in NAMES))
            return
        factor = FACTORS[i]
        values = factor.values(layout) or (None,)
        for value in values:
            layout[factor.name] = value
            yield from fill(layout, i + 1)
        del layout[factor.name]

    yield from fill({}, 0)


@functools.lru_cache(maxsize=1 << 17)
def refusal(layout: Layout) -> str | None:
    """None if the launcher accepts the layout, else the one line it refuses it with (a pure
    function of the layout: the cover's search asks again for the layouts it meets again)."""
    try:
        validate(layout.config())
    except LayoutError as e:
        return str(e)
    return None


def reason_kind(message: str) -> str:
    """A refusal's kind, for the counts: its first words, with every number and quoted name
    written as N and '...' (so "--ep 4 must divide dp x cp = 2" and "--ep 2 must divide dp x cp =
    1" are one kind)."""
    text = re.sub(r"'[^']*'", "'...'", message)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return " ".join(text.split()[:9])


@dataclass
class Census:
    accepted: list
    refused: Counter          # reason kind -> layouts
    multi_line: list          # refusals that were not one line (must stay empty)

    @property
    def total(self) -> int:
        return len(self.accepted) + sum(self.refused.values())


def census(layouts=None) -> Census:
    """Validate every layout (default: the whole space): the accepted ones, refusals by kind."""
    accepted, refused, multi = [], Counter(), []
    for layout in (enumerate_layouts() if layouts is None else layouts):
        why = refusal(layout)
        if why is None:
            accepted.append(layout)
        else:
            refused[reason_kind(why)] += 1
            if "\n" in why:
                multi.append((layout, why))
    return Census(accepted, refused, multi)


def layout_of(**given) -> Layout:
    """The layout with the `given` values and every other factor at its default (its first value,
    or None where it does not apply)."""
    layout: dict = {}
    for factor in FACTORS:
        values = factor.values(layout)
        value = given.pop(factor.name, values[0] if values else None)
        if value not in (values or (None,)):
            raise ValueError(f"{factor.name}={value!r} is not one of {values} here")
        layout[factor.name] = value
    if given:
        raise ValueError(f"no factor(s) {sorted(given)}")
    return Layout(tuple(layout[n] for n in NAMES))


# The layouts the matrix found wrong, each with what was wrong: make test runs them every time.
REGRESSIONS: list[tuple[str, Layout]] = [
    ("a MoE model under the bucketed dp on a pipeline reported the last stage's loss only: its "
     "runner wrapper copied the pipeline's loss stage but not that MoE stages' losses are summed",
     layout_of(world=2, strategy="dp", pp=2, schedule="1f1b", experts=4, balance="aux",
               capacity_scope="sequence", micro_batches=2)),
    ("torch-fsdp2 on a MoE model crashed gathering its state: the experts' bias is a buffer, "
     "which FSDP2 leaves a plain tensor, and the gather called full_tensor() on every entry",
     layout_of(world=2, strategy="torch-fsdp2", experts=4, balance="bias", capacity_scope="batch")),
    ("torch-fsdp2 over our tp shards gathered them over dp only (shapes 1/tp of single's): the "
     "placements our transforms record are read before fully_shard replaces the parameters",
     layout_of(world=4, strategy="torch-fsdp2", tp=2, micro_batches=2)),
    ("fsdp with cp on the rebuilt collectives: the prefetched all-gather, sent from refimpl.comm's "
     "lane thread, took ring attention's K/V message (dp_cp was cp's group, as dp = 1)",
     layout_of(world=2, strategy="fsdp", cp=2, collectives="refimpl",
               option=(("overlap_reduce", True),))),
]


# --- sampling, for a cover without the whole space -------------------------------------------------

def random_layout(rng: random.Random, fixed: dict | None = None, keep_default: float = 0.6,
                  within: dict | None = None) -> Layout | None:
    """A layout with `fixed` values, the others drawn (the first value, the default, with
    probability `keep_default`: most refusals come from several non-defaults at once), the world
    and the strategy from `within` (default: every world, a distinct strategy: COVER_STRATEGIES).
    None if a fixed value is not possible after the draws before it."""
    fixed, within = fixed or {}, {"strategy": COVER_STRATEGIES, **(within or {})}
    layout: dict = {}
    for factor in FACTORS:
        values = within[factor.name] if factor.name in within else factor.values(layout)
        if factor.name in fixed:
            if fixed[factor.name] not in (values or (None,)):
                return None
            layout[factor.name] = fixed[factor.name]
        elif not values:
            layout[factor.name] = None
        else:
            layout[factor.name] = (values[0] if rng.random() < keep_default
                                   else rng.choice(values))
    return Layout(tuple(layout[n] for n in NAMES))


def searched_layout(rng: random.Random, fixed: dict, accept: Callable[[Layout], bool], *,
                    within: dict | None = None, weight: Callable[[int, object], float] | None = None,
                    leaves: int = 12, nodes: int = 400) -> Layout | None:
    """An accepted layout with the `fixed` values, searched depth first with the free factors'
    values in random order: weighted by `weight(factor index, value)` where given (sampled_cover
    weighs the values seen accepted beside the fixed ones), else the default first with
    probability 0.6, as in `random_layout`.
    Where a fixed value is not possible after the values before it (virtual_stages=2 needs a
    pipeline with an interleaved schedule), it backs up to the previous free factor instead of
    starting over; a complete layout the launcher refuses (`accept` is False: dualpipev with too
    few micro-batches) moves it to the next one, the last factors changing first. Gives up after
    `leaves` complete layouts or `nodes` steps: None then. A combination that needs several
    values at once, which independent draws rarely meet, is found in one search."""
    within = {"strategy": COVER_STRATEGIES, **(within or {})}
    budget = {"leaves": leaves, "nodes": nodes}

    def descend(i: int, layout: dict) -> Layout | None:
        budget["nodes"] -= 1
        if budget["nodes"] < 0 or budget["leaves"] <= 0:
            return None
        if i == len(FACTORS):
            budget["leaves"] -= 1
            found = Layout(tuple(layout[n] for n in NAMES))
            return found if accept(found) else None
        factor = FACTORS[i]
        values = within[factor.name] if factor.name in within else factor.values(layout)
        if factor.name in fixed:
            order = [fixed[factor.name]] if fixed[factor.name] in (values or (None,)) else []
        elif not values:
            order = [None]
        elif weight is None:
            order = list(values[1:])
            rng.shuffle(order)
            order.insert(0 if rng.random() < 0.6 else rng.randrange(len(values)), values[0])
        else:   # a weighted random order (Efraimidis and Spirakis' keys u ** (1 / w))
            order = sorted(values, key=lambda v: -rng.random() ** (1.0 / weight(i, v)))
        for value in order:     # one dict, set and unset on the way down and back up
            layout[factor.name] = value
            found = descend(i + 1, layout)
            if found is not None:
                return found
        layout.pop(factor.name, None)
        return None

    return descend(0, {})


# --- covers: every t values that occur together, in few layouts ------------------------------------

# A shorthand is registry data (refimpl.registry): `--strategy pp-zbv --nproc 4 --tp 2` resolves to
# dp-naive on tp 2 x pp 2 with the zbv schedule, the same class on the same configuration, so it
# runs the same code as that layout spelled out. The census validates every spelling (and
# tests/test_layout_matrix.py checks that each shorthand's verdict is its spelled-out layout's);
# the covers run the distinct layouts: the flavours and PyTorch's twins.
COVER_STRATEGIES = tuple(s for s, e in strategies().items()
                         if s != "single" and not (e.axis and e.strategy == NAIVE))
# make test's pairwise cover: 2, 3 and 4 ranks, and neither of PyTorch's DTensor twins (a layout of
# theirs takes ~4x one of ours: DTensor's dispatch). With 8 ranks and the twins the cover costs
# make test ~3 more minutes of its 10 on 2 cores; make test-full covers every pair of them (and
# every triple), and make test runs named 8-rank layouts (tests/test_composition.py,
# tests/test_moe_compose.py) and the twins' (tests/test_tp_strategy.py, test_composition.py).
PAIRWISE_STRATEGIES = tuple(s for s in COVER_STRATEGIES if s not in ("torch-tp", "torch-fsdp2-tp"))
PAIRWISE_WORLDS = (2, 3, 4)

PRECISION = NAMES.index("precision")
# Every value a factor takes in some layout (the domains above, over every context).
DOMAINS: dict[str, tuple] = {
    "world": WORLDS, "strategy": COVER_STRATEGIES,
    "tp": AXIS_SIZES["tp"], "pp": AXIS_SIZES["pp"], "cp": AXIS_SIZES["cp"],
    "schedule": tuple(schedules()), "virtual_stages": (1, 2), "arch": ("gpt", "llama"), "experts": (0, 4),
    "balance": ("none", "aux", "bias"), "capacity_scope": ("batch", "sequence"),
    "ep": AXIS_SIZES["ep"], "sequence_parallel": (False, True), "checkpointing": (False, True),
    "micro_batches": (1, 2, 4, 8), "collectives": ("torch", "refimpl"),
    "precision": ("float64", "bf16"),
    "option": tuple(dict.fromkeys(v for s in strategies() for v in _option_values(s))),
}


def vouches(values: tuple, t: int) -> set:
    """The t-tuples a layout's run vouches for. A float64 run is held to 1e-9: every tuple it
    holds. A bf16 run is held to bf16's 2e-2, which would pass the 3.3e-3 of a real bug: only
    the tuples that hold its precision, so every other pairing must be seen in float64 to count."""
    held = set(tuples(values, t))
    if values[PRECISION] == "float64":
        return held
    return {tup for tup in held if any(i == PRECISION for i, _ in tup)}


def cost(values: tuple) -> float:
    """A layout's expected run time in seconds on 2 cores: a product of factors fitted to one
    run of the pairwise cover (213 layouts, log-residual 0.35: within x1.4 typically). Ranks
    beyond the cores wait their turn, micro-batches and tensor/context/sequence splits add
    messages, experts add all-to-alls, PyTorch's DTensor tp adds its dispatch; stages split the
    compute. Only its ratios matter: a cover takes the cheaper of two layouts that cover as much."""
    get = dict(zip(NAMES, values)).get
    log2 = math.log2
    c = 0.2 * {2: 1.0, 3: 1.38, 4: 2.34, 8: 5.23}[get("world")]
    c *= 1.34 ** log2(get("micro_batches")) * 1.26 ** log2(get("cp")) * 1.32 ** log2(get("tp"))
    c *= 0.62 ** log2(get("pp"))
    c *= 4.3 if get("strategy") in ("torch-tp", "torch-fsdp2-tp") else 1.0
    c *= 1.8 if get("experts") else 1.0
    c *= 1.38 if get("checkpointing") else 1.0
    c *= 1.55 if get("sequence_parallel") else 1.0
    c *= 1.1 if get("collectives") == "refimpl" else 1.0
    return c * (1.18 if get("precision") == "bf16" else 1.0)


@dataclass
class Cover:
    strength: int
    layouts: list            # the layouts to run
    required: int            # the t-tuples they cover between them: every one any accepted layout
                             # of the search vouches for
    refusals: list           # (layout, line) of every layout the search saw refused


def sampled_cover(strength: int = 2, *, strategies: tuple = COVER_STRATEGIES,
                  worlds: tuple = WORLDS, seed: int = 0, draws: int = 20000, tries: int = 30
                  ) -> Cover:
    """A t-wise cover found by sampling, in seconds (make test's).

    Which t values can occur together: `draws` random layouts, then, for every t values of the
    domains that no accepted layout has shown together yet, up to `tries` searches for a layout
    with those values fixed (`searched_layout`); a combination none of them finds is taken as
    impossible (`make test-full` checks that against the whole space: plain random draws with the
    values fixed missed 114 of the 1694 possible pairs, 97 of make test's 1547, e.g. bucketed dp
    with dualpipev; the search misses none). Then the layouts: AETG's construction
    (refimpl.lab.verify.covering.constructed_cover), each built around a combination not yet covered,
    each other factor taking the value that completes the most uncovered combinations, kept only
    if the launcher accepts it, or the weighted greedy choice among every layout the search
    accepted (refimpl.lab.verify.covering.greedy_cover), whichever is expected to run in less time.
    `strategies`, `worlds`: the part of the space it covers.
    Seeded: the same layouts every run, until a factor or a rule changes."""
    rng = random.Random(seed)
    within = {"strategy": strategies, "world": worlds}
    pool: dict[tuple, None] = {}
    seen: set = set()
    witness: dict = {}           # a t-tuple -> the first accepted layout seen holding it
    refusals: list = []
    together: Counter = Counter()   # how many accepted layouts hold each pair of values

    def consider(layout: Layout | None) -> bool:
        if layout is None:
            return False
        if layout.values in pool:
            return True
        why = refusal(layout)
        if why is not None:
            refusals.append((layout, why))
            return False
        pool[layout.values] = None
        together.update(tuples(layout.values, 2))
        for tup in vouches(layout.values, strength):
            witness.setdefault(tup, layout.values)
        seen.update(vouches(layout.values, strength))
        return True

    for _ in range(draws):
        consider(random_layout(rng, within=within))
    domains = {**DOMAINS, **within}
    items = [(i, v) for i, name in enumerate(NAMES) for v in domains[name]]
    for combo in itertools.combinations(items, strength):
        if len({i for i, _ in combo}) < strength or combo in seen:
            continue
        fixed = _must_hold(combo)

        def weight(i, v, combo=combo):
            # values seen accepted beside the fixed ones first: the context they need
            return 1 + sum(together[(a, (i, v)) if a[0] < i else ((i, v), a)] for a in combo)

        if not any(searched_layout(rng, fixed, consider, within=within, weight=weight)
                   is not None for _ in range(tries)):
            # An option is one strategy's: once the search has drawn another strategy it is
            # out of reach (it missed capacity_scope=sequence with tp_overlap). Once more with
            # each strategy fixed in turn, on a stream of its own (the main stream's draws stay
            # as they were).
            wide = random.Random(repr((seed, combo)))
            any(searched_layout(wide, {"strategy": name, **fixed}, consider, within=within,
                                weight=weight) is not None
                for name in within["strategy"] if "option" in fixed and "strategy" not in fixed
                for _ in range(3))

    def build(combo, score, rng):
        fixed = _must_hold(combo)
        for attempt in range(4):
            layout = _filled(fixed, score, rng, 0.25 * attempt, within)
            if layout is not None and consider(layout):
                return layout.values
        return witness[combo]

    covers = lambda r: vouches(r, strength)   # noqa: E731
    built = constructed_cover(seen, strength, build, covers, cost, rng)
    # The greedy choice among every layout the search accepted can cost less than AETG's rows
    # (make test's pairwise: 118 against 132 expected seconds): the cheaper of the two.
    picked = without_redundant(greedy_cover(list(pool), covers, seen, cost), covers, cost)
    chosen = min(built, picked, key=lambda rows: sum(map(cost, rows)))
    return Cover(strength, [Layout(r) for r in chosen], len(seen), refusals)


def _must_hold(combo: tuple) -> dict:
    """The factor values a layout must take to vouch for `combo`: its own, and float64 unless the
    combination names the precision (`vouches`)."""
    fixed = {NAMES[i]: v for i, v in combo}
    fixed.setdefault("precision", "float64")
    return fixed


def _filled(fixed: dict, score, rng: random.Random, noise: float, within: dict) -> Layout | None:
    """A layout with the `fixed` values and, for every other factor in order, the value that
    completes the most uncovered combinations with the values chosen so far (`score`), the
    default on a tie; with probability `noise` a random one instead (a retry after a refusal)."""
    layout: dict = {}
    items = [(NAMES.index(n), v) for n, v in fixed.items()]
    for i, factor in enumerate(FACTORS):
        values = within[factor.name] if factor.name in within else factor.values(layout)
        if factor.name in fixed:
            if fixed[factor.name] not in (values or (None,)):
                return None
            value = fixed[factor.name]
        elif not values:
            value = None
        elif rng.random() < noise:
            value = rng.choice(values)
        else:
            value = max(values, key=lambda v: (score(items, (i, v)), v == values[0], rng.random()))
            items.append((i, value))
        layout[factor.name] = value
    return Layout(tuple(layout[n] for n in NAMES))


def census_cover(strength: int, accepted: list) -> Cover:
    """The t-wise cover chosen from every accepted layout of the space (`census(...).accepted`):
    exact, and minutes to make (make test-full's)."""
    rows = [layout.values for layout in accepted]
    required: set = set()
    for r in rows:
        required.update(vouches(r, strength))
    chosen = greedy_cover(rows, lambda r: vouches(r, strength), required, cost)
    return Cover(strength, [Layout(r) for r in chosen], len(required), [])
