"""Acceptance of guided rows (JSON schemas) against unguided rows on the same prompts, on the demo pair:
the draft model at k = 4 at temperatures 0 to 1.2; greedy, its dynamic token trees, n-gram and suffix
decoding. The README's guided decoding figures come from it.

    python benchmarks/guided_acceptance.py [--max-tokens 96] [--out docs/benchmarks/results-guided-epyc-f32]

Each prompt is Python code after which a dict literal fits; prompt i's guided request answers it under
schema i % 4 (compact JSON, stopping at its end), its unguided one continues the code (EOS ignored). All
rows of a method and temperature run in one batch, each with its own seed. Acceptance = accepted /
drafted drafts over the rows; tokens per step = generated tokens / target steps. Writes results.json
and report.md to --out, with the machine's CPU (model, AVX-512 and AMX flags). Nothing is timed: on a
shared CPU, OMP_NUM_THREADS=1 keeps it out of other runs' way (about a minute).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.demo.model_card import machine
from speculative.models.dtypes import cpu_features
from speculative.sampling.guided import GuidedDecodingParams

TEXT = {"type": "string", "maxLength": 40}
NAMES = {"type": "array", "items": TEXT, "maxItems": 4}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": TEXT, "version": TEXT, "description": TEXT, "packages": NAMES},
        "required": ["name", "version", "description", "packages"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": TEXT,
            "email": TEXT,
            "active": {"type": "boolean"},
            "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        },
        "required": ["id", "name", "email", "active", "roles"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "host": TEXT,
            "port": {"type": "integer"},
            "debug": {"type": "boolean"},
            "timeout": {"type": "number"},
            "paths": NAMES,
        },
        "required": ["host", "port", "debug", "timeout", "paths"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "event": {"enum": ["open", "close", "error"]},
            "timestamp": {"type": "integer"},
            "message": TEXT,
            "fields": {"type": "object", "additionalProperties": TEXT, "maxProperties": 3},
        },
        "required": ["event", "timestamp", "message", "fields"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    'import json\n\n\ndef metadata():\n    """Return the package metadata."""\n    return ',
    "class User:\n    def to_dict(self):\n        return ",
    "import os\n\nDEFAULT_CONFIG = ",
    "def log_event(self, name):\n    record = ",
    "def test_parse(self):\n    expected = ",
    "    def as_json(self):\n        data = ",
    "# settings used when no file is given\nSETTINGS = ",
    "    def __getstate__(self):\n        state = ",
    "def make_request(url):\n    payload = ",
    "    def summary(self):\n        return ",
    "def default_options():\n    options = ",
    "RESPONSE = ",
]
TEMPERATURES = [0.0, 0.4, 0.8, 1.2]


def cpu() -> dict:
    """The CPU's model, its AVX-512 and AMX flags (/proc/cpuinfo) and torch's view of them."""
    flags = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx")))
            break
    return {**machine(), "avx512_amx_flags": flags, "torch_cpu_capability": cpu_features()}


def measure(llm: LLM, temperature: float, guided: bool, max_tokens: int) -> dict:
    """One batch of every prompt, guided or not, at one temperature: acceptance and figures."""
    params = [
        SamplingParams(
            temperature=temperature,
            seed=1000 + i,
            max_tokens=max_tokens,
            ignore_eos=not guided,
            guided_decoding=GuidedDecodingParams(json=SCHEMAS[i % len(SCHEMAS)]) if guided else None,
        )
        for i in range(len(PROMPTS))
    ]
    outputs = llm.generate(PROMPTS, params)
    metrics = [o.metrics for o in outputs]
    accepted, drafted = sum(m.num_accepted for m in metrics), sum(m.num_drafted for m in metrics)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    entry = {
        "acceptance": accepted / drafted if drafted else None,
        "accepted": accepted,
        "drafted": drafted,
        "tokens_per_step": generated / sum(m.num_steps for m in metrics),
        "generated": generated,
    }
    if guided:
        entry["complete_json"] = sum(_parses(o.outputs[0].text) for o in outputs) / len(outputs)
    return entry


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def report(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Guided decoding: acceptance of guided rows against unguided ones",
        "",
        f"Demo pair, k={results['k']}, {results['max_tokens']} tokens at most per row, float32 on cpu; "
        f"{len(PROMPTS)} prompts, each once guided (one of {len(SCHEMAS)} JSON schemas, compact, until the "
        "JSON ends) and once unguided (EOS ignored), one batch per row kind. "
        "Acceptance = accepted / drafted; tokens/step = generated / target steps.",
        "",
        f"Machine: {m['nproc']} CPUs, {m['cpu']} (AVX-512/AMX flags: "
        f"{' '.join(m['avx512_amx_flags']) or 'none'}; torch: {m['torch_cpu_capability']}), "
        f"torch {m['torch']} on {m['torch_threads']} thread(s), Python {m['python']}.",
    ]
    if results.get("note"):
        lines += ["", f"Code: {results['note']}."]
    lines += [
        "",
        "| method | temperature | acceptance unguided | acceptance guided | difference | tokens/step "
        "unguided | tokens/step guided | guided complete JSON |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        free, guided = row["unguided"], row["guided"]
        diff = guided["acceptance"] - free["acceptance"]
        lines.append(
            f"| {row['method']} | {row['temperature']} | {free['acceptance']:.3f} | "
            f"{guided['acceptance']:.3f} | {diff:+.3f} | {free['tokens_per_step']:.2f} | "
            f"{guided['tokens_per_step']:.2f} | {guided['complete_json']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--out", default="docs/benchmarks/results-guided-epyc-f32")
    parser.add_argument("--note", default="", help="what code ran, for the report")
    args = parser.parse_args()

    def load(method: str, **options) -> LLM:  # from the folders: an LLM built on loaded models has no EOS
        return LLM(
            str(DEMO_DIR / "target"),
            draft_model=str(DEMO_DIR / "draft") if method == "draft_model" else None,
            speculative_config=SpeculativeConfig.from_dict(
                dict(method=method, num_speculative_tokens=args.k, **options)
            ),
            dtype="float32",
        )

    draft = load("draft_model")
    others = {
        "draft_model dynamic tree": load("draft_model", tree="dynamic"),
        "ngram": load("ngram"),
        "suffix": load("suffix"),
    }
    runs = [("draft_model", draft, t) for t in TEMPERATURES] + [(m, llm, 0.0) for m, llm in others.items()]
    measure(draft, 0.0, True, 8)  # warm-up: the grammars' compilation and llguidance's tokenizer
    rows = []
    for method, llm, temperature in runs:
        row = {"method": method, "temperature": temperature}
        for guided in (False, True):
            row["guided" if guided else "unguided"] = measure(llm, temperature, guided, args.max_tokens)
        rows.append(row)
        print(
            f"{method:12} T={temperature:<4} acceptance unguided {row['unguided']['acceptance']:.3f} "
            f"guided {row['guided']['acceptance']:.3f}",
            flush=True,
        )
    results = {"k": args.k, "max_tokens": args.max_tokens, "note": args.note, "machine": cpu(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
