"""What a job is checked for before any actor starts, and how errors from inside the actors reach the user."""

import json
import os
import subprocess
import sys

import pytest
import torch

from miles_control.job.preflight import JobCheckError, check_job, describe_error, plain_error
from miles_control.spec.config import JobSpec
from miles_control.testing.tiny_models import LLAMA3_ROPE, save_tiny_model, tiny_model


@pytest.fixture(scope="module")
def llama32_bf16(tmp_path_factory):
    """A tiny Llama 3.2-style checkpoint: tied head, llama3 RoPE scaling, saved in bf16."""
    config = tiny_model(
        "llama3.2", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, rope_parameters=LLAMA3_ROPE | {"factor": 8.0},
    )  # fmt: skip
    return save_tiny_model(tmp_path_factory.mktemp("llama32"), config, dtype="bfloat16")


def spec(**fields) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "rollout": {"engine": {"type": "hf"}}, **fields})


def test_a_backend_that_cannot_train_the_model_is_refused_naming_the_config_field(llama32_bf16):
    with pytest.raises(JobCheckError, match=r"megatron backend: config.json rope_parameters.rope_type: 'llama3'"):
        check_job(spec(train={"backend": "megatron"}), llama32_bf16)
    check_job(spec(), llama32_bf16)  # fsdp2 trains whatever transformers builds


def test_a_mixture_of_experts_is_refused_the_p2p_transport_naming_the_field(tmp_path):
    """p2p pushes row shards of the model's own tensors; an MoE holds its experts fused, not as the checkpoint."""
    save_tiny_model(tmp_path, tiny_model("qwen3_moe", vocab_size=32))
    with pytest.raises(JobCheckError, match=r"sync.transport: p2p .* \(num_experts: 4 in config.json\)"):
        check_job(spec(sync={"transport": "p2p"}), tmp_path)
    check_job(spec(), tmp_path)  # the default transport carries the checkpoint's per-expert tensors


def test_pushes_the_engines_would_round_are_refused(llama32_bf16):
    with pytest.raises(JobCheckError, match="sync.dtype: float32 is not what the engines hold \\(bfloat16\\)"):
        check_job(spec(sync={"dtype": "float32"}), llama32_bf16)
    # fp32 engines hold a bf16 checkpoint exactly, and fp32 pushes too
    check_job(spec(sync={"dtype": "float32"}, rollout={"engine": {"type": "hf", "dtype": "float32"}}), llama32_bf16)


def test_sglang_takes_any_family_with_its_check_and_refuses_what_its_cpu_path_cannot_serve(tmp_path):
    """Issue 55: a family outside SGLang's layout table (GPT-2 here) is no longer refused: the engine derives the
    layout from its servers. A family SGLang's CPU path cannot serve is refused before start, with the reason."""
    gpt2 = tiny_model("gpt2", vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    save_tiny_model(tmp_path / "gpt2", gpt2)
    check_job(spec(rollout={"engine": {"type": "sglang"}}), tmp_path / "gpt2")
    save_tiny_model(tmp_path / "moe", tiny_model("qwen2_moe", vocab_size=32))
    with pytest.raises(JobCheckError, match=r"sglang engine: config.json model_type: 'qwen2_moe': .*Triton kernel"):
        check_job(spec(rollout={"engine": {"type": "sglang"}}), tmp_path / "moe")
    check_job(spec(), tmp_path / "moe")  # the hf engine serves it


def test_a_format_whose_blocks_do_not_fit_the_model_is_refused(llama32_bf16):
    """hidden 16, intermediate 32: int4 groups of 128 and MXFP8's 32-element blocks do not fit; NVFP4's 16 do."""
    with pytest.raises(JobCheckError, match=r"sync.quantization: int4 .* sync.quant_group_size 128 do not divide the "
                       r"model's hidden_size \(16\)"):  # fmt: skip
        check_job(spec(sync={"quantization": "int4"}), llama32_bf16)
    with pytest.raises(JobCheckError, match=r"train.quantization: mxfp8 .* 32-element blocks do not divide"):
        check_job(spec(train={"quantization": "mxfp8"}), llama32_bf16)
    check_job(
        spec(sync={"quantization": "int4", "quant_group_size": 16}, train={"quantization": "nvfp4"}), llama32_bf16
    )
    check_job(spec(sync={"quantization": "fp8"}), llama32_bf16)  # one scale per tensor: any shape


def test_megatron_tensor_parallel_shards_must_be_whole_blocks(tmp_path):
    """Megatron quantizes its own shards: with TP=2 the MLP's down projection holds 96 / 2 = 48 input columns per
    rank, not a whole number of 32-element groups, although 96 is."""
    config = tiny_model(
        "qwen2", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2
    )
    save_tiny_model(tmp_path, config)
    quant = {"quantization": "int4", "quant_group_size": 32}
    backend = {"type": "megatron", "world_size": 2, "tensor_parallel_size": 2}
    with pytest.raises(JobCheckError, match=r"train.quantization: int4 .* intermediate_size / tensor_parallel_size"):
        check_job(spec(train={"backend": backend, **quant}), tmp_path)
    check_job(spec(train={"backend": {**backend, "tensor_parallel_size": 1}, **quant}), tmp_path)
    check_job(spec(sync=quant, train={"backend": backend}), tmp_path)  # pushes are whole HF tensors


def test_precision_and_quantization_a_backend_cannot_run_are_refused_at_validation():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="train.precision: fp16 is not offered by torchtitan"):
        spec(train={"backend": "torchtitan", "precision": "fp16"})
    with pytest.raises(ValidationError, match="train.quantization: nvfp4 scales a whole HF tensor"):
        spec(train={"backend": "megatron", "quantization": "nvfp4"})
    with pytest.raises(ValidationError, match=r"mis_band: \[1.5, 2.0\] must hold 1"):
        spec(train={"algorithm": {"mis_band": [1.5, 2.0]}})
    with pytest.raises(ValidationError, match="mis_band needs the trainer's old-policy logprobs"):
        spec(train={"algorithm": {"mis_band": [0.5, 2.0], "old_logprobs": "rollout"}})
    with pytest.raises(ValidationError, match="sync.quantization|Input should be 'none'"):
        spec(sync={"quantization": "fp6"})
    with pytest.raises(ValidationError, match="train.quant_group_size 64 ≠ sync.quant_group_size 128"):
        spec(sync={"quantization": "int4"}, train={"quantization": "int4", "quant_group_size": 64})
    packed = {"transport": "tensor", "quantization": "fp8_block", "quant_wire": "packed"}
    with pytest.raises(ValidationError, match="packed needs SGLang on a GPU, and this job has rollout.engine.type: hf"):
        spec(sync=packed)
    with pytest.raises(ValidationError, match="rollout.engine.device: cpu"):
        spec(sync=packed, rollout={"engine": {"type": "sglang", "device": "cpu"}})
    assert spec(sync=packed, rollout={"engine": {"type": "sglang", "device": "cuda"}}).sync.quant_wire == "packed"
    # a spec stored before train.precision keeps its meaning
    stored = spec(train={"backend": {"type": "fsdp2", "mixed_precision": "bf16"}})
    assert stored.train.precision == "bf16" and "mixed_precision" not in stored.train.backend.model_dump()
    assert spec(train={"backend": "megatron", "precision": "fp16", "quantization": "int4"}).train.precision == "fp16"


def test_fp16_training_of_a_bf16_checkpoint_is_refused_unless_allowed(llama32_bf16, tmp_path):
    with pytest.raises(JobCheckError, match="train.precision: fp16 on .*config.json declares dtype bfloat16.*"
                                            "train.allow_fp16: true"):  # fmt: skip
        check_job(spec(train={"precision": "fp16"}), llama32_bf16)
    check_job(spec(train={"precision": "fp16", "allow_fp16": True}), llama32_bf16)
    check_job(spec(train={"precision": "bf16"}), llama32_bf16)
    fp32 = tmp_path / "fp32"  # the same model saved in fp32 declares float32: fp16 is the user's call
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(llama32_bf16, dtype=torch.float32).save_pretrained(fp32)
    check_job(spec(train={"precision": "fp16"}, rollout={"engine": {"type": "hf", "dtype": "float32"}}), fp32)


def test_an_unresolvable_reward_is_named(llama32_bf16):
    with pytest.raises(JobCheckError, match="rollout.reward: cannot import module 'nowhere_xyz'"):
        check_job(spec(rollout={"engine": {"type": "hf"}, "reward": "nowhere_xyz:f"}), llama32_bf16)


def test_a_user_objective_is_imported_and_built_before_the_job_starts(llama32_bf16, tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(
        "from miles_train.objectives import GRPO\n\n"
        "class Scaled(GRPO):\n    def __init__(self, scale):\n        self.scale = scale\n\n"
        "class Plain:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check_job(spec(train={"algorithm": {"name": "my_algos:Scaled", "options": {"scale": 2}}}), llama32_bf16)
    with pytest.raises(JobCheckError, match="train.algorithm: name: 'my_algos:Plain' is not a subclass of"):
        check_job(spec(train={"algorithm": "my_algos:Plain"}), llama32_bf16)
    with pytest.raises(JobCheckError, match=r"train.algorithm: options: my_algos:Scaled does not take \{\}"):
        check_job(spec(train={"algorithm": {"name": "my_algos:Scaled"}}), llama32_bf16)
    with pytest.raises(JobCheckError, match="train.algorithm: cannot import module 'no_such_module'"):
        check_job(spec(train={"algorithm": "no_such_module:X"}), llama32_bf16)


def test_episodes_are_checked_before_the_job_starts(llama32_bf16, monkeypatch):
    import sys
    import types

    with pytest.raises(JobCheckError, match="rollout.generate: cannot import module 'nowhere_xyz'"):
        check_job(spec(rollout={"engine": {"type": "hf"}, "generate": "nowhere_xyz:f"}), llama32_bf16)
    with pytest.raises(JobCheckError, match="rollout.environment: cannot import module 'nowhere_xyz'"):
        episodes = {"generate": "multi_turn", "environment": "nowhere_xyz:Env"}
        check_job(spec(rollout={"engine": {"type": "hf"}, **episodes}), llama32_bf16)
    module = types.ModuleType("preflight_envs")
    module.Env = type("Env", (), {"reset": lambda self, r: None, "step": lambda self, a: None})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "preflight_envs", module)
    episodes = {"generate": "multi_turn", "environment": "preflight_envs:Env"}
    check_job(spec(rollout={"engine": {"type": "hf"}, **episodes}), llama32_bf16)
    feedback = {"generate": "multi_turn", "environment": "miles_rollout.tasks.feedback:ArithmeticFeedback"}
    with pytest.raises(JobCheckError, match=r"rollout.environment_args: .*ArithmeticFeedback\(\{'tries': 0\}\) failed: "
                       r"ValueError: tries: 0 \(at least 1\)"):  # fmt: skip
        check_job(spec(rollout={"engine": {"type": "hf"}, **feedback, "environment_args": {"tries": 0}}), llama32_bf16)
    with pytest.raises(JobCheckError, match=r"rollout.environment: calling .*ArithmeticFeedback.* with \['tris'\]"):
        check_job(spec(rollout={"engine": {"type": "hf"}, **feedback, "environment_args": {"tris": 2}}), llama32_bf16)
    context = json.loads((llama32_bf16 / "config.json").read_text())["max_position_embeddings"]
    too_long = {**episodes, "multi_turn": {"max_total_tokens": context + 1}}
    with pytest.raises(JobCheckError, match=rf"max_total_tokens: {context + 1} is more than the model's context"):
        check_job(spec(rollout={"engine": {"type": "hf"}, **too_long}), llama32_bf16)


@pytest.mark.slow
def test_an_error_raised_in_a_ray_actor_reaches_the_user_as_raised():
    import ray

    from miles_rollout.rewards import RewardError

    class Worker:
        def fail(self):
            raise RewardError("reward 'x:f' returned 'oops' (str)")

        def crash(self):
            print("native library: the last words 7f3a", file=sys.stderr, flush=True)
            os._exit(3)  # as a segfault or the OOM killer would end it: no exception to send back

    ray.init(num_cpus=1, include_dashboard=False, address="local")
    try:
        actor = ray.remote(Worker).remote()
        with pytest.raises(Exception) as caught:
            ray.get(actor.fail.remote())
        with pytest.raises(Exception) as died:
            ray.get(actor.crash.remote())
    finally:
        ray.shutdown()
    assert "\x1b[" in str(caught.value) or "Traceback" in str(caught.value)  # what Ray hands over
    assert isinstance(plain_error(caught.value), RewardError)
    assert describe_error(caught.value) == "RewardError: reward 'x:f' returned 'oops' (str)"
    # Ray's message for a dead worker says only that it died; what it printed last is in its log
    assert "7f3a" not in str(died.value)
    assert "native library: the last words 7f3a" in describe_error(died.value)


REWARD_MODULE = '''
def score(sample):
    """A number for samples of the first weight version; a string afterwards (a plug-in bug)."""
    return 1.0 if sample.weight_versions[0] == 0 else "oops"
'''


@pytest.mark.slow
def test_a_reward_beside_the_job_file_is_found_and_its_bad_value_is_reported_plainly(tmp_path):
    """No PYTHONPATH: `miles run` puts the job file's folder on the path of the driver and of every Ray worker.
    The module works at step 1 and returns a string at step 2: the job fails naming the function and the value,
    without Ray's wrapping or colour codes, and step 1 stays recorded."""
    from miles_control.service.store import Store

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "beside_reward.py").write_text(REWARD_MODULE)
    (jobs / "job.yaml").write_text(
        f"name: plugin\nstore:\n  url: sqlite:///{tmp_path}/m.db\n"
        "model:\n  warm_start_steps: 0\n  hidden_size: 32\n  num_layers: 1\n  intermediate_size: 64\n"
        "rollout:\n  engine:\n    type: hf\n  num_prompts_per_step: 4\n  num_samples_per_prompt: 2\n"
        "  reward: beside_reward:score\n  eval:\n    every_steps: 0\n    num_prompts: 4\n"
        "schedule:\n  num_steps: 3\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"MILES_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "miles_control.cli.main", "run", str(jobs / "job.yaml"), "--quiet"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    expected = "RewardError: reward 'beside_reward:score' returned 'oops' (str)"
    assert expected in result.stderr, result.stderr[-3000:]
    assert "\x1b[" not in result.stderr and "RayTaskError" not in result.stderr
    store = Store(f"sqlite:///{tmp_path}/m.db")
    [job], _ = store.jobs()
    assert job.status == "failed" and job.error.startswith(expected) and "\x1b[" not in job.error
    assert [step for step, _ in store.metric_series(job.id, "rollout/reward_mean")] == [1]


def test_an_update_mostly_lost_to_rounding_is_reported_once(caplog):
    """train/update_kept_frac under 0.5: one warning in the log and one event in the store, naming the cause."""
    from types import SimpleNamespace

    from miles_control.job.runtime.job import JobRuntime

    events = []
    runtime = SimpleNamespace(
        _warned_update_lost=False,
        pushed_precision="bfloat16",
        recorder=SimpleNamespace(event=lambda kind, message, **data: events.append((kind, message, data))),
    )
    with caplog.at_level("WARNING"):
        for step, kept in ((1, 0.9), (2, None), (3, 0.14), (4, 0.1)):
            JobRuntime._warn_if_update_lost(runtime, step, kept)
    [(kind, message, data)] = events
    assert kind == "warning" and data == {"step": 3, "update_kept_frac": 0.14}
    assert "only 14% of the weights this step changed reach the engines, which run bfloat16 weights" in message
    assert [r.message for r in caplog.records] == [message]


def test_a_critic_folder_must_read_the_policys_token_ids(llama32_bf16, tmp_path):
    """ppo's train.critic.model: an HF folder whose embedding covers the policy's vocabulary (32 ids here)."""
    ppo = {"algorithm": "ppo", "critic": {"model": str(tmp_path / "none")}}
    with pytest.raises(JobCheckError, match=r"train.critic.model: .*none is not an HF model folder"):
        check_job(spec(train=ppo), llama32_bf16)
    small = tiny_model(
        "llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    save_tiny_model(tmp_path / "small", small)
    with pytest.raises(JobCheckError, match="train.critic.model: its vocabulary has 16 ids, the policy's 32"):
        check_job(spec(train={"algorithm": "ppo", "critic": {"model": str(tmp_path / "small")}}), llama32_bf16)
    check_job(spec(train={"algorithm": "ppo", "critic": {"model": str(llama32_bf16)}}), llama32_bf16)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def score(response, label):\n    return 1.0\n", r"rollout.reward: rewards_probe:score has the signature"),
        (
            "def score(sample):\n    return 'yes'\n",
            r"rollout.reward: reward 'rewards_probe:score' returned 'yes' \(str\)",
        ),
        ("def score(sample):\n    return float('nan')\n", r"rollout.reward: .* a reward must be a finite number"),
        ("def score(sample):\n    return sample.metadata['missing']\n", r"rollout.reward: .* raised KeyError"),
        ("async def score(sample):\n    return None\n", r"rollout.reward: .* returned None"),
        (
            "from miles_rollout.rewards import batched\n@batched\ndef score(samples):\n    return 1.0\n",
            r"rollout.reward: rewards_probe:score \(@batched\) returned float for 1 sample",
        ),
    ],
)
def test_a_users_reward_is_called_on_the_data_before_anything_starts(
    llama32_bf16, tmp_path, monkeypatch, source, message
):
    """Issue 55, item 4: a reward returning a string, or with the wrong signature, was caught only after the
    engines started, the signature error a bare TypeError. The driver now calls the reward on the first prompt (its
    label as the response) before any actor starts, and the error names rollout.reward."""
    from miles_rollout.types import PromptRecord

    (tmp_path / "rewards_probe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rewards_probe", raising=False)
    prompts = [PromptRecord(prompt="1+1=", label="2")]
    with pytest.raises(JobCheckError, match=message):
        check_job(spec(rollout={"engine": {"type": "hf"}, "reward": "rewards_probe:score"}), llama32_bf16, prompts)


def test_a_good_users_reward_passes_the_probe(llama32_bf16, tmp_path, monkeypatch):
    from miles_rollout.types import PromptRecord

    (tmp_path / "rewards_ok.py").write_text(
        "def score(sample):\n    return float(sample.response_text == sample.label)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check_job(spec(rollout={"engine": {"type": "hf"}, "reward": "rewards_ok:score"}), llama32_bf16,
              [PromptRecord(prompt="1+1=", label="2")])  # fmt: skip
