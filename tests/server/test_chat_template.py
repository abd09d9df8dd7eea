"""Chat completions on `speculative serve`'s app: the demo pair's own chat template with no flags, and
--chat-template as a template or a file, which a bad template stops before the models load."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from speculative import cli
from speculative.demo import DEMO_DIR
from speculative.server import app

from .conftest import running

MESSAGES = [{"role": "user", "content": "Return the n-th Fibonacci number."}]


def serve_app(*flags: str):
    return app.serve_app(*cli.serve_args(list(flags)))


def chat(url: str, model: str, max_tokens: int = 8):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0
    )


def test_chat_on_the_demo_server_with_no_flags() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    assert AutoTokenizer.from_pretrained(DEMO_DIR / "draft").chat_template == tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|endoftext|># Return the n-th Fibonacci number.\n\n"  # a comment, then code
    with running(serve_app()) as url:
        answer = chat(url, "speculative-demo", max_tokens=16)
    assert answer.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert answer.usage.completion_tokens > 0 and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("from_file", [False, True], ids=["template", "file"])
def test_chat_template_flag(model_dirs, tmp_path, from_file) -> None:
    marker = "file" if from_file else "flag"  # which template rendered the prompt
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<" + marker + ">{% endif %}"
    )
    if from_file:
        (tmp_path / "chat.jinja").write_text(template)
    flag = str(tmp_path / "chat.jinja") if from_file else template
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    assert tokenizer.chat_template is None  # the flag is the only template
    rendered = f"<user>{MESSAGES[0]['content']}<{marker}>"
    with running(serve_app("--model", model_dirs["target"], "--chat-template", flag)) as url:
        answer = chat(url, model_dirs["target"])
    assert answer.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_bad_chat_template_stops_serve_before_loading(model_dirs, capsys) -> None:
    assert cli.main(["serve", "--model", model_dirs["target"], "--chat-template", "{% for m in %}"]) == 2
    err = capsys.readouterr().err
    assert "speculative: error: --chat-template is not a valid Jinja template: " in err
    assert "(line 1)" in err and "loaded" not in err
