"""A job with images, end to end on the hf engine and the fsdp2 trainer: training prompts from a Parquet file with a
`datasets` Image column, held-out ones from a JSONL file of image paths, the vision tower frozen (`train.freeze`)
and so not pushed again after the first push, every push checked, the trainer's logprobs the engine's. What Miles
cannot do with images yet is refused before anything starts, naming the field."""

import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.service.store import Store

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("PIL", reason="Pillow is not installed (the vision extra)")

# a reward with some signal for a random model (it rarely says the count): 1 for an answer that starts with a digit
REWARD = "def starts_with_digit(sample):\n    return float(sample.response_text[:1].isdigit())\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The counting example made small: its data, a tiny Qwen2.5-VL, its job file and a reward module, in one folder."""
    folder = tmp_path_factory.mktemp("vision")
    subprocess.run([sys.executable, str(ROOT / "examples" / "vision" / "make_task.py"), "--out", str(folder),
                    "--num-train", "32", "--num-eval", "8", "--warm-start-target", "0"], check=True, capture_output=True,
                   timeout=300)  # fmt: skip
    (folder / "counting.yaml").write_text((ROOT / "examples" / "vision" / "counting.yaml").read_text())
    (folder / "vision_reward.py").write_text(REWARD)
    return folder


def _run(folder: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "miles_control.cli.main", "run", str(folder / "counting.yaml"), "--quiet",
            "--set", f"store.url=sqlite:///{tmp_path}/miles.db", "--set", f"output_dir={tmp_path}/runs"]  # fmt: skip
    for override in overrides:
        args += ["--set", override]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)


@pytest.mark.slow
def test_a_job_with_images_trains_with_the_tower_frozen_and_checks_every_push(task, tmp_path):
    result = _run(task, tmp_path, "schedule.num_steps=2", "rollout.eval.every_steps=1", "rollout.eval.num_prompts=8",
                  "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
                  "rollout.reward=vision_reward:starts_with_digit")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    assert store.job(1).status == "succeeded", store.job(1).error
    series = {name: dict(store.metric_series(1, name)) for name in (
        "sync/bytes", "sync/tensors", "sync/unchanged_tensors", "sync/weights_match", "train/logprob_diff",
        "rollout/reward_mean", "eval/accuracy")}  # fmt: skip
    assert series["sync/weights_match"] == {1: 1.0, 2: 1.0}  # the engine holds the trainer's weights, tower included
    assert all(d < 1e-5 for d in series["train/logprob_diff"].values()), series  # fp32: the same model, same images
    assert 0 < series["rollout/reward_mean"][1] < 1  # a signal to learn from: the trained tensors all move
    assert set(series["eval/accuracy"]) == {0, 1, 2}  # the held-out JSONL prompts were evaluated
    from miles_train.freeze import check_patterns, parameter_names

    names = parameter_names(task / "tiny-vlm")
    tower = check_patterns(names, ["model.visual.*"])
    assert series["sync/tensors"][1] == len(names)  # the first push is whole: the tower, then the text model
    assert series["sync/unchanged_tensors"][2] == len(tower)  # then the frozen tower is held back
    assert series["sync/tensors"][2] == len(names) - len(tower)
    assert series["sync/bytes"][2] < series["sync/bytes"][1]
    stored = store.samples(1)  # for the dashboard: each sample's image beside its text
    assert stored and all(len(s.images) == 1 and s.images[0].startswith("data:image/png;base64,") for s in stored)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["rollout.engine.type=sglang"], "rollout.engine.type: hf"),
        (["train.backend.type=megatron", "train.freeze=[]"], "train.backend.type: megatron rebuilds text models only"),
        (
            ["kind=sft", "rollout.num_samples_per_prompt=1", "data.label_key=label"],
            "rollout.generate: supervised does not carry images",
        ),
        (["data.chat_template=none"], "prompt 1 has images; set data.chat_template"),
    ],
)
def test_what_images_cannot_do_yet_is_refused_before_start(task, tmp_path, overrides, said):
    result = _run(task, tmp_path, *overrides)
    assert result.returncode != 0
    told = " ".join(result.stderr.split())  # the console wraps long lines
    assert said in told, told[-3000:]
    assert "starting Ray" not in result.stdout + result.stderr


def test_an_unreadable_image_is_refused_before_start_naming_its_row_and_column(task, tmp_path):
    (task / "data" / "eval_images" / "3.png").write_bytes(b"not an image")
    try:
        result = _run(task, tmp_path)
    finally:  # the module's other tests read the same folder
        subprocess.run([sys.executable, str(ROOT / "examples" / "vision" / "make_task.py"), "--out", str(task),
                        "--num-train", "32", "--num-eval", "8", "--warm-start-target", "0"], check=True,
                       capture_output=True)  # fmt: skip
    assert result.returncode != 0
    told = " ".join(result.stderr.split())
    assert "eval.jsonl:line 4: images[0]: not a readable image" in told, told[-3000:]
    assert "starting Ray" not in result.stdout + result.stderr


@pytest.mark.extended  # a learning run, about 3 minutes here (the warm start 25 s, GRPO's 200 steps)
def test_the_counting_task_learns_on_the_hf_engine(tmp_path):
    """examples/vision as shipped, shortened: a tiny Qwen2.5-VL warm-started to 0.4 greedy held-out accuracy, then
    GRPO with the vision tower frozen; the held-out accuracy rises well above its start (docs/results.md#vision:
    seeds 0–2 measured)."""
    folder = tmp_path / "task"
    subprocess.run([sys.executable, str(ROOT / "examples" / "vision" / "make_task.py"), "--out", str(folder)],
                   check=True, capture_output=True, timeout=900)  # fmt: skip
    (folder / "counting.yaml").write_text((ROOT / "examples" / "vision" / "counting.yaml").read_text())
    steps = 200
    result = _run(folder, tmp_path, f"schedule.num_steps={steps}", "rollout.eval.every_steps=50")
    assert result.returncode == 0, result.stderr[-4000:]
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    assert store.job(1).status == "succeeded", store.job(1).error
    curve = dict(store.metric_series(1, "eval/accuracy"))
    assert curve[steps] >= curve[0] + 0.3, curve
    assert all(v == 1.0 for _, v in store.metric_series(1, "sync/weights_match"))


def test_several_ranks_train_the_tower_only_when_every_prompt_has_an_image(task):
    """A rank whose rows have no image computes no gradient for the tower; FSDP2 would reduce different parameter
    sets on different ranks. Refused before start unless the tower is frozen or every prompt has an image."""
    from transformers import AutoConfig

    from miles_control.job.preflight import JobCheckError
    from miles_control.job.vision_check import check_vision
    from miles_control.spec.config import JobSpec
    from miles_rollout.types import PromptRecord

    hf_config = AutoConfig.from_pretrained(task / "tiny-vlm")
    image, text = PromptRecord("how many?", "1", images=[b"png"]), PromptRecord("1+1=", "2")

    def spec(freeze):
        return JobSpec.model_validate({"name": "x", "model": {"source": "path", "path": str(task / "tiny-vlm")},
                                       "train": {"backend": {"type": "fsdp2", "world_size": 2}, "freeze": freeze}})  # fmt: skip

    with pytest.raises(JobCheckError, match="with 2 trainer ranks the vision tower trains only when every prompt"):
        check_vision(spec([]), hf_config, task / "tiny-vlm", [image, text])
    check_vision(spec(["model.visual.*"]), hf_config, task / "tiny-vlm", [image, text])  # a frozen tower: any mix
    check_vision(spec([]), hf_config, task / "tiny-vlm", [image, image])  # every rank's rows have images
