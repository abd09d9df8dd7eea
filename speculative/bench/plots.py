"""PNG plots of the results (matplotlib, Agg backend): tokens/s by method, acceptance by draft position,
speedup against k with the bound beside it, and throughput against batch size."""

from __future__ import annotations

import io
from pathlib import Path

from speculative.extras import needs_extra

with needs_extra("bench", "speculative.bench"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency


def save(fig, path: Path) -> str:
    """Write `fig` to `path` as a PNG of 256 colours (a third of the bytes of a full-colour one, the
    same to the eye for these plots: reports are committed with their plots); returns the path."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    Image.open(buffer).convert("RGB").quantize(256).save(path, format="PNG", optimize=True)
    return str(path)


def tokens_per_second(results: dict, path: Path) -> str:
    """Grouped bars: tokens/s of every method that ran, one group per prompt set."""
    sets = results["sets"]
    names = [n for n, e in next(iter(sets.values()))["methods"].items() if e["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(sets)
    for i, (set_name, data) in enumerate(sets.items()):
        values = [data["methods"][n]["tokens_per_s"] for n in names]
        ax.bar([j + i * width for j in range(len(names))], values, width, label=set_name)
    ax.set_xticks([j + width * (len(sets) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(
        [sets[next(iter(sets))]["methods"][n]["label"] for n in names], rotation=25, ha="right"
    )
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_title("Greedy decoding speed by method")
    ax.legend()
    return save(fig, path)


def acceptance_by_position(results: dict, path: Path) -> str:
    """Acceptance rate at each draft position 1..k of our speculative methods, per prompt set."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for set_name, data in results["sets"].items():
        for entry in data["methods"].values():
            rates = entry.get("acceptance_per_position")
            if entry["status"] == "ok" and rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{set_name}: {entry['label']}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at the position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (ours)")
    ax.legend(fontsize=8)
    return save(fig, path)


def speedup_against_k(results: dict, path: Path) -> str:
    """Measured speedup over our baseline against k (solid) with the speed bound (dashed)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for set_name, sweeps in results["sweeps"]["k"].items():
        for drafter, points in sweeps.items():
            ks = [p["k"] for p in points]
            (line,) = ax.plot(
                ks, [p["speedup_vs_ours_ar"] for p in points], marker="o", label=f"{set_name}, {drafter}"
            )
            ax.plot(
                ks,
                [p["bound"] for p in points],
                linestyle="--",
                color=line.get_color(),
                label=f"{set_name}, {drafter}: bound",
            )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({p["k"] for s in results["sweeps"]["k"].values() for ps in s.values() for p in ps}))
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup over ours autoregressive")
    ax.set_title("Speedup against k, with the speed bound")
    ax.legend(fontsize=8)
    return save(fig, path)


def throughput_against_batch(results: dict, path: Path) -> str:
    """Tokens/s of each method against batch size."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = results["sweeps"]["batch"]
    for name in dict.fromkeys(r["method"] for r in rows):
        points = [r for r in rows if r["method"] == name]
        ax.plot(
            [r["batch_size"] for r in points],
            [r["tokens_per_s"] for r in points],
            marker="o",
            label=points[0]["label"],
        )
    ax.set_xticks(sorted({r["batch_size"] for r in rows}))
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_title("Throughput against batch size")
    ax.legend(fontsize=8)
    return save(fig, path)


def write_plots(results: dict, out: Path) -> list[str]:
    """Every plot into `out` (the k sweep's where one ran: `bench --methods` can leave it out); returns
    their paths."""
    out.mkdir(parents=True, exist_ok=True)
    swept = any(points for sweeps in results["sweeps"]["k"].values() for points in sweeps.values())
    return [
        tokens_per_second(results, out / "tokens_per_s.png"),
        acceptance_by_position(results, out / "acceptance_by_position.png"),
        *([speedup_against_k(results, out / "speedup_vs_k.png")] if swept else []),
        throughput_against_batch(results, out / "throughput_vs_batch.png"),
    ]
