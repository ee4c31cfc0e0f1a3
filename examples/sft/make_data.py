"""Write the SFT example's data: prompt/response pairs of 2-digit additions (train.jsonl) and held-out ones
(eval.jsonl), seeded, none of the held-out prompts among the training ones.

    python examples/sft/make_data.py        # rewrites both files beside this script
"""

import json
from pathlib import Path

from miles_rollout.tasks.arithmetic import split_train_eval

HERE = Path(__file__).parent

train, held_out = split_train_eval(num_train=3000, num_eval=300, seed=7)
for name, records in (("train.jsonl", train), ("eval.jsonl", held_out)):
    with (HERE / name).open("w") as handle:
        for r in records:
            handle.write(json.dumps({"prompt": r.prompt, "response": r.label}) + "\n")
    print(f"{HERE / name}: {len(records)} pairs")
