"""A prompt's images as data gives them: a path (relative to the data file), the bytes of an image file, a
`datasets` `Image` cell (`{"bytes", "path"}`, or a decoded PIL image), one or a list per prompt. Each becomes the
bytes of an image file, checked readable when the data is loaded, so that a bad one fails before any engine starts,
naming its row and column."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from miles_rollout.data import PromptDataError


def images_of(value: Any, where: str, base: Path | None) -> list[bytes]:
    """The images of one cell (`where`: the file, row and column, for errors): None or an empty list for none;
    `base`, the folder relative paths are read from."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]" if isinstance(value, (list, tuple)) else where
        data = _bytes_of(item, at, base)
        open_image(data, at)  # readable now, not when a rollout reaches it
        out.append(data)
    return out


def _bytes_of(item: Any, where: str, base: Path | None) -> bytes:
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, dict):  # a datasets Image cell as Parquet stores it
        if item.get("bytes"):
            return bytes(item["bytes"])
        if item.get("path"):
            return _read(str(item["path"]), where, base)
        raise PromptDataError(f"{where}: an image cell with neither bytes nor a path")
    if isinstance(item, str):
        return _read(item, where, base)
    if type(item).__module__.startswith("PIL."):  # decoded by the datasets library: saved back as a PNG file
        buffer = io.BytesIO()
        item.save(buffer, format="PNG")
        return buffer.getvalue()
    raise PromptDataError(
        f"{where}: expected an image (a path, the bytes of an image file, or a datasets Image), got "
        f"{type(item).__name__}"
    )


def _read(path: str, where: str, base: Path | None) -> bytes:
    """An image file named by the data: inside the data file's folder (`base`), so that a data file can name no
    file its reader could not (a job submitted through the API has its data file confined to the data root, and a
    sample's image reaches the store, where the API shows it)."""
    if base is None:
        raise PromptDataError(
            f"{where}: an image given as a path ({path!r}) where no data file says what it is relative to; give the "
            "image's bytes, or a datasets Image column"
        )
    folder = base.resolve()
    file = (folder / Path(path).expanduser()).resolve()  # an absolute path replaces the folder; `..` is resolved
    if file != folder and folder not in file.parents:
        raise PromptDataError(f"{where}: image {path!r} lies outside the data file's folder {folder}")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise PromptDataError(f"{where}: cannot read image {file}: {exc.strerror}") from None


class ImageError(PromptDataError):
    """An image that cannot be read; the message names where it came from."""


def open_image(data: bytes, where: str) -> Any:
    """The decoded image, in RGB (what processors expect); ImageError naming `where` when it cannot be read."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the `vision` extra
        raise PromptDataError(f"{where}: reading images needs Pillow (pip install 'miles-rollout[vision]')") from None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except Exception as exc:  # Pillow raises several types for a file it cannot decode
        raise ImageError(f"{where}: not a readable image ({type(exc).__name__}: {exc})") from None
