"""Build the distillation example's teacher: the built-in model warm-started further than the student (held-out
accuracy ≥ 0.6 instead of 0.35; the same architecture and tokenizer), copied to the repository's
.miles/teacher-arithmetic (where arithmetic-distill.yaml's relative `train.teacher` points, from any working directory).

    .venv/bin/python examples/distill/make_teacher.py       # about a minute on 2 cores, cached afterwards

Any HF folder with the student's vocabulary can be a teacher (`train.teacher`); this one is built from code because
nothing can be downloaded here.
"""

import shutil
import sys
from pathlib import Path

from miles_control.job.assets import build_builtin_model
from miles_control.spec.config import BuiltinModelConfig

TEACHER_TARGET = 0.6


def build_teacher(dest: Path) -> Path:
    source = build_builtin_model(BuiltinModelConfig(warm_start_target=TEACHER_TARGET, warm_start_steps=3000))
    shutil.copytree(source, dest, dirs_exist_ok=True)
    return dest


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[2] / ".miles" / "teacher-arithmetic"
    folder = build_teacher(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
    print(f"teacher: {folder}")
