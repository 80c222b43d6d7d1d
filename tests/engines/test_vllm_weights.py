"""pearl's weight sync inside vLLM (``pearl.engines.vllm_weights``) on the CPU: the
extension reads the published directory the trainer writes (a real tiny Qwen3's weights,
changed) and hands every tensor, by its Hugging Face name, to the model's ``load_weights``.

Fakes: vLLM's worker, that is ``self.model_runner.model``: here a transformers Qwen3 whose
``load_weights`` copies each named tensor into its parameter, the contract vLLM's model
classes keep (they also fuse and shard; that runs on a GPU: ``scripts/device-check``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pearl.engines.reference.weights import write_weights  # noqa: E402
from pearl.engines.vllm import VllmServe, render  # noqa: E402
from pearl.engines.vllm_weights import EXTENSION, METHOD, PublishedWeights  # noqa: E402


class _HfModel:
    """vLLM's model as its loader sees it: ``load_weights((name, tensor), ...)``."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.names: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.hf.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            self.names.append(name)
        return set(self.names)


class _Worker(PublishedWeights):
    def __init__(self, model: _HfModel) -> None:
        self.model_runner = type("Runner", (), {"model": model})()


def test_the_published_weights_reach_every_parameter(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _HfModel(tiny_model_dir)
    published = {n: p.detach() + 0.5 for n, p in model.hf.named_parameters()}
    write_weights(tmp_path / "v000003", published)
    out = _Worker(model).load_published_weights(str(tmp_path / "v000003"), 3)
    assert out == {"weight_version": 3, "tensors": len(published)}
    assert sorted(model.names) == sorted(published)
    for name, p in model.hf.named_parameters():
        assert torch.equal(p.detach(), published[name]), name


def test_a_directory_without_weights_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no .safetensors files"):
        _Worker(None).load_published_weights(str(tmp_path))  # type: ignore[arg-type]


def test_vllm_is_started_with_the_extension_and_the_client_calls_its_method() -> None:
    argv, _ = render(VllmServe("/m"), ())
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION
    module, _, cls = EXTENSION.rpartition(".")
    assert getattr(__import__(module, fromlist=[cls]), cls) is PublishedWeights
    assert hasattr(PublishedWeights, METHOD)
