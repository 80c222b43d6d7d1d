"""The shipped runtime profiles (``pearl/profiles/*.yaml``): they parse, every number has a
source, and their numbers relate the way the hardware and the measurements say.

Source rule for the YAML text: every line holding a numeric scalar either carries an inline
``# ...`` comment, or belongs to a run of numeric lines (no blank or other line between)
directly under a full-line comment, which then sources the whole run.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import re
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml
from trace_files import traces_or_skip

from pearl.core.fitting import DecodeRecord, PrefillRecord, fit_engine_profile
from pearl.core.profile import RuntimeProfile

RAW = "the profiles' workload figures quote raw TraceLab and SWE-agent files"

PROFILES = ("qwen3-8b.yaml", "qwen3-30b-a3b.yaml")
REPO = Path(__file__).resolve().parents[2]
NUMERIC_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
INLINE_COMMENT = re.compile(r"^\s*[^\s#].*\s#\s*\S")
FULL_LINE_COMMENT = re.compile(r"^\s*#\s*\S")


def profile_text(name: str) -> str:
    return (importlib.resources.files("pearl") / "profiles" / name).read_text()


def load(name: str) -> RuntimeProfile:
    return RuntimeProfile.model_validate(yaml.safe_load(profile_text(name)))


def numeric_lines(text: str) -> set[int]:
    """0-based line numbers of the int and float scalars of a YAML document."""
    found: set[int] = set()
    stack = [yaml.compose(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            stack.extend(v for pair in node.value for v in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.ScalarNode) and node.tag in NUMERIC_TAGS:
            found.add(node.start_mark.line)
    return found


def unsourced_lines(text: str) -> list[int]:
    """1-based numbers of the numeric lines that break the source rule (module docstring)."""
    lines = text.splitlines()
    numeric = numeric_lines(text)
    bad = []
    for ln in sorted(numeric):
        if INLINE_COMMENT.match(lines[ln]):
            continue
        above = ln - 1
        while above >= 0 and above in numeric:
            above -= 1
        if above < 0 or not FULL_LINE_COMMENT.match(lines[above]):
            bad.append(ln + 1)
    return bad


# --- the source rule itself ----------------------------------------------------------


def test_source_rule_accepts_inline_and_block_comments() -> None:
    text = "a: 1  # from x\n# from y, for both:\nb: 2\nc: 3.5\nname: qwen\n"
    assert unsourced_lines(text) == []


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a: 1\n", id="bare"),
        pytest.param("# source\n\nb: 2\n", id="blank-line-breaks-the-block"),
        pytest.param("# source\nx:\n  b: 2\n", id="key-line-breaks-the-block"),
        pytest.param("b: 2  #\n", id="empty-comment"),
        pytest.param("- 1\n- 2  # only the second\n", id="list-item"),
    ],
)
def test_source_rule_flags_unsourced_numbers(text: str) -> None:
    assert unsourced_lines(text) != []


# --- the shipped files ---------------------------------------------------------------


@pytest.mark.parametrize("name", PROFILES)
def test_profile_parses(name: str) -> None:
    profile = load(name)
    assert profile.schema_version == 1
    assert set(profile.gpus) == {"h100", "h800", "h20"}


@pytest.mark.parametrize("name", PROFILES)
def test_every_number_has_a_source(name: str) -> None:
    text = profile_text(name)
    assert numeric_lines(text), "no numbers found: the YAML walk is broken"
    assert unsourced_lines(text) == []


@pytest.mark.parametrize(
    ("name", "kv_bytes"), [("qwen3-8b.yaml", 147_456), ("qwen3-30b-a3b.yaml", 98_304)]
)
def test_kv_bytes_per_token(name: str, kv_bytes: int) -> None:
    assert load(name).model.kv_bytes_per_token == kv_bytes


@pytest.mark.parametrize("name", PROFILES)
def test_kv_capacity_positive_for_every_engine(name: str) -> None:
    profile = load(name)
    for gpu_type, gpu in profile.gpus.items():
        for engine in gpu.engines:
            assert profile.kv_capacity_tokens(gpu_type, engine.tp) > 0, (gpu_type, engine.tp)
        assert profile.feasible_tps(gpu_type) == tuple(sorted(e.tp for e in gpu.engines))


def test_qwen3_8b_h100_tp1_holds_a_few_hundred_thousand_tokens() -> None:
    assert 200_000 < load("qwen3-8b.yaml").kv_capacity_tokens("h100", 1) < 1_000_000


def test_qwen3_30b_a3b_is_not_listed_at_tp1_on_80gb() -> None:
    profile = load("qwen3-30b-a3b.yaml")
    assert profile.engine("h100", 1) is None
    assert profile.engine("h800", 1) is None
    assert profile.kv_capacity_tokens("h20", 1) > 100_000


@pytest.mark.parametrize("ctx_tokens", [0, 1024, 4096])
def test_qwen3_8b_h100_decode_matches_vllm_measurement(ctx_tokens: int) -> None:
    """vLLM: 7.3-7.7 ms per output token at concurrency 1-8 on one H100."""
    engine = load("qwen3-8b.yaml").engine("h100", 1)
    assert engine is not None
    assert 7.0e-3 <= float(engine.decode.step_s(1, ctx_tokens)) <= 8.0e-3
    assert 7.0e-3 <= float(engine.decode.step_s(8, 8 * 1024)) <= 8.0e-3


def test_qwen3_30b_a3b_h20_matches_infersim_measurements() -> None:
    """SGLang on H20: 16,594 prefill and 2,749 decode tokens/s per GPU (InferSim README)."""
    engine = load("qwen3-30b-a3b.yaml").engine("h20", 1)
    assert engine is not None
    prefill_tps = 16_384 / engine.prefill.batch_s([4096] * 4)
    assert prefill_tps == pytest.approx(16_594, rel=0.05)
    decode_tps = 100 / float(engine.decode.step_s(100, 100 * 5120))
    assert decode_tps == pytest.approx(2_749, rel=0.15)


def _decode_per_prefill(profile: RuntimeProfile, gpu_type: str, tp: int, batch: int) -> float:
    """Decode tokens/s at ``batch`` sequences of 2,048 context over prefill tokens/s of one
    2,048-token prompt: how much better the GPU is at decode than at prefill."""
    engine = profile.engine(gpu_type, tp)
    assert engine is not None
    decode = batch / float(engine.decode.step_s(batch, batch * 2048))
    prefill = 2048 / engine.prefill.batch_s([2048])
    return decode / prefill


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_h20_is_relatively_better_at_decode_than_h100(name: str, batch: int) -> None:
    profile = load(name)
    tps = {g: {e.tp for e in profile.gpus[g].engines} for g in ("h100", "h20")}
    shared = tps["h100"] & tps["h20"]
    assert shared
    for tp in shared:
        h20 = _decode_per_prefill(profile, "h20", tp, batch)
        h100 = _decode_per_prefill(profile, "h100", tp, batch)
        assert h20 > 1.5 * h100, (tp, h20, h100)


@pytest.mark.parametrize("name", PROFILES)
def test_larger_tp_is_faster_per_instance(name: str) -> None:
    profile = load(name)
    for gpu_type, gpu in profile.gpus.items():
        engines = sorted(gpu.engines, key=lambda e: e.tp)
        prefill = [e.prefill.batch_s([2048] * 4) for e in engines]
        assert all(a > b for a, b in pairwise(prefill)), gpu_type
        for batch in (1, 32, 128, 256):
            decode = [float(e.decode.step_s(batch, batch * 2048)) for e in engines]
            assert all(a > b for a, b in pairwise(decode)), (gpu_type, batch)


@pytest.mark.parametrize("name", PROFILES)
def test_h800_differs_from_h100_only_in_nvlink(name: str) -> None:
    profile = load(name)
    h100, h800 = profile.gpus["h100"], profile.gpus["h800"]
    assert h800.engines == h100.engines
    assert h800.memory_gb == h100.memory_gb
    assert h800.kv_transfer_intra_node_gb_per_s < h100.kv_transfer_intra_node_gb_per_s


@pytest.mark.parametrize("name", PROFILES)
def test_decode_regimes_meet_near_the_threshold(name: str) -> None:
    """Below the threshold the small regime is the cheaper one to extrapolate, from it on
    the large one: neither regime is wildly off at the switch (within 35 %)."""
    profile = load(name)
    for gpu in profile.gpus.values():
        for engine in gpu.engines:
            d = engine.decode
            b = d.large_batch_from
            ctx = b * 2048
            small = d.small.base_s + d.small.per_seq_s * b + d.small.per_ctx_token_s * ctx
            large = d.large.base_s + d.large.per_seq_s * b + d.large.per_ctx_token_s * ctx
            assert large == pytest.approx(small, rel=0.35), (engine.tp, small, large)


def _calibration_module() -> ModuleType:
    path = REPO / "benchmarks" / "calibrate_workload.py"
    spec = importlib.util.spec_from_file_location("calibrate_workload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", PROFILES)
def test_workload_defaults_match_the_traces(name: str) -> None:
    """The workload section quotes benchmarks/calibrate_workload.py over ../shared/traces."""
    computed = _calibration_module().calibrate(traces_or_skip(RAW))["workload_defaults"]
    json.dumps(computed)
    shipped = load(name).workload.model_dump()
    for field, value in computed.items():
        assert shipped[field] == pytest.approx(value, rel=1e-3, abs=0.05), field


def test_decode_step_vectorises_over_engines() -> None:
    """Guard for callers: ``step_s`` takes arrays and keeps the regime split per element."""
    engine = load("qwen3-8b.yaml").engine("h100", 1)
    assert engine is not None
    b = np.array([1, engine.decode.large_batch_from])
    steps = engine.decode.step_s(b, b * 1024)
    assert steps.shape == (2,)
    assert steps[1] > steps[0]


@pytest.mark.parametrize(
    ("name", "gpu_type", "tp"), [("qwen3-8b.yaml", "h100", 1), ("qwen3-30b-a3b.yaml", "h20", 2)]
)
def test_shipped_engine_survives_a_fit_round_trip(name: str, gpu_type: str, tp: int) -> None:
    """Timings generated from a shipped engine fit back to it (pearl.core.fitting)."""
    engine = load(name).engine(gpu_type, tp)
    assert engine is not None
    rng = np.random.default_rng(0)
    prefill = []
    for _ in range(20):
        new = tuple(int(x) for x in rng.integers(64, 4096, int(rng.integers(1, 5))))
        prefix = tuple(int(x) for x in rng.integers(0, 8192, len(new)))
        prefill.append(PrefillRecord(new, prefix, engine.prefill.batch_s(new, prefix)))
    threshold = engine.decode.large_batch_from
    decode = []
    for b in (1, 2, 4, 8, 16, threshold - 1, threshold, threshold + 16, 256):
        for _ in range(6):
            ctx = int(rng.integers(256, 8192, b).sum())
            decode.append(DecodeRecord(b, ctx, float(engine.decode.step_s(b, ctx))))
    fitted = fit_engine_profile(
        prefill, decode, tp=tp, kv_capacity_tokens=engine.kv_capacity_tokens
    )
    assert fitted.decode.large_batch_from == threshold
    for got, want in [
        (fitted.prefill, engine.prefill),
        (fitted.decode.small, engine.decode.small),
        (fitted.decode.large, engine.decode.large),
    ]:
        for field, value in want.model_dump().items():
            assert getattr(got, field) == pytest.approx(value, rel=1e-6, abs=1e-15), field
