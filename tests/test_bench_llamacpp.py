"""llama.cpp in `speculative bench` (bench/llamacpp.py, bench/gguf_cache.py) without llama.cpp: the GGUF
cache key, the request, a recorded answer parsed, the skip notes, the report's llama.cpp column, and a
server's life (a stand-in llama-server). With SPECULATIVE_LLAMA_CPP naming a llama.cpp checkout (and
SPECULATIVE_LLAMA_CPP_BUILD its build folder, default "build"), llama.cpp's greedy fp32 tokens on two demo
prompts are checked against HF generate's, and its Q8_0 (llama-quantize's) runs on the demo pair end to
end."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from speculative.bench import report
from speculative.bench.gguf_cache import (
    DEFAULT_CACHE,
    byte_level_bpe,
    cache_key,
    check_gguf_type,
    gguf_file,
    gguf_type,
    quantized_cache_key,
)
from speculative.bench.llamacpp import (
    LlamaCppSetup,
    llama_cpp_methods,
    llama_cpp_unavailable,
    parse_completion,
    request_body,
    server_args,
    server_binary,
    skipped_entries,
)
from speculative.bench.measure import engine_timings, speculation_stats
from speculative.bench.memory import gguf_weight_bytes
from speculative.bench.methods import Generation, Method
from speculative.bench.prompts import BUNDLED_DIR
from speculative.bench.server_process import ServerProcess
from speculative.demo import DEMO_DIR
from speculative.prompts import encode, load_jsonl

# /completion's answer from llama-server (build 10470, commit 34af94cd9): the first code prompt, the demo pair
# in f32, draft k=4, 8 tokens (on a loaded machine: slow timings); generation_settings and prompt left out
RECORDED = {
    "index": 0,
    "content": '\n        """Return a new the file.',
    "tokens": [262, 432, 1092, 322, 875, 339, 553, 14],
    "id_slot": 0,
    "stop": True,
    "model": "/root/.cache/speculative/gguf/target-f32-b232934db52ad597.gguf",
    "tokens_predicted": 8,
    "tokens_evaluated": 121,
    "has_new_line": True,
    "truncated": False,
    "stop_type": "limit",
    "stopping_word": "",
    "tokens_cached": 128,
    "timings": {
        "cache_n": 0,
        "prompt_n": 121,
        "prompt_ms": 2660.976,
        "prompt_per_token_ms": 21.991537190082646,
        "prompt_per_second": 45.47203732765722,
        "predicted_n": 8,
        "predicted_ms": 10944.302,
        "predicted_per_token_ms": 1563.4717142857141,
        "predicted_per_second": 0.6396022331986088,
        "draft_n": 14,
        "draft_n_accepted": 3,
    },
}

FAKE_SERVER = """
import http.server, json, sys
args = sys.argv[1:]
if "--help" in args:
    print("--spec-draft-n-max N   number of tokens to draft for speculative decoding (default: 3)")
    sys.exit(0)
if "--version" in args:
    print("version: 1 (fake)")
    sys.exit(0)
port = int(args[args.index("--port") + 1])
answer = json.loads(%r)

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self): self.reply({"status": "ok"})
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = request["n_predict"]
        self.reply({**answer, "tokens": list(range(n)), "timings": {**answer["timings"], "predicted_n": n}})

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_cache_key_follows_path_outtype_and_mtime(tmp_path: Path) -> None:
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    key = cache_key(model, "f32")
    assert key.startswith("target-f32-") and key.endswith(".gguf")
    assert cache_key(str(model), "f32") == key  # str or Path, same file
    assert cache_key(model, "bf16") != key
    os.utime(model / "config.json", ns=(0, time.time_ns() + 10**9))  # retrained: newer files
    assert cache_key(model, "f32") != key
    other = tmp_path / "other" / "target"
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    assert cache_key(other, "f32") != cache_key(model, "f32")
    with pytest.raises(ValueError, match="local checkpoint folder"):
        cache_key(tmp_path / "other", "f32")


def test_gguf_file_takes_the_cached_file_and_checks_its_arguments(tmp_path: Path) -> None:
    checkout, cache = tmp_path / "llama.cpp", tmp_path / "cache"
    checkout.mkdir()
    with pytest.raises(ValueError, match=r"convert_hf_to_gguf\.py"):
        gguf_file(checkout, DEMO_DIR / "target", "float32", cache)
    (checkout / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(ValueError, match="dtype must be one of"):
        gguf_file(checkout, DEMO_DIR / "target", "float16", cache)
    with pytest.raises(ValueError, match="not a local folder"):
        gguf_file(checkout, "org/some-hub-id", "float32", cache)
    cached = cache / cache_key(DEMO_DIR / "target", "bf16")
    cache.mkdir()
    cached.write_bytes(b"GGUF")
    assert gguf_file(checkout, DEMO_DIR / "target", "bfloat16", cache) == cached  # no conversion


def test_a_failed_conversion_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    checkout, cache = tmp_path / "llama.cpp", tmp_path / "cache"
    checkout.mkdir()
    (checkout / "convert_hf_to_gguf.py").write_text("raise SystemExit('no converter here')\n")
    with pytest.raises(RuntimeError, match="no converter here"):
        gguf_file(checkout, DEMO_DIR / "draft", "float32", cache)
    assert list(cache.iterdir()) == []


def test_byte_level_bpe(tmp_path: Path) -> None:
    assert byte_level_bpe(DEMO_DIR / "target")
    tokenizer = json.loads((DEMO_DIR / "target" / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits"}, tokenizer["pre_tokenizer"]],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert not byte_level_bpe(tmp_path)
    assert not byte_level_bpe(tmp_path / "missing")


def test_request_body_is_greedy_token_ids_without_cache() -> None:
    body = request_body(torch.tensor([5, 6, 7]).tolist(), 128)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 128
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["samplers"] == ["top_k", "temperature"]
    assert body["ignore_eos"] and body["return_tokens"] and not body["cache_prompt"] and not body["stream"]


def test_server_args() -> None:
    plain = server_args(Path("t.gguf"), None, None, 2, 512, 8080)
    assert plain[:2] == ["-m", "t.gguf"] and "-md" not in plain and "-ctkd" not in plain
    for flag, value in (
        ("-t", "2"),
        ("-tb", "2"),
        ("--parallel", "1"),
        ("-c", "512"),
        ("--cache-ram", "0"),
        ("--port", "8080"),
        ("--host", "127.0.0.1"),
        ("-ctk", "f32"),
        ("-ctv", "f32"),
    ):
        assert plain[plain.index(flag) + 1] == value
    fixed = server_args(Path("t.gguf"), Path("d.gguf"), 4, 2, 512, 8080, ("bf16", "f32"))
    for flag, value in (
        ("-md", "d.gguf"),
        ("--spec-type", "draft-simple"),
        ("--spec-draft-n-max", "4"),
        ("--spec-draft-n-min", "0"),
        ("--spec-draft-p-min", "0"),
        ("-td", "2"),
        ("-tbd", "2"),
        ("-ctk", "bf16"),
        ("-ctv", "bf16"),
        ("-ctkd", "f32"),
        ("-ctvd", "f32"),
    ):
        assert fixed[fixed.index(flag) + 1] == value
    defaults = server_args(Path("t.gguf"), Path("d.gguf"), None, 2, 512, 8080)
    assert "-md" in defaults and "--spec-draft-n-max" not in defaults


def test_parse_a_recorded_answer() -> None:
    g = parse_completion(RECORDED, 0.02, speculative=True)
    assert g.token_ids == [RECORDED["tokens"]] and g.seconds == 0.02
    assert (g.num_drafted, g.num_accepted, g.num_steps) == (14, 3, 8 - 1 - 3)
    assert g.prefill_seconds == pytest.approx(2.660976) and g.decode_seconds == pytest.approx(10.944302)
    plain = parse_completion({**RECORDED, "timings": {"prompt_ms": 4.0, "predicted_ms": 10.0}}, 0.02, False)
    assert (plain.num_drafted, plain.num_accepted, plain.num_steps) == (None, 0, 7)
    method = Method("llamacpp_draft", "llama.cpp draft k=4", "llama.cpp", "draft_model", 4)
    stats = speculation_stats(method, [g, g])
    assert stats["acceptance_rate"] == pytest.approx(3 / 14) and stats[
        "mean_accepted_length"
    ] == pytest.approx(1.75)
    assert stats["acceptance_per_position"] is None
    timings = engine_timings([[g], [g]], [8, 8])
    assert timings["prefill_ms"] == pytest.approx(2660.976)
    assert timings["decode_tokens_per_s"] == pytest.approx(8 / 10.944302)
    assert timings["engine_tokens_per_s"] == pytest.approx(8 / (2.660976 + 10.944302))
    assert engine_timings([[Generation([[1]], 0.1)]], [1]) == {}


def test_skip_notes(tmp_path: Path) -> None:
    assert "--llama-cpp" in llama_cpp_unavailable(None)
    why = llama_cpp_unavailable(str(tmp_path), "build-avx2")
    assert str(server_binary(tmp_path, "build-avx2")) in why and "--llama-cpp-build build-avx2" in why
    (tmp_path / "build-avx2" / "bin").mkdir(parents=True)
    server_binary(tmp_path, "build-avx2").touch()
    assert "convert_hf_to_gguf.py" in llama_cpp_unavailable(str(tmp_path), "build-avx2")
    (tmp_path / "convert_hf_to_gguf.py").touch()
    with pytest.MonkeyPatch.context() as patch:  # a quantized run needs llama-quantize too
        patch.setattr(importlib.util, "find_spec", lambda m: object())
        assert llama_cpp_unavailable(str(tmp_path), "build-avx2") is None
        why = llama_cpp_unavailable(str(tmp_path), "build-avx2", "int8")
        assert "llama-quantize not found" in why and "build llama-quantize there" in why
    (tmp_path / "build-avx2" / "bin" / "llama-quantize").touch()
    real_find_spec = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as patch:  # a checkout that is complete, and no sentencepiece
        patch.setattr(
            importlib.util, "find_spec", lambda m: None if m == "sentencepiece" else real_find_spec(m)
        )
        assert "sentencepiece" in llama_cpp_unavailable(str(tmp_path), "build-avx2")
        patch.setattr(importlib.util, "find_spec", lambda m: object())
        assert llama_cpp_unavailable(str(tmp_path), "build-avx2") is None
    assert server_binary(tmp_path, "/abs/build") == Path("/abs/build/bin/llama-server")
    entries = skipped_entries("no --llama-cpp given")
    assert set(entries) == {"llamacpp", "llamacpp_draft", "llamacpp_draft_default"}
    assert all(
        e["note"] == "no --llama-cpp given" and e["label"].startswith("llama.cpp") for e in entries.values()
    )


def _entry(label: str, **extra) -> dict:
    return {
        "label": label,
        "status": "ok",
        "tokens_per_s": 100.0,
        "speedup_vs_hf": 1.0,
        "speedup_vs_ours_ar": 1.0,
        "speedup_vs_llamacpp": None,
        "acceptance_rate": None,
        "alpha": None,
        "mean_accepted_length": 1.0,
        "bound": None,
        "efficiency": None,
        "identical_fraction": 1.0,
        "near_ties": 0,
        **extra,
    }


def test_report_adds_the_llamacpp_column_and_timings_only_where_it_ran() -> None:
    without = {
        "ours_ar": _entry("ours AR"),
        "llamacpp": {"label": "llama.cpp", "status": "skipped", "note": "x"},
    }
    assert report.method_columns(without) == report.METHOD_COLUMNS
    assert report.engine_timings_line(without) is None
    ours = {"ours_ar": _entry("ours AR", engine="ours", prefill_ms=9.0, decode_tokens_per_s=90.0)}
    assert "ours AR: outside its steps 9.0 ms, decode only 90.0 tokens/s" in report.engine_timings_line(ours)
    ran = {
        "ours_ar": _entry("ours AR", speedup_vs_llamacpp=1.2),
        "llamacpp": _entry(
            "llama.cpp",
            engine="llama.cpp",
            speedup_vs_llamacpp=1.0,
            prefill_ms=3.0,
            decode_tokens_per_s=400.0,
            engine_tokens_per_s=380.0,
        ),
    }
    columns = report.method_columns(ran)
    assert columns[columns.index("vs ours AR") + 1] == "vs llama.cpp"
    rows = report.method_rows(ran)
    assert all(len(row) == len(columns) for row in rows) and rows[0][4] == "1.20"
    line = report.engine_timings_line(ran)
    assert "llama.cpp: prefill 3.0 ms, decode only 400.0 tokens/s" in line and "ours AR" not in line


@pytest.fixture
def fake_checkout(tmp_path: Path) -> Path:
    """A llama.cpp checkout stand-in: build/bin/llama-server answers /health and /completion like the real
    one (RECORDED, with n_predict tokens), the demo pair's GGUF files already in tmp_path/cache."""
    binary = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!{sys.executable}\n" + FAKE_SERVER % json.dumps(RECORDED))
    binary.chmod(0o755)
    (tmp_path / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    (tmp_path / "cache").mkdir()
    for name in ("target", "draft"):
        (tmp_path / "cache" / cache_key(DEMO_DIR / name, "f32")).write_bytes(b"GGUF")
    return tmp_path / "llama.cpp"


def test_methods_run_on_servers_that_stop_with_the_stack(fake_checkout: Path) -> None:
    setup = LlamaCppSetup(
        str(fake_checkout),
        "build",
        str(DEMO_DIR / "target"),
        str(DEMO_DIR / "draft"),
        "float32",
        "float32",
        4,
        2,
        512,
        fake_checkout.parent / "cache",
    )
    with ExitStack() as stack:
        methods, skipped = llama_cpp_methods(setup, stack)
        assert [m.name for m in methods] == ["llamacpp", "llamacpp_draft", "llamacpp_draft_default"]
        assert [m.k for m in methods] == [0, 4, 3] and skipped == {}
        assert methods[2].label == "llama.cpp draft, defaults (k=3)" and all(
            m.max_batch == 1 for m in methods
        )
        g = methods[1].generate([[1, 2, 3]], 16)
        assert g.token_ids == [list(range(16))] and g.num_drafted == 14 and g.seconds > 0
        with pytest.raises(ValueError, match="batch 1"):
            methods[0].generate([[1], [2]], 4)
        processes = [m.server.process for m in methods]
        assert all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)  # stopped, no orphans


def test_without_a_draft_and_at_the_default_k(fake_checkout: Path) -> None:
    setup = LlamaCppSetup(
        str(fake_checkout),
        "build",
        str(DEMO_DIR / "target"),
        None,
        "float32",
        "float32",
        3,
        2,
        512,
        fake_checkout.parent / "cache",
    )
    with ExitStack() as stack:
        methods, skipped = llama_cpp_methods(setup, stack)
        assert [m.name for m in methods] == ["llamacpp"]
        assert set(skipped) == {"llamacpp_draft", "llamacpp_draft_default"}
        setup.draft = str(DEMO_DIR / "draft")
        methods, skipped = llama_cpp_methods(setup, stack)
        assert [m.name for m in methods] == ["llamacpp", "llamacpp_draft"]
        assert "default draft length is k=3" in skipped["llamacpp_draft_default"]["note"]
        methods, skipped = llama_cpp_methods(setup, stack, lambda name: name == "llamacpp")
        assert [m.name for m in methods] == ["llamacpp"] and skipped == {}  # bench --methods


def test_a_server_that_dies_reports_its_log(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\nimport sys\nprint('error: no model'); sys.exit(1)\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match="status 1:\nerror: no model"):
        ServerProcess([str(binary)], 1, "llama-server").start()


@pytest.mark.skipif(
    "SPECULATIVE_LLAMA_CPP" not in os.environ,
    reason="set SPECULATIVE_LLAMA_CPP to a llama.cpp checkout with llama-server built",
)
def test_llamacpp_greedy_fp32_equals_hf_generate() -> None:
    from transformers import AutoModelForCausalLM

    checkout = os.environ["SPECULATIVE_LLAMA_CPP"]
    build = os.environ.get("SPECULATIVE_LLAMA_CPP_BUILD", "build")
    assert llama_cpp_unavailable(checkout, build) is None
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    prompts = [encode(tokenizer, r, 400) for r in load_jsonl(BUNDLED_DIR / "code.jsonl")[:2]]
    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    setup = LlamaCppSetup(
        checkout,
        build,
        str(DEMO_DIR / "target"),
        str(DEMO_DIR / "draft"),
        "float32",
        "float32",
        4,
        torch.get_num_threads(),
        512,
        DEFAULT_CACHE,
    )
    with ExitStack() as stack:
        methods, _ = llama_cpp_methods(setup, stack)
        for prompt in prompts:
            with torch.no_grad():
                ids = torch.tensor([prompt])  # BOS is the pad token: the mask keeps it
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=32,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            expected = out[0, len(prompt) :].tolist()
            for method in methods:
                assert method.generate([prompt], 32).token_ids == [expected], method.name


@pytest.mark.skipif(
    "SPECULATIVE_LLAMA_CPP" not in os.environ,
    reason="set SPECULATIVE_LLAMA_CPP to a llama.cpp checkout with llama-server and llama-quantize built",
)
def test_llamacpp_q8_0_runs_the_demo_pair() -> None:
    """--quantization int8's llama.cpp side: the pair converted and quantized to Q8_0 by the checkout's
    llama-quantize (cached), every method decoding max_tokens greedy tokens, the draft methods the
    plain method's own; a given target GGUF of the run's type is taken, one of another type refused."""
    checkout = os.environ["SPECULATIVE_LLAMA_CPP"]
    build = os.environ.get("SPECULATIVE_LLAMA_CPP_BUILD", "build")
    assert llama_cpp_unavailable(checkout, build, "int8") is None
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    prompts = [encode(tokenizer, r, 400) for r in load_jsonl(BUNDLED_DIR / "code.jsonl")[:2]]
    threads = torch.get_num_threads()
    setup = LlamaCppSetup(
        checkout,
        build,
        str(DEMO_DIR / "target"),
        str(DEMO_DIR / "draft"),
        "float32",
        "float32",
        4,
        threads,
        512,
        DEFAULT_CACHE,
        "int8",
    )
    with ExitStack() as stack:
        methods, _ = llama_cpp_methods(setup, stack)
        q8 = DEFAULT_CACHE / quantized_cache_key(DEMO_DIR / "target", "Q8_0")
        assert all(m.gguf == q8 for m in methods) and gguf_type(q8, checkout) == "Q8_0"
        assert gguf_type(DEFAULT_CACHE / quantized_cache_key(DEMO_DIR / "draft", "Q8_0")) == "Q8_0"
        outputs = {m.name: [m.generate([p], 32).token_ids[0] for p in prompts] for m in methods}
    assert all(len(out) == 32 for outs in outputs.values() for out in outs)
    for name, outs in outputs.items():
        assert outs == outputs["llamacpp"], name
    f32 = gguf_file(checkout, DEMO_DIR / "target", "float32", DEFAULT_CACHE)
    assert 0.25 < gguf_weight_bytes(q8) / gguf_weight_bytes(f32) < 0.3  # 34 bytes per 32 weights
    with pytest.raises(ValueError, match=r"--llama-cpp-target-gguf .* is a F32 GGUF"):
        check_gguf_type(f32, "Q8_0")
    setup.target_gguf, setup.draft = str(q8), None
    with ExitStack() as stack:
        methods, _ = llama_cpp_methods(setup, stack)
        assert methods[0].gguf == q8
        assert methods[0].generate([prompts[0]], 32).token_ids == [outputs["llamacpp"][0]]
