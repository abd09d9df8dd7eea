"""EngineArgs: every argument of `LLM(...)` that the commands expose, written once (vLLM's pattern).

Each field's help and default are written once, in its `arg(...)` metadata; `EngineArgs.add_cli_args`
makes the flags of `speculative generate` and `serve` from them, `EngineArgs.from_cli_args` reads them
back, and `speculative_config()` / `llm_kwargs()` / `create_llm()` give LLM what it takes. The speculative
fields' defaults are SpeculativeConfig's own; every registered method (speculative.methods.METHODS) gets
`--method NAME`, a shortcut flag (`--ngram`, `--suffix`, `--eagle PATH`, ...) and one flag per field of
its MethodConfig (its metadata's help, its default), so a new method needs no edit here.

`add_dataclass_args` / `dataclass_from_cli_args` are the generator, shared by ServerArgs
(speculative/server/args.py) and the benchmarks' configs. Imports no torch: `--help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculative.config import DECLARED_K, SpeculativeConfig, with_draft_defaults
from speculative.console import progress
from speculative.demo import DEMO_DIR, DEMO_DIR_ENV, smollm2
from speculative.methods import METHODS, method_config
from speculative.methods.acceptance import RULES

if TYPE_CHECKING:
    from speculative.llm import LLM

QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")
"""models/quantization.py's QUANTIZATIONS, written here for the flags (this module imports no torch)."""


def arg(default: Any = None, help: str = "", **cli: Any) -> Any:
    """A dataclass field of `default` whose flag says `help`. `cli`, all optional: flags (the option
    strings; default --field-name), aliases (more option strings), choices, metavar, type, nargs,
    action, group (a mutually exclusive group's name), env (an environment variable that overrides the
    default when the parser is built), engine (the EngineArgs field whose flag this one is), default_text
    (what the help says the default is), show_default (False: say nothing of it). A list default is
    copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **cli})
    return field(default=default, metadata={"help": help, **cli})


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its factory's value for a list)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _annotation(f: dataclasses.Field) -> tuple[type | None, bool, tuple | None]:
    """(the flag's type, whether it takes a list, Literal choices) of a field's annotation (a string
    under `from __future__ import annotations`): int, float, str, bool, list[...], Literal[...], | None."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    text = re.sub(r"\s*\|\s*None|None\s*\|\s*", "", text).strip()
    many = text.startswith(("list[", "tuple["))
    if many:
        text = text[text.index("[") + 1 : -1].split(",")[0].strip()
    if text.startswith(("Literal[", "typing.Literal[")):
        choices = tuple(re.findall(r"[\"']([^\"']*)[\"']", text))
        return str, many, choices
    return {"int": int, "float": float, "str": str, "bool": bool}.get(text), many, None


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    all_none: bool = False,
    groups: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Add a flag to `parser` for each field of dataclass `cls` that has help (fields without help, or
    in `exclude`, get none). defaults: a field's default other than its dataclass's; all_none: every
    flag defaults to None (read back: the dataclass's default; help still shows it). A field with
    metadata `engine` takes that EngineArgs field's flag (its names, type, choices and help where it
    has none of its own). Returns {field name: its flag} for the flags added."""
    groups = {} if groups is None else groups
    added = {}
    for f in dataclasses.fields(cls):
        meta, typed = dict(f.metadata), f
        if "engine" in meta:  # the engine's flag: its names, type and choices; its help unless given
            typed = ENGINE_FIELDS[meta["engine"]]
            inherited = ("help", "flags", "aliases", "choices", "metavar", "type")
            meta = {**{k: v for k, v in typed.metadata.items() if k in inherited}, **meta}
        if not meta.get("help") or f.name in exclude:
            continue
        kind, many, literal = _annotation(typed)
        default = (defaults or {}).get(f.name, default_of(cls, f.name))
        if meta.get("env"):
            default = os.environ.get(meta["env"], default)
        options: dict[str, Any] = {"dest": f.name, "default": None if all_none else default}
        if kind is bool:
            options["action"] = meta.get("action", "store_true")
        else:
            options["type"] = meta.get("type", kind)
            if many:
                options["nargs"] = "+"
        for key in ("choices", "metavar", "nargs", "action"):
            if key in meta:
                options[key] = meta[key]() if key == "choices" and callable(meta[key]) else meta[key]
        if literal and "choices" not in options:
            options["choices"] = literal
        if "choices" not in options and "metavar" not in options and options.get("type") in (int, float):
            options["metavar"] = "N" if options["type"] is int else "X"
        if options.get("nargs", "") is None:
            del options["nargs"]
        options["help"] = meta["help"] + _default_text(meta, default)
        target = parser
        if meta.get("group"):
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        names = (*meta.get("flags", (f"--{f.name.replace('_', '-')}",)), *meta.get("aliases", ()))
        target.add_argument(*names, **options)
        added[f.name] = next((n for n in names if n.startswith("--")), names[0])
    return added


def _default_text(meta: dict, default: Any) -> str:
    if not meta.get("show_default", True):
        return ""
    if "default_text" in meta:
        return f" (default: {meta['default_text']})"
    if default is None or default is False or default == [] or default == "":
        return ""
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f" (default: {shown})"


def dataclass_from_cli_args(cls: type, args: argparse.Namespace, **given: Any):
    """An instance of `cls` from the flags `add_dataclass_args` made (a None of an all_none flag: the
    dataclass's default) and `given`."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is not None or default_of(cls, f.name) is None:
            values[f.name] = value
    return cls(**values, **given)


class LazyArgumentParser(argparse.ArgumentParser):
    """A (sub)command's parser whose flags are added on its first use by `fill(parser)`: flags made from a
    dataclass in a module that imports torch (the benchmarks' configs), which `speculative --help` and
    the other commands never need."""

    def __init__(self, *args, fill=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fill = fill

    def _filled(self) -> None:
        fill, self.fill = self.fill, None
        if fill is not None:
            fill(self)

    def parse_known_args(self, *args, **kwargs):
        self._filled()
        return super().parse_known_args(*args, **kwargs)

    def format_help(self) -> str:
        self._filled()
        return super().format_help()


def _spec(name: str, help: str, **cli: Any) -> Any:
    """An EngineArgs field of SpeculativeConfig's: its default is SpeculativeConfig's."""
    return arg(default_of(SpeculativeConfig, name), help, **cli)


@dataclass
class EngineArgs:
    """What `speculative generate` and `serve` build their LLM from (LLM's arguments, by their names).

    model / draft_model: None, the demo pair (`with_demo_pair`). method: a registered speculative method
    (None: "draft_model" where a draft model is given, else plain decoding). options: the method's own
    options given (its MethodConfig's fields, vLLM's flat names); the rest: LLM's and SpeculativeConfig's
    fields of the same names.
    """

    model: str | None = arg(
        None,
        "target model: hub id, local path, or a GGUF file (a .gguf, or a folder holding one)",
        default_text="the demo model, SmolLM2-135M-Instruct, with its draft",
    )
    draft_model: str | None = arg(
        None,
        "draft model sharing the target's vocabulary (or with its own tokenizer): hub id, local path, "
        "or a GGUF file",
        group="drafter",
    )
    method: str | None = arg(
        None,
        "the speculative method, by its registered name (default: draft_model with a draft model, "
        "else none: plain decoding); the shortcuts below name it too",
        choices=lambda: tuple(METHODS),
        show_default=False,
    )
    num_speculative_tokens: int | None = arg(
        None,
        "draft tokens per step (k)",
        flags=("-k", "--num-speculative-tokens"),
        default_text=f"the draft model folder's own ({DECLARED_K} in its generation_config.json), else "
        f"{default_of(SpeculativeConfig, 'num_speculative_tokens')}",
    )
    acceptance: str = _spec(
        "acceptance",
        "the acceptance rule: rejection is lossless; typical is not",
        choices=lambda: tuple(RULES),
    )
    posterior_threshold: float = _spec("posterior_threshold", "--acceptance typical: the threshold's bound")
    posterior_alpha: float = _spec("posterior_alpha", "--acceptance typical: the entropy scale")
    adaptive: bool | None = arg(
        None,
        "choose k per step in [0, k] from measured acceptance and step times, or with --no-adaptive not",
        action=argparse.BooleanOptionalAction,
        default_text="on where `serve` runs the demo model with its draft, else off",
    )
    disable_by_batch_size: int | None = _spec(
        "disable_by_batch_size",
        "decode plainly (draft nothing) at steps of N or more running rows: plain decoding's "
        "inter-token latency under load",
        default_text="speculate at every batch size",
    )
    tree: str | None = _spec(
        "tree",
        "verify a token tree of depth k per step: dynamic (follows the draft's confidence) or static",
        choices=("static", "dynamic"),
    )
    tree_width: int = _spec("tree_width", "a draft tree's children per expanded node")
    tree_nodes: int = _spec("tree_nodes", "drafts per tree")
    options: dict[str, Any] = field(default_factory=dict)
    dtype: str = arg("auto", "auto, float32, bfloat16 or float16")
    draft_dtype: str | None = arg(
        None,
        "the draft model's dtype; on a CPU a float32 draft beside a bfloat16 target can be faster",
        default_text="--dtype",
    )
    device: str = arg("cpu", "cpu or cuda")
    model_impl: str = arg("auto", "the models' forward", choices=("auto", "native", "transformers"))
    tokenizer: str | None = arg(None, "the target's tokenizer (a path or hub id)", default_text="the model's")
    draft_tokenizer: str | None = arg(
        None, "the draft model's tokenizer (drafting across tokenizers)", default_text="the draft's"
    )
    quantization: str | None = arg(
        None,
        "quantization of the target's and the draft's projections (CPU, native forward): int8, int4 "
        "weight-only (int4: bfloat16 models), w8a8 int8 weights and activations (llama.cpp's Q8_0 "
        "arithmetic), w4a8 4-bit weights and int8 activations (llama.cpp's Q4_1 arithmetic); w8a8 and "
        "w4a8 build a C++ kernel on first use",
        choices=QUANTIZATIONS,
    )
    draft_quantization: str | None = arg(
        None,
        "the draft model's quantization alone: with --draft-model naming the target's own checkpoint, "
        "a quantized copy of the target drafts (w8a8 keeps most of its tokens on a CPU)",
        choices=QUANTIZATIONS,
        default_text="--quantization",
    )
    compile: bool = arg(
        False,
        "run the native forward compiled (torch.compile; the first call of each kind compiles, a minute "
        "or more on a small CPU)",
    )
    draft_compile: bool | None = arg(
        None,
        "compile the drafter (a draft model or an EAGLE head), or with --no-draft-compile not, whatever "
        "--compile says: --draft-compile alone compiles the small drafter and leaves the target eager",
        action=argparse.BooleanOptionalAction,
        default_text="--compile",
    )
    tensor_parallel_size: int = arg(
        1,
        "split the target over N ranks (processes this command starts; under torchrun, its own); N must "
        "divide its attention heads, key/value heads and MLP columns; a model on transformers' forward is "
        "split by transformers' own tensor parallelism, where it has a plan for it",
    )
    draft_tensor_parallel_size: int = arg(
        1, "1 (the whole draft on every rank) or --tensor-parallel-size (the draft split too)"
    )
    seed: int = arg(0, "seeds requests that have no seed of their own")
    enable_prefix_caching: bool | None = arg(
        None,
        "keep the target's K/V of prompts and finished requests, so that a prompt that begins as an "
        "earlier one did (a shared system prompt, a conversation's next turn) prefills only the rest "
        "(native forward; not with precompiled buckets), or with --no-enable-prefix-caching not",
        action=argparse.BooleanOptionalAction,
        default_text="on where `serve` runs the demo model, else off",
    )
    prefix_cache_tokens: int = arg(
        16384,
        "--enable-prefix-caching: the most tokens whose K/V it keeps (each token 2 x layers x "
        "kv_heads x head_dim values); the least recently used go first",
    )

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), shortcuts: bool = True
    ) -> argparse.ArgumentParser:
        """Add the engine's flags to `parser` (not those of `exclude`): the fields', a shortcut per
        method (shortcuts), and one flag per option of every registered method."""
        groups: dict[str, Any] = {}
        engine = parser.add_argument_group("engine", "the models, how they run and how they speculate")
        add_dataclass_args(engine, EngineArgs, exclude=exclude, groups=groups)
        if shortcuts:
            drafters = groups["drafter"] if "drafter" in groups else engine.add_mutually_exclusive_group()
            add_method_shortcuts(drafters)
        options = parser.add_argument_group("method options", "each registered method's own options")
        for name, f in _option_fields().items():
            owners = {
                m: c.__dataclass_fields__[name] for m, c in METHODS.items() if name in c.__dataclass_fields__
            }
            defaults = {m: o.default for m, o in owners.items()}
            default = (  # each method's, where they differ
                f.default
                if len(set(defaults.values())) == 1
                else ", ".join(f"{m} {d}" for m, d in defaults.items())
            )
            kind, _, _ = _annotation(f)
            options.add_argument(
                f"--{name.replace('_', '-')}",
                *f.metadata.get("aliases", ()),
                dest=name,
                type=kind,
                default=None,
                metavar="N" if kind is int else "X",
                help=f"--method {', '.join(owners)}: {f.metadata.get('help', name)} (default: {default})",
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags (add_cli_args'); a ValueError naming the flags where a
        shortcut and --method disagree."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        options = {
            name: getattr(args, name) for name in _option_fields() if getattr(args, name, None) is not None
        }
        for name, method_cls in METHODS.items():
            value = getattr(args, name, None)
            if not value or name == "draft_model":
                continue
            if given.get("method") not in (None, name):
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} and --method {given['method']} name two methods: give one")
            given["method"] = name
            if method_cls.uses_draft_model:
                given["draft_model"] = value
        return cls(**given, options=options)

    def with_demo_pair(self) -> tuple[EngineArgs, bool]:
        """(these args with the demo pair filled in where --model is not given, toy): the real demo
        model (speculative.demo.smollm2, fetched and cached on first use), speculating with its draft
        unless the method needs no model, or the bundled toy pair (toy True) under SPECULATIVE_DEMO=toy
        or where the real one cannot be had (saying why on stderr). OSError saying how to get the toy
        pair where it is needed and missing."""
        if self.model is not None:
            return self, False
        modelless = self.method is not None and not METHODS[self.method].uses_draft_model
        if not smollm2.toy_requested():
            try:
                pair = smollm2.demo_pair()
                draft = self.draft_model or (None if modelless else str(pair.draft))
                return dataclasses.replace(self, model=str(pair.target), draft_model=draft), False
            except smollm2.DemoUnavailable as error:
                print(
                    f"speculative: {error}; running the bundled toy pair instead ({smollm2.DEMO_ENV}=toy "
                    "goes there directly)",
                    file=sys.stderr,
                )
        if not (DEMO_DIR / "target").is_dir():
            raise OSError(
                f"the demo pair is not at {DEMO_DIR}: pass --model, set {DEMO_DIR_ENV} to the pair's "
                f"folder, or train it with `python -m speculative.demo.train --out models/demo`"
            )
        draft = self.draft_model or (None if modelless else str(DEMO_DIR / "draft"))
        return dataclasses.replace(self, model=str(DEMO_DIR / "target"), draft_model=draft), True

    def demo_server_defaults(self) -> EngineArgs:
        """These args with `serve`'s defaults for the demo model where the flags leave them open: on
        the native forward, --enable-prefix-caching (a chat's next turn prefills only its new message:
        docs/server.md, Prefix caching); and where they speculate with a draft model's chains,
        --adaptive (the draft at its fixed k runs slower than plain decoding under load) and, on a CPU
        with the native forward, --draft-compile (the draft's graphs compile in the background while
        the server answers). Compiled, the draft's own chain is as long as its prompt lookup's (-k as
        the draft declares it, instead of the one token it declares for itself), which pays beside the
        eager target: docs/server.md, Under load."""
        prefix = self.enable_prefix_caching
        if prefix is None:
            prefix = self.model_impl != "transformers"
        args = dataclasses.replace(self, enable_prefix_caching=prefix)
        config = args.speculative_config()
        if config is None or config.method != "draft_model" or config.tree:
            return args
        adaptive = True if args.adaptive is None else args.adaptive
        draft_compile = args.draft_compile
        if draft_compile is None and args.device == "cpu" and args.model_impl != "transformers":
            draft_compile = True
        k = args.num_speculative_tokens
        if draft_compile and k is None and "num_assistant_tokens" not in args.options:
            k = config.num_speculative_tokens
        return dataclasses.replace(
            args, adaptive=adaptive, draft_compile=draft_compile, num_speculative_tokens=k
        )

    def check_speculative_flags(self) -> None:
        """Refuse a bad speculative flag before anything loads (speculative_config's ValueError), as the
        run will see them: without --model, with the demo pair's draft (its folder in the package, or
        the toy pair's: what it declares), unless the method needs no model (`with_demo_pair`)."""
        probe = self
        if self.model is None and self.draft_model is None:
            if self.method is None or METHODS[self.method].uses_draft_model:
                draft = DEMO_DIR / "draft" if smollm2.toy_requested() else smollm2.DRAFT_PACKAGE
                probe = dataclasses.replace(self, draft_model=str(draft))
        probe.speculative_config()

    def speculative_config(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig these args ask for; None (plain decoding) without a method or a draft
        model. A ValueError naming the flag for a bad value, or an option of another method."""
        method = self.method or ("draft_model" if self.draft_model is not None else None)
        for name in self.options:
            if method is None or name not in method_config(method).__dataclass_fields__:
                owners = [m for m, cls in METHODS.items() if name in cls.__dataclass_fields__]
                raise ValueError(
                    f"--{name.replace('_', '-')} is an option of --method {' / '.join(owners)}; "
                    f"the method here is {method or 'none (plain decoding)'}"
                )
        if method is None:
            return None
        common = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SpeculativeConfig)
            if f.name != "options" and getattr(self, f.name) is not None
        }
        try:
            data = with_draft_defaults({**common, "method": method, **self.options}, self.draft_model)
            return SpeculativeConfig.from_dict(data)
        except ValueError as error:
            raise ValueError(_name_the_flag(str(error))) from None

    def llm_kwargs(self) -> dict[str, Any]:
        """LLM's keyword arguments (model and draft_model as given: `with_demo_pair` fills them)."""
        names = [
            f.name for f in dataclasses.fields(self) if f.name not in _SPECULATIVE and f.name != "method"
        ]
        return {
            **{name: getattr(self, name) for name in names},
            "enable_prefix_caching": bool(self.enable_prefix_caching),
            "speculative_config": self.speculative_config(),
        }

    def create_llm(self, **overrides: Any) -> LLM:
        """The LLM of these args (and `overrides`, LLM's keywords), saying on stderr what it loads
        before it does, then which dtypes its models run in and how long loading them took."""
        from speculative.llm import LLM

        kwargs = {**self.llm_kwargs(), **overrides}
        config = kwargs["speculative_config"]
        # a head reading the target's hidden states (EAGLE, DFlash), by its method's name
        head = f"{config.method} head" if config and METHODS[config.method].reads_hidden_states else None
        loading = f"target {describe_model(kwargs['model'])}"
        if kwargs["draft_model"] is not None:
            loading += f" and {head or 'draft model'} {describe_model(kwargs['draft_model'])}"
        progress(f"loading {loading}...")
        start = time.perf_counter()
        llm = LLM(**kwargs)
        loaded = time.perf_counter() - start
        models = "target and draft" if llm.draft is not None else f"target and {head}" if head else "target"
        progress(_dtypes(llm, head))
        progress(f"loaded {models} in {loaded:.2f} s")
        return llm


_SPECULATIVE = {f.name for f in dataclasses.fields(SpeculativeConfig)}
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
"""EngineArgs' fields by name: what `arg(engine=...)` refers to."""
SHORTCUT_HELP = {
    "ngram": "draft by n-gram prompt lookup (--method ngram)",
    "suffix": "draft by suffix decoding: suffix tries of the request and of past responses (--method suffix)",
    "eagle": "draft with an EAGLE-1 head (its checkpoint directory) reading the target's hidden states; "
    "unquantized, one rank (--tree: EAGLE-2's trees)",
    "eagle3": "draft with an EAGLE-3 head (its checkpoint directory) reading the target's hidden states; "
    "unquantized, one rank (--tree: EAGLE-2's trees)",
    "dflash": "draft with a DFlash block drafter (its checkpoint directory): k tokens in one forward, "
    "reading the target's hidden states; unquantized, one rank (--tree: a tree from the block)",
    "self_draft": "draft with the target's own weights quantized (--draft-quantization, default w8a8) on "
    "the target's KV cache: no draft model; a float target on a CPU, one rank, chains (--method self_draft)",
}
"""The built-in methods' shortcut flags' help; another method's is its MethodConfig's first sentence."""


def add_method_shortcuts(
    group: Any, only: Any = None, more: str = "", notes: dict[str, str] | None = None
) -> None:
    """A flag per registered method but draft_model (--draft-model is its own): `--NAME PATH` for a
    method that reads a model from a directory (the draft_model it sets), else `--NAME`. only: a test of
    the MethodConfig class (None: every method); `more` ends their help, and notes[NAME] that flag's."""
    for name, cls in METHODS.items():
        if name == "draft_model" or (only is not None and not only(cls)):
            continue
        doc = SHORTCUT_HELP.get(name) or _first_sentence(cls.__doc__ or name)
        doc += more + (notes or {}).get(name, "")
        flag = f"--{name.replace('_', '-')}"
        if cls.uses_draft_model:
            group.add_argument(flag, metavar="PATH", dest=name, help=doc)
        else:
            group.add_argument(flag, action="store_true", dest=name, help=doc)


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, its lines joined (up to the first '. ' or '; ', the stop left out)."""
    text = " ".join(doc.split())
    return re.split(r"[.;](?:\s|$)", text, maxsplit=1)[0]


def _option_fields() -> dict[str, dataclasses.Field]:
    """Every registered method's options (MethodConfig fields), by name."""
    return {f.name: f for cls in dict.fromkeys(METHODS.values()) for f in dataclasses.fields(cls)}


def _name_the_flag(message: str) -> str:
    """A config's ValueError ("SpeculativeConfig.tree_nodes must be ...") with the flag it came from."""
    found = re.search(r"\b\w+Config\.(\w+)", message)
    if found is None:
        return message
    return f"{message} (--{found.group(1).replace('_', '-')})"


def not_under_torchrun(command: str) -> None:
    """A ValueError under torchrun (WORLD_SIZE > 1): `command` starts its own ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"{command} starts its own tensor-parallel ranks (--tensor-parallel-size); "
            "run it without torchrun"
        )


def describe_model(model: Any) -> str:
    """A model for a progress line: "target (model.safetensors, 27.1 MB)", a hub id, or an object's
    class name."""
    if not isinstance(model, (str, os.PathLike)):
        return type(model).__name__
    path = Path(model)
    if path.is_file():
        return f"{path.name} ({_megabytes(path.stat().st_size)})"
    if not path.is_dir():
        return f"{model} (from the Hugging Face hub or its cache)"
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    if not weights:
        return path.name
    files = weights[0].name if len(weights) == 1 else f"{len(weights)} weight files"
    return f"{path.name} ({files}, {_megabytes(sum(p.stat().st_size for p in weights))})"


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size < 1e9 else f"{size / 1e9:.2f} GB"


def _dtypes(llm: LLM, head: str | None) -> str:
    """The dtype each model runs in ("target in float32"), and the weights' quantization, if any; `head`:
    the head that reads the target's hidden states, if any ("eagle3 head")."""
    quantized = f", {llm.quantization} weights" if getattr(llm, "quantization", None) else ""
    if head:
        return f"target and {head} in {llm.target.dtype}"
    if llm.draft is None:
        return f"target in {llm.target.dtype}{quantized}"
    draft = getattr(llm, "draft_quantization", None)
    if llm.draft.dtype == llm.target.dtype and draft == getattr(llm, "quantization", None):
        return f"target and draft in {llm.target.dtype}{quantized}"
    drafts = f", {draft} weights" if draft else ""
    return f"target in {llm.target.dtype}{quantized}; draft in {llm.draft.dtype}{drafts}"
