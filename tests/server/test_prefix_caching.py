"""A server with prefix caching: a conversation's next turn finds its last turn in the cache, the
usage says how many prompt tokens were cached (OpenAI's prompt_tokens_details.cached_tokens), and
/metrics counts the tokens looked up and found."""

from __future__ import annotations

from speculative import LLM, SpeculativeConfig
from speculative.server.scheduler import Scheduler

from .conftest import MODEL, Served, running, tiny_app, tiny_pair


def test_a_next_turn_reports_its_cached_prompt_tokens_and_metrics_count_them(served) -> None:
    target, draft, tokenizer = tiny_pair()
    llm = LLM(
        target,
        draft_model=draft,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        tokenizer=tokenizer,
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(llm, max_num_seqs=8, max_waiting=16)
    with running(tiny_app(scheduler, tokenizer)) as url:
        server = Served(url, scheduler, llm, tokenizer)
        client = server.client()
        messages = [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "hi"},
        ]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        cached = usage.prompt_tokens_details.cached_tokens
        assert 16 <= cached < usage.prompt_tokens and cached % 16 == 0
        metrics = server.metrics()
        assert metrics[("speculative:prefix_cache_hits_total", ())] == cached
        assert (
            metrics[("speculative:prefix_cache_queries_total", ())]
            == first.usage.prompt_tokens + usage.prompt_tokens
        )
    # a server without it says nothing of cached tokens
    plain = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0
    )
    assert plain.usage.prompt_tokens_details is None
