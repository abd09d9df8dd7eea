"""A real server on 127.0.0.1: uvicorn in a background thread, the real Scheduler and LLM, over a tiny
Llama pair (target and a noisy draft) with an ASCII byte-level tokenizer that has a chat template."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from conftest import noisy_copy, tiny_model
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from speculative import LLM, SpeculativeConfig
from speculative.bench.server_process import free_port
from speculative.server.app import create_app
from speculative.server.scheduler import Scheduler

API_KEY = "test-key"
MODEL = "tiny"
MAX_PROMPT_TOKENS = 128
MAX_MODEL_LEN = 256  # the tiny model's context
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokens for printable ASCII, space and newline, plus <|endoftext|> (id 96): every
    token decodes to whole characters, so streamed text never waits on a partial one. Vocabulary 97."""
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]  # byte-level's space and newline
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pair(**overrides):
    """(target, draft, tokenizer): a 2-layer Llama of vocabulary 97 (context 256 unless overridden) and
    a draft that mostly agrees."""
    tokenizer = ascii_tokenizer()
    eos = tokenizer.eos_token_id
    target = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos, **overrides)
    return target, noisy_copy(target, 0.02), tokenizer


def speculative_llm(target, draft, tokenizer) -> LLM:
    return LLM(
        target,
        draft_model=draft,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        tokenizer=tokenizer,
    )


@contextmanager
def running(app, **options) -> Iterator[str]:
    """Serve the app with uvicorn (and these uvicorn.Config options) on a free port of 127.0.0.1 in a
    thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


@dataclass
class Served:
    """The running server, and an LLM of the same models for offline references (test thread only)."""

    url: str
    scheduler: Scheduler
    reference: LLM
    tokenizer: PreTrainedTokenizerFast

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **options)

    def post(
        self, path: str, body=None, *, content: bytes | None = None, auth: bool = True, timeout: float = 60
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        if content is not None:
            headers["Content-Type"] = "application/json"
        return httpx.post(self.url + path, json=body, content=content, headers=headers, timeout=timeout)

    def get(self, path: str, *, auth: bool = True) -> httpx.Response:
        return httpx.get(
            self.url + path, headers={"Authorization": f"Bearer {API_KEY}"} if auth else {}, timeout=30
        )

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels): value}."""
        response = self.get("/metrics")
        assert response.status_code == 200, response.text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples
        }

    def requests_counted(self, endpoint: str, status: int) -> float:
        key = ("speculative:http_requests_total", (("endpoint", endpoint), ("status", str(status))))
        return self.metrics().get(key, 0.0)

    def wait_for(self, condition, timeout: float = 10.0, what: str = "the condition") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)


def tiny_app(scheduler: Scheduler, tokenizer: PreTrainedTokenizerFast):
    """The app of the tests' servers: `scheduler`'s model as MODEL, API_KEY, the tiny model's limits."""
    return create_app(
        scheduler,
        model_name=MODEL,
        tokenizer=tokenizer,
        api_key=API_KEY,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="package")
def served() -> Iterator[Served]:
    target, draft, tokenizer = tiny_pair()
    scheduler = Scheduler(speculative_llm(target, draft, tokenizer), max_num_seqs=32, max_waiting=128)
    with running(tiny_app(scheduler, tokenizer)) as url:
        yield Served(url, scheduler, speculative_llm(target, draft, tokenizer), tokenizer)
