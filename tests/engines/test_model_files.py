"""The reference engine's model files: ``pearl model init`` writes a tiny Qwen3 that
transformers loads as its own; configs, weights, the tokenizer, the chat template and tool
calls read back as transformers and vLLM read them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the engine extra: pip install 'pearl[engine]'")
transformers = pytest.importorskip("transformers", reason="needs the dev extra")

import torch  # noqa: E402

from pearl.engines.reference.config import ModelConfig, load_config  # noqa: E402
from pearl.engines.reference.tiny import init_model  # noqa: E402
from pearl.engines.reference.tokenizer import ChatTemplateError, load  # noqa: E402
from pearl.engines.reference.tool_calls import parse_tool_calls  # noqa: E402
from pearl.engines.reference.weights import (  # noqa: E402
    read_weights,
    tensors_from_bytes,
    weights_bytes,
    write_weights,
)
from pearl.io.documents import InputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Köln"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain, 14 C"},
    {"role": "assistant", "content": "Paris: sunny. Köln: rain."},
    {"role": "user", "content": "Thanks!"},
]
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "max_position_embeddings": 8192,
    "attention_bias": True,
    "bos_token_id": 0,
    "eos_token_id": [5, 6],
    "dtype": "float16",
}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _write_config(folder: Path, doc: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


# ---- pearl model init -----------------------------------------------------------------


def test_init_writes_a_hugging_face_directory(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "pearl_model.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = load_config(tiny_model_dir)
    assert config == ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        eos_token_ids=config.eos_token_ids,
        bos_token_id=config.bos_token_id,
        torch_dtype="float32",
        model_type="qwen3",
    )
    tokenizer = load(tiny_model_dir)
    assert config.eos_token_ids[0] == tokenizer.eos_token_id == tokenizer.token_id("<|im_end|>")
    assert tokenizer.token_id("<|endoftext|>") in config.eos_token_ids
    weights = read_weights(tiny_model_dir)
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (512, 64)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert weights["model.layers.0.self_attn.q_norm.weight"].eq(1).all()
    assert 0.27 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.33  # DEFAULT_STD


def test_transformers_loads_and_generates(tiny_model_dir: Path) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = read_weights(tiny_model_dir)
    theirs = model.state_dict()
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])  # tied
    assert all(torch.equal(theirs[name], t) for name, t in ours.items())
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
    )
    assert out.shape == (1, 7)


def test_transformers_tokenizer_encodes_like_ours(tiny_model_dir: Path, hf_tokenizer: Any) -> None:
    ours = load(tiny_model_dir)
    assert len(hf_tokenizer) == ours.vocab_size == 512
    assert hf_tokenizer.eos_token_id == ours.eos_token_id
    for text in [
        "Slurm lends GPUs to rollout.",
        "naïve 日本語 <tool_call>{}</tool_call><|im_end|>",
    ]:
        ids = ours.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == ours.decode(ids)


def test_chat_templates_agree_with_transformers(tiny_model_dir: Path, hf_tokenizer: Any) -> None:
    ours = load(tiny_model_dir)
    for messages, tools, add in [(CONVERSATION, TOOLS, True), (CONVERSATION[1:2], None, False)]:
        theirs = hf_tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add, tokenize=False
        )
        assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add) == theirs
    prompt = ours.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert '"name": "get_weather"' in prompt and "<tool_response>\nrain, 14 C\n" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Köln"}}' in prompt
    assert prompt.endswith("Thanks!<|im_end|>\n<|im_start|>assistant\n")
    no_think = ours.apply_chat_template(CONVERSATION[1:2], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_template_refuses_a_late_system_message(tiny_model_dir: Path) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="first message"):
        load(tiny_model_dir).apply_chat_template(messages)


def test_templates_of_other_models_render(tmp_path: Path, tiny_model_dir: Path) -> None:
    """transformers' template features: a template file, namespaces, loop controls and
    ``{% generation %}`` blocks."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if m.role == 'tool' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content | "
        "tojson }}{% endgeneration %}{% endfor %}{{ ns.n }}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "é"}, {"role": "tool", "content": "x"}]
    assert load(tmp_path).apply_chat_template(messages) == '"é"1<|im_end|>'


def test_init_is_deterministic_and_seeded(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = init_model(tmp_path / "again", seed=0)
    other = init_model(tmp_path / "other", seed=1)
    for path in tiny_model_dir.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (again / weights).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_init_options_and_refusals(tmp_path: Path) -> None:
    path = init_model(
        tmp_path / "m",
        layers=1,
        hidden=32,
        heads=2,
        kv_heads=1,
        head_dim=8,
        intermediate=40,
        vocab=300,
        dtype="bfloat16",
    )
    config = load_config(path)
    assert (config.head_dim, config.intermediate_size, config.torch_dtype) == (8, 40, "bfloat16")
    assert read_weights(path)["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert load(path).vocab_size <= 300 == config.vocab_size
    init_model(path, seed=3)  # a pearl model is replaced
    with pytest.raises(InputError, match="vocab: must be at least 263"):
        init_model(tmp_path / "small", vocab=100)
    with pytest.raises(InputError, match="kv_heads: must divide heads"):
        init_model(tmp_path / "kv", heads=4, kv_heads=3)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a pearl model"):
        init_model(busy)
    assert (busy / "notes.txt").read_text() == "mine"
    init_model(busy, overwrite=True)
    assert not (busy / "notes.txt").exists() and (busy / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_init_prints_one_json_line(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    args = ["model", "init", "--out", str(out), "--layers", "1", "--seed", "7"]
    done = _pearl(*args)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    report = json.loads(line)
    assert report["path"] == str(out.resolve()) and "model.safetensors" in report["files"]
    assert report["parameters"] == sum(t.numel() for t in read_weights(out).values())
    bad = _pearl("model", "init", "--out", str(tmp_path / "x"), "--layers", "two")
    assert bad.returncode == 2 and "--layers: 'two' is not a whole number" in bad.stderr
    small = _pearl("model", "init", "--out", str(tmp_path / "y"), "--vocab", "10")
    assert (small.returncode, small.stdout) == (2, "")
    assert small.stderr.splitlines() == [
        "pearl: error: <model init>: vocab: must be at least 263 (bytes and specials)"
    ]


def _pearl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


# ---- configuration ---------------------------------------------------------------------


def test_load_config_reads_qwen2_and_llama(tmp_path: Path) -> None:
    qwen2 = load_config(_write_config(tmp_path / "qwen2", QWEN2_CONFIG))
    assert (qwen2.head_dim, qwen2.num_key_value_heads) == (16, 2)
    assert qwen2.attention_bias and not qwen2.qk_norm and not qwen2.tie_word_embeddings
    assert (qwen2.eos_token_ids, qwen2.bos_token_id, qwen2.torch_dtype) == ((2,), 1, "bfloat16")
    llama_dir = _write_config(tmp_path / "llama", LLAMA_CONFIG)
    (llama_dir / "generation_config.json").write_text('{"eos_token_id": [6, 7]}')
    llama = load_config(llama_dir)
    assert (llama.num_key_value_heads, llama.head_dim, llama.rope_theta) == (4, 64, 500000.0)
    assert llama.attention_bias and llama.eos_token_ids == (5, 6, 7)
    assert (llama.torch_dtype, llama.model_type) == ("float16", "llama")
    mistral = {**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    mistral.pop("dtype")
    assert load_config(_write_config(tmp_path / "mistral", mistral)).torch_dtype == "float32"


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures", "is not supported"),
        ({"architectures": None}, "architectures", "must be a list"),
        ({"hidden_size": None}, "hidden_size", "missing"),
        ({"hidden_size": "128"}, "hidden_size", "must be an integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers", "must be at least 1"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
        ({"rms_norm_eps": -1}, "rms_norm_eps", "must be a positive number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", "must be true or false"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", "not supported"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "rope_parameters", "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act", "not supported"),
        ({"use_sliding_window": True}, "use_sliding_window", "not supported"),
        ({"torch_dtype": "float64"}, "torch_dtype", "not supported"),
        ({"eos_token_id": "</s>"}, "eos_token_id", "must be a token id"),
    ],
)
def test_bad_config_fields_are_named(
    tmp_path: Path, change: dict[str, Any], field: str, problem: str
) -> None:
    doc = {k: v for k, v in {**QWEN2_CONFIG, **change}.items() if v is not None}
    folder = _write_config(tmp_path, doc)
    with pytest.raises(InputError) as err:
        load_config(folder)
    assert (err.value.path, err.value.field) == (str(folder / "config.json"), field)
    assert problem in err.value.problem


def test_default_rope_scaling_and_missing_files(tmp_path: Path) -> None:
    plain = {**QWEN2_CONFIG, "rope_scaling": {"rope_type": "default"}}
    assert load_config(_write_config(tmp_path / "plain", plain)).rope_theta == 1e6
    with pytest.raises(InputError, match=re.escape("config.json: (document): no such file")):
        load_config(tmp_path / "absent")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    with pytest.raises(InputError, match="malformed JSON"):
        load_config(tmp_path / "broken")


# ---- weights ---------------------------------------------------------------------------


def test_weights_round_trip_files_and_bytes(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "a.weight": base,
        "b.weight": base.t(),
        "c.bias": torch.zeros(2, dtype=torch.bfloat16),
    }
    write_weights(tmp_path, tensors)
    back = read_weights(tmp_path)
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    again = tensors_from_bytes(weights_bytes(tensors))
    assert all(torch.equal(again[k], v) for k, v in tensors.items())
    with pytest.raises(InputError, match="not a safetensors document"):
        tensors_from_bytes(b"\x00" * 16)


def test_sharded_weights_follow_the_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"y": torch.zeros(3)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"stray": torch.zeros(1)}, tmp_path / "other.safetensors")
    index = {
        "weight_map": {
            "x": "model-00001-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(read_weights(tmp_path)) == ["x", "y"]


def test_weight_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such model directory"):
        read_weights(tmp_path / "absent")
    with pytest.raises(InputError, match=re.escape("no *.safetensors file")):
        read_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not a header")
    with pytest.raises(InputError) as err:
        read_weights(tmp_path)
    assert err.value.path == str(tmp_path / "model.safetensors")


# ---- tokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["Slurm preempts elastic GPUs.\n  def f(x): return x", "naïve café — 日本語 🤖", " lead space"],
)
def test_tokenizer_round_trip(tiny_model_dir: Path, text: str) -> None:
    tokenizer = load(tiny_model_dir)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_and_token_text(tiny_model_dir: Path) -> None:
    tokenizer = load(tiny_model_dir)
    ids = tokenizer.encode("<|im_start|>hi<think>x</think><|im_end|>")
    assert ids[0] == tokenizer.token_id("<|im_start|>") and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "hi<think>x</think>"  # tags are not special
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>hi")
    assert (
        "".join(tokenizer.token_text(i) for i in tokenizer.encode("GPU rollout")) == "GPU rollout"
    )
    assert tokenizer.token_text(tokenizer.eos_token_id or 0) == "<|im_end|>"


def test_tokenizer_missing_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(InputError, match=re.escape("tokenizer.json: (document): no such file")):
        load(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    missing_config = re.escape("tokenizer_config.json: (document): no such file")
    with pytest.raises(InputError, match=missing_config):
        load(tmp_path)


# ---- tool calls ------------------------------------------------------------------------


def test_tool_calls_become_openai_entries() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n'
        '</tool_call>\n<tool_call>{"name": "now"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, id_seed="req-1")
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Köln"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls(text, id_seed="req-1")[1] == calls  # ids from the seed
    assert parse_tool_calls(text)[1][0]["id"] != parse_tool_calls(text)[1][0]["id"]  # random


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("plain answer ", "plain answer", []),
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, ["f"]),
        ("<tool_call>{not json}</tool_call> rest", "<tool_call>{not json}</tool_call> rest", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        ('a <tool_call>{"name": "f"}', "a", ["f"]),  # generation stopped before the tag
        ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),
        ("", None, []),
    ],
)
def test_tool_call_cases(text: str, content: str | None, names: list[str]) -> None:
    got_content, calls = parse_tool_calls(text, id_seed="s")
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names
