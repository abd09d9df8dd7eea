"""The results as a terminal table (rich), `results.json` and `report.md`: the same rows in each."""

from __future__ import annotations

import json
import math
from pathlib import Path

from speculative.extras import needs_extra

with needs_extra("bench", "speculative.bench"):
    from rich.console import Console
    from rich.table import Table

METHOD_COLUMNS = [
    "method",
    "tok/s",
    "vs HF",
    "vs ours AR",
    "accept",
    "alpha",
    "mean len",
    "bound",
    "effic.",
    "identical (ties)",
]
K_COLUMNS = ["k", "vs ours AR", "bound", "effic.", "accept", "alpha", "mean len"]
BATCH_COLUMNS = ["batch", "method", "tok/s", "identical (ties)"]


def num(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _identical(entry: dict) -> str:
    return f"{num(entry['identical_fraction'])} ({entry['near_ties']})"


def _with_llamacpp(methods: dict) -> bool:
    return any(e.get("speedup_vs_llamacpp") is not None for e in methods.values() if e["status"] == "ok")


def method_columns(methods: dict) -> list[str]:
    """METHOD_COLUMNS, with "vs llama.cpp" after "vs ours AR" where llama.cpp's plain decoding ran."""
    if not _with_llamacpp(methods):
        return METHOD_COLUMNS
    at = METHOD_COLUMNS.index("vs ours AR") + 1
    return METHOD_COLUMNS[:at] + ["vs llama.cpp"] + METHOD_COLUMNS[at:]


def method_rows(methods: dict) -> list[list[str]]:
    """One row per method of a prompt set's table that ran, in `method_columns`' order."""
    llamacpp = _with_llamacpp(methods)
    return [
        [e["label"], num(e["tokens_per_s"], ".1f"), num(e["speedup_vs_hf"]), num(e["speedup_vs_ours_ar"])]
        + ([num(e.get("speedup_vs_llamacpp"))] if llamacpp else [])
        + [
            num(e["acceptance_rate"]),
            num(e["alpha"]),
            num(e["mean_accepted_length"]),
            num(e["bound"]),
            num(e["efficiency"]),
            _identical(e),
        ]
        for e in methods.values()
        if e["status"] == "ok"
    ]


def engine_timings_line(methods: dict) -> str | None:
    """The engines' own prefill / decode split (llama.cpp's timings; ours: outside its decoding steps and
    in them), or None where no method reports one."""
    parts = [
        f"{e['label']}: prefill {e['prefill_ms']:.1f} ms, "
        f"decode only {e['decode_tokens_per_s']:.1f} tokens/s, "
        f"in the server {e['engine_tokens_per_s']:.1f} tokens/s"
        if e.get("engine") == "llama.cpp"
        else f"{e['label']}: outside its steps {e['prefill_ms']:.1f} ms, "
        f"decode only {e['decode_tokens_per_s']:.1f} tokens/s"
        for e in methods.values()
        if e["status"] == "ok" and "decode_tokens_per_s" in e
    ]
    if not parts:
        return None
    return (
        "engine's own timings (medians over prompts; tokens/s above: wall time, prefill included; ours: "
        "the time outside its decoding steps, its prefill and LLM.generate's own work, and its steps' "
        "tokens/s): " + "; ".join(parts)
    )


BOUND_ENGINES = {"ours_compiled": "ours"}  # a method's engine -> the engine whose bound it shares
ENGINE_NAMES = {"hf": "HF"}  # an engine as the report names it (others: as they are)


def _fractions(plain: list[dict], tokens_per_second: float) -> str:
    """ "<method> 50%" for each plain-decoding entry, llama.cpp's decode-only figure beside its own."""
    fractions = []
    for e in plain:
        fraction = f"{e['label']} {e['tokens_per_s'] / tokens_per_second:.0%}"
        if "decode_tokens_per_s" in e:
            fraction += f" ({e['decode_tokens_per_s'] / tokens_per_second:.0%} decode only)"
        fractions.append(fraction)
    return ", ".join(fractions)


def memory_bound_line(bound: dict | None, methods: dict) -> str | None:
    """The memory bound of plain decoding (bench/memory.py) and the fraction of it each engine's plain
    decoding reaches (tokens/s / the bound's tokens/s; llama.cpp's decode-only figure beside its own).

    `bound`: memory.engine_bounds' figures, one bound per engine from the bytes that engine reads (its
    precision, bytes, ms a token; each plain method against its own engine's bound), or one
    memory_bound for every engine (results before engine bounds)."""
    if not bound:
        return None
    plain = [e for e in methods.values() if e["status"] == "ok" and e.get("drafter") is None]
    if "engines" not in bound:
        return (
            f"memory bound of plain decoding: {bound['weight_mb']:.1f} MB of target weights / "
            f"{bound['bandwidth_gb_s']:.1f} GB/s (a large copy, read + write) = {bound['forward_ms']:.2f} ms "
            f"a forward, {bound['tokens_per_second']:.0f} tokens/s; reached: "
            + _fractions(plain, bound["tokens_per_second"])
        )
    parts = []
    for engine, figures in bound["engines"].items():
        reached = [e for e in plain if BOUND_ENGINES.get(e.get("engine"), e.get("engine")) == engine]
        part = (
            f"{ENGINE_NAMES.get(engine, engine)} ({figures['weights']}): {figures['weight_mb']:.1f} MB, "
            f"{figures['forward_ms']:.2f} ms a token ({figures['tokens_per_second']:.0f} tokens/s)"
        )
        if reached:
            part += ", reached: " + _fractions(reached, figures["tokens_per_second"])
        parts.append(part)
    return (
        "memory bound of plain decoding (the target weights each engine reads per token / "
        f"{bound['bandwidth_gb_s']:.1f} GB/s, a large copy's read + write): " + "; ".join(parts)
    )


def skipped_lines(methods: dict) -> list[str]:
    """ "<method>: skipped (<why>)" for each method that did not run."""
    return [f"{e['label']}: skipped ({e['note']})" for e in methods.values() if e["status"] == "skipped"]


def k_rows(points: list[dict]) -> list[list[str]]:
    """One row per k of a k sweep."""
    return [
        [
            str(p["k"]),
            num(p["speedup_vs_ours_ar"]),
            num(p["bound"]),
            num(p["efficiency"]),
            num(p["acceptance_rate"]),
            num(p["alpha"]),
            num(p["mean_accepted_length"]),
        ]
        for p in points
    ]


def batch_rows(rows: list[dict]) -> list[list[str]]:
    """One row per (batch size, method) of the batch sweep."""
    return [[str(r["batch_size"]), r["label"], num(r["tokens_per_s"], ".1f"), _identical(r)] for r in rows]


def run_times_line(methods: dict) -> str:
    """The step times each method's bound used, in milliseconds, and where they come from."""

    def ms(value) -> str:
        return "n/a" if value is None else f"{value * 1e3:.2f}"

    parts = [
        f"{e['label']}: T_1 {ms(e['T_1'])}"
        + (f", T_v {ms(e['T_v'])}, T_d {ms(e['T_d'])}" if e["drafter"] else "")
        for e in methods.values()
        if e["status"] == "ok" and e.get("bound") is not None
    ]
    return "bound's step times, ms (means of the runs' own calls): " + "; ".join(parts)


def precision(config: dict) -> str:
    """The run's dtype, and its quantization where it has one ("float32, int8 weights (HF: float32)")."""
    if not config.get("quantization"):
        return config["dtype"]
    return f"{config['dtype']}, {config['quantization']} weights (HF: unquantized)"


def _rich_table(title: str, columns: list[str], rows: list[list[str]], caption: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 or column == "method" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def print_tables(results: dict, console: Console) -> None:
    """The side-by-side tables, the sweeps and the step times on the terminal."""
    config = results["config"]
    for name, data in results["sets"].items():
        title = (
            f"{name}: {data['num_prompts']} prompts, {config['max_tokens']} tokens each, greedy, "
            f"{precision(config)}, {results['machine']['device']}"
        )
        console.print(
            _rich_table(
                title,
                method_columns(data["methods"]),
                method_rows(data["methods"]),
                "; ".join(skipped_lines(data["methods"])) or None,
            )
        )
        console.print(run_times_line(data["methods"]))
        for line in (
            engine_timings_line(data["methods"]),
            memory_bound_line(results.get("memory_bound"), data["methods"]),
        ):
            if line:
                console.print(line)
    for name, sweeps in results["sweeps"]["k"].items():
        for drafter, points in sweeps.items():
            console.print(
                _rich_table(
                    f"{name}: ours, {drafter}, speedup over ours AR against k", K_COLUMNS, k_rows(points)
                )
            )
    batch_set = results["sweeps"].get("batch_set", "")
    console.print(
        _rich_table(
            f"{batch_set}: throughput against batch size",
            BATCH_COLUMNS,
            batch_rows(results["sweeps"]["batch"]),
        )
    )


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(results: dict, plots: list[str]) -> str:
    """report.md: what was run, on what, the tables, the plots and the notes."""
    config, m = results["config"], results["machine"]
    draft = [
        config.get("draft_dtype"),
        config.get("draft_quantization") and f"ours {config['draft_quantization']}",
    ]
    draft_dtype = f" (draft {', '.join(d for d in draft if d)})" if any(draft) else ""
    features = f"; {m['cpu_features']}" if m.get("cpu_features") else ""
    parts = [
        "# speculative bench",
        f"Target `{config['model']}`, draft `{config['draft_model']}`, k={config['k']}, "
        f"{config['max_tokens']} tokens per prompt (greedy, EOS ignored), {precision(config)}{draft_dtype} "
        f"on {m['device']}; {config['repeats']} timed run(s) per prompt and method after two discarded "
        f"warm-ups (the first prompt, and it less its last token), runs interleaved, medians over prompts.",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}{features}), torch {m['torch']}, "
        f"transformers {m['transformers']}, "
        f"Python {m['python']}, OMP_WAIT_POLICY={m['omp_wait_policy']}"
        f"{'' if not m.get('llama_cpp') else ', llama.cpp ' + m['llama_cpp']['version']}.",
        "Columns: tokens/s (median over prompts); speedup against HF generate, against our autoregressive "
        "baseline and, where it ran, against llama.cpp's plain decoding (medians of per-prompt time ratios); "
        "acceptance rate (accepted / drafted); alpha, the per-token acceptance whose "
        "E = (1 - a^(k+1)) / (1 - a) equals the measured mean accepted length (tokens per target step); "
        "bound = E * T_1 / (k * T_d + T_v), the speedup a drafter of per-token acceptance a reaches when a "
        "step costs k drafts and one verification, with a = alpha and the step times that the runs paid "
        "(means of the runs' own target forwards and draftings, T_1 from the engine's plain decoding; the "
        "line under each table gives them); efficiency = speedup over the engine's own plain decoding "
        "(ours: ours AR; HF: HF generate) / bound; identical: fraction of outputs token-identical to HF "
        "generate's greedy output, proven near-ties (top-2 logits within 1e-4 at the first difference) "
        "counted as identical, their number in brackets.",
    ]
    for name, data in results["sets"].items():
        parts += [
            f"## {name} ({data['num_prompts']} prompts)",
            markdown_table(method_columns(data["methods"]), method_rows(data["methods"])),
            run_times_line(data["methods"]),
        ]
        parts += [
            line
            for line in (
                engine_timings_line(data["methods"]),
                memory_bound_line(results.get("memory_bound"), data["methods"]),
            )
            if line
        ]
        skipped = skipped_lines(data["methods"])
        if skipped:
            parts.append("\n".join(f"- {line}" for line in skipped))
    for name, sweeps in results["sweeps"]["k"].items():
        for drafter, points in sweeps.items():
            parts += [
                f"## k sweep: {name}, {drafter} ({config['sweep_prompts']} prompts)",
                markdown_table(K_COLUMNS, k_rows(points)),
            ]
    parts += [
        f"## Batch sweep: {results['sweeps'].get('batch_set', '')}",
        markdown_table(BATCH_COLUMNS, batch_rows(results["sweeps"]["batch"])),
    ]
    parts += ["## Run time", ", ".join(f"{phase} {s:.0f} s" for phase, s in results["seconds"].items()) + "."]
    parts += ["## Plots"] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    parts += ["## Notes", "\n".join(f"- {note}" for note in results["notes"])]
    return "\n\n".join(parts) + "\n"


def write_outputs(results: dict, out: Path, plots: list[str]) -> dict[str, Path]:
    """results.json and report.md into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "report": out / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    paths["report"].write_text(markdown(results, plots))
    return paths
