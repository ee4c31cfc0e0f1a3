"""YAML that users supply (spec files, `--set` values, `miles schedule set` values) is parsed within bounds: an
alias bomb, deep nesting, a huge file or a scalar PyYAML cannot build is a clear error, fast, never a traceback, a
hang or gigabytes of memory (issue 54, second round)."""

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from miles_control.spec.load import SpecError, apply_override, load_spec

ROOT = Path(__file__).resolve().parents[3]
MILES = [sys.executable, "-m", "miles_control.cli.main"]


def alias_bomb(levels: int = 9, width: int = 9, indent: str = "") -> str:
    """ "Billion laughs": `width`**`levels` strings once the aliases expand, in a few hundred bytes."""
    lines = [f"{indent}a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{indent}a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def flow_bomb(levels: int = 9, width: int = 9) -> str:
    """The same bomb on one line, as a `--set` value."""
    items = [f"&a0 [{', '.join(['lol'] * width)}]"]
    items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


def refused_fast(load) -> Exception:
    """What `load()` raised; it must raise within a second, allocating under 20 MB on the way."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - returned to the test to check
        error = exc
    else:
        error = None
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert error is not None, "accepted"
    assert elapsed < 1.0 and peak < 20 << 20, (elapsed, peak)
    return error


def test_an_alias_bomb_in_a_spec_file_is_refused_fast(tmp_path):
    # under a field that takes any mapping, so validation alone would not refuse it: dumping the spec would expand it
    spec = tmp_path / "bomb.yaml"
    spec.write_text("name: bomb\nrollout:\n  environment_args:\n" + alias_bomb(indent="    "))
    error = refused_fast(lambda: load_spec(spec))
    assert isinstance(error, SpecError)
    assert "invalid YAML (more than 10000 values, each alias (*name) counted as all it stands for)" in str(error), error


def test_an_alias_bomb_in_a_set_value_is_refused_fast():
    error = refused_fast(lambda: apply_override({"name": "x"}, "rollout.environment_args.x=" + flow_bomb()))
    assert isinstance(error, SpecError) and error.source == "--set" and "more than 10000 values" in str(error)


@pytest.mark.parametrize(
    "text,problem",
    [
        ("name: x\nseed: &s [*s]\n", "alias *s refers to itself"),
        ("name: x\nseed: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64 levels"),
        ("name: x\nseed: 2024-02-30\n", "line 2: invalid YAML (cannot read this value (day is out of range"),
        ("name: x\nseed: " + "9" * 5000 + "\n", "line 2: invalid YAML (cannot read this value (Exceeds the limit"),
        ("name: x\nseed: !!int ''\n", "line 2: invalid YAML (cannot read this value"),
        ("name: x\nseed: !!timestamp soon\n", "line 2: invalid YAML (cannot read this value"),
        ("name: x\nseed: !!float ''\n", "line 2: invalid YAML (cannot read this value"),
    ],
    ids=["cycle", "deep", "bad-date", "long-int", "empty-int", "bad-timestamp", "empty-float"],
)
def test_yaml_pyyaml_cannot_build_is_a_spec_error_naming_the_line(tmp_path, text, problem):
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    error = refused_fast(lambda: load_spec(spec))
    assert isinstance(error, SpecError) and problem in str(error), error


def test_a_spec_file_over_the_size_limit_is_refused_unread(tmp_path):
    spec = tmp_path / "huge.yaml"
    spec.write_text("name: x\n" + "# padding\n" * 30_000)
    with pytest.raises(SpecError, match="longer than the limit of 262144 bytes"):
        load_spec(spec)


def test_every_shipped_spec_loads_as_before():
    """The bounds are far from any real spec: each example parses to what yaml.safe_load gives."""
    from miles_control.spec.yaml_safe import load_yaml

    examples = sorted((ROOT / "examples").rglob("*.yaml"))
    assert examples
    for path in examples:
        assert load_yaml(path.read_text()) == yaml.safe_load(path.read_text()), path
    assert load_spec(ROOT / "examples" / "arithmetic.yaml", ["rollout.sampling.top_p=0.9"]).name


def run_miles(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MILES_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    return subprocess.run([*MILES, *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_invalid_yaml_in_set_or_in_the_file_exits_2_naming_it(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: x\nstore:\n  url: sqlite:///{tmp_path}/m.db\n")
    result = run_miles(tmp_path, "run", str(spec), "--quiet", "--set", "a.b=[1,")
    assert result.returncode == 2, result.stderr
    assert "'a.b=[1,': invalid YAML" in result.stderr and "Traceback" not in result.stderr
    spec.write_text("name: bomb\n" + alias_bomb())
    result = run_miles(tmp_path, "run", str(spec), "--quiet")
    assert result.returncode == 2 and "more than 10000 values" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "cache").exists()  # nothing was started
    result = run_miles(tmp_path, "schedule", "set", "1", "max_staleness=[1,", "--store", f"sqlite:///{tmp_path}/m.db")
    assert result.returncode == 2, result.stderr
    assert "'max_staleness=[1,': invalid YAML" in result.stderr and "Traceback" not in result.stderr


def test_the_dashboards_launch_form_parses_with_the_bounded_loader():
    """The dashboard's pasted spec goes through the same loader: a bomb is a syntax error on the form, fast."""
    import time

    from miles_dashboard.specs import SpecSyntaxError, parse_yaml

    start = time.perf_counter()
    with pytest.raises(SpecSyntaxError):
        parse_yaml("name: bomb\nrollout:\n  environment_args:\n" + alias_bomb(indent="    "))
    assert time.perf_counter() - start < 1.0
    assert parse_yaml("name: ok\nschedule: {num_steps: 3}") == {"name": "ok", "schedule": {"num_steps": 3}}
