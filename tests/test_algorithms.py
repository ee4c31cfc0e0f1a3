"""Issue 20 through `miles run` and `miles bench algorithms`: the objectives train the demo, dynamic sampling
keeps zero-variance groups from the trainer and the prompt stream resumes where it stood.

The maths of each objective is checked by hand in packages/miles-train/tests/test_objectives.py and across ranks
and minibatches in test_backend_contract.py; here, whole jobs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.bench.algorithms import AlgorithmResult, algorithm_result
from miles_control.bench.sweep import recorded_variants
from miles_control.service.store import Store
from miles_control.service.summary import summarize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SMALL = ("rollout.engine.type=hf", "rollout.num_prompts_per_step=16", "rollout.eval.num_prompts=50")


def bench(tmp_path: Path, steps: int, algorithms: str, *overrides: str) -> Path:
    """Run `miles bench algorithms`; returns its output folder."""
    out = tmp_path / "bench"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "bench",
        "algorithms",
        str(ROOT / "examples" / "arithmetic.yaml"),
    ]
    args += ["--out", str(out), "--steps", str(steps), "--algorithms", algorithms]
    for o in overrides:
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def results(out: Path) -> dict[str, AlgorithmResult]:
    """Each algorithm's measures, read back from the jobs the bench recorded in its store (not from its report)."""
    store = Store(f"sqlite:///{out}/bench.db")
    jobs = recorded_variants(store)
    return {name: algorithm_result(store, name, summarize(store, job_id)) for name, job_id in jobs.items()}


def check_measures(r: AlgorithmResult, steps: int) -> tuple[float, float, float]:
    """Assert that the algorithm's job ran every step with every measure; returns its held-out accuracy first, last
    and best (evaluated before training and after the last step)."""
    assert (r.summary.status, r.summary.num_steps) == ("succeeded", steps), (r.name, r.summary)
    accuracy = [a for _, a in r.summary.eval_accuracy]
    assert len(accuracy) == 2 and all(0 <= a <= 1 for a in accuracy), (r.name, r.summary.eval_accuracy)
    assert r.step_s > 0 and 0 < r.train_share < 1, (r.name, r.step_s, r.train_share)
    assert r.generated_per_trained == pytest.approx(1.0, abs=1e-6), r.name
    return accuracy[0], accuracy[-1], max(accuracy)


@pytest.mark.extended  # the default run's learning run below reads the same results and plots of four algorithms
def test_the_algorithm_bench_reports_each_algorithm(tmp_path):
    """`miles bench algorithms`, shortened (2 steps, the hf engine): a job per algorithm with every measure, and the
    plots. The objectives whose loss differs most from GRPO's: sequence-level (gspo), leave-one-out (rloo), and
    token-level returns with the KL in the reward (reinforce_pp)."""
    names = ["gspo", "rloo", "reinforce_pp"]
    out = bench(tmp_path, 2, ",".join(names), *SMALL, "rollout.eval.every_steps=2", "train.algorithm.kl_coef=0.01")
    found = results(out)
    assert set(found) == set(names), found
    for r in found.values():
        check_measures(r, 2)
    store = Store(f"sqlite:///{out}/bench.db")
    algorithms = {name: store.job(r.summary.job_id).spec["train"]["algorithm"]["name"] for name, r in found.items()}
    assert algorithms == {name: name for name in names}  # each job ran its own objective
    report = (out / "report.md").read_text()
    assert all(f"| {name} | succeeded | 2 |" in report for name in names), report
    for png in ("accuracy_vs_step.png", "accuracy_vs_wall.png", "reward_vs_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


# The default run's learning runs: the objectives whose update differs most from grpo's (a learned critic with
# GAE, a sequence-level ratio). grpo learns in tests/test_demo.py; the others differ from these by a baseline, a
# normalisation or where the KL goes (each checked by hand in test_objectives.py and across ranks in
# test_backend_contract.py) and learn in the extended tier.
LEARNS_BY_DEFAULT = ["ppo", "gspo"]


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(LEARNS_BY_DEFAULT, id="default"),
        pytest.param(
            ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"],
            id="others",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_every_algorithm_learns_the_demo_on_the_hf_engine(tmp_path, names):
    """Every RL built-in (ppo with its critic included), 20 steps of the demo on the hf engine (seeded, the same
    prompts): held-out accuracy rises above its start by more than 2.5 standard errors (~0.022 each on 500 prompts).
    Measured 0.402 → 0.514 (reinforce_pp_baseline) to 0.544 (reinforce_pp), ppo 0.524; about 2.5 minutes for all
    seven here. On SGLang (docs/results.md) the same 20 steps measured +0.09 (gspo) to +0.15 (dr_grpo). The bench's
    results are read back from its store (a job per algorithm with every measure, each its own objective), and its
    plots."""
    from miles_train.config import RL_ALGORITHMS

    assert set(names) <= set(RL_ALGORITHMS)
    out = bench(tmp_path, 20, ",".join(names), "rollout.engine.type=hf", "rollout.eval.every_steps=20")
    found = results(out)
    assert set(found) == set(names), found
    for name, r in found.items():
        first, last, best = check_measures(r, 20)
        assert last >= first + 0.06 and last <= best, (name, r.summary.eval_accuracy)
    store = Store(f"sqlite:///{out}/bench.db")
    assert {name: store.job(r.summary.job_id).spec["train"]["algorithm"]["name"] for name, r in found.items()} == {
        name: name for name in names
    }
    for png in ("accuracy_vs_step.png", "accuracy_vs_wall.png", "reward_vs_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_dynamic_sampling_keeps_uniform_groups_from_the_trainer(tmp_path):
    """The demo with rollout.dynamic_sampling on the hf engine: every step trains 16 groups of 8, none whose rewards
    all agree; what was dropped and drawn is counted; the checkpoint records where the prompt stream stands."""
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "arithmetic.yaml"),
        "--quiet",
    ]
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
    assert len(generated) == 3, generated  # a step each: something to compare
    assert all(g > t for g, t in zip(generated, trained, strict=True))  # dropped groups cost tokens
    [checkpoint] = list((tmp_path / "runs").rglob("step-3"))
    assert json.loads((checkpoint / "rollout.json").read_text()) == {"prompts_drawn": int(sum(drawn))}


def test_sft_job_learns_from_prompt_response_pairs(tmp_path):
    """`kind: sft` on the example's JSONL (examples/sft): the trainer is given the pairs' responses, and held-out
    accuracy of the model's own answers rises (measured 0.47 → 0.60 → 0.71 at steps 0, 10, 20)."""
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "sft" / "arithmetic-sft.yaml"),
    ]
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
        "miles_control.cli.main",
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
