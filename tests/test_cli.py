"""The CLI end to end, as the README shows it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from speculative import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_command(name: str) -> list[str]:
    """The README's `speculative generate` line marked by `# cli: <name>`, as argv."""
    for line in README.read_text().splitlines():
        if line.strip().startswith("speculative generate") and line.strip().endswith(f"# cli: {name}"):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"README has no `speculative generate ... # cli: {name}` line")


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speculative.cli", *argv[1:]], capture_output=True, text=True, timeout=300
    )


def test_readme_generate_command(model_dirs) -> None:
    argv = readme_command("draft")
    argv = [
        model_dirs["target"] if a == "./target" else model_dirs["draft"] if a == "./draft" else a
        for a in argv
    ]
    result = run(argv + ["--max-tokens", "12"])
    assert result.returncode == 0, result.stderr
    assert "def fibonacci(n):" in result.stdout
    assert re.search(
        r"\[draft_model, k=4\] 12 tokens in \d+ steps, finish: length\n"
        r"time to first token \d+\.\d ms, decoding \d+\.\d tokens/s\n"
        r"acceptance rate \d\.\d\d \(\d+/\d+ drafts\), mean accepted length \d\.\d\d",
        result.stdout,
    )
    # what the first call costs once, apart from the figures above, each wait announced before it
    once = (
        r"^speculative: loading target target \(model\.safetensors, \d+\.\d MB\) and draft model draft "
        r"\(model\.safetensors, \d+\.\d MB\)\.\.\.\n"
        r"speculative: target and draft in float32.*\n"
        r"speculative: loaded target and draft in \d+\.\d\d s\n"
        r"speculative: warming up on the prompts \(8 tokens\)\.\.\.\n"
        r"speculative: first call \(8 tokens, warm-up\) in \d+\.\d\d s$"
    )
    assert re.search(once, result.stderr, re.MULTILINE), result.stderr


def test_readme_first_command_on_the_demo_pair() -> None:
    """The README's first command, exactly as written, on the toy pair (the suite's SPECULATIVE_DEMO=toy:
    tests never fetch the real demo model; tests/test_demo_fetch.py checks that path), speculating."""
    result = run(readme_command("demo") + ["--max-tokens", "24"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(cli.TOY_PROMPT)
    assert "[draft_model, k=4]" in result.stdout
    rate = float(re.search(r"acceptance rate (\d\.\d\d)", result.stdout).group(1))
    assert rate > 0.2, result.stdout  # the distilled draft agrees with its target (a random one: ~0)


@pytest.mark.slow
def test_readme_tensor_parallel_command_on_the_demo_pair() -> None:
    """The README's tensor-parallel command (two ranks) writes the text of one process (float32)."""
    split = run(readme_command("tp") + ["--max-tokens", "16", "--dtype", "float32"])
    assert split.returncode == 0, split.stderr
    whole = run(readme_command("demo") + ["--max-tokens", "16", "--dtype", "float32"])
    assert split.stdout.split("\n[")[0] == whole.stdout.split("\n[")[0]
    assert "[draft_model, k=4] 16 tokens" in split.stdout


def test_ngram_suffix_and_plain(model_dirs) -> None:
    for extra, tag in (
        (["--ngram", "-k", "3"], "[ngram, k=3]"),
        (["--method", "ngram", "--prompt-lookup-max", "2"], "[ngram, k=4]"),
        (["--suffix", "-k", "6", "--suffix-max-cached-requests", "0"], "[suffix, k=6]"),  # the earlier name
        (["--method", "suffix", "--suffix-decoding-max-tree-depth", "8"], "[suffix, k=4]"),
        ([], "[autoregressive]"),
    ):
        result = run(
            [
                "speculative",
                "generate",
                "--model",
                model_dirs["target"],
                "--prompt",
                "ab ab ab",
                "--max-tokens",
                "8",
                *extra,
            ]
        )
        assert result.returncode == 0, result.stderr
        assert tag in result.stdout and "time to first token" in result.stdout
        assert "speculative: loaded target in" in result.stderr
    assert "acceptance rate" not in result.stdout  # autoregressive: nothing drafted


def test_bad_flag_is_a_clear_error(model_dirs) -> None:
    result = run(
        ["speculative", "generate", "--model", model_dirs["target"], "--prompt", "x", "--top-p", "2"]
    )
    assert result.returncode == 2
    assert "top_p must be in (0, 1]" in result.stderr


def test_draft_dtype_flag(model_dirs) -> None:
    base = [
        "speculative",
        "generate",
        "--model",
        model_dirs["target"],
        "--draft-model",
        model_dirs["draft"],
        "--prompt",
        "ab ab ab",
        "--max-tokens",
        "8",
    ]
    result = run(base + ["--dtype", "float32", "--draft-dtype", "bfloat16"])
    assert result.returncode == 0, result.stderr
    assert "[draft_model, k=4]" in result.stdout
    result = run(base + ["--draft-dtype", "int8"])
    assert result.returncode == 2 and "draft_dtype must be 'auto'" in result.stderr


def test_tree_flags(model_dirs) -> None:
    base = ["speculative", "generate", "--model", model_dirs["target"], "--prompt", "ab ab ab"]
    result = run([*base, "--draft-model", model_dirs["draft"], "--max-tokens", "8", "--tree", "dynamic"])
    assert result.returncode == 0, result.stderr
    assert "[draft_model, k=4, dynamic tree of 8]" in result.stdout
    result = run([*base, "--ngram", "--tree", "static", "--tree-nodes", "0"])
    assert result.returncode == 2 and "tree_nodes must be an integer in [1, 128]" in result.stderr
    result = run([*base, "--suffix", "--suffix-min-token-prob", "2"])
    assert result.returncode == 2 and "suffix_decoding_min_token_prob must be in [0, 1]" in result.stderr
    result = run([*base, "--suffix", "--ngram"])
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--ngram", "--tree", "static", "--tree-nodes", "0"],
            "tree_nodes must be an integer in [1, 128]; got 0 (--tree-nodes)",
        ),
        (["--suffix", "--suffix-min-token-prob", "2"], "(--suffix-decoding-min-token-prob)"),
        (
            ["--ngram", "--suffix-max-depth", "8"],
            "--suffix-decoding-max-tree-depth is an option of --method suffix",
        ),
        (["--prompt-lookup-max", "2"], "the method here is none (plain decoding)"),
        (["--method", "suffix", "--ngram"], "--ngram and --method suffix name two methods"),
        (
            ["--method", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
            "prompt_lookup_max must be",
        ),
    ],
)
def test_speculative_flag_errors_name_the_flag_before_anything_loads(capsys, flags, message) -> None:
    assert cli.main(["generate", "--model", "no/such-model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_demo_drafts_options_are_its_own_without_a_model(capsys) -> None:
    """Without --model the demo pair runs with its draft, so the draft's options are accepted before it
    is filled in (they were refused as options of plain decoding), and a model-free method's are checked
    against that method."""
    assert cli.main(["generate", "--prompt-lookup-min", "0", "--max-tokens", "4"]) == 0
    assert "[draft_model, k=4]" in capsys.readouterr().out
    assert cli.main(["generate", "--ngram", "--num-assistant-tokens", "1"]) == 2
    assert "--num-assistant-tokens is an option of --method draft_model" in capsys.readouterr().err


def test_a_registered_method_gets_its_flags() -> None:
    """A method registered by name is reachable by --method, its options by generated flags, without an
    edit of the CLI (in a process of its own: the registry is global)."""
    code = (
        "from dataclasses import dataclass, field\n"
        "from speculative.methods import MethodConfig, register\n"
        "@register('toy_method')\n"
        "@dataclass\n"
        "class ToyConfig(MethodConfig):\n"
        "    toy_depth: int = field(default=2, metadata={'help': 'how deep'})\n"
        "from speculative.cli import build_parser\n"
        "from speculative.engine_args import EngineArgs\n"
        "parser = build_parser()\n"
        "serve = parser._subparsers._group_actions[0].choices['serve']\n"
        "assert '--method toy_method: how deep (default: 2)' in ' '.join(serve.format_help().split())\n"
        "args = parser.parse_args(['serve', '--method', 'toy_method', '--toy-depth', '5', '-k', '2'])\n"
        "config = EngineArgs.from_cli_args(args).speculative_config()\n"
        "print(config.method, config.num_speculative_tokens, config.options.toy_depth)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["toy_method", "2", "5"]


def test_method_flags_state_a_whole_sentence_and_only_their_own_default() -> None:
    """A method flag's help is its docstring's first sentence, not its first line (a DFlash flag once read
    "... in one forward; no"), and bench's --eagle / --eagle3 each name their own default head
    (--dflash none)."""
    from speculative.engine_args import _first_sentence

    assert _first_sentence("A block drafter proposes k\n    tokens; no options. More.") == (
        "A block drafter proposes k tokens"
    )
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for command in ("generate", "bench"):
        commands[command].format_help()  # bench's flags are added on its first use
        heads = ("dflash", "eagle", "eagle3")
        helps = {a.dest: " ".join(a.help.split()) for a in commands[command]._actions if a.dest in heads}
        assert set(helps) == set(heads)
        assert "in one forward, reading the target's hidden states" in helps["dflash"]
    assert "models/demo/eagle)" in helps["eagle"] and "models/demo/eagle3)" in helps["eagle3"]
    assert "models/demo" not in helps["dflash"]


def test_engine_args_make_what_llm_takes() -> None:
    from speculative.engine_args import EngineArgs

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--model", "t", "--eagle3", "head", "-k", "3", "--tree", "dynamic"])
    engine = EngineArgs.from_cli_args(args)
    kwargs = engine.llm_kwargs()
    assert (kwargs["model"], kwargs["draft_model"], kwargs["seed"], kwargs["dtype"]) == (
        "t",
        "head",
        0,
        "auto",
    )
    config = kwargs["speculative_config"]
    assert (config.method, config.num_speculative_tokens, config.tree) == ("eagle3", 3, "dynamic")
    plain = EngineArgs.from_cli_args(parser.parse_args(["generate", "--model", "t"]))
    assert plain.speculative_config() is None and plain.seed == 0  # generate's --seed is the request's
    assert parser.parse_args(["generate", "--seed", "7"]).request_seed == 7


def test_python_dash_m_speculative_is_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "speculative", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: speculative ")
    assert "{generate,bench,bench-serve,serve}" in result.stdout


def test_demo_pair_from_the_environment(model_dirs) -> None:
    """SPECULATIVE_DEMO_DIR names the demo pair's folder; where it holds none, the error says what to do."""
    folder = str(Path(model_dirs["target"]).parent)
    argv = [sys.executable, "-m", "speculative", "generate", "--prompt", "ab", "--max-tokens", "4"]
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "SPECULATIVE_DEMO_DIR": folder},
    )
    assert result.returncode == 0, result.stderr
    assert "[draft_model, k=4]" in result.stdout
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "SPECULATIVE_DEMO_DIR": str(Path(folder) / "nothing")},
    )
    assert result.returncode == 2
    assert (
        "pass --model, set SPECULATIVE_DEMO_DIR to the pair's folder, or train it with "
        "`python -m speculative.demo.train --out models/demo`" in result.stderr
    )


def test_demo_dir_of_a_checkout(monkeypatch) -> None:
    from speculative import demo

    monkeypatch.delenv("SPECULATIVE_DEMO_DIR", raising=False)
    assert demo._demo_dir() == README.parent / "models" / "demo"


def test_eagle_head_flags(model_dirs, capsys) -> None:
    """--eagle drafts with the head, in chains or (--tree) trees, and writes the target's own text."""
    base = ["generate", "--model", model_dirs["target"], "--prompt", "ab ab ab", "--max-tokens", "10"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out.split("\n[")[0]
    for flags, tag in (
        (["--eagle", model_dirs["eagle"], "-k", "3"], "[eagle, k=3] 10 tokens"),
        (["--eagle", model_dirs["eagle"], "--tree", "dynamic"], "[eagle, k=4, dynamic tree of 8] 10 tokens"),
    ):
        assert cli.main(base + flags) == 0
        out, err = capsys.readouterr()
        assert out.split("\n[")[0] == plain and tag in out and "acceptance rate" in out
        assert "speculative: loaded target and eagle head in" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--quantization", "int8"], "a target that is neither precompiled nor quantized"),
        (["--tensor-parallel-size", "2"], 'method="eagle3") does not run with tensor_parallel_size > 1'),
        (["--draft-dtype", "bfloat16"], "draft_dtype is the draft model's dtype"),
    ],
    ids=["quantization", "tensor-parallel", "draft-dtype"],
)
def test_eagle_head_refusals_are_cli_errors(model_dirs, capsys, flags, message) -> None:
    argv = ["generate", "--model", model_dirs["target"], "--eagle3", model_dirs["eagle"], *flags]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_eagle_is_one_of_the_drafters(model_dirs, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--eagle", model_dirs["eagle"], "--draft-model", model_dirs["draft"]])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_help_and_argument_errors_do_not_import_the_engine() -> None:
    """`speculative --help` and a bad flag answer at once: neither imports torch nor transformers."""
    code = (
        "import sys\n"
        "from speculative.cli import main\n"
        "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert main(['generate', '--max-tokens', '-3']) == 2\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert "max_tokens must be None or an integer >= 1" in done.stderr
