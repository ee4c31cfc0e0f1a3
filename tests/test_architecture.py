"""The architecture of docs/architecture.md as executable rules, checked by reading the sources' imports."""

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
    "PIL": "pillow",
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


CONFIG_MODULE = {"miles_control": "spec/config.py"}  # where each package's spec sections live (default config.py)


def test_config_modules_import_only_pydantic():
    for module, dist in PACKAGES.items():
        config = ROOT / "packages" / dist / "src" / module / CONFIG_MODULE.get(module, "config.py")
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
    assert f"{module}/__init__.py" in names and f"{module}/{CONFIG_MODULE.get(module, 'config.py')}" in names
    # what installed code finds beside itself (package data), not in the repository
    data = {
        "miles_control": ["miles_control/service/store/migrations/env.py"],
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
    allowed_miles = {
        "miles_control.client",
        "miles_control.service.api.schemas",
        "miles_control.spec.yaml_safe",
    }  # torch-free
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
    ROOT / "packages/miles-control/src/miles_control/job/runtime",
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


# ---- miles-control's rooms: a folder per concern, imports between them in one direction -------------------------
CONTROL = ROOT / "packages" / "miles-control" / "src" / "miles_control"
ROOMS = {"spec", "job", "service", "cli", "bench", "testing", "client"}  # client.py: the extras-free API client
JOB_PARTS = {"run", "preflight", "placement", "data", "assets", "hub", "recorder", "tracking", "convert", "redact",
             "runtime", "schedules", "journal", "status"}  # fmt: skip
SERVICE_PARTS = {"api", "store", "launch", "driver", "settings", "summary", "export", "reports", "schedule_changes"}
ONE_WAY = {  # a room, or room/part → the rooms (or room/parts) it must not import; the other way round is allowed
    "spec": ROOMS - {"spec"},  # the bottom: a spec validates without torch, Ray or a store
    "job": {"service", "cli", "bench", "testing", "client"},  # the loop never imports the service
    "service": {"cli", "bench", "testing", "client"},
    "bench": {"cli"},
    "testing": {"cli", "bench"},
    "client": ROOMS - {"client", "service"} | {f"service/{p}" for p in SERVICE_PARTS - {"api"}},  # schemas only
    # inside the job: the schedules drive the runtime; a job's record (journal) and lifecycle (status) are what
    # the service shares with the loop, so they import no other part of it
    "job/runtime": {"job/schedules", "job/run"},
    "job/journal": {f"job/{p}" for p in JOB_PARTS - {"status", "journal"}},
    "job/status": {f"job/{p}" for p in JOB_PARTS - {"status"}},
    # inside the service: the API starts launches; the store is its bottom
    "service/launch": {"service/api"},
    "service/store": {f"service/{p}" for p in SERVICE_PARTS - {"store"}}
    | {f"job/{p}" for p in JOB_PARTS - {"status", "journal", "redact"}},
}


def control_part(module: str) -> str | None:
    """`miles_control.job.runtime.workers` → `job/runtime`, `miles_control.spec` → `spec`; None outside."""
    parts = module.split(".")
    return "/".join(parts[1:3]) if parts[0] == "miles_control" and len(parts) > 1 else None


def _within(part: str, rule: str) -> bool:
    return part == rule or part.startswith(rule + "/")


def back_arrows(root: Path) -> list[str]:
    """Every import under `root` (a miles_control tree) that goes against ONE_WAY, as `file: part → part`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        names = [*rel.parts[:-1], rel.parts[-1].removesuffix(".py")]
        part = "/".join(names[:2])
        forbidden = ONE_WAY.get(names[0], set()) | ONE_WAY.get(part, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # function-level imports count too
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [node.module]
            else:
                continue
            for name in imported:
                target = control_part(name)
                if target and not _within(target, part) and any(_within(target, rule) for rule in forbidden):
                    found.append(f"{rel}:{node.lineno}: {part} → {target}")
    return found


def test_every_module_of_miles_control_lives_in_a_room():
    """A newcomer finds a file from the folder names: the top level holds the rooms and the API client only, and
    the parts the rules name exist."""
    top = {p.name.removesuffix(".py") for p in CONTROL.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == ROOMS | {"__init__"}, f"outside a room: {sorted(top - ROOMS - {'__init__'})}"
    for room, parts in (("job", JOB_PARTS), ("service", SERVICE_PARTS)):
        here = {p.name.removesuffix(".py") for p in (CONTROL / room).iterdir() if p.suffix == ".py" or p.is_dir()}
        assert parts <= here, f"{room}/ lost {sorted(parts - here)}: update the rules"
    for room in ROOMS - {"client"}:
        doc = ast.get_docstring(ast.parse((CONTROL / room / "__init__.py").read_text()))
        assert doc, f"{room}/__init__.py says what the room holds"


def test_the_loop_never_imports_the_service():
    """The loop (job/) writes through job/journal.py's protocols, which the store implements; the service may import
    the loop, not the reverse; the spec imports no other room; the rules inside job/ and service/ hold."""
    found = back_arrows(CONTROL)
    assert not found, "imports against the folder rules:\n" + "\n".join(found)


def test_the_folder_check_finds_a_back_arrow(tmp_path):
    """The check above is not vacuous: the runtime importing a schedule, the recorder importing the store (inside a
    function), the launcher importing the API, the spec importing the job and the client importing the store are all
    flagged; the allowed directions are not."""
    files = {
        "job/runtime/job.py": "from miles_control.job.schedules.buffer import Buffer\n",
        "job/recorder.py": "def f():\n    import miles_control.service.store.models\n",
        "service/launch/l.py": "from miles_control.service.api.policy import check\n",
        "spec/config.py": "from miles_control.job.placement import plan\n",
        "client.py": "from miles_control.service.store import Store\nfrom miles_control.service.api.schemas import J\n",
        "job/schedules/sync.py": "from miles_control.job.runtime.job import JobRuntime\n",  # allowed
        "service/store/base.py": "from miles_control.job.status import JobStatus\n",  # allowed
        "cli/main.py": "from miles_control.bench.sweep import run\n",  # allowed
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert back_arrows(tmp_path) == [
        "client.py:1: client → service/store",
        "job/recorder.py:2: job/recorder → service/store",
        "job/runtime/job.py:1: job/runtime → job/schedules",
        "service/launch/l.py:1: service/launch → service/api",
        "spec/config.py:1: spec/config → job/placement",
    ]


# ---- the trainer: one Trainer, built by composition over a small Backend protocol ------------------------------
TRAIN = ROOT / "packages" / "miles-train" / "src" / "miles_train"
BACKEND_CLASSES = {"fsdp2": "FSDP2Backend", "megatron": "MegatronBackend", "torchtitan": "TorchtitanBackend"}


def protocol_members(source: str, protocol: str) -> set[str]:
    """The methods and annotated attributes a Protocol class of `source` declares."""
    [cls] = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == protocol]
    members = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    return members


def class_problems(source: str, name: str, required: set[str]) -> list[str]:
    """Why class `name` of `source` is not a composed implementation of `required`: a base class (the trainer is
    built by composition, not inheritance), or members it lacks (methods, class attributes, `self.x` it sets)."""
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    if not found:
        return [f"{name}: not defined"]
    cls, problems = found[0], []
    if cls.bases:
        problems.append(f"{name}: inherits from {[ast.unparse(b) for b in cls.bases]}")
    has = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            has.add(node.name)
        elif isinstance(node, ast.Assign):
            has |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            has.add(node.target.id)
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in [*targets, *(e for tup in targets if isinstance(tup, ast.Tuple) for e in tup.elts)]:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                has.add(t.attr)
    missing = sorted(required - has)
    if missing:
        problems.append(f"{name}: lacks {missing}")
    return problems


def test_each_backend_is_one_class_implementing_the_backend_protocol():
    """The framework part of a trainer is one class per backend, with no base class, that provides everything
    `miles_train.protocol.Backend` lists; `Trainer` implements `TrainerBackend` (what the schedules call) the same way,
    holding its backend."""
    protocol = (TRAIN / "protocol.py").read_text()
    required = protocol_members(protocol, "Backend")
    assert {"logits", "backward", "step_optimizer", "export_weights", "save", "load", "loss_scale"} <= required
    problems = []
    for folder, name in BACKEND_CLASSES.items():
        problems += class_problems((TRAIN / "backends" / folder / "backend.py").read_text(), name, required)
    trainer = (TRAIN / "backends" / "trainer.py").read_text()
    problems += class_problems(trainer, "Trainer", protocol_members(protocol, "TrainerBackend") | {"backend"})
    assert not problems, "\n".join(problems)


def test_the_backend_check_finds_a_subclass_and_a_missing_method():
    required = {"logits", "save", "loss_scale"}
    ok = "class A:\n    loss_scale = 1.0\n    def logits(self): ...\n    def save(self): ...\n"
    assert class_problems(ok, "A", required) == []
    set_in_init = "class A:\n    def __init__(self):\n        self.loss_scale, x = 2.0, 1\n    def logits(self): ...\n    def save(self): ...\n"
    assert class_problems(set_in_init, "A", required) == []
    assert class_problems(
        "class A(Base):\n    loss_scale = 1\n    def logits(self): ...\n    def save(self): ...\n", "A", required
    ) == ["A: inherits from ['Base']"]
    assert class_problems("class A:\n    def logits(self): ...\n", "A", required) == ["A: lacks ['loss_scale', 'save']"]


def engine_type_branches(path: Path) -> list[str]:
    """Lines of `path` that compare something's `.type` with an engine type's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in ("hf", "sglang") for s in sides)
            typed = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
            if named and typed:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_miles_control_has_no_engine_type_branch(tmp_path):
    """The engine config answers what differs by engine (`miles_rollout/engine_config.py`); miles-control asks it."""
    found = [line for path in sorted(CONTROL.rglob("*.py")) for line in engine_type_branches(path)]
    assert not found, f"engine-type branches in miles-control: {found}"
    planted = tmp_path / "spec.py"
    planted.write_text(
        "def f(spec):\n    if spec.rollout.engine.type == 'sglang':\n        pass\n    return spec.type\n"
    )
    assert engine_type_branches(planted) == ["spec.py:2"]


MAX_MODULE_LINES = 400


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """Modules under `root` longer than `limit` lines, as `path: lines`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)}: {lines}")
    return found


def test_no_module_is_over_400_lines(tmp_path):
    """A module a reader can hold in mind: none of the packages' sources passes 400 lines (split by concern, as
    `engine_config.py` and `algorithm_config.py` were). The check finds a long one."""
    found = [m for dist in PACKAGES.values() for m in long_modules(ROOT / "packages" / dist / "src")]
    assert not found, f"modules over {MAX_MODULE_LINES} lines: {found}"
    (tmp_path / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "short.py").write_text("x = 1\n" * 400)
    assert long_modules(tmp_path) == ["long.py: 401"]
