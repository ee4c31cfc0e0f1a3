"""Reward of the capitals task (`rollout.reward: capitals_reward:capital`): the city's name and nothing else.

A plug-in module beside its job file: `miles run` puts the job file's folder on the module search path
(in the driver and in every Ray worker), so no PYTHONPATH is needed.
"""

from __future__ import annotations

import re

_EDGES = re.compile(r"^[\s\"'*]+|[\s\"'*.!]+$")


def capital(sample) -> float:
    """1.0 for exactly the capital (case and surrounding quotes or a final period aside), 0.5 for an answer that
    names it among other words, 0 otherwise."""
    return score(sample.response_text, sample.label)


def score(text: str, label: str) -> float:
    """`capital`'s score of an answer `text` to a question whose capital is `label`."""
    answer = _EDGES.sub("", text).lower()
    label = label.lower()
    if answer == label:
        return 1.0
    return 0.5 if re.search(rf"\b{re.escape(label)}\b", answer) else 0.0
