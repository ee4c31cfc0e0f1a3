"""The one checkpoint format: trainer_state.json names the layout, and a trainer refuses a checkpoint whose
optimizer state does not fit its own layout, naming the fields that differ. (Save → load round trips on
every backend and layout run in test_backend_contract.py.)"""

import json

import pytest

from miles_train.backends.checkpoint import STATE_FILE, TrainerState, check_teacher, folder_identity, save_teacher


def test_a_checkpoint_names_the_fields_in_which_its_layout_differs(tmp_path):
    written = TrainerState("megatron", step=7, world_size=2, tensor_parallel_size=2)
    (tmp_path / STATE_FILE).write_text(json.dumps({**written.__dict__, "written_by": "a later version"}))
    state = TrainerState.read(tmp_path)
    assert state == written  # unknown keys are ignored
    state.check_loadable_by(TrainerState("megatron", 0, 2, 2), ("world_size", "tensor_parallel_size"), tmp_path)
    with pytest.raises(
        ValueError, match=r"written with tensor_parallel_size 2; this trainer has tensor_parallel_size 1"
    ):
        state.check_loadable_by(TrainerState("megatron", 0, 2, 1), ("world_size", "tensor_parallel_size"), tmp_path)
    with pytest.raises(ValueError, match=r"written with backend megatron; this trainer has backend fsdp2"):
        state.check_loadable_by(TrainerState("fsdp2", 0, 1), (), tmp_path)
    # fsdp2 keeps its optimizer state in full: any world size loads it
    TrainerState("fsdp2", 3, world_size=2).check_loadable_by(TrainerState("fsdp2", 0, 1), (), tmp_path)


def test_a_folder_without_trainer_state_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"is not a trainer checkpoint: no {STATE_FILE}"):
        TrainerState.read(tmp_path)


def test_a_field_the_checkpoint_does_not_record_is_not_compared(tmp_path):
    """Written before trainer_state.json recorded padded_vocab: loadable by the same layout."""
    (tmp_path / STATE_FILE).write_text(json.dumps({"backend": "torchtitan", "step": 4, "tensor_parallel_size": 2}))
    state = TrainerState.read(tmp_path)
    assert state.padded_vocab is None
    state.check_loadable_by(TrainerState("torchtitan", 0, 2, 2, padded_vocab=20), ("padded_vocab",), tmp_path)


def test_a_resume_refuses_another_teacher_than_the_one_recorded(tmp_path, tiny_model_dir, tiny_llama_dir):
    """distill: a checkpoint records its teacher's identity (config, each weights file's size, header and first and
    last MiB); a resume with a copy of that teacher elsewhere goes on, with another teacher it is refused."""
    import shutil

    teacher = folder_identity(tiny_llama_dir)
    save_teacher(tmp_path, str(tiny_llama_dir), teacher)
    moved = shutil.copytree(tiny_llama_dir, tmp_path / "moved-teacher")
    assert check_teacher(tmp_path, str(moved), folder_identity(moved))
    with pytest.raises(ValueError, match=r"train.teacher: .* is not the teacher checkpoint .* was distilled from .*"
                       r"config.json, model.safetensors differ"):  # fmt: skip
        check_teacher(tmp_path, str(tiny_model_dir), folder_identity(tiny_model_dir))
    edited = tmp_path / "edited-teacher"
    shutil.copytree(tiny_llama_dir, edited)
    weights = edited / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors differ"):
        check_teacher(tmp_path, str(edited), folder_identity(edited))
    assert not check_teacher(tmp_path / "moved-teacher", str(moved), teacher)  # a folder without a record
