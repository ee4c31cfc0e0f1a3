"""A synthetic visual task made from code: an image of 1 to `max_count` black squares on white, the question "how
many?", the count as the label. Seeded, so datasets are reproducible; written as image files beside a JSONL file of
paths, or as a Parquet file with a `datasets` Image column (what a dataset saved with the `datasets` library
holds)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

QUESTION = "how many squares?"


def counting_image(count: int, rng: random.Random, size: int = 56, cell: int = 14) -> bytes:
    """A PNG of `count` black squares on white, each in its own cell of a grid of `cell`-pixel cells (chosen at
    random), with a pixel of white around it. 14-pixel cells are Qwen2.5-VL's patches: one square per patch."""
    from PIL import Image, ImageDraw

    cells = [(x, y) for x in range(0, size - cell + 1, cell) for y in range(0, size - cell + 1, cell)]
    if count > len(cells):
        raise ValueError(f"{count} squares of {cell} px cells do not fit a {size} px image")
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for x, y in rng.sample(cells, count):
        draw.rectangle([x + 1, y + 1, x + cell - 2, y + cell - 2], fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def counting_rows(num: int, seed: int, max_count: int = 4, size: int = 56) -> list[tuple[bytes, str]]:
    """`num` (image, label) pairs, counts drawn uniformly from 1..max_count."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        count = rng.randint(1, max_count)
        rows.append((counting_image(count, rng, size), str(count)))
    return rows


def write_jsonl(rows: list[tuple[bytes, str]], path: str | Path) -> Path:
    """A JSONL file of {prompt, label, images: [path]}, the images as PNG files in `<stem>_images/` beside it,
    named relative to the file."""
    path = Path(path)
    folder = path.parent / f"{path.stem}_images"
    folder.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for i, (image, label) in enumerate(rows):
            (folder / f"{i}.png").write_bytes(image)
            handle.write(json.dumps({"prompt": QUESTION, "label": label, "images": [f"{folder.name}/{i}.png"]}) + "\n")
    return path


def write_parquet(rows: list[tuple[bytes, str]], path: str | Path) -> Path:
    """A Parquet file with a `datasets` Image column `images` (one image per row, its bytes inline)."""
    import datasets

    features = datasets.Features({"prompt": datasets.Value("string"), "label": datasets.Value("string"),
                                  "images": datasets.Image()})  # fmt: skip
    data = {"prompt": [QUESTION] * len(rows), "label": [label for _, label in rows],
            "images": [{"bytes": image, "path": None} for image, _ in rows]}  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(path))
    return path


class RecountEnvironment:
    """An episode with an image observation (a screenshot-like answer): the prompt's image is counted, then the
    environment shows another image and asks again; the episode's reward is the share of right counts. For
    `rollout.generate: multi_turn` with a vision-language model (`rollout.environment:
    miles_rollout.tasks.counting:RecountEnvironment`, `rollout.reward: env`)."""

    def __init__(self, seed: int = 0, max_count: int = 4) -> None:
        self.rng = random.Random(seed)
        self.max_count = max_count
        self.answers: list[str] = []

    def reset(self, record) -> None:
        self.answers = [record.label]
        return None  # the prompt record (its text and image) opens the episode

    def step(self, action):
        from miles_rollout.env import StepResult

        right = float(action.text.strip() == self.answers[-1])
        if len(self.answers) == 2:
            return StepResult(None, reward=right / 2, done=True)
        count = self.rng.randint(1, self.max_count)
        self.answers.append(str(count))
        image = counting_image(count, self.rng)
        content = [{"type": "image", "image": image}, {"type": "text", "text": "and here?"}]
        return StepResult([{"role": "user", "content": content}], reward=right / 2)
