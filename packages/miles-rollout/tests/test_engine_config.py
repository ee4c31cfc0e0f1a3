"""What the job's planner and checks ask an engine config (miles_control never names an engine type)."""

from miles_rollout.config import HFEngineConfig, SGLangEngineConfig


def test_the_hf_engine_takes_no_gpus_and_cannot_colocate():
    config = HFEngineConfig()
    assert config.num_engines == 1
    assert config.gpus_per_engine("auto", has_gpus=True) == 0
    assert config.gpus_problem(0) is None
    assert "runs on CPU" in (config.gpus_problem(1) or "")
    assert not config.releases_memory
    assert config.as_colocated() is config
    assert config.packed_weights_refusal() == "rollout.engine.type: hf"
    assert config.with_log_dir("/logs") is config


def test_sglang_servers_take_their_tensor_and_data_parallel_gpus():
    config = SGLangEngineConfig(type="sglang", num_engines=2, extra_args=["--tp-size", "2", "--dp=2"])
    assert config.gpus_per_server == 4
    assert config.gpus_per_engine("auto", has_gpus=True) == 4
    assert config.gpus_per_engine("auto", has_gpus=False) == 0
    assert config.gpus_per_engine(3, has_gpus=True) == 3  # refused by gpus_problem, as the spec does
    assert config.gpus_problem(4) is None and config.gpus_problem(0) is None
    assert "= 4" in (config.gpus_problem(2) or "")
    on_cpu = config.model_copy(update={"device": "cpu"})
    attached = config.model_copy(update={"urls": ["http://a"]})
    assert on_cpu.gpus_per_engine("auto", has_gpus=True) == attached.gpus_per_engine(4, has_gpus=True) == 0


def test_sglang_colocates_with_its_memory_saver_on_as_many_gpus_as_trainer_ranks():
    config = SGLangEngineConfig(type="sglang", num_engines=2)
    assert config.releases_memory
    assert config.colocated_problem(2) is None
    assert "2 engine(s) × 1 GPU(s) must equal train.backend.world_size (4" in (config.colocated_problem(4) or "")
    assert config.model_copy(update={"urls": ["http://a"]}).colocated_problem(4) is None
    colocated = config.as_colocated()
    assert colocated.extra_args == ["--enable-memory-saver"] and config.extra_args == []
    assert colocated.as_colocated().extra_args == ["--enable-memory-saver"]


def test_sglang_loads_packed_weights_on_a_gpu_and_logs_where_it_is_told():
    config = SGLangEngineConfig(type="sglang")
    assert config.packed_weights_refusal() is None
    assert config.model_copy(update={"device": "cpu"}).packed_weights_refusal() == "rollout.engine.device: cpu"
    assert config.with_log_dir("/logs").log_dir == "/logs"
    assert config.model_copy(update={"log_dir": "/mine"}).with_log_dir("/logs").log_dir == "/mine"
