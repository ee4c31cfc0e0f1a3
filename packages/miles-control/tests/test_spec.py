import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.spec.config import PathModelConfig
from miles_control.spec.load import SpecError, load_spec
from miles_control.spec.paths import NOT_A_PATH, PATH_FIELDS

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))  # with the task folders (examples/capitals/)


def test_there_are_examples():
    assert EXAMPLES, "examples/ must ship at least one job spec"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_parses(path):
    """Every value the example file sets is the value the job runs with (no key lost, renamed or coerced)."""
    import yaml

    spec = load_spec(path).model_dump(mode="json")

    def leaves(tree, prefix=()):
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, (*prefix, key))
            else:
                yield (*prefix, key), value

    written = list(leaves(yaml.safe_load(path.read_text())))
    assert written, f"{path.name} sets nothing"
    for keys, value in written:
        parsed = spec
        for key in keys:
            parsed = parsed[key]
        if isinstance(value, str) and keys[-1] == "reward" and ":" not in value:
            continue  # a registered reward's name
        loc = tuple(k if not k.isdigit() else "*" for k in keys)
        if loc in PATH_FIELDS and value not in NOT_A_PATH.get(loc, ()):
            assert parsed == str((path.parent / value).resolve()), keys  # resolved against the job file's folder
            continue
        assert parsed == value, (".".join(keys), value, parsed)


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def errors_of(path, overrides=()):
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return info.value.errors


def test_unknown_field_is_named(tmp_path):
    assert errors_of(write(tmp_path, "name: x\nrollout:\n  num_samples_per_promt: 4\n")) == [
        "rollout.num_samples_per_promt: Extra inputs are not permitted; did you mean 'num_samples_per_prompt'?"
    ]
    assert errors_of(write(tmp_path, "name: x\nzzz: 1\n")) == ["zzz: Extra inputs are not permitted"]  # none close


@pytest.mark.parametrize(
    "text, error",
    [
        ("schedule: {type: fully_async, max_stalenes: 2}", "schedule.max_stalenes: Extra inputs are not permitted; "
         "did you mean 'max_staleness'?"),  # a schedule dropped unknown names before: it ran with the default
        ("schedule: {max_staleness: 3}", "schedule.max_staleness: Extra inputs are not permitted; "
         "'max_staleness' is a field of fully_async, not of sync"),
        ("schedule: {update_weights_intrval: 3}", "schedule.update_weights_intrval: Extra inputs are not permitted; "
         "did you mean 'update_weights_interval' (a field of one_step_off, fully_async, not of sync)?"),
        ("train: {backend: {type: fsdp2, tensor_parallel_size: 2}}", "train.backend.tensor_parallel_size: Extra "
         "inputs are not permitted; 'tensor_parallel_size' is a field of megatron, torchtitan, not of fsdp2"),
        ("model: {source: path, path: m, hidden_size: 8}", "model.hidden_size: Extra inputs are not permitted; "
         "'hidden_size' is a field of builtin, not of path"),  # the tag `path` is also a field: not in the location
        ("sync: {transport: disk, dri: /x}", "sync.dri: Extra inputs are not permitted; did you mean 'dir'?"),
    ],
)  # fmt: skip
def test_an_unknown_field_gets_a_hint(tmp_path, text, error):
    assert errors_of(write(tmp_path, f"name: x\n{text}\n")) == [error]


def test_wrong_type_and_range_are_named(tmp_path):
    errors = errors_of(write(tmp_path, "name: x\ntrain:\n  optimizer:\n    lr: -1\nschedule:\n  num_steps: many\n"))
    assert any(e.startswith("train.optimizer.lr: Input should be greater than 0") for e in errors)
    assert any(e.startswith("schedule.num_steps: Input should be a valid integer") for e in errors)


def test_discriminated_choices(tmp_path):
    errors = errors_of(write(tmp_path, "name: x\nmodel:\n  source: s3\n"))
    assert errors[0].startswith("model: Input tag 's3' found using 'source' does not match"), errors
    assert "'hub'" in errors[0]  # the choices listed include the Hub
    errors = errors_of(write(tmp_path, "name: x\nrollout:\n  engine:\n    type: vllm\n"))
    assert errors[0] == (
        "rollout.engine: Input tag 'vllm' found using 'type' does not match any of the expected tags: 'hf', 'sglang'"
    )
    spec = load_spec(write(tmp_path, "name: x\nrollout:\n  engine:\n    type: sglang\n    num_engines: 2\n"))
    assert spec.rollout.engine.type == "sglang" and spec.rollout.engine.num_engines == 2
    spec = load_spec(write(tmp_path, "name: x\nmodel:\n  source: path\n  path: /m\n"))
    assert isinstance(spec.model, PathModelConfig)


def test_missing_name_and_bad_yaml(tmp_path):
    assert errors_of(write(tmp_path, "seed: 1\n")) == ["name: Field required"]
    assert errors_of(write(tmp_path, "name: [x\n"))[0].startswith("line ")
    assert errors_of(write(tmp_path, "- a\n- b\n")) == ["(top level): expected a mapping, got list"]
    assert errors_of(tmp_path / "absent.yaml") == ["no such file"]


def test_overrides(tmp_path):
    path = write(tmp_path, "name: x\n")
    spec = load_spec(path, ["rollout.sampling.temperature=0.5", "train.backend.world_size=2", "sync.dtype=bfloat16"])
    assert spec.rollout.sampling.temperature == 0.5
    assert spec.train.backend.world_size == 2
    assert spec.sync.dtype == "bfloat16"
    assert errors_of(path, ["rollout.bogus=1"]) == ["rollout.bogus: Extra inputs are not permitted"]
    assert errors_of(path, ["novalue"]) == ["'novalue': expected path.to.field=value"]
    assert errors_of(path, ["name.inner=1"]) == ["name.inner: 'name' is a value, not a section"]


def test_config_modules_do_not_import_torch():
    code = (
        "import sys, miles_control.spec.config, miles_control.spec.load, miles_rollout.config, miles_train.config, "
        "miles_sync.config; miles_control.spec.config.JobSpec(name='x'); "  # the default engine looks sglang up
        "bad = [m for m in ('torch', 'transformers', 'ray', 'sglang') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_backend_mapping_names_its_type(tmp_path):
    errors = errors_of(write(tmp_path, "name: t\ntrain:\n  backend:\n    world_size: 2\n"))
    assert any("train.backend" in e and "type: fsdp2 | megatron | torchtitan" in e for e in errors), errors


def test_schedule_and_sync_take_only_their_types_fields(tmp_path):
    """`schedule` and `sync` are unions told apart by `type` / `transport`: a field of another type is refused,
    named as the user wrote it (without the union's tag in the path)."""
    from miles_control.spec.config import FullyAsyncSchedule, SyncSchedule

    assert errors_of(write(tmp_path, "name: x\nschedule:\n  max_staleness: 2\n")) == [
        "schedule.max_staleness: Extra inputs are not permitted; 'max_staleness' is a field of fully_async, not of "
        "sync"  # the default schedule (sync) has no staleness
    ]
    assert errors_of(write(tmp_path, "name: x\nschedule:\n  type: one_step_off\n  buffer_groups: 4\n")) == [
        "schedule.buffer_groups: Extra inputs are not permitted; 'buffer_groups' is a field of fully_async, not of "
        "one_step_off"
    ]
    assert errors_of(write(tmp_path, "name: x\nsync:\n  transport: tensor\n  dir: /w\n")) == [
        "sync.dir: Extra inputs are not permitted; 'dir' is a field of disk, not of tensor"
    ]
    assert errors_of(write(tmp_path, "name: x\nsync:\n  master_port: 29500\n")) == [
        "sync.master_port: Extra inputs are not permitted; 'master_port' is a field of broadcast, p2p, not of disk"
    ]
    errors = errors_of(write(tmp_path, "name: x\nschedule:\n  type: fully_async\n  update_weights_interval: 3\n"))
    assert errors == ["schedule: Value error, max_staleness 1 < update_weights_interval - 1 = 2: between pushes "
                      "even fresh samples would be too stale"]  # fmt: skip
    spec = load_spec(write(tmp_path, "name: x\nschedule:\n  type: fully_async\n  max_staleness: 3\n"))
    assert isinstance(spec.schedule, FullyAsyncSchedule) and spec.schedule.max_staleness == 3
    assert spec.sync.transport == "disk" and isinstance(load_spec(write(tmp_path, "name: x\n")).schedule, SyncSchedule)


def test_a_schedule_stored_before_the_split_still_loads():
    """Specs stored before the schedule types were split hold every type's fields at their defaults."""
    from miles_control.spec.config import JobSpec, SyncSchedule

    stored = {"type": "sync", "num_steps": 5, "update_weights_interval": 1, "max_staleness": 1,
              "stale_policy": "drop", "buffer_groups": None, "async_eval": True, "pause_mode": "in_place"}  # fmt: skip
    schedule = JobSpec.model_validate({"name": "x", "schedule": stored}).schedule
    assert isinstance(schedule, SyncSchedule) and schedule.num_steps == 5
    with pytest.raises(ValueError, match="max_staleness"):  # a value someone set is not silently dropped
        JobSpec.model_validate({"name": "x", "schedule": {**stored, "max_staleness": 3}})


def test_a_schedule_as_another_type_keeps_what_both_have():
    from miles_control.spec.config import FullyAsyncSchedule, OneStepOffSchedule, SyncSchedule, as_schedule

    full = FullyAsyncSchedule(num_steps=7, update_weights_interval=2, max_staleness=4, pause_mode="retract")
    assert as_schedule(full, "sync") == SyncSchedule(num_steps=7, pause_mode="retract")
    assert as_schedule(full, "one_step_off") == OneStepOffSchedule(num_steps=7, update_weights_interval=2,
                                                                   pause_mode="retract")  # fmt: skip
    assert as_schedule(SyncSchedule(num_steps=3), "fully_async") == FullyAsyncSchedule(num_steps=3)
    assert SyncSchedule.live_fields() == ("pause_mode",)
    assert FullyAsyncSchedule.live_fields() == ("update_weights_interval", "max_staleness", "pause_mode",
                                                "buffer_groups", "push_between_batches")  # fmt: skip


def test_a_built_in_models_own_setting_is_refused_on_the_other(tmp_path):
    errors = errors_of(write(tmp_path, "name: x\nmodel:\n  warm_start_call_share: 0.2\n"))
    assert errors == ["model: Value error, warm_start_call_share is a setting of tiny-qwen2-calculator, not of "
                      "tiny-qwen2-arithmetic"]  # fmt: skip
    spec = load_spec(write(tmp_path, "name: x\nmodel:\n  name: tiny-qwen2-calculator\n  warm_start_call_share: 0.2\n"))
    assert spec.model.warm_start_call_share == 0.2
    # A spec goes to the workers and the store as its dump, every field written: it must validate again, the same.
    for text in ("name: x\n", "name: x\nmodel:\n  name: tiny-qwen2-calculator\n"):
        spec = load_spec(write(tmp_path, text))
        assert type(spec).model_validate(spec.model_dump(mode="json")) == spec
    assert (spec.model.warm_start_call_share, spec.model.warm_start_target) == (0.1, 0.9)  # the calculator's defaults


def test_kind_sft_fills_what_supervised_fine_tuning_needs_and_refuses_contradictions():
    from miles_control.spec.config import JobSpec

    spec = JobSpec.model_validate(
        {"name": "s", "kind": "sft", "data": {"source": "file", "path": "pairs.jsonl", "eval_path": "e.jsonl"}}
    )
    assert (spec.rollout.generate, spec.rollout.num_samples_per_prompt) == ("supervised", 1)
    assert spec.train.algorithm.name == "sft" and spec.data.label_key == "response"
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # a stored spec loads as it was
    with pytest.raises(ValueError, match="kind: sft .* but rollout.num_samples_per_prompt is 4"):
        JobSpec.model_validate({"name": "s", "kind": "sft", "rollout": {"num_samples_per_prompt": 4}})
    with pytest.raises(ValueError, match="set kind: sft"):
        JobSpec.model_validate({"name": "s", "rollout": {"generate": "supervised"}})
    with pytest.raises(ValueError, match="kind"):
        JobSpec.model_validate({"name": "s", "kind": "distill"})


def test_dynamic_sampling_and_the_overlong_penalty_are_refused_where_they_mean_nothing():
    from miles_control.spec.config import JobSpec

    with pytest.raises(ValueError, match="but train.algorithm.tis_cap is 2.0"):
        JobSpec.model_validate({"name": "s", "kind": "sft", "train": {"algorithm": {"tis_cap": 2.0}}})
    with pytest.raises(ValueError, match="rollout.sampling.temperature is 0.7"):
        JobSpec.model_validate({"name": "s", "kind": "sft", "rollout": {"sampling": {"temperature": 0.7}}})
    distill = {"algorithm": "distill", "teacher": "t"}
    with pytest.raises(ValueError, match="distill learns from the teacher's logprobs"):
        JobSpec.model_validate({"name": "s", "train": distill, "rollout": {"dynamic_sampling": {}}})
    with pytest.raises(ValueError, match="less than or equal to 8"):
        JobSpec.model_validate({"name": "s", "rollout": {"dynamic_sampling": {"oversample": 100}}})
    episodes = {"generate": "multi_turn", "environment": "m:E", "overlong_penalty": {"buffer": 2}}
    with pytest.raises(ValueError, match="overlong_penalty: measures a single-turn response"):
        JobSpec.model_validate({"name": "s", "rollout": episodes})


def test_relative_paths_are_the_job_files_and_set_values_the_working_directorys(tmp_path, monkeypatch):
    """Issue 55, item 4: a relative data.path resolved against the working directory, not the job file's folder.
    Every path field of the file is now the file's; a --set value is the command line's; a Hub id stays one."""
    jobs, elsewhere = tmp_path / "jobs", tmp_path / "elsewhere"
    (jobs / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (jobs / "data" / "train.jsonl").write_text('{"prompt": "a", "label": "b"}\n')
    spec_file = write(
        jobs,
        "name: x\ndata:\n  source: file\n  path: data/train.jsonl\n  eval_path: data/eval.jsonl\n"
        "  chat_template: tmpl.jinja\ntrain:\n  algorithm: distill\n  teacher: ../teacher\noutput_dir: runs\n",
    )
    monkeypatch.chdir(elsewhere)
    spec = load_spec(spec_file)
    assert spec.data.path == str(jobs / "data" / "train.jsonl")
    assert spec.data.eval_path == str(jobs / "data" / "eval.jsonl")  # not there yet: still the file's folder
    assert spec.data.chat_template == str(jobs / "tmpl.jinja")
    assert spec.train.teacher == str(tmp_path / "teacher") and spec.output_dir == str(jobs / "runs")
    spec = load_spec(spec_file, ["data.path=mine.jsonl", "output_dir=/abs/runs"])
    assert spec.data.path == str(elsewhere / "mine.jsonl") and spec.output_dir == "/abs/runs"
    assert spec.data.eval_path == str(jobs / "data" / "eval.jsonl")  # untouched by the --set values
    hub = write(jobs, "name: x\ndata:\n  source: hf\n  path: org/dataset\n  chat_template: model\n")
    spec = load_spec(hub)
    assert spec.data.path == "org/dataset" and spec.data.chat_template == "model"  # a Hub id, a named choice
    local = write(jobs, "name: x\ndata:\n  source: hf\n  path: data/train.jsonl\n")
    assert load_spec(local).data.path == str(jobs / "data" / "train.jsonl")  # names a file beside the job file


def test_a_wrong_kind_hides_no_other_error_of_its_section(tmp_path):
    """A section whose `type` names no kind is refused for it, and its other fields are still checked: an error every
    kind would report is reported too (not found only after the type is fixed); a field valid under some kind is not
    an error."""
    text = "name: x\nschedule: {type: syncc, num_steps: -1}\ntrain: {backend: {type: fsdp3, world_size: 0}}\n"
    errors = errors_of(write(tmp_path, text))
    assert any(e.startswith("schedule: Input tag 'syncc'") for e in errors), errors
    assert "schedule.num_steps: Input should be greater than 0" in errors, errors
    assert "train.backend.world_size: Input should be greater than or equal to 1" in errors, errors
    errors = errors_of(write(tmp_path, "name: x\nschedule: {type: syncc, max_staleness: 2}\n"))
    assert len(errors) == 1 and errors[0].startswith("schedule: Input tag"), errors  # fully_async has it


def test_kind_sft_with_a_section_that_is_not_a_mapping_is_a_validation_error():
    """Found by the API fuzzer: `kind: sft` with `rollout: -64275` raised a TypeError (a 500 from
    /api/v1/jobs/validate) where it must be a validation error naming the section."""
    from pydantic import ValidationError

    from miles_control.spec.config import JobSpec

    for section in ("rollout", "train"):
        with pytest.raises(ValidationError, match=section):
            JobSpec.model_validate({"name": "x", "kind": "sft", section: -64275})
