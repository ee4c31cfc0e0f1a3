"""Write `tasks.jsonl` beside this file: small Python functions, each with assert-style tests, for
`rollout.reward: code` (see `smollm2-coding.yaml`). Deterministic; nothing comes from a hub.

    python examples/coding/make_tasks.py            # rewrites tasks.jsonl (the file in git is its output)

Each record is {"prompt", "label", "tests": {"asserts": [...]}, "family"}. One-line functions (`add_three(x)`) are
too easy: SmolLM2-135M-Instruct passes 96 % of them before training. These ask for a loop, a condition or a
constant to be used right (count, filter, sum of a kind, a digit, a letter, a label), where it passes about a third.
The held-out records (the job's `data.num_eval`: the file's last ones) are functions no training record asks for,
from the same families.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
LISTS: list[list[int]] = [[3, 8, 1, 6], [5], [-4, 10, 0, 7, 2], []]
STRINGS = ["banana", "Hello World", "racecar", ""]


def _task(family: str, name: str, signature: str, what: str, fn: Any, inputs: list) -> dict:
    def call(arg: Any) -> str:
        return f"{name}({', '.join(repr(a) for a in arg)})" if isinstance(arg, tuple) else f"{name}({arg!r})"

    asserts = [f"assert {call(arg)} == {(fn(*arg) if isinstance(arg, tuple) else fn(arg))!r}" for arg in inputs]
    return dict(family=family, name=name, signature=signature, what=what, asserts=asserts)


def _counting() -> list[dict]:
    out = []
    for k in range(0, 3):  # easy: passed before training, so their groups carry no advantage; a few stay
        out.append(_task("count", f"count_above_{WORDS[k]}", "xs", f"returns how many numbers in the list xs are greater than {k}",
                         lambda xs, k=k: sum(x > k for x in xs), LISTS))  # fmt: skip
        out.append(_task("filter", f"keep_above_{WORDS[k]}", "xs", f"returns a list of the numbers in the list xs that are greater than {k}, in order",
                         lambda xs, k=k: [x for x in xs if x > k], LISTS))  # fmt: skip
    for letter in "abeilnorst":
        out.append(_task("letters", f"count_{letter}", "s", f"returns how many times the letter '{letter}' appears in the string s",
                         lambda s, c=letter: s.count(c), STRINGS))  # fmt: skip
    return out


def _sums() -> list[dict]:
    table = {
        "sum_of_squares": ("returns the sum of the squares of the numbers in the list xs", lambda xs: sum(x * x for x in xs)),
        "sum_of_evens": ("returns the sum of the even numbers in the list xs", lambda xs: sum(x for x in xs if x % 2 == 0)),
        "sum_of_odds": ("returns the sum of the odd numbers in the list xs", lambda xs: sum(x for x in xs if x % 2)),
        "count_evens": ("returns how many even numbers the list xs has", lambda xs: sum(x % 2 == 0 for x in xs)),
        "count_negatives": ("returns how many negative numbers the list xs has", lambda xs: sum(x < 0 for x in xs)),
        "keep_evens": ("returns a list of the even numbers in the list xs, in order", lambda xs: [x for x in xs if x % 2 == 0]),
        "keep_odds": ("returns a list of the odd numbers in the list xs, in order", lambda xs: [x for x in xs if x % 2]),
        "doubled": ("returns a list with every number of the list xs multiplied by 2", lambda xs: [2 * x for x in xs]),
        "spread": ("returns the largest number of the non-empty list xs minus its smallest", lambda xs: max(xs) - min(xs)),
    }  # fmt: skip
    out = []
    for name, (what, fn) in table.items():
        inputs = [xs for xs in LISTS if xs] if name == "spread" else LISTS
        out.append(_task("sums", name, "xs", what, fn, inputs))
    return out


def _numbers() -> list[dict]:
    out = []
    for k in range(3, 10):
        out.append(_task("label", f"fizz_{WORDS[k]}", "n", f"returns the string 'Fizz' if n is divisible by {k}, and the string of n otherwise",
                         lambda n, k=k: "Fizz" if n % k == 0 else str(n), [k, k + 1, 2 * k, 1]))  # fmt: skip
        out.append(_task("label", f"buzz_{WORDS[k]}", "n", f"returns the string 'Buzz' if n is greater than {k}, and the string of n otherwise",
                         lambda n, k=k: "Buzz" if n > k else str(n), [k, k + 1, 2 * k, 1]))  # fmt: skip
        if k < 6:
            out.append(_task("digits", f"remainder_{WORDS[k]}", "n", f"returns the remainder of n divided by {k}",
                             lambda n, k=k: n % k, [10, 7, 100, 0]))  # fmt: skip
    table = {
        "digit_sum": ("returns the sum of the decimal digits of the non-negative integer n", lambda n: sum(map(int, str(n))), [123, 0, 9, 4071]),
        "factorial": ("returns n factorial for a non-negative integer n", lambda n: 1 if n < 2 else n * table["factorial"][1](n - 1), [0, 1, 5, 7]),
        "sign": ("returns -1 if n is negative, 0 if n is 0 and 1 if n is positive", lambda n: (n > 0) - (n < 0), [-5, 0, 3, 12]),
        "number_of_digits": ("returns how many decimal digits the non-negative integer n has", lambda n: len(str(n)), [0, 7, 45, 1000]),
        "is_prime": ("returns True if the integer n is a prime number and False otherwise",
                     lambda n: n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)), [2, 9, 13, 1]),
    }  # fmt: skip
    for name, (what, fn, inputs) in table.items():
        out.append(_task("numbers", name, "n", what, fn, inputs))
    return out


def _strings() -> list[dict]:
    table = {
        "count_vowels": ("returns how many vowels (a, e, i, o, u, lower case) the string s has", lambda s: sum(c in "aeiou" for c in s)),
        "is_palindrome": ("returns True if the string s reads the same backwards and False otherwise", lambda s: s == s[::-1]),
        "count_words": ("returns how many words separated by spaces the string s has", lambda s: len(s.split())),
        "without_spaces": ("returns the string s with every space removed", lambda s: s.replace(" ", "")),
        "first_upper": ("returns the string s with its first character in upper case and the rest unchanged", lambda s: s[:1].upper() + s[1:]),
        "count_upper": ("returns how many upper-case letters the string s has", lambda s: sum(c.isupper() for c in s)),
    }  # fmt: skip
    out = [_task("strings", name, "s", what, fn, STRINGS) for name, (what, fn) in table.items()]
    for a, b in [("a", "o"), ("e", "i"), ("o", "0"), ("l", "L"), (" ", "_")]:
        label = {" ": "space", "_": "underscore", "0": "zero"}
        name = f"replace_{label.get(a, a)}_by_{label.get(b, b)}"
        out.append(_task("replace", name, "s", f"returns the string s with every '{a}' replaced by '{b}'",
                         lambda s, a=a, b=b: s.replace(a, b), STRINGS))  # fmt: skip
    return out


def records() -> list[dict]:
    """Every task as a prompt record, shuffled with a fixed seed (held-out = the last ones of the file)."""
    tasks = _counting() + _sums() + _numbers() + _strings()
    random.Random(0).shuffle(tasks)
    return [
        {"prompt": f"Write a Python function `{t['name']}({t['signature']})` that {t['what']}.", "label": "",
         "tests": {"asserts": t["asserts"]}, "family": t["family"]}
        for t in tasks
    ]  # fmt: skip


if __name__ == "__main__":
    rows = records()
    (HERE / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} tasks to {HERE / 'tasks.jsonl'}")
