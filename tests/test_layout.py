"""The package layout says where code runs, and the imports keep to it (docs/architecture.md §1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "trainer"

# Where each part of trainer/ runs; everything not listed is shared by all three.
SIDES = {
    "ranks": (
        "trainpipe.trainer.__main__",
        "trainpipe.trainer.loop",
        "trainpipe.trainer.drills",
        "trainpipe.trainer.preflight.__main__",
        "trainpipe.trainer.preflight.probes",
        "trainpipe.trainer.checkpoint.checkpointer",
    ),
    "supervisor": ("trainpipe.trainer.supervise",),
    "orchestrator": ("trainpipe.trainer.orchestrate",),
    "launcher": ("trainpipe.trainer.launch",),  # in the orchestrator's process, starting the per-host supervisors
}
PACKAGES = ("trainer", "tasks", "flows")  # installed as trainpipe.trainer, trainpipe.tasks, trainpipe.flows
# Besides its own side and shared code, what a side may import.
# The orchestrator checks a run's launcher (its kind and its options) where it resolves the run.
ALSO = {"launcher": ("supervisor",), "orchestrator": ("launcher",)}


def module_name(path: Path) -> str:
    """The import name of a file of trainer/, tasks/ or flows/: under the distribution's namespace."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return "trainpipe." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def side_of(module: str) -> str:
    for side, prefixes in SIDES.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return side
    return "shared"


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(TRAINER.rglob("*.py"))}


def test_each_module_imports_only_its_own_side_and_shared_code():
    crossings = {}
    for module, imported in MODULES.items():
        own = side_of(module)
        allowed = (own, "shared", *ALSO.get(own, ()))
        bad = sorted(i for i in imported if i.startswith("trainpipe.trainer.") and side_of(i) not in allowed)
        bad += sorted(
            i for i in imported if i == "prefect" or i.startswith(("prefect.", "trainpipe.flows", "trainpipe.tasks"))
        )
        if bad:
            crossings[f"{module} ({own})"] = bad
    assert len(MODULES) > 30 and not crossings, crossings


@pytest.mark.parametrize("entry", ["trainpipe.trainer.loop.main", "trainpipe.trainer.preflight.probes"])
def test_the_rank_entry_points_load_nothing_of_the_supervisor_orchestrator_or_prefect(entry):
    code = f"import sys, {entry}; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    forbidden = [
        m
        for m in loaded
        if m.startswith(
            (
                "trainpipe.trainer.supervise",
                "trainpipe.trainer.orchestrate",
                "prefect",
                "trainpipe.flows",
                "trainpipe.tasks",
            )
        )
    ]
    assert not forbidden, forbidden


def test_the_cli_loads_no_prefect_settings_before_it_points_prefect_at_a_server():
    """Prefect reads its settings (PREFECT_API_URL among them) once, when ``prefect.context`` is first imported;
    the CLI sets that variable for the `trainpipe up` server (``use_running_servers``) after its own imports, so
    those must not load it: ``serve`` would otherwise register its deployments with a temporary server."""
    code = "import sys, trainpipe.flows.cli; print(sorted(m for m in sys.modules if m.startswith('prefect')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_what_the_serving_forkserver_preloads_starts_no_thread_and_no_torch():
    """Forking is safe only from a process without threads; torch (and CUDA) stay for the ranks' own processes."""
    from trainpipe.flows.warm_start import PRELOAD

    code = f"import sys, threading, {', '.join(PRELOAD)}; print(threading.active_count(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["1", "False"], out.stdout


def test_the_tasks_and_flows_know_the_launcher_contract_not_the_supervisor():
    """The layering above trainer/ (docs/architecture.md §1): flows orchestrate tasks, tasks adapt trainer code,
    and both start work on the cluster through trainer.launch and its contract (trainer/launcher.py), never the
    supervisor or the ranks' code; a task never imports a flow."""
    below = ("trainpipe.trainer.supervise", "trainpipe.trainer.loop", "trainpipe.trainer.drills")
    crossings = {}
    for folder in ("tasks", "flows"):
        for path in sorted((ROOT / folder).glob("*.py")):
            imported = imports_of(path)
            bad = sorted(m for m in imported if any(m == b or m.startswith(b + ".") for b in below))
            bad += sorted(m for m in imported if folder == "tasks" and m.startswith("trainpipe.flows"))
            if bad:
                crossings[f"{folder}/{path.name}"] = bad
    assert crossings == {}


@pytest.mark.parametrize("entry", ["trainpipe.trainer", "trainpipe.trainer.preflight"])
def test_the_rank_programs_answer_help_and_a_wrong_argument_as_argparse_does(entry):
    """--help: the usage and exit 0; a wrong argument: one usage and error line, exit 2; never a traceback."""
    helped = subprocess.run([sys.executable, "-m", entry, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage:" in helped.stdout and "Traceback" not in helped.stderr, helped.stderr
    wrong = subprocess.run([sys.executable, "-m", entry, "--no-such"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "error:" in wrong.stderr and "Traceback" not in wrong.stderr, wrong.stderr


def test_every_import_of_trainpipes_own_code_is_under_its_namespace():
    """trainer, tasks and flows are other distributions' import names too (a text-to-speech library depends on
    one called trainer): trainpipe installs its folders as trainpipe.trainer, trainpipe.tasks, trainpipe.flows,
    and no file of the repository imports the bare names."""
    bare = {}
    for path in sorted(p for d in (*PACKAGES, "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")):
        found = sorted(m for m in imports_of(path) if m.split(".")[0] in PACKAGES)
        if found:
            bare[str(path.relative_to(ROOT))] = found
    assert bare == {}


def test_the_distribution_lists_every_package_of_the_folders():
    """pyproject.toml maps each folder under the namespace and lists its packages by hand (setuptools' finder
    cannot prefix them): a package folder left out of the list would be missing from an installed wheel."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {f"trainpipe.{p}": p for p in PACKAGES}
    folders = {module_name(p.parent / "__init__.py") for d in PACKAGES for p in (ROOT / d).rglob("__init__.py")}
    assert set(tool["packages"]) == folders


def test_static_tools_see_the_modules_the_interpreter_imports():
    """links/trainpipe holds one link per folder, to the folder the editable install maps that name to, so a type
    checker or an IDE given links/ (pyproject's [tool.pyright] extraPaths) resolves each trainpipe.* import to the
    file the interpreter loads."""
    import importlib
    import tomllib

    assert "links" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]["extraPaths"]
    for package in PACKAGES:
        link = ROOT / "links" / "trainpipe" / package
        assert link.is_symlink() and link.resolve() == ROOT / package, link
        loaded = Path(importlib.import_module(f"trainpipe.{package}").__file__).resolve()
        assert loaded == (link / "__init__.py").resolve()
    assert not (ROOT / "links" / "trainpipe" / "__init__.py").exists()  # a namespace, as installed


def test_another_distributions_trainer_package_does_not_shadow_trainpipe(tmp_path):
    """A package named trainer (and tasks, flows) first on the path, as beside another distribution, and the
    working directory elsewhere: trainpipe's modules and CLI still load their own code."""
    for name in PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the other distribution was imported')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)}
    code = "import trainpipe.trainer.config, trainpipe.tasks.train, trainpipe.flows.cli; print('own')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "own", proc.stderr[-2000:]


def test_each_package_docstring_names_the_modules_it_holds():
    """A maintainer opening a folder reads its __init__'s docstring first: it names every module of the folder."""
    import ast as _ast

    unnamed = {}
    for init in sorted(p for d in PACKAGES for p in (ROOT / d).rglob("__init__.py")):
        doc = _ast.get_docstring(_ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__"))
        missing = [m for m in modules if f"``{m}``" not in doc and f"`{m}`" not in doc and f"{m}.py" not in doc]
        if missing:
            unnamed[str(init.relative_to(ROOT))] = missing
    assert unnamed == {}
