"""The reference engine's forward pass against ``transformers`` on the same weights: whole
prompts, chunked prefill, batched decode of sequences of different lengths over scattered
cache slots, and the Qwen2/Llama variants (q/k/v bias, no q/k norm, untied head)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import transformers_model  # noqa: E402

from pearl.engines.reference.config import load_config  # noqa: E402
from pearl.engines.reference.model import CausalLM, KVPool, SeqInput, WeightError  # noqa: E402
from pearl.engines.reference.weights import read_weights  # noqa: E402

TOL = 1e-4


def _ours(model_dir: Path) -> CausalLM:
    m = CausalLM(load_config(model_dir), torch.float32)
    m.load(read_weights(model_dir))
    return m


def _reference_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def _slots(start: int, n: int, stride: int = 3) -> torch.Tensor:
    """Scattered slots, as blocks from a fragmented pool are."""
    return torch.arange(n, dtype=torch.long) * stride + start


def test_prefill_chunks_and_batched_decode_match_transformers(tiny_model_dir: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 500, (24,), generator=gen)
    b = torch.randint(0, 500, (9,), generator=gen)
    ref_a, ref_b = _reference_logits(tiny_model_dir, a), _reference_logits(tiny_model_dir, b)
    m = _ours(tiny_model_dir)
    kv = KVPool(m.cfg, 512, torch.float32)
    slots_a, slots_b = _slots(0, 24), _slots(1, 9)
    whole = m.forward([SeqInput(a.tolist(), 0, slots_a)], kv)
    assert (whole[0] - ref_a[-1]).abs().max() < TOL
    # chunked prefill of a (10 + 6 tokens) beside the whole prefill of b
    m.forward([SeqInput(a[:10].tolist(), 0, slots_a)], kv)
    out = m.forward(
        [SeqInput(a[10:16].tolist(), 10, slots_a), SeqInput(b.tolist(), 0, slots_b)], kv
    )
    assert (out[0] - ref_a[15]).abs().max() < TOL
    assert (out[1] - ref_b[-1]).abs().max() < TOL
    # one token at a time for a, batched with a sequence of another length
    for t in range(16, 24):
        out = m.forward([SeqInput([int(a[t])], t, slots_a), SeqInput([int(b[-1])], 8, slots_b)], kv)
        assert (out[0] - ref_a[t]).abs().max() < TOL
        assert (out[1] - ref_b[-1]).abs().max() < TOL


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_qwen2_and_llama_directories_match_transformers(arch: str, tmp_path: Path) -> None:
    transformers_model(arch).save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    ref = _reference_logits(tmp_path, ids)
    m = _ours(tmp_path)
    assert m.cfg.attention_bias is (arch == "qwen2") and not m.cfg.qk_norm
    out = m.forward([SeqInput(ids.tolist(), 0, _slots(0, 12))], KVPool(m.cfg, 64, torch.float32))
    assert (out[0] - ref[-1]).abs().max() < TOL


def test_weights_that_do_not_fit_are_refused_and_change_nothing(tiny_model_dir: Path) -> None:
    m = _ours(tiny_model_dir)
    before = m.state_dict()
    bad = {"model.norm.weight": torch.ones(3)}
    with pytest.raises(WeightError, match="shape"):
        m.load(bad, partial=True)
    with pytest.raises(WeightError, match="unexpected"):
        m.load({"model.nope.weight": torch.ones(3)}, partial=True)
    with pytest.raises(WeightError, match="missing"):
        m.load({"model.norm.weight": torch.ones(m.cfg.hidden_size)})
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    m.release()
    assert not m.loaded
