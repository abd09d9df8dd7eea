"""`speculative bench-serve`'s outputs: results.json, report.md (a table per loop kind) and load.png."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from speculative.bench.plots import plt, save
from speculative.bench.report import markdown_table, num

LEVEL_COLUMNS = [
    "server",
    "level",
    "req/s",
    "out tok/s",
    "TTFT p50 / p99 (ms)",
    "TPOT p50 / p99 (ms)",
    "ITL per chunk p50 / p99 (ms)",
    "ITL per token p50 / p99 (ms)",
    "errors",
    "RSS max (MiB)",
]
MIB = 2**20


def _pair(figures: dict) -> str:
    return f"{num(figures['p50'], '.1f')} / {num(figures['p99'], '.1f')}"


def _rss_max(server: dict, spans: list[list[float]]) -> float | None:
    """The largest RSS sample (MiB) inside one of the spans [start, seconds]."""
    inside = [rss for t, rss in server["rss"] if any(a <= t <= a + n for a, n in spans)]
    return max(inside) / MIB if inside else None


def _label(level: dict) -> str:
    if "rate" in level:
        return f"{level['rate']:g} req/s"
    return f"{level['concurrency']} client{'s' if level['concurrency'] > 1 else ''}"


def level_rows(results: dict, kind: str) -> list[list[str]]:
    """Table rows of every server's levels of `kind` ("closed": by concurrency, "open": by rate)."""
    rows = []
    for name, server in results["servers"].items():
        for level in server[kind]:
            rows.append(
                [
                    name,
                    _label(level),
                    num(level["requests_per_s"]),
                    num(level["output_tokens_per_s"], ".1f"),
                    _pair(level["ttft_ms"]),
                    _pair(level["tpot_ms"]),
                    _pair(level["itl_ms"]),
                    _pair(level["itl_token_ms"]),
                    f"{level['errors']} of {level['requests']}",
                    num(_rss_max(server, level["spans"]), ".0f"),
                ]
            )
    return rows


ENGINE_COLUMNS = [
    "server",
    "level",
    "steps",
    "drafting steps",
    "draft tokens a drafting step",
    "prefill share of busy time",
]


def engine_rows(results: dict) -> list[list[str]]:
    """Table rows of every level's engine counters (load.engine_counters), where the server had them:
    its steps, the share that drafted, the draft tokens such a step verified a row on average, and the
    prefills' share of the engine thread's busy seconds."""
    rows = []
    for name, server in results["servers"].items():
        for level in server["closed"] + server["open"]:
            engine = level.get("engine")
            if not engine:
                continue
            steps = {int(k): n for k, n in engine["steps"].items()}
            total, drafting = sum(steps.values()), sum(n for k, n in steps.items() if k)
            drafted = sum(k * n for k, n in steps.items())
            busy = engine["prefill_s"] + engine["step_s"]
            rows.append(
                [
                    name,
                    _label(level),
                    str(total),
                    f"{drafting / total:.1%}" if total else "-",
                    num(drafted / drafting if drafting else None, ".2f"),
                    f"{engine['prefill_s'] / busy:.1%}" if busy else "-",
                ]
            )
    return rows


def speedup_lines(results: dict) -> list[str]:
    """One line per server but plain and level: its output tokens/s over plain's in the same round, the
    median and range over the rounds (none without a plain server)."""
    plain = results["servers"].get("plain")
    if plain is None:
        return []
    lines = []
    for name, server in results["servers"].items():
        if name == "plain":
            continue
        for kind in ("closed", "open"):
            for level, base in zip(server[kind], plain[kind]):
                ratios = [
                    ours / theirs if theirs else math.nan
                    for ours, theirs in zip(
                        level["rounds_output_tokens_per_s"], base["rounds_output_tokens_per_s"]
                    )
                ]
                spread = f", {min(ratios):.2f}x to {max(ratios):.2f}x" if len(ratios) > 1 else ""
                rounds = "round" if len(ratios) == 1 else "rounds"
                lines.append(
                    f"{name}, {_label(level)}: {statistics.median(ratios):.2f}x plain "
                    f"({len(ratios)} {rounds}{spread})"
                )
    return lines


def soak_lines(results: dict) -> list[str]:
    """One line per server that soaked: requests, errors, RSS before and after, and the verdict."""
    lines = []
    for name, server in results["servers"].items():
        soak = server["soak"]
        if soak is None:
            continue
        verdict = "flat" if soak["flat"] else "NOT flat"
        heap = (
            ""
            if soak["heap_growth"] is None
            else f"C heap in use {soak['heap_baseline'] / MIB:.1f} -> {soak['heap_end'] / MIB:.1f} MiB "
            f"({soak['heap_growth'] / 2**10:+.0f} KiB), "
        )
        lines.append(
            f"{name}: {soak['requests']} requests in {soak['seconds']:.0f} s, {soak['errors']} errors; idle "
            f"after the warm-up and at the end: {heap}RSS {soak['rss_baseline'] / MIB:.1f} -> "
            f"{soak['rss_end'] / MIB:.1f} MiB ({soak['growth'] / 2**10:+.0f} KiB); a leak of 1 KiB a "
            f"request would add {soak['bound'] / 2**10:.0f} KiB: {verdict}"
        )
    return lines


def token_range(max_tokens: int, spread: float) -> tuple[int, int]:
    """The least and the most tokens a request asks for: max_tokens * (1 -+ spread), at least 1."""
    return max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))


def _lengths(config: dict) -> str:
    """What the requests asked for: "64 tokens each", or the range their lengths were drawn from."""
    n, spread = config["max_tokens"], config.get("max_tokens_range", 0.0)
    if not spread:
        return f"{n} tokens each"
    low, high = token_range(n, spread)
    return f"{low} to {high} tokens each, drawn uniformly"


def _rounds(config: dict) -> str:
    rounds = config["rounds"]
    if rounds == 1:
        return "one round"
    return f"{rounds} rounds, each running every level on one server after another (the order rotated)"


def markdown(results: dict, plot: str) -> str:
    """report.md: what ran on what, the closed- and open-loop tables, the soak and the plot."""
    config, m = results["config"], results["machine"]
    parts = [
        "# speculative bench-serve",
        f"`speculative serve` per server ({', '.join(results['servers'])}; draft: "
        f"{config.get('method', 'draft_model')}, k={config['k']}, "
        f"adaptive: k up to {config['k']}), {config['dtype']}{', compiled' if config['compile'] else ''}; "
        f"prompts from `{Path(results['prompts']).name}` ({config['num_prompts']} in turn"
        f"{_conversations(config)}), "
        f"{_lengths(config)} (EOS ignored), temperature {config['temperature']}, streamed "
        f"over HTTP; {config['requests']} requests per level (at least 2 per client), "
        f"{_rounds(config)}.",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}; {m['cpu_features']}), torch {m['torch']}, "
        f"Python {m['python']}.",
        "Columns, over every round's requests: requests/s and output tokens/s over the rounds' wall time; "
        "time to first token, time per output token after the first, inter-chunk latency (a speculative "
        "step's chunk can hold several tokens) and inter-token latency (a chunk's gap shared by its "
        "tokens, each token a sample), p50 / p99; requests that failed; the server's largest RSS in the "
        "level.",
        "## Closed loop (clients sending back to back)",
        markdown_table(LEVEL_COLUMNS, level_rows(results, "closed")),
    ]
    if any(server["open"] for server in results["servers"].values()):
        parts += [
            "## Open loop (Poisson arrivals)",
            markdown_table(LEVEL_COLUMNS, level_rows(results, "open")),
        ]
    speedups = speedup_lines(results)
    if speedups:
        parts += [
            "## Against plain decoding",
            "Each server's output tokens/s over plain's in the same round: the median over the rounds, "
            "and the least and the most.",
            "\n".join(f"- {line}" for line in speedups),
        ]
    engine = engine_rows(results)
    if engine:
        parts += [
            "## Engine",
            "From each server's /metrics over the level (every round): its engine's steps, the share of "
            "them that drafted, the draft tokens such a step verified a row on average, and the share of "
            "the engine thread's busy time spent prefilling admitted requests.",
            markdown_table(ENGINE_COLUMNS, engine),
        ]
    soak = soak_lines(results)
    if soak:
        parts += ["## Soak", "\n".join(f"- {line}" for line in soak)]
    examples = {
        e for s in results["servers"].values() for lv in s["closed"] + s["open"] for e in lv["error_examples"]
    }
    if examples:
        parts += ["## Errors", "\n".join(f"- {e}" for e in sorted(examples))]
    parts += ["## Plot", f"![load]({Path(plot).name})"]
    return "\n\n".join(parts) + "\n"


def plot(results: dict, path: Path) -> str:
    """Output tokens/s and TTFT / TPOT p50 against concurrency (closed loop) per server, and each
    server's RSS over time."""
    fig, (throughput, latency, memory) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, server in results["servers"].items():
        levels = server["closed"]
        clients = [level["concurrency"] for level in levels]
        (line,) = throughput.plot(
            clients, [level["output_tokens_per_s"] for level in levels], "o-", label=name
        )
        color = line.get_color()  # a server's colour in every panel
        ttft = [level["ttft_ms"]["p50"] for level in levels]
        latency.plot(clients, ttft, "o-", color=color, label=f"{name} TTFT")
        latency.plot(
            clients, [level["tpot_ms"]["p50"] for level in levels], "s--", color=color, label=f"{name} TPOT"
        )
        times, rss = zip(*server["rss"]) if server["rss"] else ((), ())
        memory.plot(times, [r / MIB for r in rss], color=color, label=name)
    for ax in (throughput, latency):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.legend()
    throughput.set_ylabel("output tokens/s")
    throughput.set_title("Throughput (closed loop)")
    latency.set_yscale("log")
    latency.set_ylabel("ms (p50, log scale)")
    latency.set_title("Time to first token, time per output token")
    memory.set_xlabel("seconds since the benchmark started")
    memory.set_ylabel("RSS (MiB)")
    memory.set_title("Server memory")
    memory.legend()
    return save(fig, path)


def write_load_outputs(results: dict, out: Path) -> dict[str, Path]:
    """results.json, report.md and load.png into `out` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "report": out / "report.md", "plot": out / "load.png"}
    paths["json"].write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    paths["report"].write_text(markdown(results, plot(results, paths["plot"])))
    return paths


def _conversations(config: dict) -> str:
    """The report's words for LoadConfig.conversations."""
    if not config.get("conversations"):
        return ""
    return "; closed loop as conversations: a record's user turns, the answers as the history"
