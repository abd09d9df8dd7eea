"""`speculative bench --quantization int8 | int4` without llama.cpp: llama-quantize's command line and
cache key (a stand-in llama-quantize), the type check of a given target GGUF (tiny GGUFs written here),
the bytes each engine reads per token and their memory bounds, the flags, and a quantized bench run on a
tiny pair (ours and HF; llama.cpp skipped)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model

from speculative import cli
from speculative.bench import report
from speculative.bench import run as bench_run
from speculative.bench.gguf_cache import (
    QUANT_TYPES,
    cache_key,
    check_gguf_type,
    expected_gguf_type,
    gguf_type,
    quantize_command,
    quantized_cache_key,
    quantized_gguf_file,
)
from speculative.bench.llamacpp import LlamaCppSetup, llama_cpp_unavailable
from speculative.bench.memory import engine_bounds, gguf_weight_bytes, memory_bound, weight_bytes
from speculative.bench.prompts import BUNDLED_DIR
from speculative.demo import DEMO_DIR
from speculative.models.llama import NativeCausalLM

F32, Q8_0, Q4_1 = (gguf.GGMLQuantizationType[name] for name in ("F32", "Q8_0", "Q4_1"))


def write_gguf(path: Path, tensors: dict[str, tuple[int, int, gguf.GGMLQuantizationType]], file_type=None):
    """A GGUF of random [rows, columns] tensors in the given types (1-row ones as vectors), with
    general.file_type where `file_type` (a gguf.LlamaFileType) is given."""
    writer = gguf.GGUFWriter(path, "llama")
    if file_type is not None:
        writer.add_file_type(file_type)
    rng = np.random.default_rng(0)
    for name, (rows, columns, kind) in tensors.items():
        data = rng.standard_normal((rows, columns)).astype(np.float32)
        if rows == 1:
            data = data[0]
        if kind == F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_quantize_command_and_cache_key(tmp_path: Path) -> None:
    command = quantize_command(Path("/l/build/bin/llama-quantize"), Path("a.gguf"), Path("b.gguf"), "Q8_0", 2)
    assert command == ["/l/build/bin/llama-quantize", "a.gguf", "b.gguf", "Q8_0", "2"]
    assert QUANT_TYPES == {"int8": "Q8_0", "int4": "Q4_1", "w8a8": "Q8_0", "w4a8": "Q4_1"}
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    key = quantized_cache_key(model, "Q8_0")
    assert key.startswith("target-f32-q8_0-") and key.endswith(".gguf")
    others = {
        cache_key(model, "f32"),  # the float conversion it is made from
        cache_key(model, "bf16"),
        quantized_cache_key(model, "Q4_1"),  # another type
    }
    assert key not in others and len(others) == 3
    os.utime(model / "config.json", ns=(0, time.time_ns() + 10**9))  # retrained: newer files
    assert quantized_cache_key(model, "Q8_0") != key


FAKE_QUANTIZE = """
import sys
source, out, kind, threads = sys.argv[1:]
if kind == "FAIL":
    print("llama_model_quantize: failed to quantize"); sys.exit(1)
with open(sys.argv[0] + ".calls", "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
open(out, "wb").write(open(source, "rb").read() + kind.encode())
"""


def test_quantized_files_are_made_by_llama_quantize_once(tmp_path: Path, monkeypatch) -> None:
    checkout, cache = tmp_path / "llama.cpp", tmp_path / "cache"
    binary = checkout / "build" / "bin" / "llama-quantize"
    binary.parent.mkdir(parents=True)
    (checkout / "convert_hf_to_gguf.py").write_text("")
    cache.mkdir()
    source = cache / cache_key(DEMO_DIR / "draft", "f32")
    source.write_bytes(b"GGUF")  # converted already
    with pytest.raises(ValueError, match="llama-quantize not found"):
        quantized_gguf_file(checkout, "build", DEMO_DIR / "draft", "int8", cache)
    binary.write_text(f"#!{sys.executable}\n" + FAKE_QUANTIZE)
    binary.chmod(0o755)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantized_gguf_file(checkout, "build", DEMO_DIR / "draft", "int2", cache)
    out = quantized_gguf_file(checkout, "build", DEMO_DIR / "draft", "int8", cache, threads=3)
    assert out == cache / quantized_cache_key(DEMO_DIR / "draft", "Q8_0")
    assert out.read_bytes() == b"GGUFQ8_0"
    calls = Path(str(binary) + ".calls")
    partial = out.with_name(out.stem + ".partial.gguf")
    assert calls.read_text().split() == [str(source), str(partial), "Q8_0", "3"]
    assert quantized_gguf_file(checkout, "build", DEMO_DIR / "draft", "int8", cache) == out
    assert len(calls.read_text().splitlines()) == 1  # cached: llama-quantize ran once
    monkeypatch.setitem(QUANT_TYPES, "int4", "FAIL")
    with pytest.raises(RuntimeError, match="failed to quantize"):
        quantized_gguf_file(checkout, "build", DEMO_DIR / "draft", "int4", cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([source.name, out.name])  # no partial file


def test_a_given_target_gguf_must_be_of_the_runs_type(tmp_path: Path) -> None:
    matrices = {"token_embd.weight": (64, 64, Q8_0), "blk.0.attn_q.weight": (64, 64, Q4_1)}
    q4 = write_gguf(tmp_path / "q4_1.gguf", matrices, gguf.LlamaFileType.MOSTLY_Q4_1)
    f32 = write_gguf(tmp_path / "f32.gguf", {"token_embd.weight": (64, 64, F32)}, gguf.LlamaFileType.ALL_F32)
    assert (gguf_type(q4), gguf_type(f32)) == ("Q4_1", "F32")
    more_q8 = {**matrices, "blk.0.ffn_up.weight": (128, 64, Q8_0)}
    untyped = write_gguf(tmp_path / "untyped.gguf", more_q8)  # no general.file_type: most bytes decide
    assert gguf_type(untyped) == "Q8_0"
    assert [expected_gguf_type(d, q) for d, q in [("float32", None), ("bfloat16", None)]] == ["F32", "BF16"]
    assert [expected_gguf_type("bfloat16", q) for q in ("int8", "int4", "w8a8", "w4a8")] == [
        "Q8_0",
        "Q4_1",
        "Q8_0",
        "Q4_1",
    ]
    assert check_gguf_type(q4, "Q4_1") == q4
    with pytest.raises(ValueError, match=r"--llama-cpp-target-gguf .*q4_1\.gguf is a Q4_1 GGUF.* Q8_0"):
        check_gguf_type(q4, "Q8_0")
    with pytest.raises(ValueError, match=r"--llama-cpp-target-gguf .*: no such file"):
        check_gguf_type(tmp_path / "missing.gguf", "F32")
    setup = LlamaCppSetup(
        str(tmp_path), "build", "unused", None, "float32", "float32", 4, 1, 64, tmp_path, "int8", str(q4)
    )
    with pytest.raises(ValueError, match="--llama-cpp-target-gguf"):
        setup.target_file()
    setup.quantization = "int4"
    assert setup.target_file() == q4


def test_the_bench_refuses_a_given_gguf_of_another_type_before_loading(tmp_path: Path) -> None:
    checkout = tmp_path / "llama.cpp"
    (checkout / "build" / "bin").mkdir(parents=True)
    (checkout / "convert_hf_to_gguf.py").write_text("")
    (checkout / "build" / "bin" / "llama-server").touch()
    q4 = write_gguf(tmp_path / "q4.gguf", {"w.weight": (32, 32, Q4_1)}, gguf.LlamaFileType.MOSTLY_Q4_1)
    config = bench_run.BenchConfig(llama_cpp_target_gguf=str(q4), quantization="int8")
    with pytest.raises(ValueError, match="give --llama-cpp DIR"):
        bench_run.check_llama_cpp(config)
    config.llama_cpp = str(checkout)
    assert "llama-quantize" in llama_cpp_unavailable(str(checkout), "build", "int8")
    assert "llama-quantize" not in (llama_cpp_unavailable(str(checkout), "build") or "")  # unquantized
    with pytest.raises(ValueError, match="llama-quantize not found"):
        bench_run.check_llama_cpp(config)
    (checkout / "build" / "bin" / "llama-quantize").touch()
    if llama_cpp_unavailable(str(checkout), "build", "int8") is None:  # httpx and sentencepiece here
        with pytest.raises(ValueError, match=r"--llama-cpp-target-gguf .* is a Q4_1 GGUF"):
            bench_run.check_llama_cpp(config)
        config.quantization = "int4"
        bench_run.check_llama_cpp(config)


def test_cli_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quantization", "int4", "--llama-cpp-target-gguf", "m.gguf"])
    assert (args.quantization, args.llama_cpp_target_gguf) == ("int4", "m.gguf")
    plain = parser.parse_args(["bench"])
    assert plain.quantization is None and plain.llama_cpp_target_gguf is None
    assert parser.parse_args(["bench", "--quantization", "w8a8"]).quantization == "w8a8"
    assert "activations quantized to int8" in bench_run.quantization_note("w8a8", "float32")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--quantization", "int2"])


def packed_bytes(layer, quantization: str | None, group_size: int | None = None) -> int:
    """What a layer of [out, in] weights reads per forward: float weights; int8 weights and a float32
    scale per output channel; int4 nibbles and a bfloat16 scale and zero per group (torch's layouts)."""
    out_features = sum(linear.out_features for linear in layer.linears)
    in_features = layer.linears[0].in_features
    if quantization is None:
        return out_features * in_features * 4
    if quantization == "int8":
        return out_features * in_features + out_features * 4
    return out_features * in_features // 2 + (in_features // group_size) * out_features * 2 * 2


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_per_precision(tied: bool) -> None:
    """A forward reads each layer's weights in their own precision, the lm_head once, and one row of
    an embedding that is not the lm_head; the norms and RoPE frequencies whole."""
    hf = tiny_model(vocab_size=128, tie_word_embeddings=tied)
    hidden, vocab = 64, 128
    native = NativeCausalLM.from_hf(hf)
    norms = sum(p.numel() * p.element_size() for n, p in native.named_parameters() if "norm" in n)
    small = norms + native.inv_freq.numel() * 4
    layers = native.packed_linears()
    assert weight_bytes(native) == small + sum(packed_bytes(p, None) for p in layers)  # embedding once
    hf_buffers = sum(b.untyped_storage().nbytes() for b in hf.buffers())  # HF's RoPE buffers, not ours
    assert weight_bytes(hf) - hf_buffers == weight_bytes(native) - native.inv_freq.numel() * 4
    native.quantize("int8")
    assert weight_bytes(native) == small + sum(packed_bytes(p, "int8") for p in layers)
    assert packed_bytes(layers[-1], "int8") == vocab * hidden + vocab * 4  # the lm_head's int8 copy
    bf16 = NativeCausalLM.from_hf(tiny_model(vocab_size=128, tie_word_embeddings=tied).to(torch.bfloat16))
    bf16.quantize("int4")
    layers = bf16.packed_linears()
    assert all(p.quantization == "int4" and p.group_size == 64 for p in layers)
    assert weight_bytes(bf16) == norms // 2 + bf16.inv_freq.numel() * 4 + sum(
        packed_bytes(p, "int4", 64) for p in layers
    )


def test_gguf_weight_bytes_count_what_llama_cpp_reads(tmp_path: Path) -> None:
    layer = {"blk.0.attn_q.weight": (64, 64, Q8_0), "output_norm.weight": (1, 64, F32)}
    embedding = {"token_embd.weight": (128, 64, Q8_0)}
    q8 = 64 * 64 // 32 * 34 + 64 * 4
    tied = write_gguf(tmp_path / "tied.gguf", {**embedding, **layer})
    assert gguf_weight_bytes(tied) == q8 + 128 * 64 // 32 * 34  # token_embd read whole as the output
    untied = write_gguf(tmp_path / "untied.gguf", {**embedding, **layer, "output.weight": (128, 64, Q4_1)})
    assert gguf_weight_bytes(untied) == q8 + 128 * 64 // 32 * 20  # token_embd only looked up


def test_engine_bounds_and_the_report_line() -> None:
    bounds = engine_bounds(
        25e9,
        {
            "hf": ("float32", 100_000_000),
            "ours": ("int8", 25_000_000),
            "llama.cpp": ("Q8_0 GGUF", 26_562_500),
        },
    )
    assert bounds["bandwidth_gb_s"] == pytest.approx(25.0)
    ours = bounds["engines"]["ours"]
    assert ours["weights"] == "int8" and ours == {"weights": "int8", **memory_bound(25_000_000, 25e9)}
    assert ours["forward_ms"] == pytest.approx(1.0) and bounds["engines"]["llama.cpp"]["forward_ms"] == (
        pytest.approx(1.0625)
    )
    methods = {
        "hf_generate": {
            "label": "HF generate",
            "engine": "hf",
            "status": "ok",
            "drafter": None,
            "tokens_per_s": 125.0,
        },
        "ours_ar": {
            "label": "ours AR",
            "engine": "ours",
            "status": "ok",
            "drafter": None,
            "tokens_per_s": 500.0,
        },
        "ours_ar_compiled": {
            "label": "ours AR, compiled",
            "engine": "ours_compiled",
            "status": "ok",
            "drafter": None,
            "tokens_per_s": 800.0,
        },
        "ours_draft": {"label": "ours draft", "engine": "ours", "status": "ok", "drafter": "draft_model"},
        "llamacpp": {
            "label": "llama.cpp",
            "engine": "llama.cpp",
            "status": "ok",
            "drafter": None,
            "tokens_per_s": 470.6,
            "decode_tokens_per_s": 705.9,
        },
    }
    line = report.memory_bound_line(bounds, methods)
    assert "/ 25.0 GB/s" in line
    assert "HF (float32): 100.0 MB, 4.00 ms a token (250 tokens/s), reached: HF generate 50%" in line
    assert (
        "ours (int8): 25.0 MB, 1.00 ms a token (1000 tokens/s), reached: ours AR 50%, ours AR, compiled 80%"
        in line
    )
    assert (
        "llama.cpp (Q8_0 GGUF): 26.6 MB, 1.06 ms a token (941 tokens/s), "
        "reached: llama.cpp 50% (75% decode only)" in line
    )
    assert "ours draft" not in line


def test_a_quantized_bench_run_on_a_tiny_pair(model_dirs, tmp_path: Path) -> None:
    """int8: ours quantized (target and draft), HF in float and labelled so, the EAGLE methods and
    llama.cpp skipped with why, each engine's bound from its own bytes, the report saying so."""
    config = bench_run.BenchConfig(
        model=model_dirs["target"],
        draft_model=model_dirs["draft"],
        heads={"eagle": model_dirs["eagle"]},
        prompts=[str(BUNDLED_DIR / "code.jsonl")],
        k=4,
        sweep_k=[1, 4],
        batch_sizes=[1],
        max_tokens=24,
        num_prompts=2,
        sweep_prompts=1,
        quantization="int8",
    )
    results = bench_run.run_bench(config, lambda phase, total: None)
    methods = results["sets"]["code"]["methods"]
    ran = {name for name, e in methods.items() if e["status"] == "ok"}
    assert ran == {
        "hf_generate",
        "hf_assisted",
        "hf_prompt_lookup",
        "ours_ar",
        "ours_draft",
        "ours_ngram",
        "ours_suffix",
        "ours_draft_adaptive",
        "ours_ngram_adaptive",
        "ours_draft_lookup",
        "ours_draft_lookup_own1",
        "ours_draft_lookup_adaptive",
        "ours_draft_tree",
        "ours_ngram_tree",
        "ours_suffix_tree",
    }
    assert methods["hf_generate"]["label"] == "HF generate (float32 weights)"
    assert methods["hf_assisted"]["label"] == "HF assisted k=4 (float32 weights)"
    assert methods["ours_ar"]["label"] == "ours autoregressive"
    assert "unquantized target" in methods["ours_eagle"]["note"]
    assert methods["llamacpp"]["status"] == "skipped" and "--llama-cpp" in methods["llamacpp"]["note"]
    engines = results["memory_bound"]["engines"]
    assert set(engines) == {"hf", "ours"}
    assert engines["hf"]["weights"] == "float32" and engines["ours"]["weights"] == "int8"
    assert engines["ours"]["weight_mb"] < engines["hf"]["weight_mb"] / 3  # int8 beside float32
    assert any(note.startswith("Quantized run (--quantization int8)") for note in results["notes"])
    assert results["config"]["quantization"] == "int8"
    markdown = report.markdown(results, [])
    assert "float32, int8 weights (HF: unquantized)" in markdown
    assert "ours (int8): " in markdown and "reached: ours autoregressive " in markdown
