"""Without an extra's modules, each entry point says which extra to install (speculative.extras)."""

from __future__ import annotations

import importlib

import pytest

from speculative import cli
from speculative.extras import EXTRAS, needs_extra


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "prometheus_client"])
def test_serve_names_the_server_extra(hide_module, capsys, missing) -> None:
    hide_module(missing, "speculative.server")
    assert cli.main(["serve"]) == 2
    assert (
        "speculative serve needs the server extra: pip install 'speculative[server]' "
        f"(no module named '{missing}')"
    ) in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["rich", "matplotlib"])
def test_bench_names_the_bench_extra(hide_module, capsys, missing) -> None:
    hide_module(missing, "speculative.bench.run", "speculative.bench.report", "speculative.bench.plots")
    assert cli.main(["bench", "--quick"]) == 2
    assert (
        "speculative bench needs the bench extra: pip install 'speculative[bench]' "
        f"(no module named '{missing}"
    ) in capsys.readouterr().err


def test_replicas_name_the_replicas_extra(hide_module, capsys) -> None:
    hide_module("ray", "speculative.server.replicas")
    assert cli.main(["serve", "--replicas", "2"]) == 2
    assert (
        "speculative serve --replicas needs the replicas extra: pip install 'speculative[replicas]' "
        "(no module named 'ray')"
    ) in capsys.readouterr().err


MODULES = [  # (missing module, module importing it, its extra)
    ("llguidance", "speculative.sampling.guided", "guided"),
    ("fastapi", "speculative.server.app", "server"),
    ("prometheus_client", "speculative.server.metrics", "server"),
    ("matplotlib", "speculative.bench.plots", "bench"),
    ("rich", "speculative.bench.report", "bench"),
    ("ray", "speculative.server.replicas", "replicas"),
]


@pytest.mark.parametrize("missing, module, extra", MODULES)
def test_modules_name_their_extra(hide_module, missing, module, extra) -> None:
    hide_module(missing, module)
    with pytest.raises(
        ModuleNotFoundError,
        match=rf"needs the {extra} extra: pip install "
        rf"'speculative\[{extra}\]'",
    ) as caught:
        importlib.import_module(module)
    assert caught.value.name.partition(".")[0] == missing


def test_other_missing_modules_pass_unchanged() -> None:
    with (
        pytest.raises(ModuleNotFoundError, match="No module named 'no_such_module'"),
        needs_extra("bench", "speculative bench"),
    ):
        import no_such_module  # noqa: F401
    with (
        pytest.raises(ValueError, match=f"extra must be one of {', '.join(EXTRAS)}; got 'gpu'"),
        needs_extra("gpu", "x"),
    ):
        pass
