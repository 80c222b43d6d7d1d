"""pearl's weight sync inside vLLM: a worker extension that loads the trainer's published
weights from a directory.

vLLM mixes the class named by ``--worker-extension-cls`` into every worker (each tensor-
parallel rank); its methods are then callable over ``POST /collective_rpc {"method",
"kwargs"}`` (``VLLM_SERVER_DEV_MODE=1``), which runs them on every worker and answers the
list of their results. :class:`PublishedWeights` adds one:

``load_published_weights(weights_path, weight_version=None)`` reads every
``*.safetensors`` file of ``weights_path`` (what the trainer's ``export_weights`` writes:
``model.safetensors`` with Hugging Face names, ``pearl.trainer.protocol``) tensor by
tensor on the host, and hands them to the model's own ``load_weights`` (vLLM's loader
for the architecture: it maps Hugging Face names onto its fused, sharded parameters and
copies each into place on this rank's GPU). It answers ``{"weight_version", "tensors"}``.

Why not vLLM's ``reload_weights``: it reloads from the model path the engine started
with, and the trainer publishes each version to a new directory. pearl's reference engine
answers the same method (``pearl.engines.reference.server``), so the one client call
(:meth:`pearl.engines.client.EngineClient.reload_weights` with a path) drives both.

Nothing here imports vLLM: the class is resolved by name inside vLLM's worker, where
``self.model_runner`` is vLLM's. The engine must be awake (its weights on the GPU): the
agent wakes an engine before it syncs one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXTENSION = "pearl.engines.vllm_weights.PublishedWeights"  # --worker-extension-cls
METHOD = "load_published_weights"  # its collective_rpc method


def weight_files(weights_path: str | Path) -> list[Path]:
    """The directory's safetensors files; a ``FileNotFoundError`` naming it if none."""
    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{weights_path}: no .safetensors files")
    return files


def published_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor of the files, one at a time, on the host."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


class PublishedWeights:
    """Mixed into vLLM's worker (the module docstring); ``model_runner`` is the worker's."""

    model_runner: Any

    def load_published_weights(
        self, weights_path: str, weight_version: int | None = None
    ) -> dict[str, Any]:
        files = weight_files(weights_path)  # before the model is touched
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in published_tensors(files):
                count += 1
                yield item

        import torch

        with torch.no_grad():
            self.model_runner.model.load_weights(counted())
        return {"weight_version": weight_version, "tensors": count}
