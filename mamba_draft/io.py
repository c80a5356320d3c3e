"""Atomic writes: a reader (or a resumed run) sees the old file or the complete new one, never half of one."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file


CACHE_ENV = "MAMBA_DRAFT_CACHE"  # where the package keeps what it derives (GGUF dense copies, row blocks)


def cache_root() -> Path | None:
    """$MAMBA_DRAFT_CACHE (default ~/.cache/mamba-draft); None when it is "off" (nothing kept)."""
    root = os.environ.get(CACHE_ENV, "~/.cache/mamba-draft")
    return None if root == "off" else Path(root).expanduser()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary sibling of `path` (one filesystem) to fill; it replaces `path` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # os.open with 0o666 gets the mode a plain open() would (the umask applies); mkstemp's would be 0600
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 2, **dumps_kwargs) -> None:
    """`obj` as JSON (strict: NaN and infinity are refused) plus a final newline."""
    write_text(path, json.dumps(obj, indent=indent, allow_nan=False, **dumps_kwargs) + "\n")


def save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary sibling of `directory`; it replaces `directory` only if the block succeeds."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty (pass overwrite=True to replace it)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{directory.name}.", dir=directory.parent,
                                     ignore_cleanup_errors=True) as tmp:  # removed unless renamed into place
        yield Path(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(tmp, directory)
