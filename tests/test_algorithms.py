"""Issue 20 through `miles run` and `miles bench algorithms`: the objectives train the demo, dynamic sampling
keeps zero-variance groups from the trainer and the prompt stream resumes where it stood.

The maths of each objective is checked by hand in packages/miles-train/tests/test_objectives.py and across ranks
and minibatches in test_backend_contract.py; here, whole jobs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.store import Store

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SMALL = ("rollout.engine.type=hf", "rollout.num_prompts_per_step=16", "rollout.eval.num_prompts=50")


def bench(tmp_path: Path, steps: int, algorithms: str, *overrides: str) -> tuple[str, Path]:
    out = tmp_path / "bench"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli",
        "bench",
        "algorithms",
        str(ROOT / "examples" / "arithmetic.yaml"),
    ]
    args += ["--out", str(out), "--steps", str(steps), "--algorithms", algorithms]
    for o in overrides:
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return (out / "report.md").read_text(), out


def rows(report: str, names: list[str]) -> dict[str, list[str]]:
    found = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0] in names and cells[0] not in found:
            found[cells[0]] = cells
    return found


@pytest.mark.extended  # the default run's learning run below reads the same report and plots of four algorithms
def test_the_algorithm_bench_reports_each_algorithm(tmp_path):
    """`miles bench algorithms`, shortened (2 steps, the hf engine): a row per algorithm with every measure, and the
    plots. The objectives whose loss differs most from GRPO's: sequence-level (gspo), leave-one-out (rloo), and
    token-level returns with the KL in the reward (reinforce_pp)."""
    names = ["gspo", "rloo", "reinforce_pp"]
    report, out = bench(tmp_path, 2, ",".join(names), *SMALL, "rollout.eval.every_steps=2", "train.grpo.kl_coef=0.01")
    found = rows(report, names)
    assert set(found) == set(names), report
    for cells in found.values():
        assert cells[1:3] == ["succeeded", "2"], cells
        first, last, best = map(float, re.match(r"([\d.]+) → ([\d.]+) \(([\d.]+)\)", cells[3]).groups())
        assert 0 <= first <= 1 and 0 <= last <= best <= 1, cells
        step_s, train_share, per_trained = (float(c) for c in cells[5:8])
        assert step_s > 0 and 0 < train_share < 1 and per_trained == pytest.approx(1.0, abs=1e-6), cells
    store = Store(f"sqlite:///{out}/bench.db")
    algorithms = [job.spec["train"]["algorithm"]["name"] for job in store.jobs()[0]]
    assert sorted(algorithms) == sorted(names)  # each job ran its own objective
    for png in ("accuracy_vs_step.png", "accuracy_vs_wall.png", "reward_vs_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


# The default run's learning runs: the objectives whose update differs most (a learned critic with GAE, a
# sequence-level ratio, a leave-one-out baseline, token-level returns with the KL in the reward). grpo learns in
# tests/test_demo.py; dr_grpo and reinforce_pp_baseline differ from grpo and reinforce_pp by a normalisation or a
# baseline (checked by hand in test_objectives.py) and learn in the extended tier.
LEARNS_BY_DEFAULT = ["ppo", "gspo", "rloo", "reinforce_pp"]


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(LEARNS_BY_DEFAULT, id="default"),
        pytest.param(["grpo", "dr_grpo", "reinforce_pp_baseline"], id="others", marks=pytest.mark.extended),
    ],
)
def test_every_algorithm_learns_the_demo_on_the_hf_engine(tmp_path, names):
    """Every RL built-in (ppo with its critic included), 20 steps of the demo on the hf engine (seeded, the same
    prompts): held-out accuracy rises above its start by more than 2.5 standard errors (~0.022 each on 500 prompts).
    Measured 0.402 → 0.514 (reinforce_pp_baseline) to 0.544 (reinforce_pp), ppo 0.524; about 2.5 minutes for all
    seven here. On SGLang (docs/results.md) the same 20 steps measured +0.09 (gspo) to +0.15 (dr_grpo). The bench's
    report and plots are read as well: a row per algorithm with every measure, each job its own objective."""
    from miles_train.config import RL_ALGORITHMS

    assert set(names) <= set(RL_ALGORITHMS)
    report, out = bench(tmp_path, 20, ",".join(names), "rollout.engine.type=hf", "rollout.eval.every_steps=20")
    found = rows(report, names)
    assert set(found) == set(names), report
    for name, cells in found.items():
        assert cells[1:3] == ["succeeded", "20"], cells
        first, last, best = map(float, re.match(r"([\d.]+) → ([\d.]+) \(([\d.]+)\)", cells[3]).groups())
        assert last >= first + 0.06 and last <= best <= 1, (name, cells)
        step_s, train_share, per_trained = (float(c) for c in cells[5:8])
        assert step_s > 0 and 0 < train_share < 1 and per_trained == pytest.approx(1.0, abs=1e-6), cells
    store = Store(f"sqlite:///{out}/bench.db")
    assert sorted(job.spec["train"]["algorithm"]["name"] for job in store.jobs()[0]) == sorted(names)
    for png in ("accuracy_vs_step.png", "accuracy_vs_wall.png", "reward_vs_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_dynamic_sampling_keeps_uniform_groups_from_the_trainer(tmp_path):
    """The demo with rollout.dynamic_sampling on the hf engine: every step trains 16 groups of 8, none whose rewards
    all agree; what was dropped and drawn is counted; the checkpoint records where the prompt stream stands."""
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [sys.executable, "-m", "miles_control.cli", "run", str(ROOT / "examples" / "arithmetic.yaml"), "--quiet"]
    for o in (
        *SMALL,
        f"store.url={url}",
        f"output_dir={tmp_path}/runs",
        "schedule.num_steps=3",
        "schedule.checkpoint_every=3",
        "rollout.eval.every_steps=0",
        'rollout.dynamic_sampling={"oversample": 2.0, "max_rounds": 4}',
    ):
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error

    def series(name: str) -> list[float]:
        return [v for _, v in store.metric_series(1, name)]

    assert series("rollout/ds_padded_groups") == [0.0, 0.0, 0.0]
    assert series("rollout/zero_std_group_frac") == [0.0, 0.0, 0.0]  # of the batch the trainer got
    assert series("rollout/ds_used_samples") == [128.0] * 3
    dropped, drawn = series("rollout/ds_dropped_groups"), series("rollout/prompts_drawn")
    assert sum(dropped) > 0, dropped  # the warm-started model answers some prompts always or never right
    for d, n, surplus in zip(dropped, drawn, series("rollout/ds_surplus_groups"), strict=True):
        assert n == 16 + d + surplus  # every drawn prompt is used, dropped, or surplus
    generated, trained = series("rollout/ds_generated_tokens"), series("train/num_tokens")
    assert all(g > t for g, t in zip(generated, trained, strict=True))  # dropped groups cost tokens
    [checkpoint] = list((tmp_path / "runs").rglob("step-3"))
    assert json.loads((checkpoint / "rollout.json").read_text()) == {"prompts_drawn": int(sum(drawn))}


def test_sft_job_learns_from_prompt_response_pairs(tmp_path):
    """`kind: sft` on the example's JSONL (examples/sft): the trainer is given the pairs' responses, and held-out
    accuracy of the model's own answers rises (measured 0.47 → 0.60 → 0.71 at steps 0, 10, 20)."""
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [sys.executable, "-m", "miles_control.cli", "run", str(ROOT / "examples" / "sft" / "arithmetic-sft.yaml")]
    args += ["--log-every", "5"]
    for o in (
        f"store.url={url}",
        f"output_dir={tmp_path}/runs",
        "schedule.num_steps=15",
        "rollout.eval.every_steps=15",
    ):
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "reward" not in result.stderr.split("running")[-1]  # sft progress lines show no reward
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error
    curve = dict(store.metric_series(1, "eval/accuracy"))
    assert curve[15] >= curve[0] + 0.08, curve
    samples = store.samples(1, step=1)
    assert samples and all(s.response == s.label for s in samples)  # the pairs' responses, not generations
    losses = [v for _, v in store.metric_series(1, "train/loss")]
    assert 0 < losses[-1] < losses[0], losses  # the mean negative log-likelihood of the responses falls


def test_distillation_moves_the_student_towards_its_teacher(tmp_path):
    """examples/distill: the demo's model (≈ 0.4 held-out accuracy) distilled from the same model warm-started to
    0.6, on the hf engine: the reverse KL to the teacher (train/teacher_kl) falls. Measured over 20 steps: 0.40 at
    the first step, 0.18 at the last (the mean of the first three 0.47, of the last three 0.18)."""
    sys.path.insert(0, str(ROOT / "examples" / "distill"))
    from make_teacher import build_teacher

    teacher = build_teacher(tmp_path / "teacher")  # cached: the built-in model with another warm-start target
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli",
        "run",
        str(ROOT / "examples" / "distill" / "arithmetic-distill.yaml"),
    ]
    args += ["--quiet"]
    for o in (
        f"store.url={url}",
        f"output_dir={tmp_path}/runs",
        f"train.teacher={teacher}",
        "schedule.num_steps=12",
        "rollout.eval.every_steps=12",
    ):
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error
    kl = [v for _, v in store.metric_series(1, "train/teacher_kl")]
    assert len(kl) == 12 and sum(kl[-3:]) / 3 < 0.75 * sum(kl[:3]) / 3, kl  # closer to the teacher
    assert all(v > 0 for v in kl[:3]), kl  # the student starts away from its teacher: the test has teeth
