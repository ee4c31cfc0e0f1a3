"""`sync.check_after_resume` in the rollout worker (the Ray actor's class, run in this process on the hf engine):
generation resumes before the weight check, a check that fails rolls the engine back to the version it held
before, and the runtime's span records the pause apart from the push."""

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from miles_control.job.runtime.workers import RolloutWorker
from miles_rollout.tasks.arithmetic import arithmetic_prompts
from miles_sync import build_sender, sync_config

sys.path.insert(0, str(Path(__file__).parent))
from model_matrix import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_a_failed_check_after_resume_rolls_the_engine_back(tmp_path):
    model_dir = build_model("qwen2.5", "float32", tmp_path / "model")
    spec = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text())
    prompts = arithmetic_prompts(4, seed=0)
    worker = RolloutWorker(spec, str(model_dir), prompts, prompts)
    try:
        engine = worker.engine
        before = engine.weight_fingerprint()
        checked_while_generating = []
        fingerprint = engine.weight_fingerprint

        def recorded() -> str:
            checked_while_generating.append(engine._resumed.is_set())  # the hf engine's pause flag
            return fingerprint()

        engine.weight_fingerprint = recorded
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        weights = [(n, p.detach() + 0.01) for n, p in model.named_parameters()]
        sender = build_sender(sync_config(transport="tensor"))
        try:
            good = sender.publish(weights, weight_version=1)
            received = worker.receive_weights(good, check_after_resume=True)
            assert (received.weight_version, received.fingerprint) == (1, good.fingerprint)
            assert received.check_failure is None and received.rolled_back_to is None
            assert checked_while_generating == [True]  # the check ran once the engine had resumed
            assert 0 < received.paused_s <= received.end - received.start
            with pytest.raises(RuntimeError, match="no previous version is kept"):
                engine.roll_back()  # a passed check frees the version kept for a roll-back

            # A version whose check fails (here: the trainer's fingerprint is not what the engine computes).
            moved = [(n, t + 0.01) for n, t in weights]
            bad = dataclasses.replace(sender.publish(moved, weight_version=2), fingerprint="not-the-engines")
            received = worker.receive_weights(bad, check_after_resume=True)
            assert received.rolled_back_to == 1 and received.weight_version == 1
            assert received.check_failure is not None and "not-the-engines" in received.check_failure
            assert received.fingerprint == good.fingerprint == engine.weight_fingerprint() != before
            assert checked_while_generating[1] is True

            # Checked before resuming (the default), the same failure is left to the runtime: no roll-back.
            bad = dataclasses.replace(sender.publish(moved, weight_version=3), fingerprint="not-the-engines")
            received = worker.receive_weights(bad)
            assert received.rolled_back_to is None and received.weight_version == 3
            assert received.fingerprint != bad.fingerprint
        finally:
            sender.close()
    finally:
        worker.shutdown()
