"""Contract suite for TrainerBackend, every backend and layout against plain PyTorch and against fsdp2.

Layouts (gloo, one process per rank): fsdp2 on 1 and 2 ranks; megatron TP=1, TP=2 and DP=2, and the mixtures of
experts on one rank and with their experts over two (EP=2); torchtitan on 1 rank, TP=2 and FSDP over 2 ranks, and the
mixtures of experts on one rank and FSDP over two. Every run starts from the same HF checkpoint and
takes the same steps on the same batch, in fp32.

Parity tolerance (fp32): loss, KL, entropy and gradient norm within 1e-5 of fsdp2 on one rank
(measured here: ≤ 3e-7); logprobs within 1e-5; weights after one Adam step (lr 1e-3) within 3e-3.
"""

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_train.collate import collate, logprobs_from_logits, token_logprobs
from miles_train.config import AlgorithmConfig
from miles_train.loss import (
    LossInputs,
    aggregate,
    denominators,
    kl_estimate,
    masked_is_weights,
    staleness_weights,
    truncated_is_weights,
)
from miles_train.objectives import AdvantageInputs, build_objective, check_advantages

RANK_SCRIPT = Path(__file__).with_name("backend_rank.py")
sys.path.insert(0, str(RANK_SCRIPT.parent))
from backend_rank import contract_batch, offpolicy_batch, partial_ages  # noqa: E402


# ---- the GRPO step's formulas written plainly (the oracle the backends are held to) ---------------------------
def group_advantages(rewards: list[float], groups: list[int]) -> torch.Tensor:
    """(r − group mean) / (group's unbiased std + 1e-6); 0 for a group of one or of equal rewards."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for g in set(groups):
        idx = torch.tensor([i for i, x in enumerate(groups) if x == g])
        if len(idx) > 1 and r[idx].std() > 0:
            out[idx] = (r[idx] - r[idx].mean()) / (r[idx].std() + 1e-6)
    return out.float()


def clipped_policy_loss(logprobs, old, adv, eps):
    ratio = torch.exp(logprobs - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def kl_k3(logprobs, ref):
    return torch.exp(ref - logprobs) - (ref - logprobs) - 1


def token_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc's own aborts on a corrupted heap. A fresh CI run once saw one in a rank (inside torch's gloo collectives, at
# no line of Miles, which is Python); it never came back in repeated runs. Such a run is run once more, saying why;
# a second one, or any other failure, fails the test.
HEAP_ABORT = re.compile(r"malloc\(\): |free\(\): |double free or corruption|malloc_consolidate\(\)")


def run_ranks(model_dir, world_size: int, tmp_path, variant: str = "fsdp2", mode: str = "", _tries: int = 2) -> dict:
    tag = re.sub(r"\W+", "_", mode)[:80]  # a json: mode holds quotes and braces
    out, port = tmp_path / f"ws{world_size}-{variant}{tag}.pt", free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANK_SCRIPT),
                str(model_dir),
                str(r),
                str(world_size),
                str(port),
                str(out),
                str(tmp_path / f"ckpt-{world_size}-{variant}{tag}"),
                variant,
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    failed = [f"rank {r}:\n{log[-3000:]}" for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode]
    aborted = [
        log for p, log in zip(procs, logs, strict=True) if p.returncode == -signal.SIGABRT and HEAP_ABORT.search(log)
    ]
    if aborted and _tries > 1:
        warnings.warn(
            f"a rank aborted on glibc's heap check; the ranks run once more:\n{aborted[0][-600:]}", stacklevel=2
        )
        shutil.rmtree(tmp_path / f"ckpt-{world_size}-{variant}{tag}", ignore_errors=True)  # what the first run left
        return run_ranks(model_dir, world_size, tmp_path, variant, mode, _tries - 1)
    assert not failed, "\n".join(failed)
    return torch.load(out, weights_only=False)


# (variant, world size, model): see backend_rank.py for the variants. `qwen2` is untied with q/k/v
# biases; `llama` has no biases and tied embeddings; `qwen3` has per-head q/k norms (under TP=2 their
# gradients come from each rank's heads and must be summed) and tied embeddings. All have an odd
# vocabulary (TP=2 pads it).
LAYOUTS = [
    ("fsdp2", 1, "qwen2"),
    ("fsdp2", 2, "qwen2"),
    ("megatron", 1, "qwen2"),
    ("megatron-tp2", 2, "qwen2"),
    ("megatron", 2, "qwen2"),
    ("torchtitan", 1, "qwen2"),
    ("torchtitan-tp2", 2, "qwen2"),
    ("torchtitan", 2, "qwen2"),
    ("fsdp2", 1, "llama"),
    ("megatron-tp2", 2, "llama"),
    ("torchtitan-tp2", 2, "llama"),
    ("fsdp2", 1, "qwen3"),
    ("megatron-tp2", 2, "qwen3"),
    ("torchtitan-tp2", 2, "qwen3"),
    # mixtures of experts (untied): megatron's MoELayer against transformers' (fsdp2), the experts on one rank, and
    # over two expert-parallel ranks (each token's hidden state travels to its experts' rank and back)
    ("megatron", 1, "mixtral"),
    ("megatron-ep2", 2, "qwen3_moe"),
    # torchtitan's MoE (grouped experts, FSDP-sharded over two ranks in the second)
    ("torchtitan", 1, "qwen3_moe"),
    ("torchtitan", 2, "mixtral"),
]
UNTIED = ("qwen2", "qwen3_moe", "mixtral")
IDS = [f"{m}-{v}-ws{n}" for v, n, m in LAYOUTS]
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_llama_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir, tiny_mixtral_dir):
    return {
        "qwen2": tiny_model_dir,
        "llama": tiny_llama_dir,
        "qwen3": tiny_qwen3_dir,
        "qwen3_moe": tiny_qwen3_moe_dir,
        "mixtral": tiny_mixtral_dir,
    }


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Each layout's run, made once on first use."""
    cache: dict = {}

    def get(variant: str, world_size: int, model: str = "qwen2") -> dict:
        key = (variant, world_size, model)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{model}-{variant}")
            cache[key] = run_ranks(models[model], world_size, folder, variant)
        return cache[key]

    return get


@pytest.fixture(params=LAYOUTS, ids=IDS)
def layout(request, runs, models):
    """(name, model folder, model, result) of one layout."""
    variant, world_size, model = request.param
    return f"{model} {variant} ws{world_size}", models[model], model, runs(variant, world_size, model)


def reference_step(model_dir):
    """The same GRPO step written plainly on an unsharded HF model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = contract_batch()
    c = collate(batch)
    with torch.no_grad():
        old, _ = token_logprobs(model, c)
        ref_lp, _ = token_logprobs(ref, c)
    logprobs, _ = token_logprobs(model, c)
    adv = group_advantages(batch.rewards, batch.group_index)[:, None].expand_as(logprobs)
    pg = clipped_policy_loss(logprobs, old, adv, 0.2)
    loss = token_mean(pg + 0.1 * kl_k3(logprobs, ref_lp), c.loss_mask)
    return model, old, c, loss


def hf_state(model) -> dict[str, torch.Tensor]:
    """An HF model's tensors as its checkpoint holds them: a tied head is the embedding (miles_sync.naming), a
    mixture of experts' fused experts are per expert (what the fsdp2 export sends)."""
    from miles_train.backends.fsdp2 import convert

    return dict(convert.to_hf(model, dict(model.state_dict())))


def load_exported(model, tensors: dict[str, torch.Tensor]) -> None:
    """Exported tensors (the checkpoint's names; a tied head once) into an HF model, which must take all of them."""
    from miles_train.backends.fsdp2 import convert

    missing, unexpected = model.load_state_dict(convert.from_hf(model, tensors), strict=False)
    assert not unexpected and not missing


def test_export_uses_hf_names_and_full_tensors(layout):
    name, model_dir, model, result = layout
    hf = hf_state(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    assert set(result["initial"]) == set(hf), name
    assert ("lm_head.weight" in result["initial"]) == (model in UNTIED), f"{name}: a tied head is sent once"
    for key, tensor in hf.items():
        assert torch.equal(result["initial"][key], tensor), f"{name}: {key}"


def test_logprobs_and_loss_match_plain_pytorch(layout):
    name, model_dir, _, result = layout
    _, old, c, loss = reference_step(model_dir)
    for i, row in enumerate(result["logprobs"]):
        start = contract_batch().response_start[i] - 1
        assert torch.allclose(torch.tensor(row), old[i, start : start + len(row)], atol=TOL), name
    assert result["metrics"]["train/loss"] == pytest.approx(loss.item(), abs=TOL)
    assert result["metrics"]["train/num_tokens"] == sum(map(len, contract_batch().loss_mask))


def test_parity_with_fsdp2(layout, runs):
    """Same checkpoint, same batch: the same loss and gradient norm as fsdp2 on one rank, two steps."""
    name, _, model, result = layout
    base = runs("fsdp2", 1, model)
    for step in ("metrics", "metrics2"):
        for key in ("train/loss", "train/kl", "train/entropy", "train/grad_norm"):
            assert result[step][key] == pytest.approx(base[step][key], abs=TOL), f"{name} {step} {key}"
    assert base["metrics"]["train/grad_norm"] > 0.1  # clipping at 1.0 was active: the norms are comparable
    # Adam's first step moves each weight by about ±lr (1e-3) whatever the gradient's size, so a
    # gradient of the wrong sign shows as a 2e-3 difference; measured differences are ≤ 3e-6.
    for key, tensor in base["after"].items():
        assert torch.allclose(result["after"][key], tensor, atol=1e-4), f"{name}: {key}"
    for mine, theirs in zip(result["logprobs_after"], base["logprobs_after"], strict=True):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), atol=TOL), name


def test_a_step_moves_probability_towards_positive_advantages(layout):
    name, _, _, result = layout
    assert any(not torch.equal(result["after"][n], t) for n, t in result["initial"].items())
    batch = contract_batch()
    advantages = group_advantages(batch.rewards, batch.group_index)
    gain = sum(
        float(a) * (sum(after) - sum(before))
        for a, before, after in zip(advantages, result["logprobs"], result["logprobs_after"], strict=True)
    )
    assert gain > 0, f"{name}: the GRPO step must raise the likelihood of better-than-average responses"


def test_exported_weights_give_the_trainers_logprobs(layout):
    """After a step, the exported tensors in an HF model (what the hf engine runs; SGLang's side is
    tests/test_logprob_parity.py and the demo tests) give the logprobs the trainer computes."""
    name, model_dir, _, result = layout
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_exported(model, result["after"])
    batch = contract_batch()
    c = collate(batch)
    with torch.no_grad():
        engine, _ = token_logprobs(model.eval(), c)
    for i, row in enumerate(result["logprobs_after"]):
        start = batch.response_start[i] - 1
        assert torch.allclose(torch.tensor(row), engine[i, start : start + len(row)], atol=TOL), name


def test_save_load_round_trip(layout):
    from miles_sync import weight_fingerprint

    name, _, _, result = layout
    assert weight_fingerprint(result["reloaded"].items()) == weight_fingerprint(result["after"].items()), name
    assert weight_fingerprint(result["reloaded"].items()) != result["after2_fp"]
    # optimizer state came back too: the step after reload repeats the step after save bit for bit
    assert result["after_reload_step_fp"] == result["after2_fp"], name
    assert result["metrics_after_reload"]["train/kl"] == result["metrics2"]["train/kl"]


# Reduced precision (train.precision) on every backend, against fp32 fsdp2 on one rank: logprobs and the gradient
# norm move by what bf16's 8 and fp16's 11 significant bits allow (PRECISION_TOL, with the measured values), and a
# step still moves the weights.
PRECISION_LAYOUTS = [
    ("fsdp2-bf16", 1),
    ("fsdp2-bf16", 2),
    ("fsdp2-fp16", 1),
    ("megatron-bf16", 1),
    ("megatron-tp2-bf16", 2),
    ("megatron-fp16", 1),
    ("torchtitan-bf16", 1),
    ("torchtitan-tp2-bf16", 2),
]
PRECISION_TOL = {  # measured: bf16 |Δ logprob| ≤ 1.3e-3, grad norm ≤ 9e-4 relative; fp16 ≤ 1.7e-4 and ≤ 5e-5
    "bf16": {"loss": 1e-4, "logprobs": 5e-3, "grad": 3e-3},
    "fp16": {"loss": 1e-4, "logprobs": 1e-3, "grad": 5e-4},
}


@pytest.mark.parametrize(("variant", "world_size"), PRECISION_LAYOUTS, ids=[f"{v}-ws{n}" for v, n in PRECISION_LAYOUTS])
def test_reduced_precision(variant, world_size, runs):
    result, fp32 = runs(variant, world_size), runs("fsdp2", 1)
    tol = PRECISION_TOL[variant.rsplit("-", 1)[1]]
    assert abs(result["metrics"]["train/loss"] - fp32["metrics"]["train/loss"]) < tol["loss"], variant
    # the loss of a first step (ratio 1, KL 0) does not depend on the precision; its gradient does
    grad, grad32 = result["metrics"]["train/grad_norm"], fp32["metrics"]["train/grad_norm"]
    assert grad != grad32 and grad == pytest.approx(grad32, rel=tol["grad"]), (variant, grad, grad32)
    diff = max(
        abs(a - b)
        for ra, rb in zip(result["logprobs"], fp32["logprobs"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    assert 0 < diff < tol["logprobs"], (variant, diff)
    moved = [n for n, t in result["initial"].items() if not torch.equal(result["after"][n], t)]
    assert moved, f"{variant}: a step changed no weight"
    # save → load restores the fp32 master weights and the optimizer state: the step after a reload repeats the
    # step after the save bit for bit, in reduced precision too
    assert result["after_reload_step_fp"] == result["after2_fp"], variant
    if variant.endswith("fp16"):
        assert result["metrics"]["train/overflow_skipped"] in (0.0, 1.0)  # counted, whether or not it happened
    print(f"{variant} ws{world_size}: |Δ logprob| max {diff:.2e}, grad norm {grad:.5f} vs fp32 {grad32:.5f}")


@pytest.mark.parametrize(
    ("variant", "world_size"), [("fsdp2", 1), ("fsdp2", 2), ("torchtitan-tp2", 2), ("megatron", 1)]
)
def test_qat_int4_forward_uses_the_quantized_weights(variant, world_size, models, runs, tmp_path):
    """train.quantization: int4: the trainer's logprobs are those of the model whose linear weights are rounded to
    INT4 (groups of 32), computed plainly; the gradient passes straight through, so a step changes the fp32 master
    weights, including those too small to move a quantized value."""
    from miles_sync import formats

    result = run_ranks(models["qwen2"], world_size, tmp_path, variant=variant, mode="qat-int4")
    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if formats.quantizable(name, param.shape):
                param.copy_(formats.fake_quantize(param, "int4", 32, name))
        expected, _ = token_logprobs(model, collate(contract_batch()))
    plain = runs("fsdp2", 1)
    for i, row in enumerate(result["logprobs"]):
        start = contract_batch().response_start[i] - 1
        assert torch.allclose(torch.tensor(row), expected[i, start : start + len(row)], atol=TOL), (variant, i)
        assert not torch.allclose(torch.tensor(row), torch.tensor(plain["logprobs"][i]), atol=1e-3)  # it is not fp32
    moved = [n for n, t in result["initial"].items() if not torch.equal(result["after"][n], t)]
    assert "model.layers.0.self_attn.q_proj.weight" in moved
    assert result["after"]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def plain_old_and_reference(model_dir, batch):
    """The collated batch, and the logprobs of an unsharded fp32 HF model of the checkpoint (π_old, which is also
    the reference before any step) on it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    c = collate(batch)
    with torch.no_grad():
        old, _ = token_logprobs(model, c)
    return c, old, old.clone()


def test_masked_importance_sampling_matches_plain_pytorch(tiny_model_dir, tmp_path):
    """algorithm.mis_band: tokens whose ratio π_old/π_rollout leaves [0.4, 3] carry no loss, as written plainly."""
    result = run_ranks(tiny_model_dir, 2, tmp_path, mode="mis")
    batch = offpolicy_batch()
    c, old, ref_lp = plain_old_and_reference(tiny_model_dir, batch)
    adv = group_advantages(batch.rewards, batch.group_index)[:, None].expand_as(old)
    pg = clipped_policy_loss(old, old, adv, 0.2)
    keep, dropped = masked_is_weights(old, c.rollout_logprobs, 0.4, 3.0)
    loss = token_mean(pg * keep + 0.1 * kl_k3(old, ref_lp), c.loss_mask)
    frac = float(token_mean(dropped.float(), c.loss_mask))
    assert 0 < frac < 1  # the band drops some tokens, not all: the test has teeth
    assert result["metrics"]["train/mis_dropfrac"] == pytest.approx(frac, abs=1e-6)
    assert result["metrics"]["train/loss"] == pytest.approx(float(loss), abs=1e-5)


OFF_POLICY = [(1, "offpolicy"), (2, "offpolicy"), (1, "offpolicy-int4push"), (2, "offpolicy-partial")]


@pytest.mark.parametrize(("world_size", "mode"), OFF_POLICY)
def test_off_policy_correction_matches_plain_pytorch(world_size, mode, tiny_model_dir, tmp_path):
    """Truncated importance sampling and staleness decay weight the loss exactly as written plainly. With INT4
    pushes and an unquantized trainer, π_old is still the trainer's own (unquantized) policy: the PPO ratio
    starts at 1 and the rollout's quantization error is left to TIS. Partial rollouts: every token is weighed by
    its own age, not its sample's."""
    result = run_ranks(tiny_model_dir, world_size, tmp_path, mode=mode)  # the loop is shared by every backend
    batch = offpolicy_batch()
    c, old, ref_lp = plain_old_and_reference(tiny_model_dir, batch)
    logprobs = old  # a first step: the policy is π_old
    adv = group_advantages(batch.rewards, batch.group_index)[:, None].expand_as(logprobs)
    pg = clipped_policy_loss(logprobs, old, adv, 0.2)
    tis, truncated = truncated_is_weights(old, c.rollout_logprobs, 1.5)
    weights = staleness_weights([0, 1, 2, 0, 1, 2], "decay", 0.5, 1)[:, None]
    if mode == "offpolicy-partial":  # the response positions of each row, in order, get their token's weight
        weights = torch.zeros_like(c.loss_mask)
        for row, ages in enumerate(partial_ages(batch)):
            where = c.loss_mask[row].nonzero().flatten()
            weights[row, where] = staleness_weights(ages, "decay", 0.5, 1)
        expected = float((weights * c.loss_mask).sum() / c.loss_mask.sum())
        assert result["metrics"]["train/token_weight_mean"] == pytest.approx(expected, abs=1e-6)
    loss = token_mean(pg * tis * weights + 0.1 * kl_k3(logprobs, ref_lp), c.loss_mask)
    metrics = result["metrics"]
    assert metrics["train/loss"] == pytest.approx(float(loss), abs=1e-5)
    assert metrics["train/tis_clipfrac"] == pytest.approx(float(token_mean(truncated.float(), c.loss_mask)), abs=1e-6)
    assert 0 < metrics["train/tis_clipfrac"] < 1  # the cap bit on some tokens, not all: the test has teeth
    assert metrics["train/tis_max"] == pytest.approx(1.5)
    assert metrics["train/sample_weight_mean"] == pytest.approx((1 + 0.5 + 0.25) / 3)


PUSHED = [("fsdp2", 2), ("megatron", 1), ("torchtitan", 1), ("megatron-tp2", 2), ("torchtitan-tp2", 2)]


@pytest.mark.parametrize(("variant", "world_size"), PUSHED, ids=[f"{v}-ws{n}" for v, n in PUSHED])
def test_engines_in_bf16_the_trainer_trains_the_weights_as_pushed(variant, world_size, tiny_model_dir, tmp_path):
    """With bf16 engines (set_push_dtype), the policy trained is the bf16-rounded one the engines run, its master
    weights stay fp32, and the step reports which share of its changes reach the engines."""
    result = run_ranks(tiny_model_dir, world_size, tmp_path, variant=variant, mode="pushed")
    metrics = result["metrics"]
    # old logprobs are recomputed under the pushed weights and the forward uses them too: on-policy at the start
    assert metrics["train/ratio"] == pytest.approx(1.0, abs=1e-6) and metrics["train/clipfrac"] == 0.0
    rounded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16))
    batch = contract_batch()
    c = collate(batch)
    with torch.no_grad():
        expected, _ = token_logprobs(rounded.eval(), c)
    for i, row in enumerate(result["logprobs"]):
        start = batch.response_start[i] - 1
        assert torch.allclose(torch.tensor(row), expected[i, start : start + len(row)], atol=TOL), variant
    after, before = result["after"], result["initial"]
    assert all(t.dtype == torch.float32 for t in after.values())  # fp32 master weights
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in after.values())  # not rounded in place
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    kept = sum(int(((after[n] != before[n]) & (after[n].bfloat16() != before[n].bfloat16())).sum()) for n in before)
    assert metrics["train/update_kept_frac"] == pytest.approx(kept / changed, abs=1e-6)
    assert 0.0 < metrics["train/update_kept_frac"] < 1.0


# Each objective with a loss option, on 2 data-parallel ranks and 2 minibatches (rows 0, 2, 4 then 1, 3, 5), against
# the same update written plainly on one unsharded model: the aggregated loss (train/objective, the mean of the two
# minibatches') and the mean gradient norm of the two. lr 1e-12 keeps the second minibatch's weights those of the
# first to ~1e-12. The ratio's denominator is the off-policy batch's rollout logprobs (−2 and −4, the model's are
# near −2.8): ratios near 0.45 and 3.3, so the clip and the dual clip (c = 3) bite, and a KL in the reward (under
# those logprobs, against the checkpoint) is not 0.
OBJECTIVES = [
    ("grpo", {}),
    ("dr_grpo", {"entropy_coef": 0.01}),
    ("gspo", {"dual_clip": 3.0}),
    ("rloo", {"kl_estimator": "k2"}),
    ("reinforce_pp", {"kl_estimator": "k1"}),
    ("grpo", {"aggregation": "seq_mean_token_mean", "kl_in_reward": True}),
    ("ppo", {}),  # the critic's head starts at 0: the first step's values are 0, and GAE runs on the rewards alone
]


def plain_minibatch_updates(model_dir, config: AlgorithmConfig, teacher=None) -> list[tuple[float, float]]:
    """(aggregated loss, gradient norm) of each minibatch, as the update is written plainly (kl_coef 0.1; with a
    teacher, distill: kl_coef 0 and the teacher is the frozen model)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(teacher or model_dir, dtype=torch.float32).eval()
    kl_coef = 0.0 if teacher else 0.1
    objective = build_objective(config)
    kl_in_reward = objective.kl_in_reward if config.kl_in_reward is None else config.kl_in_reward
    batch = contract_batch() if teacher else offpolicy_batch()
    whole = collate(batch)
    with torch.no_grad():
        old, _ = token_logprobs(model, whole)  # distill recomputes π_old; the others take the rollout's
        ref, _ = token_logprobs(reference, whole)
    if not teacher:
        old = whole.rollout_logprobs
    penalty = kl_coef * kl_estimate(old, ref, config.kl_estimator) * whole.loss_mask if kl_in_reward else None
    inputs = AdvantageInputs(
        torch.tensor(batch.rewards, dtype=torch.float64), batch.group_index, whole.loss_mask, penalty
    )
    inputs.old_logprobs, inputs.ref_logprobs = old, ref
    if objective.needs_values:
        inputs.values = torch.zeros_like(old, dtype=torch.float64)  # a fresh critic's (its head is 0)
    adv = check_advantages(config.name, objective.advantages(inputs), len(batch), old.shape[1], whole.loss_mask)
    out = []
    for rows in ([0, 2, 4], [1, 3, 5]):
        part = batch.select(rows)
        c = collate(part)
        width = c.loss_mask.shape[1]
        model.zero_grad()
        logits = model(input_ids=c.input_ids, attention_mask=c.attention_mask).logits
        logprobs, entropy = logprobs_from_logits(logits, c, 1.0, with_entropy=True, entropy_grad=True)
        loss_inputs = LossInputs(
            logprobs, old[rows][:, :width], adv[rows][:, :width], c.loss_mask, 0.2, 0.2, config.dual_clip
        )
        per_token, _ = objective.policy_loss(loss_inputs)
        if not kl_in_reward and kl_coef > 0:
            per_token = per_token + kl_coef * kl_estimate(logprobs, ref[rows][:, :width], config.kl_estimator)
        per_token = per_token - config.entropy_coef * entropy
        aggregation = config.aggregation or objective.aggregation
        loss = aggregate(per_token, c.loss_mask, aggregation, *denominators(part.loss_mask))
        loss.backward()
        norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None))
        out.append((float(loss.detach()), float(norm)))
    return out


@pytest.mark.parametrize(("name", "options"), OBJECTIVES, ids=[f"{n}-{'-'.join(o) or 'plain'}" for n, o in OBJECTIVES])
def test_each_objective_split_over_ranks_and_minibatches_matches_plain_pytorch(name, options, tiny_model_dir, tmp_path):
    config = AlgorithmConfig(name=name, **options)
    settings = {"num_minibatches": 2, "old_logprobs": "rollout"}
    spec = {"algorithm": config.model_dump(exclude_unset=True), "settings": settings, "lr": 1e-12, "batch": "offpolicy"}
    result = run_ranks(tiny_model_dir, 2, tmp_path, mode="json:" + json.dumps(spec))
    plain = plain_minibatch_updates(tiny_model_dir, config)
    metrics = result["metrics"]
    assert metrics["train/objective"] == pytest.approx(sum(loss for loss, _ in plain) / 2, abs=1e-6)
    assert metrics["train/grad_norm"] == pytest.approx(sum(norm for _, norm in plain) / 2, rel=1e-4)
    assert metrics["train/grad_norm"] > 1e-2  # a step with a signal
    assert 0 < metrics["train/clipfrac"] < 1  # the clip bites on some tokens: the test has teeth


@pytest.mark.parametrize(
    "variant",  # the rebuilt backends repeat it in the extended tier (their parity with fsdp2 is in the default)
    [
        "fsdp2",
        pytest.param("megatron", marks=pytest.mark.extended),
        pytest.param("torchtitan", marks=pytest.mark.extended),
    ],
)
def test_the_grad_norm_is_measured_when_nothing_clips(variant, tiny_model_dir, tmp_path):
    """Issue 55: with optimizer.max_grad_norm null (the demo's setting) train/grad_norm read 0.0. It is the real
    norm of every backend, as plain PyTorch computes it, whether or not it is clipped."""
    config = AlgorithmConfig(name="grpo")
    spec = {"settings": {"num_minibatches": 2, "old_logprobs": "rollout"}, "lr": 1e-12, "batch": "offpolicy"}
    result = run_ranks(tiny_model_dir, 2, tmp_path, variant, mode="json:" + json.dumps({**spec, "max_grad_norm": None}))
    plain = plain_minibatch_updates(tiny_model_dir, config)
    assert result["metrics"]["train/grad_norm"] == pytest.approx(sum(norm for _, norm in plain) / 2, rel=1e-4)


@pytest.mark.parametrize(
    ("objective", "world_size", "message"),
    [
        ("NaNLoss", 2, r"objective user_objectives:NaNLoss: policy loss \(3, \d+\) is nan at row 0 token \d+"),
        ("DetachedLoss", 1, r"objective user_objectives:DetachedLoss: the policy loss \(6, \d+\) has no gradient"),
        (
            "WrongShapeAdvantages",
            1,
            r"objective user_objectives:WrongShapeAdvantages: advantages have shape \(7,\); expected \(6,\)",
        ),
    ],
)
def test_a_user_objective_returning_nonsense_fails_before_the_optimizer_steps(
    objective, world_size, message, tiny_model_dir, tmp_path
):
    spec = {"algorithm": {"name": f"user_objectives:{objective}"}, "expect_error": True}
    result = run_ranks(tiny_model_dir, world_size, tmp_path, mode="json:" + json.dumps(spec))
    assert re.search(message, result["error"]), result["error"]
    for key, tensor in result["initial"].items():
        assert torch.equal(result["after"][key], tensor), key  # no optimizer step happened


# distill on every backend: the student (qwen2) learns from a teacher of another architecture (llama, tied head)
DISTILL = [("fsdp2", 2), ("megatron-tp2", 2), ("torchtitan", 1)]


@pytest.mark.parametrize(("variant", "world_size"), DISTILL, ids=[f"{v}-ws{n}" for v, n in DISTILL])
def test_distill_scores_with_the_teacher_as_written_plainly(
    variant, world_size, tiny_model_dir, tiny_llama_dir, tmp_path
):
    config = AlgorithmConfig(name="distill")
    spec = {
        "algorithm": config.model_dump(exclude_unset=True),
        "settings": {"num_minibatches": 2},
        "lr": 1e-12,
        "teacher": str(tiny_llama_dir),
    }
    result = run_ranks(tiny_model_dir, world_size, tmp_path, variant, mode="json:" + json.dumps(spec))
    plain = plain_minibatch_updates(tiny_model_dir, config, teacher=tiny_llama_dir)
    metrics = result["metrics"]
    assert metrics["train/objective"] == pytest.approx(sum(loss for loss, _ in plain) / 2, abs=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(sum(norm for _, norm in plain) / 2, rel=1e-3)
    # the teacher is another model: the advantages (teacher − student logprobs) are far from 0
    assert metrics["train/advantage_abs_mean"] > 0.1 and metrics["train/grad_norm"] > 1e-2


# PPO's critic on every backend: trained on the same rows as the policy, saved and resumed with it
CRITIC = [("fsdp2", 2), ("megatron-tp2", 2), ("torchtitan", 1)]


@pytest.mark.parametrize(("variant", "world_size"), CRITIC, ids=[f"{v}-ws{n}" for v, n in CRITIC])
def test_ppo_trains_its_critic_and_resumes_it_with_the_policy(variant, world_size, tiny_model_dir, tmp_path):
    """Step 1 on the contract batch: the fresh critic's values are 0, so the returns are the rewards discounted by
    λ = 0.9 from each response's last token (1, 0.9, 0.81 for a rewarded response of three tokens) and the value
    loss is ½ R² averaged over the 14 tokens; its gradient norm is the one of that loss written plainly on one
    process (values taken where the loss mask says, the ranks' gradients reduced once per row). The critic learns
    (step 2's loss on the same batch is lower, its values moved towards the returns), and after a save, a step and a
    load, the next step repeats that step exactly, down to the critic's weights after it: the value model and its
    AdamW state came back (a fresh critic would again predict 0; a fresh optimizer would step differently)."""
    spec = {
        "algorithm": "ppo",
        "critic": {"lr": 0.01, "lam": 0.9, "value_clip": None},
        "settings": {"kl_coef": 0.0},
        "lr": 1e-4,
        "resume": True,
    }
    result = run_ranks(tiny_model_dir, world_size, tmp_path, variant, mode="json:" + json.dumps(spec))
    returns = [[0.81, 0.9, 1.0], [], [], [], [0.81, 0.9, 1.0], [1.0]]  # rewarded rows 0, 4, 5 (lengths 3, 3, 1)
    first = result["metrics"]
    assert first["train/value_mean"] == 0.0
    assert first["train/return_mean"] == pytest.approx(sum(map(sum, returns)) / 14, abs=1e-6)
    assert first["train/value_loss"] == pytest.approx(0.5 * sum(r * r for row in returns for r in row) / 14, abs=1e-6)
    second, resumed = result["metrics2"], result["metrics_after_reload"]
    assert second["train/value_loss"] < 0.8 * first["train/value_loss"], (first, second)
    assert 0 < second["train/value_mean"] < first["train/return_mean"]
    assert first["train/critic_grad_norm"] == pytest.approx(plain_critic_grad_norm(tiny_model_dir, returns), rel=1e-4)
    assert first["train/grad_norm"] > 0
    for key in ("train/value_loss", "train/value_mean", "train/explained_variance", "train/objective"):
        assert resumed[key] == pytest.approx(second[key], abs=1e-5), key
    assert result["after_reload_step_fp"] == result["after2_fp"]  # the policy resumed too
    assert result["critic_after_reload_step_fp"] == result["critic_after2_fp"] is not None


def plain_critic_grad_norm(model_dir, returns: list[list[float]]) -> float:
    """The norm of the gradient of ½(V − R)², token mean over the contract batch, for a fresh value model."""
    from miles_train.critic import load_value_model
    from miles_train.loss import value_loss

    model = load_value_model(model_dir, torch.device("cpu"))
    batch = contract_batch()
    c = collate(batch)
    values = model(c.input_ids, c.attention_mask)[:, :-1]
    targets = torch.zeros_like(values)
    for i, row in enumerate(returns):
        start = batch.response_start[i] - 1
        targets[i, start : start + len(row)] = torch.tensor(row)
    per_token, _ = value_loss(values, torch.zeros_like(values), targets, None)
    (per_token * c.loss_mask).sum().div(c.loss_mask.sum()).backward()
    return float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters() if p.grad is not None)))


def test_distill_checkpoints_record_the_teacher_and_resume_against_it(tiny_model_dir, tiny_llama_dir, tmp_path):
    """The teacher is frozen, so a checkpoint holds its identity rather than its weights (teacher.json); a resume
    with the same teacher checks it and repeats the step after the save exactly."""
    spec = {"algorithm": "distill", "teacher": str(tiny_llama_dir), "lr": 1e-4, "resume": True}
    result = run_ranks(tiny_model_dir, 2, tmp_path, "fsdp2", mode="json:" + json.dumps(spec))
    [checkpoint] = list(tmp_path.glob("ckpt-2-fsdp2*"))
    record = json.loads((checkpoint / "teacher.json").read_text())
    assert record["path"] == str(tiny_llama_dir) and set(record["identity"]) == {"config.json", "model.safetensors"}
    assert result["after_reload_step_fp"] == result["after2_fp"]
    assert result["metrics_after_reload"]["train/teacher_kl"] == pytest.approx(result["metrics2"]["train/teacher_kl"])


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "own-routing"])
@pytest.mark.parametrize("variant", ["megatron-ep2", "torchtitan"])
def test_the_rebuilt_backends_meet_the_engines_routing_as_transformers_does(
    variant, replay, tiny_qwen3_moe_dir, tmp_path
):
    """Rollout routing replay on megatron with the experts over two ranks and on torchtitan over two FSDP ranks (each
    rank its own rows): the engine's routing (the model's own,
    but one row's positions sent to other experts in layer 0, one position given none) gives the logprobs that transformers'
    model gives under the same routing (miles_train.routing on the HF routers), and the agreement counts the
    positions that differ."""
    from miles_train.routing import Agreement, engine_routing, routers

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    batch = contract_batch()
    c = collate(batch)
    chosen: dict[int, torch.Tensor] = {}
    hooks = [r.register_forward_hook(lambda m, i, out, layer=layer: chosen.__setitem__(layer, out[2]))
             for layer, r in routers(model).items()]  # fmt: skip
    with torch.no_grad():
        model(input_ids=c.input_ids)
    for hook in hooks:
        hook.remove()
    rows, width = c.input_ids.shape
    engine = torch.stack([chosen[layer].view(rows, width, -1) for layer in sorted(chosen)], 2).view(rows, width, -1)
    moved = len(batch.input_ids[1]) - 1  # row 1's routed positions: other experts in layer 0
    engine[1, :moved, :2] = (engine[1, :moved, :2] + 1) % 4
    engine[4, 2, 2:] = -1  # row 4, layer 1: none given (the trainer's own choice)
    routed = [engine[i, : len(ids) - 1].to(torch.int16) for i, ids in enumerate(batch.input_ids)]
    torch.save(routed, tmp_path / "routed.pt")
    batch.routed_experts = routed
    agreement = Agreement()
    with torch.no_grad(), engine_routing(model, collate(batch).routed_experts, replay, agreement):
        expected, _ = token_logprobs(model, collate(batch))
    assert agreement.same == agreement.total - moved

    mode = "json:" + json.dumps({"routed": str(tmp_path / "routed.pt"), "replay": replay, "lr": 1e-3})
    result = run_ranks(tiny_qwen3_moe_dir, 2, tmp_path, variant, mode)
    for i, row in enumerate(result["logprobs"]):
        start = batch.response_start[i] - 1
        assert torch.allclose(torch.tensor(row), expected[i, start : start + len(row)], atol=TOL), i
    assert result["metrics"]["train/routing_agreement"] == pytest.approx(agreement.value)
    with torch.no_grad():
        own, _ = token_logprobs(model, collate(batch))
    # the row sent to other experts moves only under replay
    start = batch.response_start[1] - 1
    shift = max(abs(float(own[1, start + j]) - lp) for j, lp in enumerate(result["logprobs"][1]))
    assert (shift > 1e-4) == replay, shift
