"""TEMPORARY stand-in (replaced by the models branch)."""
from __future__ import annotations
from pathlib import Path
import torch
from safetensors.torch import load_file

def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out |= load_file(f)
    return out
