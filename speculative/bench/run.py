"""The benchmark run: configuration, the loaded pair, the methods, and the order of the measurements.

One process, the same prompts and pair for every method, two warm-up runs discarded, runs interleaved,
medians (measure.py). A speculative method's speed bound (timing.py) uses its measured tokens per step
and the step times its runs paid (clock.py); its efficiency divides its speedup over its own engine's
plain decoding (ours: our baseline; HF: HF `generate`) by that bound.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from speculative.bench.gguf_cache import (
    DEFAULT_CACHE,
    OUTTYPES,
    QUANT_TYPES,
    check_gguf_type,
    expected_gguf_type,
    gguf_type,
)
from speculative.bench.llamacpp import (
    LlamaCppSetup,
    llama_cpp_methods,
    llama_cpp_unavailable,
    server_binary,
    server_version,
    skipped_entries,
)
from speculative.bench.measure import Advance, compare_methods, sweep_batch, sweep_k
from speculative.bench.memory import copy_bandwidth, engine_bounds, gguf_weight_bytes, weight_bytes
from speculative.bench.methods import (
    HFMethod,
    Method,
    OursMethod,
    hf_assistant,
    hf_static,
    vllm_method,
    vllm_unavailable,
)
from speculative.bench.plots import write_plots
from speculative.bench.prompts import default_sets, resolve_set
from speculative.bench.report import print_tables, write_outputs
from speculative.bench.synthetic import build_pair
from speculative.bench.timing import bound_figures
from speculative.config import SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.extras import needs_extra
from speculative.llm import LLM
from speculative.machine import machine
from speculative.methods import METHODS, NgramConfig
from speculative.models.compiled import CompiledCausalLM, warm_up_pair
from speculative.models.dtypes import cpu_features
from speculative.models.llama import NativeCausalLM
from speculative.precompile import PreCompileConfig
from speculative.prompts import encode, load_jsonl

with needs_extra("bench", "speculative.bench"):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


# The methods every ratio is taken against: the reference outputs and each engine's plain decoding.
BASELINES = ("hf_generate", "ours_ar", "ours_ar_compiled", "llamacpp")


@dataclass
class BenchConfig:
    """What `speculative bench` measures (the CLI flags, with the same names).

    model / draft_model: the pair (paths or hub ids); draft_model None skips the draft-model methods.
    heads: the heads that read the target's hidden states to measure, by method (every registered
        method that `reads_hidden_states`: "eagle", "eagle3", "dflash") -> the head's directory; {} skips
        them (so do tensor_parallel_size > 1 and quantization: heads run on one rank, unquantized).
    prompts: prompt sets, JSONL files or bundled sets' names (prompts.resolve_set), named after the
        file's stem; None: the bundled sets for the pair's tokenizer (prompts.default_sets: the chat sets
        where it has a chat template other than the toy demo's, the toy's code, multiturn and edit sets
        otherwise).
    k: drafts per step of the side-by-side comparison; sweep_k: the k of the k sweep.
    tree_nodes / tree_width: the tree methods' SpeculativeConfig.tree_nodes and tree_width (k deep).
    batch_sizes: the batch-size sweep. max_tokens: tokens generated per prompt (EOS ignored).
    num_prompts: prompts per set, the first ones (None: all); sweep_prompts: prompts per k-sweep point.
    repeats: timed runs per prompt and method.
    dtype / draft_dtype: the models' dtypes, ours and Hugging Face's alike (draft_dtype None: dtype).
    draft_quantization: ours runs the draft quantized so (LLM(draft_quantization=...)); with the
        target's own checkpoint as draft_model, a quantized copy of the target drafts. HF's assistant
        and llama.cpp's draft stay as `quantization` has them.
    compile: also measure ours compiled (torch.compile, models/compiled.py): autoregressive, every
        drafter's method at k, and adaptive k up to k with the draft model and n-gram lookup; their
        graphs are compiled while the pair loads.
    tensor_parallel_size: ours split over that many ranks (LLM's tensor_parallel_size); each of our
        methods then loads the pair itself (every rank must), and `compile` is refused.
    llama_cpp: a llama.cpp checkout whose folder `llama_cpp_build` holds bin/llama-server (llamacpp.py);
        None skips the llama.cpp methods. The pair must then be local folders (converted to GGUF once,
        cached in `gguf_cache`, gguf_cache.py).
    quantization: None, "int8", "int4", "w8a8" or "w4a8": ours runs target and draft quantized
        (LLM(quantization=...); int4: bfloat16 models), llama.cpp GGUFs of the matching type made by the
        checkout's llama-quantize (int8 and w8a8: Q8_0, int4 and w4a8: Q4_1; gguf_cache.QUANT_TYPES). HF's
        methods run the float models, labelled so, and stay the identical column's reference; the EAGLE
        methods skip (a head needs an unquantized target).
    llama_cpp_target_gguf: a ready GGUF for llama.cpp's target instead of converting `model` (e.g. the
        file a float copy was dequantized from); its type must be the run's (F32, BF16, Q8_0, Q4_1),
        else a ValueError naming --llama-cpp-target-gguf.
    methods: fnmatch patterns over the methods' names: only the matching ones run (with the BASELINES,
        which every ratio needs), and a drafter's k sweep only where its eager method at k does; None:
        every method.
    synthetic: instead of model / draft_model / eagle, a synthetic pair of that size built in process
        (synthetic.py: "1b", "7b" or "tiny"), its draft calibrated to `synthetic_acceptance`; prompts
        are tokenized by the demo pair's tokenizer. vLLM and llama.cpp need checkpoints: they skip.
    """

    model: str = field(
        default=str(DEMO_DIR / "target"),
        metadata={"engine": "model", "help": "target model", "default_text": "the demo model"},
    )
    draft_model: str | None = field(
        default=str(DEMO_DIR / "draft"),
        metadata={"engine": "draft_model", "help": "draft model", "default_text": "the demo model's draft"},
    )
    heads: dict[str, str] = field(
        default_factory=lambda: {name: str(DEMO_DIR / name) for name in ("eagle", "eagle3")}
    )
    prompts: list[str] | None = field(
        default=None,
        metadata={
            "help": "a prompt set: a bundled one's name or a JSONL file (repeat; default: the chat, "
            "code-chat, summarize and chat-multiturn sets for an instruction-tuned model; for the toy pair "
            "code, multiturn and edit)",
            "action": "append",
            "nargs": None,
        },
    )
    k: int = field(default=4, metadata={"engine": "num_speculative_tokens"})
    tree_nodes: int = field(
        default=8, metadata={"engine": "tree_nodes", "help": "drafts per tree of the tree methods"}
    )
    tree_width: int = field(default=2, metadata={"engine": "tree_width"})
    sweep_k: list[int] = field(
        default_factory=lambda: list(range(1, 9)), metadata={"help": "k values of the k sweep"}
    )
    batch_sizes: list[int] = field(
        default_factory=lambda: [1, 4, 8], metadata={"help": "batch sizes", "flags": ("--batch-size",)}
    )
    max_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt, EOS ignored"})
    num_prompts: int | None = field(default=12, metadata={"help": "prompts per set, the first ones"})
    sweep_prompts: int = field(default=4, metadata={"help": "prompts per k-sweep point"})
    repeats: int = field(default=1, metadata={"help": "timed runs per prompt and method"})
    dtype: str = field(default="float32", metadata={"engine": "dtype"})
    draft_dtype: str | None = field(
        default=None,
        metadata={
            "engine": "draft_dtype",
            "help": "the draft's dtype, ours and HF's assistant",
            "default_text": "--dtype",
        },
    )
    draft_quantization: str | None = field(
        default=None,
        metadata={
            "engine": "draft_quantization",
            "help": "ours runs the draft quantized so (HF's assistant does not)",
        },
    )
    device: str = field(default="cpu", metadata={"engine": "device"})
    model_impl: str = field(default="auto", metadata={"engine": "model_impl"})
    seed: int = field(default=0, metadata={"engine": "seed", "help": "seeds the prompts' sampling"})
    compile: bool = field(
        default=False,
        metadata={
            "engine": "compile",
            "help": "also measure ours compiled (torch.compile): autoregressive, each drafter at k, "
            "adaptive k up to k",
        },
    )
    tensor_parallel_size: int = field(default=1, metadata={"engine": "tensor_parallel_size"})
    llama_cpp: str | None = field(
        default=None,
        metadata={
            "help": "also measure llama.cpp: a llama.cpp checkout whose --llama-cpp-build folder holds "
            "bin/llama-server (without it the llama.cpp methods are skipped); the pair must be local folders",
            "metavar": "DIR",
        },
    )
    llama_cpp_build: str = field(
        default="build",
        metadata={"help": "build folder under --llama-cpp, or an absolute path", "metavar": "NAME"},
    )
    gguf_cache: str = field(
        default=str(DEFAULT_CACHE),
        metadata={"help": "where the pair's GGUF files for llama.cpp are kept", "metavar": "DIR"},
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "engine": "quantization",
            "help": "compare quantized weights: ours runs target and draft quantized (int4: bfloat16 "
            "models; w8a8 and w4a8: int8 activations too), llama.cpp GGUFs its llama-quantize makes "
            "(int8 and w8a8: Q8_0, int4 and w4a8: Q4_1); HF stays unquantized",
        },
    )
    llama_cpp_target_gguf: str | None = field(
        default=None,
        metadata={
            "help": "a ready GGUF for llama.cpp's target instead of converting --model (its type must be "
            "the run's: F32, BF16, or Q8_0 / Q4_1 with --quantization)",
            "metavar": "PATH",
        },
    )
    synthetic: str | None = field(
        default=None,
        metadata={
            "help": "instead of --model: a synthetic Llama-shaped pair of that size, random weights, built "
            "in process, its draft the target's first layers (for speed at real sizes without a model hub)",
            "choices": ("1b", "7b", "tiny"),
        },
    )
    synthetic_acceptance: float = field(
        default=0.8,
        metadata={"help": "--synthetic: the draft's greedy agreement with the target it is calibrated to"},
    )
    methods: list[str] | None = field(
        default=None,
        metadata={
            "help": "only the methods whose names (results.json's: ours_ar_compiled, "
            "ours_draft_adaptive_compiled, llamacpp_draft, ...) match one of these patterns (fnmatch: "
            "'ours_*_compiled'), and the k sweeps of the drafters selected at k; the baselines of every "
            "ratio always run (hf_generate, ours_ar, ours_ar_compiled, llamacpp)",
            "metavar": "PATTERN",
            "default_text": "all",
        },
    )

    def selects(self, name: str) -> bool:
        """Whether the method called `name` runs (`methods`; a baseline always does)."""
        return (
            self.methods is None
            or name in BASELINES
            or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.methods)
        )

    def quick(self) -> BenchConfig:
        """The CI smoke test's settings: 2 prompts a set, 24 tokens, k sweep [1, k] on 1 prompt, batch
        sizes 1 and 2, 1 repeat."""
        return BenchConfig(
            **{
                **asdict(self),
                "sweep_k": [1, self.k],
                "batch_sizes": [1, 2],
                "max_tokens": 24,
                "num_prompts": 2,
                "sweep_prompts": 1,
                "repeats": 1,
            }
        )


def short_name(drafter: str) -> str:
    """A drafter's name in its methods' names: ours_draft, ours_ngram_compiled, ..."""
    return "draft" if drafter == "draft_model" else drafter


class Pair:
    """The target and draft, loaded once: our engine's models shared by every LLM, and HF's copies."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.compile and config.tensor_parallel_size > 1:
            raise ValueError("--compile does not run with --tensor-parallel-size > 1 yet")
        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        draft_dtype = (
            dtype
            if config.draft_dtype is None
            else config.draft_dtype
            if config.draft_dtype == "auto"
            else getattr(torch, config.draft_dtype)
        )
        self.synthetic = None
        if config.synthetic is not None:  # HF's models are the pair; ours share their weights
            if config.tensor_parallel_size > 1 or config.draft_dtype is not None:
                raise ValueError("--synthetic pairs run on one rank, in one dtype (no --draft-dtype)")
            built = build_pair(
                config.synthetic,
                torch.bfloat16 if dtype == "auto" else dtype,
                config.device,
                config.seed,
                config.synthetic_acceptance,
            )
            self.synthetic, self.hf_target, self.hf_draft = built, built.target, built.draft
            models, tokenizer = (built.target, built.draft), str(DEMO_DIR / "target")
        else:
            models, tokenizer = (config.model, config.draft_model), None
        spec = SpeculativeConfig("draft_model", config.k) if models[1] else None
        self.llm = LLM(
            models[0],
            draft_model=models[1],
            speculative_config=spec,
            dtype=config.dtype,
            draft_dtype=config.draft_dtype if models[1] else None,
            device=config.device,
            seed=config.seed,
            model_impl=config.model_impl,
            tokenizer=tokenizer,
            quantization=config.quantization,
            draft_quantization=config.draft_quantization if models[1] else None,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        if self.llm.tokenizer is None:
            raise ValueError(f"{config.model} has no tokenizer: the benchmark's prompts are text")
        self.tokenizer = self.llm.tokenizer
        self.target = self.llm.target.model
        self.draft = self.llm.draft.model if self.llm.draft is not None else None
        if self.synthetic is None:
            self.hf_target = (
                AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype).to(self.device).eval()
            )
            self.hf_draft = (
                AutoModelForCausalLM.from_pretrained(config.draft_model, dtype=draft_dtype)
                .to(self.device)
                .eval()
                if config.draft_model
                else None
            )
        tok = self.tokenizer
        self.pad_token_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
        self.drafters = ["draft_model", "ngram", "suffix"] if self.draft is not None else ["ngram", "suffix"]
        if not skipped_heads(config):
            self.drafters += list(config.heads)
        if self_draft_runs(config, self.target):
            self.drafters.append("self_draft")
        self.compiled_target = self.compiled_draft = None
        if config.compile:  # sharing the eager models' weights; every shape the runs use compiled now
            self.compiled_target = CompiledCausalLM(self.target)
            self.compiled_draft = CompiledCausalLM(self.draft) if self.draft is not None else None
            warm_up_pair(
                self.compiled_target,
                self.compiled_draft,
                PreCompileConfig(sorted({1, max(config.batch_sizes)})),
                config.k,
                every_width=True,  # n-gram lookup's and suffix decoding's verifications (shared target)
                every_draft_length=any(
                    config.selects(name)
                    for name in ("ours_draft_adaptive_compiled", "ours_draft_adaptive_compiled_draft")
                ),
            )

    def ours(
        self,
        drafter: str | None,
        k: int,
        compiled: bool = False,
        adaptive: bool = False,
        tree: str | None = None,
        lookup: bool = False,
        own: int = 0,
        draft_compiled: bool = False,
        **options,
    ) -> OursMethod | None:
        """Our engine on the shared models: plain decoding (drafter None), draft model, n-gram, suffix or
        a head (drafter "eagle", "eagle3", "dflash": config.heads'); with `compiled`, on the compiled
        models (engine "ours_compiled"); with `adaptive`, k chosen per step in [0, k]
        (SpeculativeConfig.adaptive); with `tree`, token trees of that shape, k deep, of the config's
        tree_width and tree_nodes; with `lookup` (the draft model), prompt lookup first (LOOKUP_MIN), the
        draft's own chain at most `own` long (num_assistant_tokens; 0: k); with `draft_compiled` (the
        draft model), the compiled draft beside the eager target (LLM's draft_compile); `options`: more
        SpeculativeConfig fields. None where the config's `methods` leave it out
        (nothing loaded)."""
        config = self.config
        engine, suffix, label = ("ours_compiled", "_compiled", ", compiled") if compiled else ("ours", "", "")
        if drafter is None:
            name, label = f"ours_ar{suffix}", f"ours autoregressive{label}"
        else:
            short = short_name(drafter)
            if adaptive:
                suffix, label = f"_adaptive{suffix}", f"{label}, adaptive"
            if tree:
                suffix, label = f"_tree{suffix}", f"{label}, {tree} tree of {config.tree_nodes}"
            if lookup:
                mine = f", the draft's own chain {own}" if own else ""
                suffix, label = (
                    f"_lookup{f'_own{own}' if own else ''}{suffix}",
                    f", prompt lookup first{mine}{label}",
                )
                options.update(prompt_lookup_min=LOOKUP_MIN, num_assistant_tokens=own)
            if draft_compiled:
                suffix, label = f"{suffix}_compiled_draft", f"{label}, the draft compiled"
            name, label = f"ours_{short}{suffix}", f"ours {short} k{'<=' if adaptive else '='}{k}{label}"
        if not config.selects(name):
            return None
        target, draft = (self.compiled_target, self.compiled_draft) if compiled else (self.target, self.draft)
        if draft_compiled:
            draft = self.compiled_draft
        # compile: the models are compiled already; an EAGLE head, loaded by the LLM, is compiled there
        loading = {"device": self.device, "tokenizer": self.tokenizer, "compile": compiled}
        if config.tensor_parallel_size > 1:  # every rank loads the pair itself
            target, draft = config.model, config.draft_model
            loading.update(dtype=config.dtype, model_impl=config.model_impl, quantization=config.quantization)
            loading.update(tensor_parallel_size=config.tensor_parallel_size)
            if drafter == "draft_model":
                loading.update(draft_dtype=config.draft_dtype, draft_quantization=config.draft_quantization)
        if drafter is None:
            return OursMethod(name, label, engine, llm=LLM(target, **loading))
        if drafter == "self_draft":  # the copy: --draft-quantization's, else the method's default
            loading.update(draft_quantization=config.draft_quantization)
        if tree:
            options.update(tree_nodes=config.tree_nodes, tree_width=config.tree_width)
        llm = LLM(
            target,
            draft_model=draft if drafter == "draft_model" else config.heads.get(drafter),
            speculative_config=SpeculativeConfig.from_dict(
                dict(method=drafter, num_speculative_tokens=k, adaptive=adaptive, tree=tree, **options)
            ),
            seed=config.seed,
            **loading,
        )
        return OursMethod(
            name,
            label,
            engine,
            drafter,
            k,
            llm=llm,
            adaptive=adaptive,
            tree=tree,
            ragged=bool(lookup and own),
        )

    def hf_dtype(self) -> str:
        """The dtype of HF's target ("float32", "bfloat16", ...)."""
        return str(next(self.hf_target.parameters()).dtype).removeprefix("torch.")

    def hf(self, drafter: str | None, k: int) -> HFMethod:
        """Hugging Face `generate`: greedy, assisted by the draft, or prompt lookup (these two: batch 1)."""
        if drafter is None:
            return HFMethod(
                "hf_generate", "HF generate", "hf", model=self.hf_target, pad_token_id=self.pad_token_id
            )
        if drafter == "draft_model":
            name, label, options = (
                "hf_assisted",
                "HF assisted",
                {"assistant_model": hf_assistant(self.hf_draft, k)},
            )
        else:
            name, label = "hf_prompt_lookup", "HF prompt lookup"
            options = {
                "prompt_lookup_num_tokens": k,
                "max_matching_ngram_size": NgramConfig().prompt_lookup_max,
            }
        return HFMethod(
            name,
            f"{label} k={k}",
            "hf",
            drafter,
            k,
            max_batch=1,
            model=self.hf_target,
            pad_token_id=self.pad_token_id,
            options=options,
        )


def load_sets(
    config: BenchConfig, tokenizer, max_prompt_tokens: int, notes: list[str]
) -> dict[str, list[list[int]]]:
    """Each prompt set's first `num_prompts` prompts as token ids, named after the file's stem: the
    config's sets, else the bundled ones for the tokenizer (BenchConfig.prompts)."""
    sets = {}
    paths = default_sets(tokenizer) if config.prompts is None else map(resolve_set, config.prompts)
    for path in paths:
        records = load_jsonl(path)[: config.num_prompts]
        ids = [encode(tokenizer, r, max_prompt_tokens) for r in records]
        cut = sum(len(encode(tokenizer, r, 10**9)) > max_prompt_tokens for r in records)
        if cut:
            notes.append(
                f"{Path(path).stem}: {cut} prompt(s) cut to their last {max_prompt_tokens} tokens "
                f"to fit the models' context"
                + (" (chats: leading messages dropped whole, prompts.encode)" if records[0].chat else "")
            )
        sets[Path(path).stem] = ids
    return sets


NOTES = [
    "HF methods generate with eos_token_id=None and ours with ignore_eos=True: every output has max_tokens "
    "tokens and both follow the target's own greedy text.",
    "HF assisted generation drafts a constant k per step (num_assistant_tokens_schedule='constant', no "
    "confidence threshold), like ours; HF prompt lookup matches n-grams of up to 3 tokens, like ours.",
    "HF's tokens per step come from counting the target's forward calls (accepted = tokens - calls); what it "
    "drafted, hence its acceptance rate and per-position acceptance, is not available.",
    "The bound's a is alpha, the per-token acceptance whose E = (1 - a^(k+1)) / (1 - a) equals the measured "
    "tokens per step; accepted / drafted (the acceptance rate column) counts drafts after a rejection as "
    "rejected and would understate E and the bound.",
    "The bound's T_1, T_v and T_d are means over the runs' own calls (bench/clock.py: our engine's step "
    "records, forward hooks on HF's models): T_1 over the one-token forwards of the engine's plain decoding, "
    "T_v over the method's verifications of k + 1 tokens, T_d its drafting time per drafted token (HF prompt "
    "lookup's proposals are not clocked: T_d = 0, an upper bound). What keeps an efficiency below 1 is then "
    "the engine's own work around those calls, and the prefill.",
    "HF assisted generation and prompt lookup take batch 1 only: the batch sweep leaves them out.",
    "Ours n-gram verifies only what it proposed (a plain step where no row has a match) in greedy batches, "
    "which the bound, at T_v(k) for every step, does not count: its efficiency can exceed 1.",
    "Ours suffix (suffix decoding) drafts from suffix tries of the request and of a cache of earlier "
    "responses, proposing only what their counts justify (so its T_v is over every verification, whatever "
    "its width). Every pass over a set, and every call of the batch sweep, starts with an empty cache: a "
    "prompt is drafted from the responses to the prompts before it in its pass, never from its own.",
    "Adaptive methods choose k per step in [0, k] from the acceptance and step times they measure "
    "(SpeculativeConfig.adaptive; eager up to the k sweep's largest k, compiled up to k, every k's graphs "
    "compiled while the pair loads); with no single k they have no bound.",
    "Tree methods verify a token tree of depth k in one forward (SpeculativeConfig.tree). Their bound "
    "takes the measured tokens per step (a the per-depth acceptance giving it), T_v over their own tree "
    "verifications whatever their size, and T_d per depth of drafting: E * T_1 / (k * T_d + T_v), what a "
    "perfect engine would reach with the same trees at the same call times.",
    "Ours eagle drafts with an EAGLE head (SpeculativeConfig method eagle or eagle3), chains of k and "
    "EAGLE-2's dynamic trees (ours dflash: a block drafter, k drafts in one forward, chains only): "
    "one decoder layer reading the target's hidden states, which the target's "
    "verification returns beside its logits (that cost is in the method's own T_v). Its T_d is the head's "
    "work per drafted token, feeding it the target's features of the tokens kept at the step before "
    "included, so a step costs k * T_d + T_v as a draft model's does and the bound holds unchanged. A "
    "run's first proposal, where a draft model prefills the prompt (an EAGLE head is fed the prompt's "
    "features as its row joins, the prefill's time), is left out of T_d for every drafter, as the "
    "bound leaves out every prefill. The head runs on one rank (compiled methods: the target's calls "
    "compiled, tree verifications too, and a greedy chain's or tree's whole drafting, one call of the "
    "head); HF has no counterpart.",
]

HF_STATIC_NOTE = (
    "HF generate, static cache, compiled: generate(cache_implementation='static') as transformers runs it, "
    "its decoding forward compiled (torch.compile; with CUDA graphs on CUDA; on a CPU only because the "
    "benchmark asks, CompileConfig._compile_all_devices), one StaticCache sized for the longest prompt "
    "and reused, so that only the warm-up compiles. Its forwards are not hooked (a compiled forward would "
    "trace the hooks): no step times. Included with --compile or on CUDA."
)

LLAMA_CPP_NOTE = (
    "llama.cpp methods (bench/llamacpp.py): one llama-server per method, the pair converted to GGUF in the "
    "bench's dtype by the checkout's convert_hf_to_gguf.py, the bench's thread count, one slot, no prompt "
    "cache, KV caches in the models' dtypes; each prompt sent as token ids to /completion, greedy, "
    "max_tokens tokens with EOS ignored. Their "
    "tokens/s is wall time from request to answer over loopback HTTP, prefill included, like every other "
    "method's; the line under each table gives llama.cpp's own split (prompt_ms, and decode-only tokens/s = "
    "predicted_n / predicted_ms). Tokens per step = 1 + draft_n_accepted / (tokens - 1 - draft_n_accepted). "
    "Their step times are not clocked, so they have no bound; batch 1 only (the batch sweep leaves them out)."
)


# Drafters with a Hugging Face counterpart, an adaptive method and a k sweep; suffix decoding has no HF
# counterpart and already sizes its proposals by itself.
SWEPT = ("draft_model", "ngram")
# The draft model with prompt lookup first (ours_draft_lookup): where a row's last 2 tokens occur
# earlier in its context, what followed them is proposed instead of the draft's tokens; in
# ours_draft_lookup_own1, the draft's own chain is 1 token (a lookup's k).
LOOKUP_MIN = 2
LOOKUP_OWN = 1


def self_draft_runs(config: BenchConfig, target: object) -> bool:
    """Whether the self-draft (SpeculativeConfig(method="self_draft"): the target's quantized copy on
    its KV cache) runs: a float target on the native forward, on a CPU, on one rank."""
    return (
        isinstance(target, NativeCausalLM)
        and target.device.type == "cpu"
        and config.quantization is None
        and config.tensor_parallel_size == 1
    )


def skipped_heads(config: BenchConfig) -> dict[str, dict]:
    """The heads' methods' entries as skipped (with why) where they cannot run: no head given, or the
    target split over ranks, or quantized; {} where they run."""
    if config.heads and config.tensor_parallel_size == 1 and config.quantization is None:
        return {}
    note = (
        "no head: --eagle PATH, --eagle3 PATH or --dflash PATH (the toy target's: models/demo/eagle, "
        "models/demo/eagle3)"
        if not config.heads
        else "heads run on one rank, not with --tensor-parallel-size > 1"
        if config.tensor_parallel_size > 1
        else f"heads need an unquantized target, not --quantization {config.quantization}"
    )
    skipped = {}
    for method in config.heads or ("eagle",):
        skipped[f"ours_{method}"] = {"label": f"ours {method}", "note": note}
        if METHODS[method].trees:
            skipped[f"ours_{method}_tree"] = {"label": f"ours {method}, dynamic tree", "note": note}
    return skipped


def build_methods(
    pair: Pair, servers: ExitStack, longest_prompt: int
) -> tuple[list[Method], dict[str, dict]]:
    """The methods of the side-by-side table, and those skipped (with why). llama.cpp's servers are
    started here and registered on `servers`, which stops them. longest_prompt: the longest prompt's
    tokens (HF's static cache is sized for it)."""
    config, drafters = pair.config, pair.drafters
    swept = [d for d in drafters if d in SWEPT]
    methods: list[Method] = [pair.hf(None, 0)] + [pair.hf(d, config.k) for d in swept]
    if config.compile or pair.device.type == "cuda":
        methods.append(hf_static(pair.hf_target, pair.pad_token_id, longest_prompt + config.max_tokens))
    if config.quantization is not None:  # HF runs the float models: its rows say so
        for method in methods:
            method.label = f"{method.label} ({pair.hf_dtype()} weights)"
    methods += [pair.ours(None, 0)] + [pair.ours(d, config.k) for d in drafters]
    adapted = swept + [d for d in drafters if d == "self_draft"]
    methods += [pair.ours(d, max(config.sweep_k + [config.k]), adaptive=True) for d in adapted]
    looked = ["draft_model"] if pair.draft is not None else []  # the draft with prompt lookup first
    methods += [pair.ours(d, config.k, lookup=True) for d in looked]
    methods += [pair.ours(d, config.k, lookup=True, own=LOOKUP_OWN) for d in looked if config.k > LOOKUP_OWN]
    methods += [pair.ours(d, max(config.sweep_k + [config.k]), adaptive=True, lookup=True) for d in looked]
    trees = [d for d in drafters if METHODS[d].trees]  # each grows the tree that suits it
    methods += [pair.ours(d, config.k, tree=METHODS[d].suited_tree) for d in trees]
    if config.compile:
        methods += [pair.ours(None, 0, compiled=True)]
        methods += [pair.ours(d, config.k, compiled=True) for d in drafters]
        methods += [pair.ours(d, config.k, compiled=True, adaptive=True) for d in adapted]
        methods += [pair.ours(d, config.k, compiled=True, lookup=True) for d in looked]
        own = [d for d in looked if config.k > LOOKUP_OWN]
        methods += [pair.ours(d, config.k, compiled=True, lookup=True, own=LOOKUP_OWN) for d in own]
        methods += [pair.ours(d, config.k, compiled=True, adaptive=True, lookup=True) for d in looked]
        methods += [pair.ours(d, config.k, compiled=True, tree=METHODS[d].suited_tree) for d in trees]
        if pair.draft is not None:  # the draft compiled alone, beside the eager target
            methods += [pair.ours("draft_model", config.k, draft_compiled=True)]
            methods += [pair.ours("draft_model", config.k, adaptive=True, draft_compiled=True)]
    methods = [m for m in methods if m is not None and config.selects(m.name)]
    skipped = skipped_heads(config)
    if pair.draft is None:
        for name, label in (
            ("hf_assisted", "HF assisted"),
            ("ours_draft", "ours draft"),
            ("vllm_draft", "vLLM draft"),
        ):
            skipped[name] = {"label": label, "note": "no --draft-model given"}
    why_not = (
        "a synthetic pair has no checkpoint to load" if pair.synthetic else vllm_unavailable(pair.device)
    )
    if why_not is None and pair.draft is not None and config.selects("vllm_draft"):
        methods.append(vllm_method(config.model, config.draft_model, config.k, config.dtype))
    elif "vllm_draft" not in skipped:
        skipped["vllm_draft"] = {"label": "vLLM draft", "note": why_not}
    why_not = llama_cpp_unavailable(config.llama_cpp, config.llama_cpp_build, config.quantization)
    if why_not is not None:
        skipped.update(skipped_entries(why_not))
        return methods, {name: entry for name, entry in skipped.items() if config.selects(name)}
    dtypes = [
        str(next(m.parameters()).dtype).removeprefix("torch.")
        for m in (pair.hf_target, pair.hf_draft)
        if m is not None
    ]
    setup = LlamaCppSetup(
        config.llama_cpp,
        config.llama_cpp_build,
        config.model,
        config.draft_model,
        dtypes[0],
        dtypes[-1],
        config.k,
        torch.get_num_threads(),
        min(m.max_length for m in (pair.target, pair.draft) if m is not None),
        config.gguf_cache,
        config.quantization,
        config.llama_cpp_target_gguf,
    )
    llama_methods, llama_skipped = llama_cpp_methods(setup, servers, config.selects)
    skipped = {name: entry for name, entry in {**skipped, **llama_skipped}.items() if config.selects(name)}
    return methods + llama_methods, skipped


def check_llama_cpp(config: BenchConfig) -> None:
    """A ValueError, before anything loads, where the llama.cpp settings cannot run: --llama-cpp
    given but unusable (llama-quantize too, for a quantized run), --llama-cpp-target-gguf without
    --llama-cpp, or of another type than the run's (known here when --dtype is float32 or bfloat16)."""
    if config.llama_cpp is not None:
        why_not = llama_cpp_unavailable(config.llama_cpp, config.llama_cpp_build, config.quantization)
        if why_not is not None:
            raise ValueError(why_not)
    if config.llama_cpp_target_gguf is None:
        return
    if config.llama_cpp is None:
        raise ValueError("--llama-cpp-target-gguf is llama.cpp's target: give --llama-cpp DIR with it")
    if config.dtype in OUTTYPES and config.quantization in (None, *QUANT_TYPES):
        expected = expected_gguf_type(config.dtype, config.quantization)
        check_gguf_type(config.llama_cpp_target_gguf, expected, checkout=config.llama_cpp)


def bound_weights(pair: Pair, gguf: Path | None, llama_cpp: dict | None) -> dict[str, tuple[str, int]]:
    """What each engine's plain decoding reads per token (memory.engine_bounds' `weights`): HF the
    float target, ours its own target (quantized or not; split over ranks, the float target's
    bytes), llama.cpp its target GGUF where it runs."""
    hf = (pair.hf_dtype(), weight_bytes(pair.hf_target))
    quantization = pair.config.quantization
    weights = {"hf": hf}
    if pair.config.tensor_parallel_size == 1:
        weights["ours"] = (quantization or hf[0], weight_bytes(pair.target))
    elif quantization is None:
        weights["ours"] = hf
    if gguf is not None:
        weights["llama.cpp"] = (
            f"{llama_cpp['gguf_type']} GGUF",
            gguf_weight_bytes(gguf, pair.config.llama_cpp),
        )
    return weights


def quantization_note(quantization: str, hf_dtype: str) -> str:
    """The results' note on a quantized run (--quantization)."""
    return (
        f"Quantized run (--quantization {quantization}): ours runs target and draft with "
        f"{quantization} projections and lm_head (models/quantization.py: "
        + {
            "int8": "weight-only, symmetric per output channel",
            "int4": "weight-only, asymmetric, a scale and zero per group",
            "w8a8": "int8 weights symmetric per output channel, times activations quantized to int8 "
            "per blocks of 32 inside each matmul",
            "w4a8": "4-bit weights in Q4_1's scheme (a float16 scale and minimum a block of 32), the "
            "lm_head w8a8, times activations quantized to int8 per blocks of 32 inside each matmul",
        }[quantization]
        + f"); llama.cpp runs {QUANT_TYPES[quantization]} GGUFs made by its own llama-quantize with its "
        "default choices for that type from the f32 conversion (or the given --llama-cpp-target-gguf). "
        f"HF's methods run the {hf_dtype} models (rows labelled so) and HF generate's greedy output stays "
        "the identical column's reference: for the quantized engines that column is their agreement with "
        "the float model, not an exactness check (a quantized engine is exact against its own quantized "
        "target, which tests/test_quantization.py checks). The memory bound line gives each engine's "
        "bound from the bytes it reads."
    )


@contextmanager
def stopwatch(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Record the wall time of the `with` block as seconds[phase]."""
    start = time.perf_counter()
    yield
    seconds[phase] = time.perf_counter() - start


def run_bench(config: BenchConfig, advance: Advance) -> dict:
    """Measure everything `config` asks for; returns the results (the content of results.json).

    The side-by-side table runs on every prompt set; the draft model's k sweep on the first set and the
    n-gram k sweep on the last (code and edit with the default sets); the batch sweep on the first set.
    llama.cpp's servers are stopped at the end, on an error or on Ctrl-C.
    """
    with ExitStack() as servers:
        return _run_bench(config, advance, servers)


def _run_bench(config: BenchConfig, advance: Advance, servers: ExitStack) -> dict:
    """run_bench's work, llama.cpp's servers registered on `servers`."""
    clock = time.perf_counter()
    check_llama_cpp(config)
    if config.synthetic is not None and (config.llama_cpp is not None or config.heads):
        raise ValueError("--synthetic pairs have no checkpoint for --llama-cpp and no head (--eagle, ...)")
    torch.manual_seed(config.seed)
    notes = list(NOTES)
    if torch.device(config.device).type == "cpu":
        policy = os.environ.get("OMP_WAIT_POLICY") or "unset (OpenMP's default: threads spin a while)"
        notes.append(
            f"OMP_WAIT_POLICY: {policy}. It moves the baselines as much as ours: with PASSIVE, threads "
            "sleep between parallel regions, every small op of HF's multi-threaded forward pays a "
            "wake-up, and ours runs forwards of up to 64 tokens on one thread instead "
            "(speculative.models.llama.small_call_threads). Compare runs made under the same policy."
        )
    pair = Pair(config)
    advance("loading the pair" + (" and compiling every shape its methods use" if config.compile else ""), 1)
    if pair.synthetic is not None:
        notes.insert(0, pair.synthetic.describe())
    if config.quantization is not None:
        notes.append(quantization_note(config.quantization, pair.hf_dtype()))
    if config.draft_quantization is not None and config.draft_model is not None:
        notes.append(
            f"Ours drafts with {config.draft_quantization} projections (--draft-quantization: "
            "LLM(draft_quantization=...)), the target as --quantization has it; HF's assistant and "
            "llama.cpp's draft run the draft model as --quantization alone has them."
        )
    if config.compile:
        notes.append(
            "Compiled methods (torch.compile of the native forward) share the eager models' weights; "
            "every graph they use was compiled while the pair loaded. Their speedups are against the "
            "eager ours AR; their bound and efficiency use ours AR, compiled, and their own step times. "
            "Methods whose draft alone is compiled (LLM's draft_compile: the compiled draft, its graphs "
            "compiled while the pair loaded, beside the eager target) are eager methods: their speedups, "
            "bound and efficiency are against the eager ours AR."
        )
    ks = sorted(set(config.sweep_k) | {config.k})
    limits = [m.max_length for m in (pair.target, pair.draft) if m is not None]
    max_prompt = min(limits) - config.max_tokens - max(ks) - 2
    if max_prompt < 1:
        raise ValueError(
            f"max_tokens={config.max_tokens} leaves no room for a prompt in the models' "
            f"context of {min(limits)} tokens"
        )
    sets = load_sets(config, pair.tokenizer, max_prompt, notes)
    names = list(sets)
    longest = max(len(p) for prompts in sets.values() for p in prompts)
    methods, skipped = build_methods(pair, servers, longest)
    if any(m.name == "hf_static" for m in methods):
        notes.append(HF_STATIC_NOTE)
    llama_cpp = None
    gguf = next((m.gguf for m in methods if m.engine == "llama.cpp"), None)
    if gguf is not None:
        notes.append(LLAMA_CPP_NOTE)
        binary = server_binary(config.llama_cpp, config.llama_cpp_build)
        llama_cpp = {
            "server": display_path(str(binary)),
            "version": server_version(binary),
            "target_gguf": display_path(str(gguf)),
            "gguf_type": gguf_type(gguf, config.llama_cpp),
        }
    results: dict = {
        "config": _with_relative_paths(asdict(config)),
        "machine": {
            **machine(),
            "device": str(pair.device),
            "cpu_features": cpu_features(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "llama_cpp": llama_cpp,
        },
        "memory_bound": engine_bounds(copy_bandwidth(pair.device), bound_weights(pair, gguf, llama_cpp)),
        "sets": {},
        "sweeps": {"k": {}},
        "notes": notes,
        "seconds": {"loading": time.perf_counter() - clock},
    }
    seconds = results["seconds"]
    references, runs = {}, {}
    for name, prompts in sets.items():  # one warm-up per method, before its first timed run
        phase = f"{name}: methods side by side"
        with stopwatch(seconds, phase):
            table, references[name], runs[name] = compare_methods(
                pair, methods, prompts, advance, phase, warmup=name == names[0]
            )
        table.update({m: {**entry, "status": "skipped"} for m, entry in skipped.items()})
        results["sets"][name] = {"num_prompts": len(prompts), "methods": table}
    ar = next(m for m in methods if m.name == "ours_ar")
    for drafter in (d for d in pair.drafters if d in SWEPT and config.selects(f"ours_{short_name(d)}")):
        name = names[0] if drafter == "draft_model" else names[-1]
        phase = f"{name}: k sweep, {drafter}"
        with stopwatch(seconds, phase):
            points = sweep_k(pair, ar, drafter, sets[name][: config.sweep_prompts], advance, phase)
        results["sweeps"]["k"].setdefault(name, {})[drafter] = points
    batch_methods = [m for m in methods if m.engine in ("ours", "ours_compiled") or m.name == "hf_generate"]
    phase = f"{names[0]}: batch sweep"
    with stopwatch(seconds, phase):
        results["sweeps"]["batch"] = sweep_batch(
            pair, batch_methods, sets[names[0]], references[names[0]], runs[names[0]], advance, phase
        )
    results["sweeps"]["batch_set"] = names[0]
    entries = [
        e for data in results["sets"].values() for e in data["methods"].values() if e["status"] == "ok"
    ]
    entries += [p for sweeps in results["sweeps"]["k"].values() for points in sweeps.values() for p in points]
    for entry in entries:
        own_speedup, run_times = entry.pop("own_speedup"), entry.pop("run_times")
        if entry.get("engine") == "llama.cpp":  # its step times are not clocked: no bound
            entry.update(T_1=None, T_v=None, T_d=None, bound=None, efficiency=None)
            continue
        if entry.get("adaptive"):  # no single k: no bound, and alpha is not a per-token acceptance at k
            entry.update(T_1=run_times["T_1"], T_v=None, T_d=None, bound=None, efficiency=None, alpha=None)
            continue
        entry.update(bound_figures(entry["drafter"], entry["k"], entry["alpha"], own_speedup, run_times))
    results["seconds"]["total"] = time.perf_counter() - clock
    return results


def logged_progress(console: Console) -> Advance:
    """An Advance that prints a line with the seconds since it was made when a phase's first run and
    its last are done."""
    done: dict[str, int] = {}
    start = time.perf_counter()

    def advance(phase: str, total: int) -> None:
        done[phase] = done.get(phase, 0) + 1
        if done[phase] in (1, total):
            line = f"[{time.perf_counter() - start:.0f} s] {phase}: {done[phase]}/{total}"
            console.print(line, markup=False, highlight=False)

    return advance


def run_and_report(config: BenchConfig, out: Path, console: Console) -> dict:
    """Run the benchmark with a progress bar (a line a phase's start and end where stderr is not a
    terminal), print the tables, write results.json, report.md and plots."""
    transformers.logging.set_verbosity_error()  # HF's deprecation chatter from inside assisted generation
    transformers.logging.disable_progress_bar()
    stderr = Console(stderr=True)
    if stderr.is_terminal:
        tasks: dict[str, int] = {}
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=stderr,
            transient=False,
        ) as progress:

            def advance(phase: str, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = progress.add_task(phase, total=total)
                progress.advance(tasks[phase])

            results = run_bench(config, advance)
    else:  # a log, where a bar would show only at the end: a line as each phase starts and ends
        results = run_bench(config, logged_progress(stderr))
    print_tables(results, console)
    plots = write_plots(results, out)
    paths = write_outputs(results, out, plots)
    console.print(
        f"{results['seconds']['total']:.0f} s; wrote {paths['json']}, {paths['report']} and "
        f"{len(plots)} plots to {out}/"
    )
    return results


def display_path(path: str) -> str:
    """An absolute path as results record it: relative to the working directory where it lies under
    it, else to the home folder as ~/... (a committed report names no machine's own folders)."""
    if os.path.isabs(path):
        for base, prefix in ((Path.cwd(), ""), (Path.home(), "~/")):
            if Path(path).is_relative_to(base):
                return prefix + os.path.relpath(path, base)
    return path


def _with_relative_paths(config: dict) -> dict:
    """The config with its paths (models, prompt sets, llama.cpp) as display_path shows them."""

    def shown(value):
        if isinstance(value, list):
            return [shown(v) for v in value]
        if isinstance(value, dict):
            return {k: shown(v) for k, v in value.items()}
        return display_path(value) if isinstance(value, str) else value

    return {name: shown(value) if name in _PATH_FIELDS else value for name, value in config.items()}


_PATH_FIELDS = (
    "model",
    "draft_model",
    "heads",
    "prompts",
    "llama_cpp",
    "gguf_cache",
    "llama_cpp_target_gguf",
)
