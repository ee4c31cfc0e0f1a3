"""Architecture rules of DESIGN.md, checked by reading the sources' imports."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "miles_sync": "miles-sync",
    "miles_rollout": "miles-rollout",
    "miles_train": "miles-train",
    "miles_control": "miles-control",
}
ALLOWED = {  # which Miles packages each may import
    "miles_sync": set(),
    "miles_rollout": {"miles_sync"},
    "miles_train": {"miles_sync"},
    "miles_control": {"miles_sync", "miles_rollout", "miles_train"},
}
# import name → distribution name, where they differ
DIST_OF = {
    "yaml": "pyyaml",
    "pyarrow": "pyarrow",
    "sqlalchemy": "sqlalchemy",
    "safetensors": "safetensors",
    "pydantic_settings": "pydantic-settings",
    "megatron": "megatron-core",
    "mlflow": "mlflow-skinny",  # the tracking extra's client (the full `mlflow` provides the same import)
}


def full_imports_of(folder: Path) -> dict[str, set[str]]:
    """Full module names imported by each file under `folder`."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def imports_of(folder: Path) -> dict[str, set[str]]:
    """Top-level module names imported by each file under `folder`."""
    return {f: {n.split(".")[0] for n in names} for f, names in full_imports_of(folder).items()}


@pytest.mark.parametrize("module", sorted(PACKAGES))
def test_dependency_rule(module):
    src = ROOT / "packages" / PACKAGES[module] / "src" / module
    forbidden = set(PACKAGES) - ALLOWED[module] - {module}
    offenders = {f: sorted(n & forbidden) for f, n in imports_of(src).items() if n & forbidden}
    assert not offenders, f"{module} may import only {sorted(ALLOWED[module])} of Miles: {offenders}"


@pytest.mark.parametrize("module", sorted(PACKAGES))
def test_every_third_party_import_is_declared(module):
    """So that `pip install packages/<name>` alone gives a working package (extras count: an optional
    feature such as PostgreSQL imports its driver only when used)."""
    package_dir = ROOT / "packages" / PACKAGES[module]
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    extras = [dep for deps in project.get("optional-dependencies", {}).values() for dep in deps]
    declared = {
        re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower().replace("_", "-")
        for dep in project["dependencies"] + extras
    }
    used = set().union(*imports_of(package_dir / "src" / module).values())
    third_party = {n for n in used if n not in sys.stdlib_module_names and n not in PACKAGES}
    for miles_dep in ALLOWED[module]:
        if miles_dep in used:
            third_party.add(miles_dep)
    tokenizers_via_transformers = {"tokenizers"} if "transformers" in declared else set()
    missing = sorted(
        n
        for n in third_party - tokenizers_via_transformers
        if DIST_OF.get(n, n).lower().replace("_", "-") not in declared
    )
    assert not missing, f"{PACKAGES[module]} imports {missing} without declaring them in pyproject.toml"


def test_config_modules_import_only_pydantic():
    for module, dist in PACKAGES.items():
        config = ROOT / "packages" / dist / "src" / module / "config.py"
        used = imports_of(config.parent)[str(config.relative_to(ROOT))]
        # importlib: miles_rollout.config looks sglang up (find_spec, which does not import it) to pick the
        # default engine; the subprocess test below checks that validating a spec imports no torch.
        assert used <= {"__future__", "typing", "importlib", "re", "pydantic", *PACKAGES}, (config, used)


@pytest.mark.slow
@pytest.mark.parametrize("dist", sorted(PACKAGES.values()))
def test_each_package_builds_a_wheel_alone(dist, tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT / "packages" / dist),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    module = dist.replace("-", "_")
    assert f"{module}/__init__.py" in names and f"{module}/config.py" in names
    # what installed code finds beside itself (package data), not in the repository
    data = {
        "miles_control": ["miles_control/store/migrations/env.py"],
        "miles_rollout": ["miles_rollout/engines/sglang/cpu_shim/sgl_kernel/__init__.py"],
    }
    missing = [name for name in data.get(module, []) if name not in names]
    assert not missing, f"the {dist} wheel lacks {missing}"


DASHBOARD = ROOT / "apps" / "dashboard"


def test_the_dashboard_talks_to_the_api_only():
    """The dashboard (apps/dashboard, its own distribution) reaches the control plane only through the typed API
    client (miles_control.client and the API's schema models) and imports no torch: everything it shows comes over
    REST. No Miles package imports the dashboard (`miles dashboard` runs it as a program)."""
    app = DASHBOARD / "src" / "miles_dashboard"
    allowed = {"streamlit", "altair", "pandas", "httpx", "yaml", "pydantic", "miles_dashboard"}
    allowed_miles = {"miles_control.client", "miles_control.api.schemas", "miles_control.yaml_safe"}  # torch-free
    used = full_imports_of(app)
    offenders = {
        f: sorted(
            n for n in names if n not in allowed_miles and n.split(".")[0] not in allowed | set(sys.stdlib_module_names)
        )
        for f, names in used.items()
    }
    offenders = {f: n for f, n in offenders.items() if n}
    assert used and not offenders, (
        f"the dashboard may use only {sorted(allowed | allowed_miles)} and the stdlib: {offenders}"
    )
    assert any("miles_control.client" in names for names in used.values())  # the one client, not its own
    for dist in PACKAGES.values():
        importers = [
            f for f, names in imports_of(ROOT / "packages" / dist / "src").items() if "miles_dashboard" in names
        ]
        assert not importers, f"{dist} imports the dashboard: {importers}"
    # every third-party import is declared by the app's own pyproject.toml
    project = tomllib.loads((DASHBOARD / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    third_party = {n.split(".")[0] for names in used.values() for n in names} - set(sys.stdlib_module_names)
    third_party -= {"miles_dashboard"}
    missing = sorted(n for n in third_party if DIST_OF.get(n, n).replace("_", "-") not in declared)
    assert not missing, f"miles-dashboard imports {missing} without declaring them"
    code = (
        "import sys, miles_control.client; "
        "print([m for m in ('torch', 'ray', 'transformers', 'sqlalchemy', 'fastapi') if m in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing the API client loads {loaded}"


def test_every_backend_folder_has_the_same_file_set():
    """Each trainer backend is laid out as torchtitan's model folders are: `backend.py` (the TrainerBackend),
    `convert.py` (HF ⇄ the framework's names and layouts), `parallelize.py` (the parallel layout, the only
    file that calls the framework's sharding / model-parallel APIs), and `cpu.py` where the framework needs
    adjustments to run without a GPU."""
    backends = ROOT / "packages" / "miles-train" / "src" / "miles_train" / "backends"
    folders = sorted(p for p in backends.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert {f.name for f in folders} == {"fsdp2", "megatron", "torchtitan"}
    parallel_apis = {"fully_shard", "initialize_model_parallel", "DistributedDataParallel", "parallelize_qwen3",
                     "ParallelDims"}  # fmt: skip
    for folder in folders:
        files = {p.name for p in folder.glob("*.py")}
        assert {"__init__.py", "backend.py", "convert.py", "parallelize.py"} <= files, (folder.name, files)
        assert files <= {"__init__.py", "backend.py", "convert.py", "parallelize.py", "cpu.py"}, (folder.name, files)
        for path in folder.glob("*.py"):
            if path.name != "parallelize.py":
                names = set()
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.Name):
                        names.add(node.id)
                    elif isinstance(node, ast.Attribute):
                        names.add(node.attr)
                    elif isinstance(node, ast.alias):
                        names.add(node.name.split(".")[-1])
                assert not names & parallel_apis, f"{path.relative_to(ROOT)} uses {names & parallel_apis}"


# Where no transport may be named (issue 18): the engines and the runtime reach every transport through
# miles_sync's registry (`receive`, `build_sender`, `needs_receiver_ranks`), so adding one edits miles_sync only.
TRANSPORT_FREE = [
    ROOT / "packages/miles-rollout/src/miles_rollout/engines",
    ROOT / "packages/miles-rollout/src/miles_rollout/manager.py",
    ROOT / "packages/miles-rollout/src/miles_rollout/protocol.py",
    ROOT / "packages/miles-control/src/miles_control/runtime",
]


def transport_conditionals(path: Path, names: set[str]) -> list[str]:
    """Lines of `path` that name a transport in code (a string literal other than a docstring), compare a
    `.transport`, or import a transport module."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
            found.append(f"{path.name}:{node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.Compare) and any(
            isinstance(n, ast.Attribute) and n.attr == "transport" for n in [node.left, *node.comparators]
        ):
            found.append(f"{path.name}:{node.lineno}: compares .transport")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles_sync.transports"):
            found.append(f"{path.name}:{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.startswith("miles_sync.transports") for a in node.names):
            found.append(f"{path.name}:{node.lineno}: imports a transport module")
    return found


def test_engines_and_runtime_have_no_transport_conditionals():
    from miles_sync import TRANSPORTS

    names = set(TRANSPORTS) | {"p2p"}
    files = [f for root in TRANSPORT_FREE for f in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    assert len(files) > 10, "the folders checked moved: update TRANSPORT_FREE"
    found = [line for f in files for line in transport_conditionals(f, names)]
    assert not found, "transport-specific code outside miles_sync:\n" + "\n".join(found)


def test_the_transport_check_finds_a_conditional(tmp_path):
    """The check above is not vacuous: it flags each form of transport-specific code."""
    sample = tmp_path / "engine.py"
    sample.write_text(
        '"""Loads "disk" pushes."""\n'
        "from miles_sync.transports.disk import read\n"
        "def load(handle):\n"
        '    """tensor"""\n'
        '    if handle.transport == "broadcast":\n'
        "        pass\n"
    )
    found = transport_conditionals(sample, {"disk", "tensor", "broadcast"})
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports miles_sync.transports.disk",
        "compares .transport",
        "the string 'broadcast'",
    ]


# ---- miles-control's folders: the loop never imports the service; each pair of folders in one direction --------
CONTROL = ROOT / "packages" / "miles-control" / "src" / "miles_control"
LOOP = {"runtime", "schedules", "run", "recorder", "placement", "preflight", "convert"}
SERVICE = {"store", "api", "launch", "client"}
SHARED = {"journal", "status"}  # what the loop needs from a job's record, and the job lifecycle: both sides import
ONE_WAY = {  # part → the parts it must not import (the other way round is allowed)
    **dict.fromkeys(LOOP, SERVICE),
    **dict.fromkeys(SHARED, LOOP | SERVICE),
    "runtime": SERVICE | {"schedules"},  # schedules drive the runtime
    "launch": {"api"},  # the API starts launches
    "store": LOOP | {"api", "launch", "client"},  # the bottom of the service
}


def control_part(module: str) -> str | None:
    """`miles_control.runtime.job` → `runtime`, `miles_control.run` → `run`; None outside miles_control."""
    parts = module.split(".")
    return parts[1] if parts[0] == "miles_control" and len(parts) > 1 else None


def back_arrows(root: Path) -> list[str]:
    """Every import under `root` (a miles_control folder) that goes against ONE_WAY, as `file: part → part`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        part = rel.parts[0].removesuffix(".py")
        forbidden = ONE_WAY.get(part, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # function-level imports count too
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if control_part(name) in forbidden:
                    found.append(f"{rel}:{node.lineno}: {part} → {control_part(name)}")
    return found


def test_the_loop_never_imports_the_service():
    """The loop (runtime, schedules, run, recorder, …) writes through miles_control.journal's protocols, which the
    store implements; the service side (store, api, launch, client) may import the loop, not the reverse."""
    parts = {p.name.removesuffix(".py") for p in CONTROL.iterdir() if p.suffix == ".py" or p.is_dir()}
    named = LOOP | SERVICE | SHARED
    assert named <= parts, f"a folder named here moved: {sorted(named - parts)}"
    found = back_arrows(CONTROL)
    assert not found, "imports against the folder rules:\n" + "\n".join(found)


def test_the_folder_check_finds_a_back_arrow(tmp_path):
    """The check above is not vacuous: a runtime module importing a schedule, a recorder importing the store (inside
    a function) and a launcher importing the API are all flagged; the allowed direction is not."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "job.py").write_text("from miles_control.schedules.buffer import Buffer\n")
    (tmp_path / "recorder.py").write_text("def f():\n    import miles_control.store.models\n")
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "l.py").write_text("from miles_control.api.policy import check\n")
    (tmp_path / "schedules").mkdir()
    (tmp_path / "schedules" / "sync.py").write_text("from miles_control.runtime.job import JobRuntime\n")
    assert back_arrows(tmp_path) == [
        "launch/l.py:1: launch → api",
        "recorder.py:2: recorder → store",
        "runtime/job.py:1: runtime → schedules",
    ]
