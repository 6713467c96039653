"""The package's layers, enforced as ../shared/DESIGN.md draws them ("Layout"): every import in
refimpl/ (function-level ones too, and the "module:Class" strings the registry imports by name) runs
downward, no module is part of an import circle, and a parallelism never imports another.

The layers, bottom first, in DESIGN's order. A module may import its own layer and the layers below
it, never one above:

    foundation   launch (+ the rank entry point, the launcher's plug-in seam), mesh, and the
                 seam (refimpl.seam: every layer's collectives and phases go through it, so it
                 sits below all of them)
    model        the GPT, the MoE layer (routing only: its collectives are parallel/ep's),
                 activation checkpointing, the data
    memory       what a run holds (arithmetic, measured)
    comm         collectives rebuilt from send/recv
    cost         alpha-beta, bytes per collective, hardware datasheets
    interface    config, placement, rank_model, step, strategy: what every strategy plugs into
    parallel     one folder per parallelism (dp < zero < fsdp may share; tp, pp, cp and ep import
                 no other)
    compose      the transforms in their order, optimizer resharding, composed twins
    registry     the --strategy names (DESIGN puts it with parallel/; it names compose's twin too,
                 so it sits above compose)
    train        the one loop (+ its plug-in seam, loop_extras)
    bench        DESIGN's contract name for the alpha-beta fit and the bus-bandwidth factor
  THE LAB (refimpl/lab/), above every core layer: the core never imports it
    lab measure  the runtime (zygote, flight recorder, staged backend), labels and byte counts,
                 traces, sweeps and measurements, predictions, checkpoints, the shard-only build,
                 the loop's additions, the pipeline's tools, PyTorch's twins and notebook 10's faults (the plug-ins)
    lab verify   equivalence, the bisector, the dry run, the layout matrix
    lab plan     the planner (it reads the dry run, never the other way round)
    lab tools    plots, the TensorBoard plugin, the CLI

An import inside a function is allowed only where the module says why (ALLOWED_LAZY).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "refimpl"

LAYERS = [
    ("foundation", ("launch", "process_group", "launch_tools", "_rank", "seam",
                    "mesh", "__init__")),
    ("model", ("model",)),
    ("memory", ("memory",)),
    ("comm", ("comm",)),
    ("cost", ("cost",)),
    ("interface", ("config", "placement", "rank_model", "step", "strategy")),
    ("parallel", ("parallel",)),
    ("compose", ("compose",)),
    ("registry", ("registry",)),
    ("train", ("loop_extras", "train")),
    ("bench", ("bench",)),
    # THE LAB (refimpl/lab/): it imports the core, the core never imports it
    ("lab measure", ("lab", "lab.runtime", "lab.instrument", "lab.trace", "lab.measure",
                     "lab.checkpoint", "lab.predict", "lab.progress", "lab.env", "lab.twins",
                     "lab.faults", "lab.pipeline", "lab.tensor", "lab.rank_build", "lab.loop")),
    ("lab verify", ("lab.verify",)),
    ("lab plan", ("lab.plan",)),
    ("lab tools", ("lab.plots", "lab.source", "lab.tb_plugin", "lab.cli", "__main__")),
]
CORE_LAYERS = len([name for name, _ in LAYERS if not name.startswith("lab")])
# Inside parallel/: a folder may import the folders listed for it (and its own), nothing else.
PARALLEL_MAY_IMPORT = {
    "dp": set(), "zero": {"dp"}, "fsdp": {"dp", "zero"},
    "tp": set(), "pp": set(), "cp": set(), "ep": set(), "__init__": set(),
}
# Function-level imports of refimpl modules, each with its reason.
ALLOWED_LAZY = {
    "lab.cli": "the CLI imports a subcommand's modules only when that subcommand runs",
    "_rank": "a rank imports the launcher after its environment (threads, device) is set",
    "lab.runtime.zygote": "the zygote forks ranks; each imports its entry point after the fork",
    "lab.runtime.tools": "a rank registers the staged backend, or audits its factories, only when "
                         "it is asked for",
    "lab.tb_plugin.plugin": "TensorBoard loads the plugin at start; pandas/plotly wait for a request",
    "lab.tb_plugin.runs": "as lab.tb_plugin.plugin",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(module: str, node: ast.AST) -> list[str]:
    """The refimpl modules (relative names) an import statement loads."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:   # relative: from . import x
            pkg = module.split(".")[:-node.level] if not MODULES[module].name == "__init__.py" \
                else module.split(".")[:len(module.split(".")) - node.level + 1]
            base = ".".join(["refimpl", *pkg, base]).rstrip(".")
        targets = [f"{base}.{a.name}" for a in node.names] + [base]
    out = []
    for t in targets:
        if t != "refimpl" and not t.startswith("refimpl."):
            continue
        name = t[len("refimpl."):] if t != "refimpl" else "__init__"
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


# "refimpl.parallel.dp.naive:NaiveDataParallel": a class named in a string, for importlib (a
# "-m refimpl._rank" starts a process: not an import)
NAMED = re.compile(r"^refimpl(\.\w+)+:\w+$")


def _named_in_strings(module: str, tree: ast.AST) -> list[str]:
    """The refimpl modules a module names in string constants of the form importlib takes (the
    registry's entries): importing by name is still importing."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED.match(node.value):
            out += _resolve(module, ast.Import(names=[ast.alias(node.value.split(":")[0])]))
    return out


def _edges() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    edges, lazy = defaultdict(set), defaultdict(set)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, node):
                    edges[module].add(target)
                    if id(node) not in top:
                        lazy[module].add(target)
        edges[module].update(_named_in_strings(module, tree))
    return edges, lazy


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"refimpl.{module} is in no layer: add it to tests/test_imports.py")
    return best


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def upward(edges) -> list[str]:
    return [f"refimpl.{a} ({LAYERS[layer_of(a)][0]}) imports refimpl.{b} ({LAYERS[layer_of(b)][0]})"
            for a in sorted(edges) for b in sorted(edges[a]) if layer_of(b) > layer_of(a)]


def _folder(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "parallel":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def crossing(edges) -> list[str]:
    found = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            fa, fb = _folder(a), _folder(b)
            if fa and fb and fb != fa and fb not in PARALLEL_MAY_IMPORT[fa]:
                found.append(f"refimpl.{a} imports refimpl.{b}")
    return found


def circles(edges) -> list[list[str]]:
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(set(edges) | {b for bs in edges.values() for b in bs}):
        if module not in index:
            visit(module)
    return found


def is_core(module: str) -> bool:
    return layer_of(module) < CORE_LAYERS


def core_into_lab(edges) -> list[str]:
    """Each import of a lab module by a core module, named: file, then the module it imports."""
    return [f"refimpl/{MODULES[a].relative_to(ROOT)} (core) imports refimpl.{b} (lab)"
            if a in MODULES else f"refimpl.{a} (core) imports refimpl.{b} (lab)"
            for a in sorted(edges) if is_core(a) for b in sorted(edges[a]) if not is_core(b)]


def test_the_core_never_imports_the_lab():
    edges, _ = _edges()
    found = core_into_lab(edges)
    assert not found, "the core imports the lab (DESIGN.md, Layout):\n" + "\n".join(found)


def test_imports_run_downward():
    edges, _ = _edges()
    assert not upward(edges), "upward imports:\n" + "\n".join(upward(edges))


def test_a_parallelism_never_imports_another():
    edges, _ = _edges()
    assert not crossing(edges), "\n".join(crossing(edges))


def test_no_import_circle():
    edges, _ = _edges()
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_function_level_imports_only_where_a_reason_is_written():
    _, lazy = _edges()
    unexplained = [f"refimpl.{a} imports {sorted(lazy[a])} inside a function"
                   for a in sorted(lazy) if lazy[a] and a not in ALLOWED_LAZY]
    assert not unexplained, "\n".join(unexplained)


def test_the_checks_name_what_they_find():
    """On a made-up graph with one fault of each kind, each check names exactly that fault (so a
    pass on the real graph means something)."""
    made_up = {"model.gpt": {"parallel.tp.layers"},            # upward
               "parallel.tp.layers": {"parallel.pp.stage"},    # a parallelism into another
               "parallel.pp.stage": {"parallel.pp.runner", "parallel.dp.naive"},   # tp/pp/cp/ep
               "parallel.pp.runner": {"parallel.pp.stage"},    # a circle        # import no dp
               "lab.verify.dryrun": {"lab.plan.cli"},          # verify sits below plan
               "model.moe": {"comm.ring"},                     # model sits below comm
               "train": {"lab.verify.equivalence"}}            # the core into the lab
    assert upward(made_up) == [
        "refimpl.lab.verify.dryrun (lab verify) imports refimpl.lab.plan.cli (lab plan)",
        "refimpl.model.gpt (model) imports refimpl.parallel.tp.layers (parallel)",
        "refimpl.model.moe (model) imports refimpl.comm.ring (comm)",
        "refimpl.train (train) imports refimpl.lab.verify.equivalence (lab verify)"]
    assert core_into_lab(made_up) == ["refimpl/train.py (core) imports refimpl.lab.verify.equivalence (lab)"]
    assert crossing(made_up) == ["refimpl.parallel.pp.stage imports refimpl.parallel.dp.naive",
                                 "refimpl.parallel.tp.layers imports refimpl.parallel.pp.stage"]
    assert circles(made_up) == [["parallel.pp.runner", "parallel.pp.stage"]]


def test_a_strategy_named_in_a_string_is_an_import():
    """The registry imports its strategies by "module:Class" name, and so does the twins' plug-in:
    the check sees those edges."""
    edges, _ = _edges()
    assert "parallel.dp.naive" in edges["registry"]
    assert "lab.twins.torch_fsdp2_tp" in edges["lab.twins.plugin"]
