"""`rollout.reward: code` in a whole job: model-written programs run in the sandbox against each record's tests,
every execution's outcome a metric; and a sandbox that cannot run is refused before any engine starts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_control.service.store import Store
from miles_rollout.code_reward import cases_of, program_of
from miles_rollout.rewards import RewardError
from miles_rollout.types import Sample

ROOT = Path(__file__).resolve().parents[1]


def _records() -> list[dict]:
    """Small functions with tests in both shapes; the tiny arithmetic model writes digits, not code."""
    records = []
    for a in range(12):
        records.append(
            {"prompt": f"{a}+{a}=", "label": "", "tests": {"stdin_stdout": [{"input": "", "output": str(2 * a)}]}}
        )
        records.append(
            {"prompt": f"{a}+1=", "label": "", "tests": {"asserts": [f"assert int(str({a} + 1)) == {a + 1}"]}}
        )
    return records


def _job(tmp_path: Path, **sandbox) -> list[str]:
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    spec = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text())
    spec.update(name="code", data={"source": "file", "path": "tasks.jsonl", "num_eval": 4})
    spec["rollout"].update(reward="code", num_prompts_per_step=4, num_samples_per_prompt=4, code_sandbox=sandbox)
    spec["rollout"]["eval"] = {"every_steps": 2, "num_prompts": 4}
    spec["schedule"].update(num_steps=2, checkpoint_every=0)
    spec["store"] = {"url": f"sqlite:///{tmp_path}/miles.db"}
    spec["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return [sys.executable, "-m", "miles_control.cli.main", "run", str(tmp_path / "job.yaml"), "--quiet"]


def _sample(response: str, **metadata) -> Sample:
    return Sample(0, "p", "", [1], [2], [0.0], [1], response_text=response, metadata=metadata)


def test_the_program_and_the_cases_of_a_sample():
    assert program_of("Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```") == "print(2)\n"
    assert program_of("print(3)") == "print(3)"
    assert cases_of(_sample("", tests={"asserts": ["assert True"]})) == {"asserts": ["assert True"]}
    with pytest.raises(RewardError, match="no tests"):
        cases_of(_sample(""))
    with pytest.raises(RewardError, match=r"stdin_stdout\[0\] needs an output"):
        cases_of(_sample("", tests={"stdin_stdout": [{"input": "1"}]}))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/sandbox.sh)")
def test_a_job_scores_programs_in_the_sandbox_and_reports_each_outcome(tmp_path):
    result = subprocess.run(_job(tmp_path, workers=2), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    assert store.job(1).status == "succeeded", store.job(1).error
    for step in (1, 2):
        shares = {
            m.name: m.value for m in store.metrics(1, None) if m.step == step and m.name.startswith("reward/code_")
        }
        assert set(shares) == {f"reward/code_{o}" for o in
                               ("passed", "failed", "timeout", "memory", "crashed", "output_limit", "sandbox_error")}, shares  # fmt: skip
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares["reward/code_sandbox_error"] == 0.0  # the sandbox ran every program
    rewards = [m.value for m in store.metrics(1, ["rollout/reward_mean"])]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)


@pytest.mark.slow
def test_a_sandbox_that_cannot_run_is_refused_before_engines_start(tmp_path):
    command = _job(tmp_path, python="/opt/python3")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode != 0
    said = " ".join(result.stderr.split())  # the console wraps long lines
    assert "JobCheckError: rollout.code_sandbox.python: '/opt/python3' is not an executable absolute path" in said, said


def test_the_coding_examples_tasks_are_make_tasks_output_and_each_has_asserts():
    """examples/coding/tasks.jsonl is what make_tasks.py writes (rerun it after changing the families), and every
    record has the asserts shape `reward: code` reads, with one function per record."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tasks", ROOT / "examples" / "coding" / "make_tasks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [json.loads(line) for line in (ROOT / "examples" / "coding" / "tasks.jsonl").read_text().splitlines()]
    assert rows == module.records()
    names = set()
    for row in rows:
        tests = cases_of(_sample("", tests=row["tests"]))
        name = row["prompt"].split("`")[1].split("(")[0]
        assert all(line.startswith(f"assert {name}(") for line in tests["asserts"]), row
        names.add(name)
    assert len(names) == len(rows)  # a held-out record never asks for a function a training record asks for
