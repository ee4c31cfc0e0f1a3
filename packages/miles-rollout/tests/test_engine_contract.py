"""Contract suite for RolloutEngine, run against every implementation that exists here."""

import asyncio
import importlib.util
import pickle
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_rollout import (
    FinishReason,
    GenerateRequest,
    HFEngineConfig,
    RolloutEngine,
    SamplingParams,
    WeightPushError,
    build_engine,
)
from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engine_client import EngineClient
from miles_rollout.protocol import AbortsRequests, LimitsCalls, ReleasesMemory, TimesPushPhases, call_limit
from miles_sync import (
    TRANSPORTS,
    DiskSync,
    build_sender,
    needs_receiver_ranks,
    read_buckets,
    sync_config,
    weight_fingerprint,
)

ENGINE_CONFIGS = {"hf": HFEngineConfig()}
if importlib.util.find_spec("sglang") is not None:
    ENGINE_CONFIGS["sglang"] = SGLangEngineConfig(type="sglang", max_total_tokens=8192)
ENGINE_MARKS = {"sglang": [pytest.mark.sglang, pytest.mark.slow]}


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=ENGINE_MARKS.get(name, [])) for name in sorted(ENGINE_CONFIGS)],
)
def module_engine(request, tiny_model_dir):
    eng = build_engine(ENGINE_CONFIGS[request.param], tiny_model_dir, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture
def engine(module_engine, tiny_model_dir, tmp_path):
    """One engine per module (SGLang servers take seconds to start), reset after every test."""
    yield module_engine
    asyncio.run(module_engine.resume())
    if module_engine.weight_version != 0:
        original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters()
        module_engine.receive(publish([(n, p.detach()) for n, p in original], 0, tmp_path / "reset"))


def publish(weights, version: int, folder, bucket_bytes: int = 64 << 20):
    """Publish through the disk transport, which every engine accepts."""
    return build_sender(DiskSync(dir=str(folder), bucket_bytes=bucket_bytes)).publish(weights, weight_version=version)


def requests(n: int, sampling: SamplingParams, prefix: str = "") -> list[GenerateRequest]:
    prompts = [[3 + (i % 10), 13, 4 + (i % 7), 16] for i in range(n)]
    return [GenerateRequest(p, sampling, request_id=f"{prefix}{i}") for i, p in enumerate(prompts)]


def test_implements_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert asyncio.run(engine.health())
    assert engine.weight_version == 0


def test_capabilities_are_protocols_the_engine_implements(engine):
    """What only some engines offer is asked with isinstance, never probed for by name."""
    assert isinstance(engine, AbortsRequests)
    offered = {cap.__name__ for cap in (LimitsCalls, ReleasesMemory, TimesPushPhases) if isinstance(engine, cap)}
    assert offered == {"hf": {"LimitsCalls"}, "sglang": {"ReleasesMemory", "TimesPushPhases"}}[engine.name]
    assert call_limit(engine) == (1 if engine.name == "hf" else None)


def test_generate_shapes_and_limits(engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5)
    results = asyncio.run(engine.generate(requests(6, sampling)))
    assert [r.request_id for r in results] == [str(i) for i in range(6)]
    for r in results:
        assert 1 <= len(r.output_ids) <= 5
        assert len(r.output_logprobs) == len(r.output_ids)
        assert all(lp <= 0.0 for lp in r.output_logprobs)
        assert r.weight_versions == [0]
        if r.finish_reason == FinishReason.LENGTH:
            assert len(r.output_ids) == 5


def test_logprobs_match_a_teacher_forced_forward(engine, tiny_model_dir):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=6)
    results = asyncio.run(engine.generate(requests(4, sampling)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for req, res in zip(requests(4, sampling), results, strict=True):
        ids = torch.tensor([req.input_ids + res.output_ids])
        logits = model(ids).logits[0, len(req.input_ids) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(res.output_logprobs), expected, atol=1e-4)


def test_greedy_is_deterministic_and_batch_independent(engine):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    batched = asyncio.run(engine.generate(requests(5, sampling)))
    alone = asyncio.run(engine.generate(requests(5, sampling)[2:3]))
    assert batched[2].output_ids == alone[0].output_ids  # left padding must not change the answer


def test_stop_token_ends_generation(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = asyncio.run(engine.generate(requests(1, greedy)))[0]
    stop = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(first.output_ids[0],))
    stopped = asyncio.run(engine.generate(requests(1, stop)))[0]
    assert stopped.output_ids == first.output_ids[:1]
    assert stopped.finish_reason == FinishReason.STOP


def generate_in_background(engine, sampling: SamplingParams, num_requests: int = 3, prefix: str = ""):
    """Start a long generation in a thread and give it time to be in flight."""
    out: dict = {}
    worker = threading.Thread(
        target=lambda: out.setdefault("r", asyncio.run(engine.generate(requests(num_requests, sampling, prefix))))
    )
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive(), "the long generation finished before the test could pause it"
    return worker, out


LONG = SamplingParams(temperature=1.0, max_new_tokens=900, ignore_eos=True)


def test_ignore_eos_generates_exactly_max_new_tokens(engine):
    results = asyncio.run(engine.generate(requests(2, SamplingParams(max_new_tokens=40, ignore_eos=True))))
    assert [len(r.output_ids) for r in results] == [40, 40]
    assert all(r.finish_reason == FinishReason.LENGTH for r in results)


def test_pause_abort_ends_in_flight_requests(engine):
    worker, out = generate_in_background(engine, LONG)
    asyncio.run(engine.pause("abort"))
    worker.join(timeout=60)
    assert not worker.is_alive(), "abort must end in-flight requests"
    asyncio.run(engine.resume())
    assert all(r.finish_reason == FinishReason.ABORT for r in out["r"])
    assert all(0 < len(r.output_ids) < 900 for r in out["r"])
    after = asyncio.run(engine.generate(requests(1, SamplingParams(max_new_tokens=3))))
    assert after[0].finish_reason != FinishReason.ABORT


def test_abort_requests_ends_those_requests_alone(engine):
    """Dynamic sampling's surplus: the named requests end at once with what they generated, the others go on."""
    # ids of their own: SGLang may still hold an aborted id while it cleans up, and other tests reuse "0", "1", …
    worker, out = generate_in_background(engine, LONG, prefix="abort-")
    asyncio.run(engine.abort_requests(["abort-0", "abort-2"]))
    worker.join(timeout=120)
    assert not worker.is_alive()
    first, middle, last = out["r"]
    assert first.finish_reason == last.finish_reason == FinishReason.ABORT
    assert all(0 < len(r.output_ids) < 900 and len(r.output_logprobs) == len(r.output_ids) for r in (first, last))
    assert middle.finish_reason == FinishReason.LENGTH and len(middle.output_ids) == 900


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_requests_across_a_weight_push(engine, tiny_model_dir, tmp_path, mode):
    worker, out = generate_in_background(engine, LONG)
    asyncio.run(engine.pause(mode))
    time.sleep(0.5)
    assert worker.is_alive(), f"{mode} must hold requests, not end them"
    engine.receive(publish(new_weights(tiny_model_dir), 5, tmp_path / "w"))
    asyncio.run(engine.resume())
    worker.join(timeout=120)
    for r in out["r"]:
        assert r.finish_reason == FinishReason.LENGTH and len(r.output_ids) == 900
        assert r.weight_versions == [0, 5]  # a sample that spans a push records both versions
        k = r.token_versions.count(0)  # ... and which version generated each of its ids
        assert 0 < k < 900 and r.token_versions == [0] * k + [5] * (900 - k)


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logprob of every output id under `model` at temperature 1, given the prompt and the ids before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def test_partial_rollout_continues_an_aborted_request_under_the_new_weights(engine, tiny_model_dir, tmp_path):
    """rollout.partial_rollouts: a request aborted by a push is sent again with what it had, generates the rest
    under the new weights, and comes back whole: every id, its logprob under the weights that generated it, and
    its version."""
    prompts = [r.input_ids for r in requests(2, LONG)]
    out: dict = {}
    clients: list[EngineClient] = []

    async def run() -> list:
        client = EngineClient(engine, continue_aborted=True)
        clients.append(client)
        return await asyncio.gather(
            *(client.generate(p, LONG, request_id=f"partial-{i}") for i, p in enumerate(prompts))
        )

    worker = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(run())))
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive(), "the long generation finished before the test could pause it"
    asyncio.run(engine.pause("abort"))
    deadline = time.time() + 60
    while clients[0].num_continued < len(prompts) and time.time() < deadline:
        time.sleep(0.05)  # both requests came back aborted and were sent again: they wait for the push to end
    assert clients[0].num_continued == len(prompts)
    assert worker.is_alive(), "a continued request must wait for the resume"
    new = new_weights(tiny_model_dir)
    engine.receive(publish(new, 5, tmp_path / "w"))
    asyncio.run(engine.resume())
    worker.join(timeout=180)
    assert not worker.is_alive()
    old_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    new_model.load_state_dict(dict(new), strict=False)
    for prompt, r in zip(prompts, out["r"], strict=True):
        assert r.finish_reason == FinishReason.LENGTH and len(r.output_ids) == len(r.output_logprobs) == 900
        k = r.token_versions.count(0)
        assert 0 < k < 900 and r.token_versions == [0] * k + [5] * (900 - k)
        assert r.weight_versions == [0, 5]
        got = torch.tensor(r.output_logprobs)
        assert torch.allclose(got[:k], teacher_forced(old_model, prompt, r.output_ids)[:k], atol=1e-3)
        assert torch.allclose(got[k:], teacher_forced(new_model, prompt, r.output_ids)[k:], atol=1e-3)


def new_weights(model_dir):
    """The model's own weights, perturbed: what a trainer would publish after a step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach() + 0.01) for n, p in model.named_parameters()]


def test_receive_weights_sets_version_and_fingerprint(engine, tiny_model_dir, tmp_path):
    weights = new_weights(tiny_model_dir)
    before = engine.weight_fingerprint()
    handle = publish(weights, 2, tmp_path / "w", bucket_bytes=4096)
    fingerprint = engine.receive(handle)
    assert fingerprint == handle.fingerprint == engine.weight_fingerprint() != before
    assert engine.weight_version == 2


def test_a_push_lands_through_the_one_engine_side_sequence(engine, tiny_model_dir, tmp_path):
    """`miles_rollout.push.land`: pause → receive → resume, timed by phase, and the one judgement of the push (a
    measurement only where the engine checks the weights that serve)."""
    import dataclasses

    from miles_rollout.push import land

    handle = publish(new_weights(tiny_model_dir), 3, tmp_path / "w")
    landed = land(engine, handle)
    assert (landed.weight_version, landed.fingerprint, landed.expected) == (3, handle.fingerprint, handle.fingerprint)
    assert landed.matches and landed.weights_match is (True if engine.verifies_loads else None)
    assert {"pause", "load", "resume"} <= set(landed.phases) and 0 < landed.paused_s <= landed.end - landed.start
    assert landed.check_failure is None and landed.rolled_back_to is None
    # a trainer fingerprint the engine does not hold: judged as a mismatch, never as a match
    other = dataclasses.replace(publish(new_weights(tiny_model_dir), 4, tmp_path / "w2"), fingerprint="not-this")
    landed = land(engine, other)
    assert not landed.matches and landed.weights_match is (False if engine.verifies_loads else None)


@pytest.mark.parametrize("transport", ["disk", "tensor"])  # SGLang: servers read the folder / take each bucket
def test_receive_rejects_incomplete_or_foreign_weights(engine, tiny_model_dir, tmp_path, transport):
    """Refused whole, before any weight is touched (a ValueError that names the engine, not a WeightPushError)."""
    weights = new_weights(tiny_model_dir)
    before = engine.weight_fingerprint()
    senders = []

    def push(tensors, folder):
        if transport == "disk":
            return publish(tensors, 3, folder)
        senders.append(build_sender(sync_config(transport="tensor", bucket_bytes=8192)))
        return senders[-1].publish(tensors, weight_version=3)

    try:
        with pytest.raises(ValueError, match=f"{engine.name} engine: weight version 3 lacks 1 parameter"):
            engine.receive(push(weights[:-1], tmp_path / "a"))
        with pytest.raises(ValueError, match=r"unknown weights \['not.a.weight'\]"):
            engine.receive(push([*weights, ("not.a.weight", torch.zeros(1))], tmp_path / "b"))
    finally:
        for sender in senders:
            sender.close()
    assert engine.weight_version == 0
    assert engine.weight_fingerprint() == before  # nothing was half-loaded


def test_tiny_top_p_samples_the_greedy_token(engine):
    greedy = asyncio.run(engine.generate(requests(4, SamplingParams(temperature=0.0, max_new_tokens=5))))
    nucleus = asyncio.run(engine.generate(requests(4, SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=5))))
    assert [r.output_ids for r in nucleus] == [r.output_ids for r in greedy]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_transport_loads_and_passes_the_equality_check(engine, tiny_model_dir, tmp_path, transport):
    weights = new_weights(tiny_model_dir)
    where = {"disk": {"dir": str(tmp_path / "w")}, "broadcast": {"timeout_s": 60}, "p2p": {"timeout_s": 60}}
    config = sync_config(transport=transport, bucket_bytes=8192, **where.get(transport, {}))
    # a collective group's size comes from the engine; p2p's receiving rank is the engine's process
    sender = build_sender(config, receiver_ranks=engine.receiver_ranks() if needs_receiver_ranks(config) else 1)
    try:
        for version in (7, 8):
            handle = sender.publish(weights, weight_version=version)
            assert handle.num_buckets > 1  # several buckets travel, in order
            assert engine.receive(handle) == handle.fingerprint == weight_fingerprint(weights)
            sender.wait()  # a no-op but for broadcast, whose sender finishes in the background
            assert engine.weight_version == version
            assert engine.weight_fingerprint() == handle.fingerprint
            weights = [(n, t + 0.01) for n, t in weights]
        out = asyncio.run(engine.generate(requests(2, SamplingParams(max_new_tokens=3))))
        assert all(r.weight_versions == [8] for r in out)  # the engine serves the new version
    finally:
        sender.close()


@pytest.mark.parametrize("transport", ["tensor", "broadcast", "disk"])
def test_a_delta_push_sends_only_what_changed_and_the_engine_holds_the_whole_version(
    engine, tiny_model_dir, transport, tmp_path
):
    """sync.delta: after a step that froze half the tensors, only the other half travels (bytes counted; on disk,
    compressed, the version folder holds only them), and the engine's fingerprint (SGLang: verified against every
    server's checksums) is that of the whole new version."""
    weights = new_weights(tiny_model_dir)
    extra = {
        "broadcast": {"timeout_s": 60},
        "disk": {"dir": str(tmp_path / "w"), "compression": "zstd"},
    }.get(transport, {})
    config = sync_config(transport=transport, bucket_bytes=8192, delta=True, **extra)
    sender = build_sender(config, receiver_ranks=engine.receiver_ranks())
    try:
        first = sender.publish(weights, weight_version=1)
        assert first.base_version is None and first.num_tensors == len(weights)  # a sender's first push is whole
        assert engine.receive(first) == first.fingerprint
        sender.wait()
        moving = {name for name, _ in weights[::2]}
        moved = [(n, t + 0.01 if n in moving else t) for n, t in weights]
        second = sender.publish(moved, weight_version=2)
        assert second.base_version == 1 and second.num_tensors == len(moving)
        assert second.unchanged_tensors == len(weights) - len(moving)
        assert second.num_bytes == sum(t.numel() * t.element_size() for n, t in moved if n in moving)
        if transport == "disk":
            written = {n for bucket in read_buckets(second) for n, _ in bucket}
            assert written == moving
            on_disk = [sum(f.stat().st_size for f in Path(h.location).glob("bucket-*")) for h in (first, second)]
            assert on_disk[1] / on_disk[0] < 1.2 * second.num_bytes / first.num_bytes < 1.2  # only they are written
        assert engine.receive(second) == second.fingerprint == weight_fingerprint(moved)
        sender.wait()
        assert engine.weight_version == 2 and engine.weight_fingerprint() == weight_fingerprint(moved)
        out = asyncio.run(engine.generate(requests(2, SamplingParams(max_new_tokens=3))))
        assert all(r.weight_versions == [2] for r in out)
        if transport == "tensor":  # a delta on a version the engine does not hold is refused, nothing loaded
            stale = build_sender(config)
            try:
                stale.publish(weights, weight_version=5)
                bad = stale.publish(moved, weight_version=6)
                with pytest.raises(ValueError, match="delta on version 5 but the engine holds version 2"):
                    engine.receive(bad)
            finally:
                stale.close()
            assert engine.weight_version == 2 and engine.weight_fingerprint() == weight_fingerprint(moved)
            # a refused push touched no weight (refused at its first bucket): a delta on version 2 follows
            follow = sender.publish([(n, t + 0.01) for n, t in moved], weight_version=3)
            assert follow.base_version == 2
            assert engine.receive(follow) == follow.fingerprint
    finally:
        sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_push_that_breaks_mid_way_leaves_the_engine_on_its_previous_version(
    engine, tiny_model_dir, tmp_path, transport, monkeypatch
):
    """The receiving side's stream of buckets dies after the first bucket (the transport's own `read` raises
    there): the engine raises a WeightPushError that names it, keeps its version number, and holds the previous
    weights (SGLang: verified against every server's checksums). SGLang's servers take each bucket as it arrives
    (all transports but disk, whose folder they read once the engine read all of it): the engine reloads the
    previous version into them from its own copy."""
    import miles_sync.transports as registry

    weights = new_weights(tiny_model_dir)
    where = {"disk": {"dir": str(tmp_path / "w")}, "broadcast": {"timeout_s": 5}, "p2p": {"timeout_s": 5}}
    config = sync_config(transport=transport, bucket_bytes=8192, **where.get(transport, {}))
    sender = build_sender(config, receiver_ranks=engine.receiver_ranks() if needs_receiver_ranks(config) else 1)
    module = sys.modules[registry.transport(transport).read.__module__]  # receive() reads through its module
    whole_read = module.read

    def read_then_die(*args, **kwargs):
        stream = whole_read(*args, **kwargs)
        yield next(stream)
        raise ConnectionResetError("the sender died after the first bucket")

    before, version = engine.weight_fingerprint(), engine.weight_version
    monkeypatch.setattr(module, "read", read_then_die)
    try:
        handle = sender.publish(weights, weight_version=version + 1)
        assert handle.num_buckets > 1
        with pytest.raises(WeightPushError) as failed:
            engine.receive(handle)
        message = str(failed.value)  # names the engine (SGLang: its servers), the version and what it still holds
        assert message.startswith(f"{engine.name} engine") and f"weight version {version + 1} failed" in message
        assert "the sender died after the first bucket" in message
        assert re.search(rf"holds? version {version}\b", message), message
        if engine.name == "sglang":  # every server serves again, on the previous version (checked below)
            assert all(slot.admitted for slot in engine.slots) and all(slot.url in message for slot in engine.slots)
            # the servers had begun loading (all but disk): they are reloaded
            expected = "nothing" if transport == "disk" else "again (reloaded from this engine's copy, verified)"
            assert expected in message, message
        assert isinstance(failed.value.__cause__, ConnectionResetError)
        carried = pickle.loads(pickle.dumps(failed.value))  # as Ray hands it from the rollout actor to the driver
        assert type(carried) is WeightPushError and str(carried) == message
        assert engine.weight_version == version
        assert engine.weight_fingerprint() == before
    finally:
        monkeypatch.undo()
        try:
            sender.close()  # a group sender reports that its receiver left
        except (RuntimeError, TimeoutError):
            pass
    # Nothing of the broken push is left in the way (SGLang: an open update, a group): the next push loads.
    retry = build_sender(config, receiver_ranks=engine.receiver_ranks() if needs_receiver_ranks(config) else 1)
    try:
        assert engine.receive(retry.publish(weights, weight_version=version + 1)) == weight_fingerprint(weights)
        retry.wait()
        assert engine.weight_version == version + 1
    finally:
        retry.close()


@pytest.mark.parametrize("transport", ["tensor", "broadcast"])  # SGLang: through shared memory / the group
def test_a_version_checked_after_resume_can_be_rolled_back(engine, tiny_model_dir, transport):
    """`receive(..., check_later=True)` takes a version without checking it ("" back) and keeps the previous one;
    `weight_fingerprint()` checks it while generation runs; `roll_back()` returns to the previous version (SGLang:
    reloaded into every server and verified against its checksums), once."""
    before, version = engine.weight_fingerprint(), engine.weight_version
    weights = new_weights(tiny_model_dir)
    config = sync_config(transport=transport, bucket_bytes=8192, **({"timeout_s": 60} if transport != "tensor" else {}))
    sender = build_sender(config, receiver_ranks=engine.receiver_ranks() if needs_receiver_ranks(config) else 1)
    sampling = SamplingParams(max_new_tokens=3)
    try:
        handle = sender.publish(weights, weight_version=version + 1)
        assert engine.receive(handle, check_later=True) == ""
        sender.wait()
        assert engine.weight_version == version + 1
        assert asyncio.run(engine.generate(requests(2, sampling)))[0].weight_versions == [version + 1]
        assert engine.weight_fingerprint() == handle.fingerprint != before  # the check, after resuming
        assert engine.roll_back() == version
        assert engine.weight_version == version and engine.weight_fingerprint() == before
        if engine.name == "sglang":
            assert all(slot.admitted for slot in engine.slots)
        assert asyncio.run(engine.generate(requests(2, sampling)))[0].weight_versions == [version]
        with pytest.raises(RuntimeError, match="no previous version is kept"):
            engine.roll_back()
        # a version taken with its check done at once keeps nothing to roll back to
        again = sender.publish(weights, weight_version=version + 2)
        assert engine.receive(again) == again.fingerprint
        sender.wait()
        with pytest.raises(RuntimeError, match="no previous version is kept"):
            engine.roll_back()
    finally:
        sender.close()


def test_a_load_whose_server_check_fails_is_rolled_back(engine, tiny_model_dir, monkeypatch):
    """SGLang checks every server's checksums after a load: when that fails, the engine takes back the version it
    held, reloads it into every server and verifies it (the check fails once here, injected)."""
    if engine.name != "sglang":
        pytest.skip("only SGLang checks servers after a load (the hf engine's check is the fingerprint it computes)")
    from miles_rollout.engines.sglang.weights import WeightMismatchError

    before, version = engine.weight_fingerprint(), engine.weight_version
    verify, calls = engine._weights.verify, []

    def fails_once(slot, checked_version):
        calls.append(checked_version)
        if len(calls) == 1:
            raise WeightMismatchError(f"{slot.url}: a tensor differs (injected)")
        verify(slot, checked_version)

    monkeypatch.setattr(engine._weights, "verify", fails_once)
    sender = build_sender(sync_config(transport="tensor"))
    try:
        with pytest.raises(WeightPushError, match="injected") as failed:
            engine.receive(sender.publish(new_weights(tiny_model_dir), weight_version=version + 1))
        assert f"hold version {version} again" in str(failed.value)
        assert calls == [version + 1] + [version] * len(engine.slots)  # the failed check, then the roll-back's
    finally:
        sender.close()
        monkeypatch.undo()
    assert engine.weight_version == version and engine.weight_fingerprint() == before
    assert all(slot.admitted for slot in engine.slots)


def test_partial_rollouts_leave_what_the_client_aborted_ended(engine):
    """Dynamic sampling's surplus (abort_outstanding) is ended for good, partial rollouts or not."""
    out: dict = {}
    clients: list[EngineClient] = []

    async def run():
        client = EngineClient(engine, continue_aborted=True)
        clients.append(client)
        task = asyncio.ensure_future(client.generate(requests(1, LONG)[0].input_ids, LONG, request_id="surplus"))
        await asyncio.sleep(0.3)
        await client.abort_outstanding()
        return await task

    worker = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(run())))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert out["r"].finish_reason == FinishReason.ABORT and 0 < len(out["r"].output_ids) < 900
    assert clients[0].num_continued == 0


def test_a_continuation_held_by_a_pause_is_ended_by_abort_outstanding(engine):
    """Dynamic sampling's abort reaches a continuation that waits for the push to end: it does not run to its end
    once generation resumes."""
    out: dict = {}
    clients: list[EngineClient] = []

    loops: list[asyncio.AbstractEventLoop] = []

    async def run():
        client = EngineClient(engine, continue_aborted=True)
        clients.append(client)
        loops.append(asyncio.get_running_loop())
        return await client.generate(requests(1, LONG)[0].input_ids, LONG, request_id="held")

    worker = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(run())))
    worker.start()
    time.sleep(0.3)
    asyncio.run(engine.pause("abort"))
    deadline = time.time() + 60
    while clients[0].num_continued < 1 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the continuation reaches the engine, which holds it
    ended = asyncio.run_coroutine_threadsafe(clients[0].abort_outstanding(), loops[0]).result(timeout=60)
    assert ended == 1
    asyncio.run(engine.resume())
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert out["r"].finish_reason == FinishReason.ABORT and len(out["r"].output_ids) < 900
