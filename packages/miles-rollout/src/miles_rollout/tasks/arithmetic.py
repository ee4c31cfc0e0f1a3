"""Integer arithmetic with exact answers: `"37+58="` → `"95"`. Seeded, so datasets are reproducible."""

from __future__ import annotations

import random

from miles_rollout.types import PromptRecord

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# Every character an arithmetic prompt or answer can contain.
ALPHABET = "0123456789+-*="


def arithmetic_prompts(
    num_prompts: int, seed: int, digits: int = 2, operations: list[str] | tuple[str, ...] = ("+",)
) -> list[PromptRecord]:
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    records = []
    for _ in range(num_prompts):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(list(operations))
        records.append(PromptRecord(f"{a}{op}{b}=", str(_OPS[op](a, b))))
    return records


def split_train_eval(
    num_train: int, num_eval: int, seed: int, digits: int = 2, operations: list[str] | tuple[str, ...] = ("+",)
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Held-out prompts never appear in the training set."""
    held_out = arithmetic_prompts(num_eval, seed=seed + 1_000_003, digits=digits, operations=operations)
    held_out_prompts = {r.prompt for r in held_out}
    train = [r for r in arithmetic_prompts(num_train, seed, digits, operations) if r.prompt not in held_out_prompts]
    return train, held_out


SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def build_char_tokenizer(alphabet: str = ALPHABET, added_tokens: tuple[str, ...] = ()):
    """A character-level fast tokenizer (one token per character), saveable as an HF folder.

    Ids: `<pad>`=0, `<eos>`=1, `<unk>`=2, then the alphabet in order, then `added_tokens`: words that are one
    token each (the calculator's `<call>`, `</call>`), not special (decoding keeps them).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return fast
