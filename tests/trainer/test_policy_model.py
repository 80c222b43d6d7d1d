"""The trainer's torch model against ``transformers`` on the same weights: the tiny Qwen3
batched with right padding, Qwen2 and Llama directories; its parameters are the engine's
under Hugging Face names, and every one of them gets a gradient. (Against the reference
engine's behaviour logprobs: ``test_publish.py``, which starts an engine.)"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import transformers_model  # noqa: E402

from pearl.engines.reference.model import WeightError, weight_shapes  # noqa: E402
from pearl.engines.reference.weights import read_weights  # noqa: E402
from pearl.trainer.model import PolicyModel  # noqa: E402

TOL = 1e-4


def _hf_logits(model_dir: Path, *rows: torch.Tensor) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [hf(r[None]).logits[0] for r in rows]


def test_right_padded_batch_matches_transformers(tiny_model_dir: Path) -> None:
    m = PolicyModel.from_dir(tiny_model_dir)
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == weight_shapes(m.cfg)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 500, (n,), generator=gen) for n in (24, 9, 16)]
    ids = torch.zeros(3, 24, dtype=torch.long)  # right padding with id 0
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    with torch.no_grad():
        logits, logprobs = m.logits(ids), m.token_logprobs(ids)
    for i, (r, ref) in enumerate(zip(rows, _hf_logits(tiny_model_dir, *rows), strict=True)):
        n = len(r)
        assert (logits[i, :n] - ref).abs().max() < TOL
        ref_lp = torch.log_softmax(ref[:-1], -1).gather(-1, r[1:, None]).squeeze(-1)
        assert (logprobs[i, 1:n] - ref_lp).abs().max() < TOL
        assert logprobs[i, 0] == 0.0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_qwen2_and_llama_match_transformers(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers_model(arch).save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    m = PolicyModel.from_dir(tmp_path)
    assert m.lm_head is not None and m.cfg.attention_bias is (arch == "qwen2")
    with torch.no_grad():
        assert (m.logits(ids[None])[0] - _hf_logits(tmp_path, ids)[0]).abs().max() < TOL


def test_every_parameter_gets_a_gradient_and_bad_weights_change_nothing(
    tiny_model_dir: Path,
) -> None:
    m = PolicyModel.from_dir(tiny_model_dir)
    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    m.token_logprobs(ids).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    before = m.hf_state_dict()
    weights = read_weights(tiny_model_dir)
    with pytest.raises(WeightError, match="shape"):
        m.load_weights(weights | {"model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightError, match="missing"):
        m.load_weights({k: v for k, v in weights.items() if k != "model.norm.weight"})
    assert all(torch.equal(before[k], v) for k, v in m.hf_state_dict().items())
