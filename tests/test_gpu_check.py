"""The GPU check (scripts/gpu_check.sh, scripts/gpu_check_stages.sh, scripts/gpu_check.py) on a CPU:
what each stage selects, how a stage the budget ends is reported, the folder HTA is handed, the
toolchain probe before the compiled MFU, and that everything imported is on the GPU image or in
the wheel lists. None of it starts a rank."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- what each stage runs -------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The GPU machine's stages as the script would run them (GPU_CHECK_PLAN=1 runs nothing):
    (section, argv) per stage."""
    out = tmp_path_factory.mktemp("plan") / "run"
    env = dict(os.environ, GPU_CHECK_PLAN="1", GPU_CHECK_DIR=str(out), PYTHON=sys.executable)
    subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], env=env, cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=120)
    lines = (out / "plan.txt").read_text().splitlines()
    return [(section, shlex.split(cmd)) for section, cmd in (line.split("\t", 1) for line in lines)]


def _pytest_args(argv: list[str]) -> list[str] | None:
    """The arguments after `-m pytest`, or None for a command that is not pytest."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "pytest":
            return argv[i + 2:]
    return None


def test_every_stage_selects_its_tests_with_not_full(plan):
    runs = {section: args for section, argv in plan if (args := _pytest_args(argv)) is not None}
    assert {"(a) issue 35", "(e) shared GPU", "tests", "notebooks", "(f) suite"} <= set(runs)
    for section, args in runs.items():
        marks = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"]
        assert marks and marks[-1] == "not full", (section, args)


_COLLECTOR = '''
import json, os
def pytest_collection_finish(session):
    with open(os.environ["COLLECTED"], "w") as f:
        json.dump({i.nodeid: sorted({m.name for m in i.iter_markers()} | set(i.fixturenames))
                   for i in session.items}, f)
'''


def _collect(argv: list[str], tmp_path: Path, name: str) -> dict[str, list[str]]:
    """The tests a stage's pytest command selects (after -k and -m), with their markers and
    fixtures."""
    (tmp_path / "stage_collector.py").write_text(_COLLECTOR)
    args = [a for a in _pytest_args(argv) if not a.startswith("--junitxml")]
    env = dict(os.environ, COLLECTED=str(tmp_path / f"{name}.json"), REFIMPL_SHARED_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q",
                        "-p", "stage_collector"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow     # three collections of test_nccl_rules.py: ~20 s
def test_stages_a_and_e_split_the_nccl_rules_file_with_no_full_test(plan, tmp_path):
    """(a) runs issue 35's tests, (e) the rest of test_nccl_rules.py: no test twice, none left
    out but the `full` ones, and no `full` test in either (the bf16 layout sweep and the bisector
    are beyond the budget). The strategies' one staged launch (`audit_dirs`, every layout) is
    read in (e) alone, so it runs once."""
    argv = dict(plan)
    a = _collect(argv["(a) issue 35"], tmp_path, "a")
    e = _collect(argv["(e) shared GPU"], tmp_path, "e")
    files = [x for x in _pytest_args(argv["(a) issue 35"]) if x.endswith(".py")]
    every = _collect(["-m", "pytest", *files], tmp_path, "all")
    assert a and e and not set(a) & set(e)
    assert not [t for t in {**a, **e}.values() if "full" in t]
    assert set(a) | set(e) == {t for t, marks in every.items() if "full" not in marks}
    assert any("full" in marks for marks in every.values())
    assert not [t for t, marks in a.items() if "audit_dirs" in marks]
    assert [t for t, marks in e.items() if "audit_dirs" in marks]


# ---- the budget: a stage it ends is not a failure --------------------------------------------

def _stages(tmp_path: Path, budget: int, *stages: str) -> tuple[int, str]:
    """Run `stages` (lines calling stage ...) through scripts/gpu_check_stages.sh with a budget of
    `budget` s and no time kept for the table; return the exit status and status.txt."""
    out = tmp_path / "run"
    script = "\n".join([
        "set -u", f"DIR={shlex.quote(str(out))}", f"PYTHON={shlex.quote(sys.executable)}",
        f"BUDGET={budget}", "STOP=1000", "TABLE_S=0", "START=$SECONDS",
        'mkdir -p "$DIR/logs"; : > "$DIR/status.txt"',
        ". scripts/gpu_check_stages.sh", "trap finish EXIT", *stages])
    r = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    return r.returncode, (out / "status.txt").read_text()


def test_a_stage_the_budget_ends_is_not_finished_not_failed(tmp_path):
    rc, status = _stages(tmp_path, 2, 'stage s "longer than the budget" 60 - -- sleep 30')
    row = status.splitlines()[0]
    assert "not finished (budget)" in row and "TIMED OUT" not in row and "FAILED" not in row
    assert rc == 0, status


def test_a_stage_past_its_own_cap_or_with_a_failure_before_the_cut_fails_the_check(tmp_path):
    rc, status = _stages(tmp_path, 100, 'stage s "past its cap" 1 - -- sleep 30')
    assert "TIMED OUT" in status.splitlines()[0] and rc == 1
    # a pytest stage whose progress showed failures before the budget ended it, one on a line
    # the cut left without its percentage
    rc, status = _stages(tmp_path / "2", 2, "stage s \"a test failed\" 60 - -- bash -c "
                         "'echo \"..F.  [ 40%]\"; printf ...E; sleep 30'")
    row = status.splitlines()[0]
    assert "not finished (budget)" in row and "2 FAILED before the cut" in row and rc == 1


# ---- HolisticTraceAnalysis gets the rank traces alone -----------------------------------------

def test_hta_is_handed_a_folder_of_rank_traces_only(gpu_check, tmp_path, monkeypatch):
    """A profiled run's folder holds run_summary.json and TensorBoard scalars beside the traces;
    HTA reads every *.json of its folder as a rank's trace ("distributedInfo key does not exist"
    on the summary). The fake below reads the folder as HTA does."""
    import pandas as pd

    from tests.test_gpu_trace import _trace

    real = tmp_path / "trace-dp-nccl"
    real.mkdir()
    for rank in (0, 1):
        trace = _trace()
        trace["distributedInfo"].update(rank=rank, world_size=2)
        (real / f"rank{rank}.{100 + rank}.pt.trace.json").write_text(json.dumps(trace))
    (real / "run_summary.json").write_text(json.dumps({"strategy": "dp", "world_size": 2}))
    (real / "events.out.tfevents.1.refimpl").write_bytes(b"\0")
    folders = []

    class TraceAnalysis:
        def __init__(self, trace_dir):
            folders.append(sorted(p.name for p in Path(trace_dir).iterdir()))
            self.ranks = []
            for path in sorted(Path(trace_dir).glob("*.json")):
                info = json.loads(path.read_text()).get("distributedInfo")
                if info is None:
                    raise ValueError(f"distributedInfo key does not exist in {path.name}")
                self.ranks.append(info["rank"])

        def get_comm_comp_overlap(self, visualize=False):
            return pd.DataFrame({"rank": self.ranks, "comp_comm_overlap_pctg": 100 / 3})

    hta = types.ModuleType("hta.trace_analysis")
    hta.TraceAnalysis = TraceAnalysis
    monkeypatch.setitem(sys.modules, "hta", types.ModuleType("hta"))
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", hta)
    rows = []
    gpu_check._hta(lambda *row: rows.append(row), True, tmp_path)
    assert folders[-1] == ["rank0.100.pt.trace.json", "rank1.101.pt.trace.json"]
    assert rows[-1][2] == "rank 0: HTA 33.3% vs ours 33.3%, rank 1: HTA 33.3% vs ours 33.3%"


# ---- the compiled MFU needs a host toolchain ----------------------------------------------------

def test_compiled_mfu_without_a_toolchain_is_a_row_saying_why_not_a_failure(gpu_check, tmp_path,
                                                                           monkeypatch):
    import torch

    from refimpl.lab.measure import mfu

    def measure(*args, compile=False, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # the GPU path of the part
    monkeypatch.setattr(mfu, "measure", measure)
    monkeypatch.setattr(gpu_check, "toolchain_missing", lambda: "no host C compiler (probed)")
    rows = gpu_check.figures(tmp_path, "mfu", ["mfu_compiled"])
    assert [r["value"] for r in rows] == ["skipped: no host C compiler (probed)"]
    assert "FAILED" not in (tmp_path / "figures-mfu.json").read_text()   # what the exit reads
    # with the toolchain there, the part runs (and this fake's failure is one)
    monkeypatch.setattr(gpu_check, "toolchain_missing", lambda: None)
    rows = gpu_check.figures(tmp_path, "mfu", ["mfu_compiled"])
    assert rows[0]["figure"] == "FAILED" and "C compiler" in rows[0]["value"]


def test_the_toolchain_probe_names_what_is_missing(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_has_triton", lambda: False)
    assert "Triton is not installed" in gpu_check.toolchain_missing()
    monkeypatch.setattr(gpu_check, "_has_triton", lambda: True)
    gcc = shutil.which("gcc") or shutil.which("clang")
    monkeypatch.delenv("CC", raising=False)
    path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", str(tmp_path))             # no compiler on it
    assert "no host C compiler" in gpu_check.toolchain_missing()
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    assert "is not an executable" in gpu_check.toolchain_missing()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", path)
    if gcc is None:
        pytest.skip("no gcc or clang on this machine: the compiling half of the probe is not shown")
    headers = tmp_path / "include"
    headers.mkdir()
    assert "no Python headers" in gpu_check.toolchain_missing(headers)
    (headers / "Python.h").write_text("#error not a Python.h\n")
    assert "cannot compile a file including Python.h" in gpu_check.toolchain_missing(headers)
    if (gpu_check.python_include_dir() / "Python.h").is_file():
        assert gpu_check.toolchain_missing() is None


# ---- every third-party import is on the GPU image or in the wheel lists -------------------------

# Import names that differ from their distribution's and are not installed here to be looked up.
NOT_INSTALLED_HERE = {"hta": "holistictraceanalysis"}


def _names(path: Path) -> set[str]:
    return {re.sub(r"[-_.]+", "-", line.split("==")[0].strip()).lower()
            for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def _sources():
    for folder in ("refimpl", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            yield path, path.read_text()
    yield SCRIPTS / "gpu_check.py", (SCRIPTS / "gpu_check.py").read_text()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":   # IPython's magics and shell lines are not Python
                lines = "".join(cell["source"]).splitlines()
                yield path, "\n".join("" if ln.lstrip()[:1] in ("%", "!") else ln for ln in lines)


def _optional(node, parents) -> bool:
    """An import inside a try whose handler catches ImportError: the code runs without it."""
    for parent in parents.get(node, ()):
        if isinstance(parent, ast.Try) and node in [n for s in parent.body for n in ast.walk(s)]:
            for handler in parent.handlers:
                caught = ast.unparse(handler.type) if handler.type else "BaseException"
                if re.search(r"ImportError|ModuleNotFoundError|\bException\b", caught):
                    return True
    return False


def imported_modules() -> dict[str, set[str]]:
    """Top-level module -> the files importing it, required imports only (absolute ones)."""
    found: dict[str, set[str]] = {}
    for path, source in _sources():
        tree = ast.parse(source)
        parents: dict = {}
        for parent in ast.walk(tree):
            if isinstance(parent, ast.Try):
                for child in ast.walk(parent):
                    parents.setdefault(child, []).append(parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if not _optional(node, parents):
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    # what gpu_check.sh runs by name: python -m X, python -c "import X", pytest --nbval-lax
    shell = (SCRIPTS / "gpu_check.sh").read_text()
    for name in re.findall(r'"\$PYTHON" -m (\w+)', shell) + re.findall(r'-c "import (\w+)', shell):
        found.setdefault(name, set()).add("scripts/gpu_check.sh")
    if "--nbval-lax" in shell:
        found.setdefault("nbval", set()).add("scripts/gpu_check.sh")
    return found


def test_every_third_party_import_is_on_the_gpu_image_or_in_the_wheel_lists():
    """refimpl, the notebooks, the tests (the check runs them) and the GPU check import only the
    standard library, this repository, the image's packages (scripts/gpu_image_packages.txt) and
    the wheels the check installs (scripts/gpu_wheels.txt, gpu_wheels_optional.txt). Import names
    are mapped to distributions (yaml -> pyyaml, PIL -> pillow) by the installed metadata here."""
    from importlib.metadata import packages_distributions

    there = (_names(SCRIPTS / "gpu_image_packages.txt") | _names(SCRIPTS / "gpu_wheels.txt")
             | _names(SCRIPTS / "gpu_wheels_optional.txt"))
    assert {"torch", "numpy", "pandas", "pytest", "pyyaml", "pillow"} <= there
    ours = {"refimpl", "tests", "scripts"} | {p.stem for p in SCRIPTS.glob("*.py")}
    dists = packages_distributions()
    missing, unknown = {}, []
    for module, files in sorted(imported_modules().items()):
        if module in sys.stdlib_module_names or module in ours:
            continue
        names = dists.get(module) or [NOT_INSTALLED_HERE.get(module)]
        if names == [None]:
            unknown.append(module)
            continue
        if not {re.sub(r"[-_.]+", "-", n).lower() for n in names} & there:
            missing[f"{module} ({', '.join(names)})"] = sorted(files)[:3]
    assert not unknown, f"not installed here, so its distribution is unknown: add it to NOT_INSTALLED_HERE: {unknown}"
    assert not missing, f"imported but neither on the GPU image nor in the wheel lists: {missing}"
