"""`speculative bench`: the speed-bound arithmetic, prompt loading, and the --quick run end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import byte_tokenizer, tiny_model

from speculative import cli
from speculative.bench import run as bench_run
from speculative.bench.measure import interleaved
from speculative.bench.memory import copy_bandwidth, memory_bound, weight_bytes
from speculative.bench.methods import Generation, Method
from speculative.bench.prompts import BUNDLED_DIR
from speculative.bench.report import memory_bound_line
from speculative.bench.run import skipped_heads
from speculative.bench.timing import (
    acceptance_for_tokens_per_step,
    efficiency,
    expected_tokens_per_step,
    speedup_bound,
)
from speculative.demo import DEMO_DIR, corpus, smollm2
from speculative.prompts import PromptRecord, encode, load_jsonl

SKIPPED = {"vllm_draft", "llamacpp", "llamacpp_draft", "llamacpp_draft_default"}  # no vLLM, no --llama-cpp
METHODS = {
    "hf_generate",
    "hf_assisted",
    "hf_prompt_lookup",
    "ours_ar",
    "ours_draft",
    "ours_ngram",
    "ours_draft_adaptive",
    "ours_ngram_adaptive",
    "ours_draft_lookup",
    "ours_draft_lookup_own1",
    "ours_draft_lookup_adaptive",
    "ours_draft_tree",
    "ours_ngram_tree",
    "ours_suffix",
    "ours_suffix_tree",
    "ours_self_draft",
    "ours_self_draft_adaptive",
} | SKIPPED
PLOTS = ("tokens_per_s.png", "acceptance_by_position.png", "speedup_vs_k.png", "throughput_vs_batch.png")


def test_expected_tokens_per_step() -> None:
    assert expected_tokens_per_step(0.5, 3) == pytest.approx((1 - 0.5**4) / 0.5)  # 1.875
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.999999, 5) == pytest.approx(6.0, rel=1e-5)
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_step(1.5, 3)


def test_acceptance_for_tokens_per_step_inverts_e() -> None:
    for a in (0.0, 0.3, 0.63, 0.9, 1.0):
        assert acceptance_for_tokens_per_step(expected_tokens_per_step(a, 4), 4) == pytest.approx(a, abs=1e-6)
    # drafts are accepted in prefixes, so accepted / drafted understates a: 0.63 of 4 drafts per step
    # kept is 1 + 4 * 0.63 = 3.52 tokens per step, which takes a = 0.82 in E, not 0.63
    assert acceptance_for_tokens_per_step(3.52, 4) == pytest.approx(0.82, abs=0.01)
    assert acceptance_for_tokens_per_step(0.5, 4) == 0.0 and acceptance_for_tokens_per_step(9.0, 4) == 1.0


def test_bound_and_efficiency() -> None:
    # E = 1.875; T_1 = 10, k * T_d + T_v = 3 * 1 + 12 = 15: bound 1.25
    assert speedup_bound(0.5, 3, t_1=10.0, t_v=12.0, t_d=1.0) == pytest.approx(1.25)
    assert efficiency(1.0, 1.25) == pytest.approx(0.8)
    # no acceptance, free drafts, verification as cheap as one token: no speedup at all
    assert speedup_bound(0.0, 4, t_1=2.0, t_v=2.0, t_d=0.0) == pytest.approx(1.0)


def test_jsonl_plain_and_spec_bench(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "def f(x):"},
        {"id": "b", "prompt": "class A:"},
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
    ]
    path.write_text("\n".join(json.dumps(obj) for obj in lines) + "\n\n")
    records = load_jsonl(path)
    assert records == [
        PromptRecord("1", "def f(x):"),
        PromptRecord("b", "class A:"),
        PromptRecord("81", "Write a poem.", chat=True),
    ]
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_jsonl(path)


def test_encode_uses_chat_template_for_turns_and_keeps_the_last_tokens() -> None:
    tokenizer = byte_tokenizer()
    assert tokenizer.decode(encode(tokenizer, PromptRecord("1", "hello", chat=True), 100)) == "hello"
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert (
        tokenizer.decode(encode(tokenizer, PromptRecord("1", "hi", chat=True), 100)) == "<user>hi<assistant>"
    )
    assert tokenizer.decode(encode(tokenizer, PromptRecord("1", "hi", chat=False), 100)) == "hi"
    assert tokenizer.decode(encode(tokenizer, PromptRecord("1", "abcdef"), 3)) == "def"


def test_bundled_sets_come_from_heldout_files() -> None:
    code, edit = load_jsonl(BUNDLED_DIR / "code.jsonl"), load_jsonl(BUNDLED_DIR / "edit.jsonl")
    for records in (code, edit):
        assert 16 <= len(records) <= 24
        assert all(corpus.is_heldout(r.id.rsplit(":", 1)[0]) for r in records)
    assert all(
        r.text.rstrip().split("\n")[-1].lstrip().startswith(("def ", "class ", "async def ")) for r in code
    )
    for r in edit:  # the function, the comment, then the function's first line again
        assert r.text.startswith(r.text.split("\n")[-1] + "\n") and "# The same code again" in r.text

    turns = load_jsonl(BUNDLED_DIR / "multiturn.jsonl")
    assert len(turns) >= 16 and len(turns) % 3 == 0
    assert all(corpus.is_heldout(r.id.rsplit(":", 1)[0]) for r in turns)
    for conversation in zip(*[iter(turns)] * 3):  # the same definition header after different text
        assert len({r.id.rsplit("/", 1)[0] for r in conversation}) == 1
        assert len({r.text.split("\n")[-1] for r in conversation}) == 1
        assert len({r.text for r in conversation}) == 3


def run_quick(out: Path, heads: tuple[str, ...], *model_args: str) -> dict:
    """`speculative bench --quick` in a subprocess; returns results.json after checking what every run
    must show: all methods (vLLM and llama.cpp skipped with a note), a chain and a tree of each of the
    `heads`, our outputs identical to the target's greedy output, finite speedups and bounds, the report
    and the plots."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "speculative.cli", "bench", "--quick", "--out", str(out), *model_args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ours draft k=4" in result.stdout and "vs ours AR" in result.stdout
    assert "s] loading the pair: 1/1" in result.stderr  # progress as lines where stderr is not a terminal
    results = json.loads((out / "results.json").read_text())
    assert set(results["sets"]) == {"code", "multiturn", "edit"}
    for data in results["sets"].values():
        methods = data["methods"]
        assert set(methods) == METHODS | {f"ours_{head}{tree}" for head in heads for tree in ("", "_tree")}
        assert all(methods[name]["status"] == "skipped" and methods[name]["note"] for name in SKIPPED)
        for name, entry in methods.items():
            if name in SKIPPED:
                continue
            assert entry["status"] == "ok"
            figures = ("tokens_per_s", "speedup_vs_hf", "speedup_vs_ours_ar")
            # no single k, no bound; the bound's step times are the runs' own
            figures += ("bound", "efficiency", "T_1") if not entry["adaptive"] else ("T_1",)
            for key in figures:
                assert math.isfinite(entry[key]) and entry[key] > 0, (name, key, entry[key])
            if name.startswith("ours"):
                assert entry["identical_fraction"] == 1.0, (name, entry)
        assert len(methods["ours_draft"]["acceptance_per_position"]) == 4
        assert methods["ours_draft_tree"]["tree"] == "dynamic" and methods["ours_draft"]["tree"] is None
        for head in heads:  # each head's drafting clocked: a bound of its own
            for name in (f"ours_{head}", f"ours_{head}_tree"):
                assert (
                    methods[name]["drafter"] == head and methods[name]["T_d"] > 0 and methods[name]["T_v"] > 0
                )
            assert (
                methods[f"ours_{head}_tree"]["tree"] == "dynamic" and methods[f"ours_{head}"]["tree"] is None
            )
            assert len(methods[f"ours_{head}"]["acceptance_per_position"]) == 4
    for sweeps in results["sweeps"]["k"].values():
        for points in sweeps.values():
            assert [p["k"] for p in points] == [1, 4]
            assert all(math.isfinite(p["speedup_vs_ours_ar"]) and math.isfinite(p["bound"]) for p in points)
            assert all(p["T_v"] > 0 and p["T_d"] > 0 for p in points)
    batch = results["sweeps"]["batch"]
    assert {r["batch_size"] for r in batch} == {1, 2}
    assert {(r["batch_size"], r["method"]) for r in batch} >= {
        (2, f"ours_{h}{t}") for h in heads for t in ("", "_tree")
    }
    assert all(r["identical_fraction"] == 1.0 for r in batch if r["method"].startswith("ours"))
    report = (out / "report.md").read_text()
    assert (
        "## code" in report
        and "## edit" in report
        and "vLLM" in report
        and "bound's step times, ms" in report
    )
    assert "llama.cpp: skipped (no --llama-cpp given" in report
    for plot in PLOTS:
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return results


def test_bench_quick_on_tiny_models(model_dirs, tmp_path: Path) -> None:
    results = run_quick(
        tmp_path / "out",
        ("eagle", "dflash"),
        "--model",
        model_dirs["target"],
        "--draft-model",
        model_dirs["draft"],
        "--eagle",
        model_dirs["eagle"],
        "--dflash",
        model_dirs["dflash"],
        "--tree-nodes",
        "5",
        "--tree-width",
        "3",
    )
    assert results["config"]["max_tokens"] == 24
    assert (results["config"]["tree_nodes"], results["config"]["tree_width"]) == (5, 3)
    methods = results["sets"]["code"]["methods"]
    tree = methods["ours_eagle_tree"]
    assert tree["label"] == "ours eagle k=4, dynamic tree of 5" and tree["tokens"] > 0
    block = methods["ours_dflash"]  # a block drafter beside the EAGLE head: chains and trees, exact
    assert block["status"] == "ok" and block["identical_fraction"] == 1.0 and block["T_d"] > 0
    block_tree = methods["ours_dflash_tree"]
    assert block_tree["label"] == "ours dflash k=4, dynamic tree of 5"
    assert block_tree["status"] == "ok" and block_tree["identical_fraction"] == 1.0
    assert any("cut to their last" in note for note in results["notes"])  # 256-token models, longer prompts


def test_bench_quick_on_the_demo_pair(tmp_path: Path) -> None:
    results = run_quick(
        tmp_path / "out", ("eagle", "eagle3")
    )  # run from the checkout: its paths are recorded relative to it
    assert results["config"]["model"] == "models/demo/target"
    assert str(Path.cwd()) not in (tmp_path / "out" / "report.md").read_text()
    assert results["sets"]["code"]["methods"]["ours_draft"]["acceptance_rate"] > 0.2


def test_bench_methods_runs_the_selected_ones_and_the_baselines(model_dirs, tmp_path: Path) -> None:
    """--methods: the matching methods, their drafter's k sweep, and the baselines every ratio needs;
    nothing else is loaded, run or reported as skipped."""
    out = tmp_path / "out"
    model = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"]]
    result = subprocess.run(
        [sys.executable, "-m", "speculative.cli", "bench", "--quick", "--out", str(out), *model]
        + ["--methods", "ours_ngram*", "vllm_*"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["methods"] == ["ours_ngram*", "vllm_*"]
    ran = {"hf_generate", "ours_ar", "ours_ngram", "ours_ngram_adaptive", "ours_ngram_tree"}
    for data in results["sets"].values():
        methods = data["methods"]
        assert set(methods) == ran | {"vllm_draft", "llamacpp"}  # those two skipped, saying why
        assert {name for name, entry in methods.items() if entry["status"] == "ok"} == ran
        assert all(methods[name]["identical_fraction"] == 1.0 for name in ran)
    assert {d for sweeps in results["sweeps"]["k"].values() for d in sweeps} == {"ngram"}
    assert {r["method"] for r in results["sweeps"]["batch"]} <= ran
    assert (out / "report.md").read_text().count("ours draft") == 0


def test_bench_methods_patterns() -> None:
    config = bench_run.BenchConfig(methods=["ours_*_compiled", "llamacpp_draft"])
    chosen = ["ours_draft_compiled", "ours_draft_adaptive_compiled", "llamacpp_draft"]
    assert all(config.selects(name) for name in chosen + list(bench_run.BASELINES))
    assert not any(config.selects(name) for name in ("ours_draft", "llamacpp_draft_default", "hf_assisted"))
    assert bench_run.BenchConfig().selects("anything")


def test_bench_head_flags(monkeypatch, model_dirs) -> None:
    """The demo target's heads by default (the toy pair's two, the demo model's packaged EAGLE-3 head),
    --eagle / --eagle3 / --dflash's otherwise (several side by side), none for another target: their
    methods are then skipped, and say why (as they are with the target split over ranks); a head
    without trees has no tree method to skip."""
    configs = []
    monkeypatch.setattr(bench_run, "run_and_report", lambda config, out, console: configs.append(config))
    both = ["--eagle3", model_dirs["eagle"], "--dflash", model_dirs["dflash"]]
    for argv in ([], both, ["--model", model_dirs["target"]]):
        assert cli.main(["bench", *argv]) == 0
    demo, given, other = configs
    assert demo.heads == {name: str(DEMO_DIR / name) for name in ("eagle", "eagle3")}
    assert not skipped_heads(demo)
    assert given.heads == {"eagle3": model_dirs["eagle"], "dflash": model_dirs["dflash"]}
    assert other.heads == {}
    assert skipped_heads(other)["ours_eagle"]["note"].startswith("no head: --eagle PATH")
    monkeypatch.setenv(smollm2.DEMO_ENV, "")  # the real demo model (its fetch faked): its packaged head
    fetched = smollm2.DemoPair(Path(model_dirs["target"]), Path(model_dirs["draft"]), Path("unused.gguf"))
    monkeypatch.setattr(smollm2, "demo_pair", lambda: fetched)
    assert cli.main(["bench"]) == 0 and cli.main(["bench", "--draft-model", model_dirs["draft"]]) == 0
    assert configs[-2].model == model_dirs["target"] and configs[-2].draft_model == model_dirs["draft"]
    for real in configs[-2:]:
        assert real.heads == {"eagle3": str(smollm2.EAGLE3_PACKAGE)}
    assert (smollm2.EAGLE3_PACKAGE / "model.safetensors").is_file()
    split = dataclasses.replace(given, tensor_parallel_size=2)
    assert set(skipped_heads(split)) == {"ours_eagle3", "ours_eagle3_tree", "ours_dflash", "ours_dflash_tree"}
    assert "one rank" in skipped_heads(split)["ours_dflash"]["note"]


def test_memory_bound_counts_each_weight_once_and_reports_fractions() -> None:
    model = tiny_model()  # untied: the LM head is read whole, the input embedding a row at a time
    embedding = model.get_input_embeddings().weight
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())  # rotary inv_freq
    assert weight_bytes(model) == buffers + sum(
        p.untyped_storage().nbytes() for p in model.parameters() if p is not embedding
    )
    model.lm_head.weight = embedding  # tied: the one matrix is read whole once
    assert weight_bytes(model) == buffers + sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert copy_bandwidth(torch.device("cpu"), nbytes=8 * 2**20, repeats=3) > 1e8  # > 0.1 GB/s anywhere
    bound = memory_bound(100_000_000, 25e9)  # 100 MB at 25 GB/s: 4 ms a forward, 250 tokens/s
    assert bound["forward_ms"] == pytest.approx(4.0) and bound["tokens_per_second"] == pytest.approx(250.0)
    methods = {
        "ours_ar": {"label": "ours AR", "status": "ok", "drafter": None, "tokens_per_s": 125.0},
        "ours_draft": {
            "label": "ours draft",
            "status": "ok",
            "drafter": "draft_model",
            "tokens_per_s": 300.0,
        },
        "llamacpp": {
            "label": "llama.cpp",
            "status": "ok",
            "drafter": None,
            "tokens_per_s": 150.0,
            "decode_tokens_per_s": 200.0,
        },
    }
    line = memory_bound_line(bound, methods)
    assert "4.00 ms a forward, 250 tokens/s" in line
    assert "ours AR 50%" in line and "llama.cpp 60% (80% decode only)" in line and "ours draft" not in line
    assert memory_bound_line(None, methods) is None


def test_compiled_methods_compile_the_eagle_head(model_dirs) -> None:
    """A compiled method's LLM runs on the pair's compiled models, and compiles the EAGLE head it loads
    (whose drafting, chain or tree, is then one compiled call), as `LLM(..., compile=True)` does."""
    from speculative.models.compiled import CompiledCausalLM
    from speculative.models.loading import load_model

    config = bench_run.BenchConfig(model=model_dirs["target"], heads={"eagle": model_dirs["eagle"]}, k=3)
    pair = object.__new__(bench_run.Pair)  # the fields `ours` reads, without loading HF's models
    pair.config, pair.device, pair.tokenizer = config, torch.device("cpu"), byte_tokenizer()
    pair.target, pair.draft = load_model(model_dirs["target"], "float32").model, None
    pair.compiled_target, pair.compiled_draft = CompiledCausalLM(pair.target), None
    for tree in (None, "dynamic"):
        method = pair.ours("eagle", 3, compiled=True, tree=tree)
        assert method.engine == "ours_compiled" and method.llm.target.model is pair.compiled_target
        assert isinstance(method.llm.engine.proposer.compiled, CompiledCausalLM)
        assert pair.ours("eagle", 3, tree=tree).llm.engine.proposer.compiled is None


def test_the_warm_up_runs_two_prompt_lengths_before_the_timed_runs() -> None:
    """torch.compile makes a prefill's length dynamic at its second length: the discarded warm-up
    calls each method with two, so that no timed run compiles; every timed run is one prompt's."""

    @dataclasses.dataclass
    class Recording(Method):
        calls: list = dataclasses.field(default_factory=list)

        def generate(self, prompts, max_tokens):
            self.calls.append([len(p) for p in prompts])
            return Generation([[0] * max_tokens], 1.0)

    methods = [Recording("a", "a", "ours"), Recording("b", "b", "hf")]
    prompts = [[1, 2, 3, 4], [5, 6]]
    runs = interleaved(methods, prompts, 3, 1, lambda *_: None, "phase", warmup=True)
    for method in methods:
        assert method.calls == [[4], [3], [4], [2]]
        assert [len(r) for r in runs[method.name]] == [1, 1]
    one_token = Recording("c", "c", "ours")
    interleaved([one_token], [[7]], 3, 1, lambda *_: None, "phase", warmup=True)
    assert one_token.calls == [[1], [1]]  # one warm-up, then the timed run
