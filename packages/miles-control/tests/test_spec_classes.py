"""Issue 54, findings 1, 3 and 6 as classes: every path field of a spec, every number that sizes memory, time,
processes or disk, every number field against booleans. The walks go over the spec's models (every kind of every
section), so a field added later without its rule fails here."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel

from miles_control.service.api.policy import LIMITED, UNSIZED, check_spec
from miles_control.service.settings import JobLimits, ServerSettings
from miles_control.spec.config import JobSpec
from miles_control.spec.paths import PATH_FIELDS


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(_is_list(a) for a in typing.get_args(annotation))


def spec_fields(model: type[BaseModel] = JobSpec, loc: tuple[str, ...] = ()):
    """(location, field) of every field of the spec, through every kind of each section; a list's items are `*`."""
    for name, field in model.model_fields.items():
        here = (*loc, name)
        yield here, field
        for inner in _models(field.annotation):
            yield from spec_fields(inner, (*here, "*") if _is_list(field.annotation) else here)


def _types(annotation: Any) -> set[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return {type(v) for v in typing.get_args(annotation)}
    args = typing.get_args(annotation)
    return set().union(*(_types(a) for a in args)) if args else {annotation}


def _upper_bound(field) -> bool:
    return any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None for m in field.metadata)


def test_every_path_like_field_is_in_the_path_table():
    """A string field whose name or description says file/folder/path must be in spec.paths.PATH_FIELDS (confined
    over the API, resolved against the job file) or be a field that is not opened as a local path."""
    not_paths = {  # dotted paths of code, Hub ids, URLs: never opened as local files
        ("rollout", "reward"), ("rollout", "generate"), ("rollout", "environment"), ("data", "map"),
        ("train", "algorithm", "name"), ("model", "name"), ("store", "url"), ("tracking", "*", "tracking_uri"),
        ("rollout", "remote_reward", "url"), ("ray", "address"), ("data", "prompt_key"), ("data", "label_key"),
    }  # fmt: skip
    not_paths |= {("model", "dtype"), ("sync", "compression"), ("tracking", "*", "project")}  # "a folder" in prose
    not_paths.add(("rollout", "code_sandbox", "python"))  # an interpreter under /usr, checked by the sandbox itself
    # a hub environment's module id, ASGI app and server URL: imported or reached, never opened as files
    not_paths |= {
        ("rollout", "environment", "id"),
        ("rollout", "environment", "app"),
        ("rollout", "environment", "url"),
    }
    found = set()
    for loc, field in spec_fields():
        if str not in _types(field.annotation) or loc in not_paths:
            continue
        named = loc[-1].endswith(("path", "dir", "file", "folder")) or loc[-1] in ("teacher", "chat_template")
        if named or "folder" in (field.description or "").lower():
            found.add(loc)
    assert found - set(PATH_FIELDS) == set(), "path-like fields missing from spec.paths.PATH_FIELDS"
    assert set(PATH_FIELDS) - {loc for loc, _ in spec_fields()} == set(), "PATH_FIELDS names fields that do not exist"


def test_every_sizing_number_is_bounded():
    """Finding 3: a number of a spec either has an upper bound in the spec, is bounded by a server limit
    (MILES_LIMITS__*), or sizes nothing (rates, coefficients, seeds: api.policy.UNSIZED)."""
    limited = {loc for locs in LIMITED.values() for loc in locs}
    unbounded = []
    for loc, field in spec_fields():
        types = _types(field.annotation)
        if not types & {int, float} or bool in types:
            continue
        if loc in limited or _upper_bound(field) or loc[-1] in UNSIZED:
            continue
        unbounded.append(".".join(loc))
    assert unbounded == []
    assert set(LIMITED) == set(JobLimits.model_fields)  # every limit bounds something, every bound is a limit
    spec_locs = {loc for loc, _ in spec_fields()}
    assert limited - spec_locs == set(), "LIMITED names fields that do not exist"


@pytest.mark.parametrize(
    "loc, value",
    [
        (("data", "num_train"), 10**12),
        (("model", "warm_start_batch_size"), 10**9),
        (("data", "num_eval"), 10**9),
        (("rollout", "eval", "num_prompts"), 10**9),
        (("sync", "keep_versions"), 10**6),
        (("schedule", "keep_checkpoints"), 10**6),
        (("rollout", "engine", "num_threads"), 10**5),
        (("train", "backend", "num_threads"), 10**5),
        (("rollout", "engine", "startup_timeout_s"), 1e9),
        (("model", "num_heads"), 10**6),
    ],
)
def test_sizing_fields_over_a_limit_are_refused_over_the_api(tmp_path, loc, value):
    """The fields the probe sized up (and their kin) are refused at submission, naming the field and the limit."""
    data: dict[str, Any] = {"name": "big"}
    node = data
    for key in loc[:-1]:
        node = node.setdefault(key, {})
    node[loc[-1]] = value
    if loc[:2] == ("rollout", "engine"):
        node["type"] = "sglang" if loc[-1].endswith("timeout_s") else "hf"
    if loc[:2] == ("train", "backend"):
        node["type"] = "fsdp2"
    spec = JobSpec.model_validate(data)
    _, problems = check_spec(spec, ServerSettings(data_dir=tmp_path, cpus=4))
    where = [p["loc"][2:] for p in problems if "above this server's limit" in p["msg"]]
    assert list(loc) in where, problems
    assert any("MILES_LIMITS__" in p["msg"] for p in problems)


def test_numbers_refuse_booleans_in_every_section():
    """Finding 6: `num_steps: true` was read as 1. Every number field of every kind refuses true and false."""
    checked = 0
    for loc, field in spec_fields():
        types = _types(field.annotation)
        if "*" in loc or not types & {int, float} or bool in types:
            continue
        data: dict[str, Any] = {"name": "x"}
        node = data
        for key in loc[:-1]:
            node = node.setdefault(key, {})
        node[loc[-1]] = True
        with pytest.raises(ValueError, match="expected a number, got true"):
            _validate_some_kind(data, loc)
        checked += 1
    assert checked > 60  # every section's numbers were reached


def _validate_some_kind(data: dict[str, Any], loc: tuple[str, ...]) -> None:
    """Validate `data`, trying each kind of the section that holds the field (a field of one engine, backend,
    schedule or transport) until one has it: the error must still be the boolean's."""
    kinds = {
        ("rollout", "engine"): ("type", ["hf", "sglang"]),
        ("train", "backend"): ("type", ["fsdp2", "megatron", "torchtitan"]),
        ("schedule",): ("type", ["sync", "one_step_off", "fully_async"]),
        ("sync",): ("transport", ["disk", "tensor", "broadcast", "p2p", "inproc"]),
        ("model",): ("source", ["builtin", "path", "package", "hub"]),
        ("rollout", "environment"): ("type", ["verifiers", "openenv"]),
    }
    for section, (tag, names) in kinds.items():
        if loc[: len(section)] == section and len(loc) == len(section) + 1:
            node = data
            for key in section:
                node = node[key]
            errors = []
            for name in names:
                node[tag] = name
                try:
                    JobSpec.model_validate(data)
                except ValueError as exc:
                    if "expected a number, got true" in str(exc):
                        raise
                    errors.append(str(exc))
            raise AssertionError(f"{'.'.join(loc)}: no kind refused the boolean: {errors}")
    JobSpec.model_validate(data)


def test_revisions_that_are_paths_are_refused():
    """Finding 6: `model.revision` and `data.revision` accepted `../` paths (the cache keeps a revision as a file
    name). Both now take what git names refs: branches, tags, `refs/pr/N`, commits."""
    for bad in ("../x", "refs/../../etc", "/abs", "a//b", ".hidden", "x\\y", "main.lock", "a b"):
        with pytest.raises(ValueError, match="is not a revision"):
            JobSpec.model_validate({"name": "x", "model": {"source": "hub", "name": "o/m", "revision": bad}})
        with pytest.raises(ValueError, match="is not a revision"):
            JobSpec.model_validate({"name": "x", "data": {"source": "hf", "path": "o/d", "revision": bad}})
    for good in ("main", "v1.0", "refs/pr/1", "0123456789abcdef0123456789abcdef01234567"):
        JobSpec.model_validate({"name": "x", "model": {"source": "hub", "name": "o/m", "revision": good}})


@pytest.mark.parametrize("name", ["private", "a/b", "notes.txt", "folder/"])
def test_a_hub_shaped_path_is_never_opened_from_the_servers_folder(tmp_path, monkeypatch, name):
    """Finding 1: `data.source: hf` with a Hub-id-shaped path that is not under data_root was exempted as a Hub id,
    then opened relative to the driver's working directory, and its lines came back through the samples API. Now
    it is looked up in the Hugging Face cache only (offline here: not found), whatever lies in the working
    directory."""
    from miles_control.job.data import load_job_prompts
    from miles_control.job.hub import HubError

    server_dir = tmp_path / "server"
    target = server_dir / name / "rows.jsonl" if name.endswith("/") else server_dir / name  # a file or a folder
    name = name.rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text('{"prompt": "secret line", "label": "x"}\n' * 50)  # what the server can read
    monkeypatch.chdir(server_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    settings = ServerSettings(data_root=tmp_path / "data", data_dir=tmp_path / "state", cpus=4)
    spec = JobSpec.model_validate({"name": "x", "data": {"source": "hf", "path": name, "num_eval": 1}})
    checked, problems = check_spec(spec, settings)
    if problems:  # refused as outside the data root: also fine
        assert "outside" in problems[0]["msg"]
        return
    assert checked.data.path == name  # kept as a Hub id
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises((HubError, ValueError)) as caught:
        load_job_prompts(checked.data)
    assert "secret line" not in str(caught.value)
    assert "cache" in str(caught.value) or "Hub" in str(caught.value)
