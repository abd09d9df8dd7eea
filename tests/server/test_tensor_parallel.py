"""The server at tensor_parallel_size=2 (spawned ranks, gloo): continuous batching over concurrent
streams gives every greedy and seeded request the output it gets alone in one process. Slow: it
starts its rank 1 anew (about 7 s of its 10)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from speculative import LLM, SpeculativeConfig
from speculative.distributed import shutdown
from speculative.server.app import create_app
from speculative.server.scheduler import Scheduler

from .conftest import API_KEY, MAX_MODEL_LEN, MAX_PROMPT_TOKENS, MODEL, running, speculative_llm, tiny_pair
from .test_concurrency import client_request, stream

NUM_CLIENTS = 12
MAX_NUM_SEQS = 6  # fewer than the clients' sequences: requests wait, then join the running batch


@pytest.mark.slow  # about 10 s, most of it starting rank 1
def test_concurrent_streams_at_tensor_parallel_2_give_each_request_its_solo_output() -> None:
    target, draft, tokenizer = tiny_pair()
    reference = speculative_llm(target, draft, tokenizer)
    requests = [client_request(i) for i in range(NUM_CLIENTS)]
    expected = {}
    for i, (_path, body, params) in enumerate(requests):
        if params is not None:
            prompt = body.get("prompt") or tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            expected[i] = reference.generate(prompt, params)[0].outputs[0]
    try:
        llm = LLM(
            target,
            draft_model=draft,
            speculative_config=SpeculativeConfig(num_speculative_tokens=3),
            tokenizer=tokenizer,
            tensor_parallel_size=2,
        )
        app = create_app(
            Scheduler(llm, max_num_seqs=MAX_NUM_SEQS),
            model_name=MODEL,
            tokenizer=tokenizer,
            api_key=API_KEY,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            max_model_len=MAX_MODEL_LEN,
        )
        with running(app) as url, ThreadPoolExecutor(NUM_CLIENTS) as pool:
            results = list(pool.map(lambda r: stream(url, r[0], r[1]), requests, timeout=120))
    finally:
        shutdown()
    for i, ((_path, body, _params), (texts, finish, _usage)) in enumerate(zip(requests, results)):
        assert sorted(texts) == sorted(finish) == list(range(body.get("n", 1))), (i, texts, finish)
        if i in expected:
            assert texts[0] == expected[i].text, (i, body)
            assert finish[0] == expected[i].finish_reason
