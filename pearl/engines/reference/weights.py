"""A model's weights as safetensors: read from a Hugging Face directory, written atomically,
and as bytes for pushing weights over the wire. Tensor names stay Hugging Face's
(``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file

from pearl.io.documents import InputError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files: those its
    ``model.safetensors.index.json`` names when it has one, else every ``*.safetensors``."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise InputError(str(folder), "", "no such model directory")
    files = _indexed_files(folder) if (folder / INDEX_FILE).is_file() else _all_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in _read_file(path).items():
            if name in tensors:
                raise InputError(str(path), name, "tensor also in another safetensors file")
            tensors[name] = tensor
    return tensors


def write_weights(model_dir: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``MODEL_DIR/model.safetensors`` atomically (a temporary file, then a rename):
    a reader sees the old file or the new one, never half of one. Returns its path."""
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHTS_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(_contiguous(tensors), tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # mkstemp's file is private; a model is read by other processes
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def weights_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The tensors as one safetensors document in memory."""
    return save(_contiguous(tensors), metadata={"format": "pt"})


def tensors_from_bytes(data: bytes, source: str = "<weights bytes>") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors document; a corrupt one is an ``InputError`` on
    ``source``."""
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise InputError(source, "", f"not a safetensors document ({err})") from None


def _indexed_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise InputError(str(index), "weight_map", "missing or malformed") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(str(index), "weight_map", "must map tensor names to file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not (folder / name).is_file():
            raise InputError(str(folder / name), "", "no such file (named by the index)")
    return [folder / name for name in names]


def _all_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(str(folder), "", "no *.safetensors file")
    return files


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise InputError(str(path), "", "no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise InputError(str(path), "", f"not a safetensors file ({err})") from None


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors stores dense, unshared tensors: copy views and tied weights apart."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
