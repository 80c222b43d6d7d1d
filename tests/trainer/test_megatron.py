"""The Megatron-core trainer's CPU half: the name and layout mapping (HF -> Megatron -> HF bit
for bit; grouped-query, multi-query and multi-head attention; tied and untied embeddings;
q/k/v biases; both layer specs), the config mapping and its refusals, and, with
megatron-core installed, a real ``GPTModel`` built on CPU from the tiny model: its names and
shapes are the mapping's, it takes the weights and gives them back unchanged, and its
logits equal transformers'.

What is faked, and only here (:func:`cpu_forward`): Megatron's forward pass has three CUDA
edges: the rotary embedding moves its frequencies to ``torch.cuda.current_device()``
(patched to answer "cpu"), and the attention dropout forks the CUDA RNG tracker (patched
to a no-op; dropout is 0). The third, the default causal mask made on CUDA, is not faked:
``model.causal_mask`` passes an explicit mask off CUDA. With them, one training step equals
the reference trainer's (loss, metrics, gradients, updated weights). CUDA steps, bfloat16
and the reload into vLLM need a GPU: ``scripts/device-check``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pearl.agents.batches import RolloutBatch

if TYPE_CHECKING:
    from torch import Tensor

    from pearl.trainer.grpo import GrpoTrainer
    from pearl.trainer.model import PolicyModel

torch = pytest.importorskip("torch", reason="needs the engine extra: pip install 'pearl[engine]'")

from hf_models import transformers_model  # noqa: E402

from pearl.engines.reference.config import ModelConfig, load_config  # noqa: E402
from pearl.engines.reference.tiny import init_model  # noqa: E402
from pearl.engines.reference.weights import read_weights, write_weights  # noqa: E402
from pearl.io.documents import InputError  # noqa: E402
from pearl.trainer.megatron import names  # noqa: E402
from pearl.trainer.megatron.config import (  # noqa: E402
    gpt_model_kwargs,
    load_megatron_config,
    parse_options,
    transformer_config_kwargs,
)

TOL = 1e-4  # logits, float32, Megatron's CPU forward against transformers'
# megatron-core warns of what it falls back to without Apex and Transformer Engine, and of
# its own deprecations
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _variant(root: Path, name: str, **kwargs: int) -> Path:
    """A one-layer tiny Qwen3 written by ``init_model`` with other head counts."""
    return init_model(
        root / name,
        layers=1,
        hidden=64,
        heads=kwargs["heads"],
        kv_heads=kwargs["kv_heads"],
        vocab=300,
    )


def _untie(src: Path, out: Path, seed: int = 3) -> Path:
    """A copy of ``src`` with an untied, random ``lm_head.weight``."""
    shutil.copytree(src, out)
    doc = json.loads((out / "config.json").read_text())
    doc["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(doc))
    weights = read_weights(src)
    emb = weights["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(seed)
    weights["lm_head.weight"] = torch.randn(emb.shape, generator=gen) * 0.3
    write_weights(out, weights)
    return out


def _with_qkv_bias(
    cfg: ModelConfig, weights: dict[str, torch.Tensor]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Qwen2's layout: biases on q, k, v (random, so that their layout shows)."""
    cfg = dataclasses.replace(cfg, architecture="Qwen2ForCausalLM", attention_bias=True)
    gen = torch.Generator().manual_seed(4)
    out = dict(weights)
    for name, shape in names.hf_shapes(cfg).items():
        if name.endswith("_proj.bias"):
            out[name] = torch.randn(shape, generator=gen)
    return cfg, out


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron-models")
    return {
        "gqa-tied": tiny_model_dir,  # 4 heads, 2 kv heads, tied (the session's tiny model)
        "gqa-untied": _untie(tiny_model_dir, root / "untied"),
        "mha": _variant(root, "mha", heads=4, kv_heads=4),
        "mqa": _variant(root, "mqa", heads=4, kv_heads=1),
    }


# -- 1. the mapping, without megatron ------------------------------------------------------


@pytest.mark.parametrize("spec", names.SPECS)
@pytest.mark.parametrize("which", ["gqa-tied", "gqa-untied", "mha", "mqa", "qkv-bias"])
def test_hf_to_megatron_to_hf_is_bit_for_bit(
    models: dict[str, Path], which: str, spec: names.Spec
) -> None:
    path = models["gqa-untied" if which == "qkv-bias" else which]
    cfg, hf = load_config(path), read_weights(path)
    if which == "qkv-bias":
        cfg, hf = _with_qkv_bias(cfg, hf)
    mg = names.hf_to_megatron(hf, cfg, spec)
    assert {k: tuple(v.shape) for k, v in mg.items()} == names.megatron_shapes(cfg, spec)
    back = names.megatron_to_hf(mg, cfg, spec)
    assert list(back) == list(names.hf_shapes(cfg))
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    tied = cfg.tie_word_embeddings
    assert ("output_layer.weight" in mg) is (not tied) and ("lm_head.weight" in back) is not tied


def test_qkv_is_interleaved_per_query_group_and_fc1_is_gate_then_up() -> None:
    """4 query heads in 2 groups, head_dim 1: each row holds its own label."""
    cfg = _config(heads=4, kv_heads=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # q heads 0..3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = names.fuse_qkv(q, k, v, cfg)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert [t.flatten().tolist() for t in names.split_qkv(fused, cfg)] == [
        [10, 11, 12, 13],
        [20, 21],
        [30, 31],
    ]
    hf = {k: torch.zeros(s) for k, s in names.hf_shapes(cfg).items()}
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.full((6, 4), 1.0)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.full((6, 4), 2.0)
    fc1 = names.hf_to_megatron(hf, cfg)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1[:, 0].tolist() == [1.0] * 6 + [2.0] * 6


def test_the_specs_differ_only_in_where_the_norms_live(tiny_model_dir: Path) -> None:
    cfg = load_config(tiny_model_dir)
    local, te = names.megatron_shapes(cfg, "local"), names.megatron_shapes(cfg, "te")
    only_local = {k.split(".", 3)[3] for k in set(local) - set(te)}
    only_te = {k.split(".", 3)[3] for k in set(te) - set(local)}
    assert only_local == {"input_layernorm.weight", "pre_mlp_layernorm.weight"}
    assert only_te == {
        "self_attention.linear_qkv.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_weight",
    }
    assert local["decoder.layers.0.self_attention.q_layernorm.weight"] == (cfg.head_dim,)
    assert names.megatron_name("model.layers.1.self_attn.k_norm.weight") == (
        "decoder.layers.1.self_attention.k_layernorm.weight"
    )


def test_weights_that_do_not_fit_are_named(tiny_model_dir: Path) -> None:
    cfg, hf = load_config(tiny_model_dir), read_weights(tiny_model_dir)
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        names.hf_to_megatron(missing, cfg)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.extra\.weight: not a tensor"):
        names.hf_to_megatron({**hf, "model.layers.0.extra.weight": torch.zeros(1)}, cfg)
    bad = {**hf, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"^model\.norm\.weight: shape \[3\]"):
        names.hf_to_megatron(bad, cfg)
    # a tied checkpoint that carries its head: dropped when equal, refused when not
    emb = hf["model.embed_tokens.weight"]
    same = names.hf_to_megatron({**hf, "lm_head.weight": emb.clone()}, cfg)
    assert "output_layer.weight" not in same
    with pytest.raises(ValueError, match=r"^lm_head\.weight: differs"):
        names.hf_to_megatron({**hf, "lm_head.weight": emb + 1}, cfg)
    mg = names.hf_to_megatron(hf, cfg)
    del mg["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match=r"^decoder\.final_layernorm\.weight: missing"):
        names.megatron_to_hf(mg, cfg)


def _config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=6,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        eos_token_ids=(1,),
        bos_token_id=None,
        torch_dtype="float32",
        model_type="qwen3",
    )


# -- 3. the config mapping -----------------------------------------------------------------


def test_the_tiny_config_maps_to_megatrons_arguments(tiny_model_dir: Path) -> None:
    cfg = load_megatron_config(tiny_model_dir)
    kwargs = transformer_config_kwargs(cfg, on_cpu=True)
    assert {
        k: kwargs[k]
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
            "use_cpu_initialization",
        )
    } == {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 192,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-6,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "use_cpu_initialization": True,
    }
    gpt = gpt_model_kwargs(cfg)
    assert (gpt["vocab_size"], gpt["position_embedding_type"], gpt["rotary_base"]) == (
        512,
        "rope",
        1e6,
    )
    assert gpt["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        pytest.param({"hidden_act": "gelu"}, "hidden_act", id="activation"),
        pytest.param(
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", id="scaled-rope"
        ),
        pytest.param({"use_sliding_window": True}, "use_sliding_window", id="sliding-window"),
        pytest.param({"attention_bias": True}, "attention_bias", id="o-proj-bias"),
        pytest.param({"mlp_bias": True}, "mlp_bias", id="mlp-bias"),
        pytest.param({"attention_dropout": 0.1}, "attention_dropout", id="dropout"),
        pytest.param({"torch_dtype": "float16"}, "torch_dtype", id="float16"),
        pytest.param({"architectures": ["Qwen3MoeForCausalLM"]}, "architectures", id="moe"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line_naming_the_field(
    tiny_model_dir: Path, tmp_path: Path, edit: dict[str, object], field: str
) -> None:
    doc = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**doc, **edit}))
    with pytest.raises(InputError) as err:
        load_megatron_config(tmp_path)
    message = str(err.value)
    assert "\n" not in message and err.value.field == field
    assert message.startswith(f"{tmp_path / 'config.json'}: {field}: ")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        pytest.param({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size", id="tp"),
        pytest.param({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size", id="pp"),
        pytest.param({"compute_dtype": "float16"}, "compute_dtype", id="float16"),
        pytest.param({"spec": "apex"}, "spec", id="spec"),
        pytest.param({"lr": 1e-6}, "lr", id="lr-is-the-trainer-configs"),
        pytest.param({"learning_rate": 1e-6}, "learning_rate", id="unknown"),
    ],
)
def test_unsupported_options_are_refused_naming_the_field(
    options: dict[str, object], field: str
) -> None:
    with pytest.raises(InputError) as err:
        parse_options(options)
    assert err.value.field == field and "\n" not in str(err.value)
    assert parse_options().spec == "auto"


def test_the_mapping_modules_import_no_megatron() -> None:
    code = (
        "import sys, pearl.trainer.megatron.config, pearl.trainer.megatron.names; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


# -- 2. a real GPTModel on CPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_cpu() -> Iterator[object]:
    """Megatron's parallel state for this process (gloo, world size 1)."""
    pytest.importorskip(
        "megatron.core", reason="needs the megatron extra: pip install 'pearl[megatron]'"
    )
    from pearl.trainer.megatron import model

    model.init_parallel(torch.device("cpu"))
    yield model
    model.destroy_parallel()


@contextlib.contextmanager
def cpu_forward() -> Iterator[None]:
    """The two CUDA calls of Megatron's forward, answered for the CPU (module docstring)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())
        yield


def _build(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    from pearl.trainer.megatron import model

    cfg = load_megatron_config(path)
    return cfg, model.build_model(cfg, spec="local", device=torch.device("cpu"))


@pytest.mark.parametrize("which", ["gqa-tied", "gqa-untied", "mqa"])
def test_a_cpu_built_gpt_model_has_the_mappings_names_and_shapes(
    megatron_cpu: object, models: dict[str, Path], which: str
) -> None:
    from pearl.trainer.megatron import model

    cfg, gpt = _build(models[which])
    have = {k: tuple(v.shape) for k, v in model.megatron_tensors(gpt).items()}
    hf = read_weights(models[which])
    mapped = names.hf_to_megatron(hf, cfg, "local")
    assert have == {k: tuple(v.shape) for k, v in mapped.items()}
    assert have == names.megatron_shapes(cfg, "local")
    assert all(k.endswith(model.EXTRA_STATE) for k in set(gpt.state_dict()) - set(have)), (
        "only Megatron's _extra_state entries are not weights"
    )
    model.load_hf_weights(gpt, hf, cfg, "local")
    back = model.hf_weights(gpt, cfg, "local")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("which", ["gqa-tied", "gqa-untied", "mha", "mqa"])
def test_cpu_logits_equal_transformers(
    megatron_cpu: object, models: dict[str, Path], which: str
) -> None:
    transformers = pytest.importorskip("transformers")
    from pearl.trainer.megatron import model

    cfg, gpt = _build(models[which])
    model.load_hf_weights(gpt, read_weights(models[which]), cfg, "local")
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(5))
    gpt.eval()
    with torch.no_grad(), cpu_forward():
        ours = model.logits(gpt, ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(models[which]).eval()
    with torch.no_grad():
        theirs = ref(ids).logits
    assert ours.shape == theirs.shape == (2, 11, cfg.vocab_size)
    assert (ours - theirs).abs().max().item() < TOL


def test_qkv_biases_reach_the_right_heads(megatron_cpu: object, tmp_path: Path) -> None:
    """A Qwen2 with random q/k/v biases, written by transformers, against its logits."""
    pytest.importorskip("transformers")
    from pearl.trainer.megatron import model

    torch.manual_seed(6)
    ref = transformers_model("qwen2", num_hidden_layers=1, initializer_range=0.3).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
    ref.save_pretrained(tmp_path)
    cfg, gpt = _build(tmp_path)
    assert cfg.attention_bias and not cfg.qk_norm
    model.load_hf_weights(gpt, read_weights(tmp_path), cfg, "local")
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(7))
    gpt.eval()
    with torch.no_grad(), cpu_forward():
        ours = model.logits(gpt, ids)
    with torch.no_grad():
        theirs = ref(ids).logits
    assert (ours - theirs).abs().max().item() < TOL


def test_the_transformer_engine_spec_needs_transformer_engine(megatron_cpu: object) -> None:
    from pearl.trainer.megatron import model

    if model.transformer_engine_available():
        pytest.skip("transformer_engine is installed: the TE spec is built on the GPU check")
    assert model.resolve_spec("auto") == "local"


def test_token_logprobs_are_transformers_log_softmax(
    megatron_cpu: object, models: dict[str, Path]
) -> None:
    """The trainer's logprobs (Megatron's vocab-parallel cross entropy, negated)."""
    transformers = pytest.importorskip("transformers")
    from pearl.trainer.megatron import model

    cfg, gpt = _build(models["gqa-untied"])
    model.load_hf_weights(gpt, read_weights(models["gqa-untied"]), cfg, "local")
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(8))
    gpt.eval()
    with torch.no_grad(), cpu_forward():
        ours = model.token_logprobs(gpt, ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["gqa-untied"]).eval()
    with torch.no_grad():
        logp = ref(ids).logits.log_softmax(-1)
    theirs = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert ours.shape == (2, 9) and (ours - theirs).abs().max().item() < TOL


def test_an_export_is_a_model_directory_with_the_same_weights(
    megatron_cpu: object, models: dict[str, Path], tmp_path: Path
) -> None:
    """Version 0 exported: bit for bit the weights it was built from, beside the model
    directory's config (the reference trainer's layout, ``pearl.trainer.grpo``);
    checkpoints and offload keep the weights."""
    from pearl.trainer.megatron.trainer import MegatronTrainer

    src = models["gqa-untied"]
    trainer = MegatronTrainer.start(src, device=torch.device("cpu"))
    out = trainer.export_weights(tmp_path / "exports")
    assert out == tmp_path / "exports" / "v000000"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    hf, back = read_weights(src), read_weights(out)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert trainer.export_weights(tmp_path / "exports") == out  # replaced whole
    assert [p.name for p in (tmp_path / "exports").iterdir()] == ["v000000"]
    trainer.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "trainer.json").is_file()
    trainer.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        trainer.logprobs([1, 2, 3])
    trainer.onload()
    trainer.load_checkpoint(tmp_path / "ckpt")
    again = read_weights(trainer.export_weights(tmp_path / "again"))
    assert trainer.version == 0 and all(torch.equal(again[k], hf[k]) for k in hf)


# -- 4. the same update as the reference trainer -------------------------------------------

AGREE = 1e-5  # loss, metrics and updated weights, Megatron's CPU step against the reference's
GRAD_AGREE = 1e-6  # each optimizer step's gradient, through the name mapping (seen: 1e-7)
# every knob that changes the loss away from its on-policy value: two minibatches (the
# second one's ratio is off 1 and clipped), microbatches of two sequences, a cap that
# masks tokens, clip-higher, the KL to a reference model, the gradient clipped. adam_eps
# 1e-4, not the default 1e-8: Adam's first step is lr * g / (|g| + eps), whose slope in g
# is up to lr / eps, so at the default a gradient element near 1e-8 turns the two
# forwards' float32 rounding (gradients agree to ~1e-7) into a weight gap of ~3e-5 (one
# element in 131k, seen); at 1e-4 that gain is at most lr / eps = 10.
AGREE_CONFIG: dict[str, float] = {
    "lr": 1e-3,
    "adam_eps": 1e-4,
    "minibatches": 2,
    "max_tokens_per_microbatch": 24,
    "eps_clip": 0.1,
    "eps_clip_high": 0.15,
    "behav_imp_weight_cap": 1.5,
    "kl_coef": 0.05,
    "grad_clip": 0.5,
    "seed": 3,
}


def _agreement_batch(policy: PolicyModel) -> RolloutBatch:
    """Three groups of four completions sampled from the model, their behaviour logprobs
    perturbed (an older policy's, as it were: importance weights off 1, some over the
    cap); one trajectory ``agent_error``, one with a NaN reward, one token's logprob -inf."""
    from rollouts import batch_of, sample, subset_reward, trajectory

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (5,), generator=gen).tolist() for _ in range(3)]
    subset = frozenset(range(3, 200))
    trajs = []
    for i, (p, o, lp) in enumerate(sample(policy, prompts, 4, 6, gen)):
        noise = 0.4 * torch.randn(len(lp), generator=gen)
        noisy = (torch.tensor(lp) + noise).clamp(max=0.0).tolist()  # still logprobs
        end = "agent_error" if i == 1 else "answered"
        reward = float("nan") if i == 6 else subset_reward(o, subset)
        trajs.append(trajectory(f"t{i}", p, o, noisy, 0, reward, end_reason=end))
    trajs[9].logprobs[5 + 2] = float("-inf")  # its third generated token
    return batch_of(0, 0, trajs, 4)


def _record_gradients(trainer: GrpoTrainer, mp: pytest.MonkeyPatch) -> list[dict[str, Tensor]]:
    """Each optimizer step's gradients (after the clip), by the trainer's parameter names."""
    seen: list[dict[str, Tensor]] = []
    step = trainer.optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        params = trainer.optimizer.param_groups[0]["params"]
        seen.append({n: p.grad.clone() for n, p in zip(trainer.names, params, strict=True)})
        return step(*args, **kwargs)

    mp.setattr(trainer.optimizer, "step", recording)
    return seen


@pytest.mark.parametrize("which", ["gqa-tied", "gqa-untied"])
def test_one_step_equals_the_reference_trainers(
    megatron_cpu: object, models: dict[str, Path], which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``train_step`` of ``MegatronTrainer`` (Megatron's CPU forward, float32) and of
    ``ReferenceTrainer`` from the same model on the same batch with the same
    ``TrainerConfig``: the same loss and metrics, the same gradient at each optimizer step
    and the same updated weights, under Hugging Face names (both step torch's AdamW)."""
    from pearl.trainer.config import TrainerConfig
    from pearl.trainer.megatron.config import parse_options
    from pearl.trainer.megatron.trainer import MegatronTrainer
    from pearl.trainer.reference import ReferenceTrainer

    config = TrainerConfig.model_validate(AGREE_CONFIG)
    ref = ReferenceTrainer(models[which], config)
    batch = _agreement_batch(ref.model)
    options = parse_options({"spec": "local", "compute_dtype": "float32"})
    meg = MegatronTrainer.start(models[which], config, options, device=torch.device("cpu"))
    grads_meg, grads_ref = _record_gradients(meg, monkeypatch), _record_gradients(ref, monkeypatch)
    with cpu_forward():
        got = meg.train_step(batch)
    want = ref.train_step(batch)
    for name, value in dataclasses.asdict(want).items():
        if name != "time_s":
            assert getattr(got, name) == pytest.approx(value, abs=AGREE), name
    # the batch exercises what it should: masked trajectories, the cap, the clip, the KL
    assert want.tokens == 10 * 6 - 1 and want.clip_fraction > 0 and want.kl and want.kl > 0
    assert want.importance_weight_mean != pytest.approx(1.0, abs=1e-3)
    assert want.grad_norm > AGREE_CONFIG["grad_clip"]
    assert len(grads_meg) == len(grads_ref) == 2
    grad_gap = 0.0
    for mine_g, theirs_g in zip(grads_meg, grads_ref, strict=True):
        mapped = names.megatron_to_hf(mine_g, meg.cfg, "local")
        assert mapped.keys() == theirs_g.keys()
        grad_gap = max(grad_gap, *((mapped[k] - theirs_g[k]).abs().max().item() for k in mapped))
    mine, theirs = meg.hf_weights(), ref.hf_weights()
    assert mine.keys() == theirs.keys()
    gap = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    start = read_weights(models[which])
    moved = max((theirs[k] - start[k]).abs().max().item() for k in theirs)
    assert grad_gap < GRAD_AGREE and gap < AGREE and moved > 100 * AGREE, (grad_gap, gap, moved)
