"""Guided (structured) decoding with llguidance: token masks from a JSON schema, regex, choice or grammar.

A `Guide` is a grammar compiled for one tokenizer and logits width; `Guide.new_state()` gives each
sequence a `GuideState`, a matcher that follows the tokens the sequence commits. Speculative decoding
asks for the masks of a whole block at once: `GuideState.allowed_for_block(drafts)` returns the allowed
tokens after the committed tokens and after each prefix of the drafts, and leaves the state as it was;
`accept(tokens)` then commits what the verifier emitted. Drafters draft under the same grammar
(speculative/proposers/grammar.py): `advance(drafts)` walks the matcher along drafts, `rollback()`
undoes that, and `valid_prefix(drafts)` says how far a ready-made proposal is allowed.

Masks are computed by llguidance as bitmasks (one bit a token, in 32-bit words) through its executor,
which walks the drafts and rolls back in native code, and are unpacked to bool tensors on the CPU.

EOS: the tokenizer's EOS (or the ids passed as `eos_token_ids`) is allowed exactly when the grammar can
end, and is the only token allowed once the grammar is complete (`finished`). Ids at or past the
tokenizer's vocabulary (padding of the logits) are never allowed.

The constraint a request asks for, `GuidedDecodingParams`, is plain data and lives beside SamplingParams
(speculative/sampling_params.py, below this package); it is imported here too.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from speculative.extras import needs_extra
from speculative.sampling_params import GuidedDecodingParams

with needs_extra("guided", "guided decoding"):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg_np

__all__ = ["Guide", "GuideState", "GuidedDecodingParams", "allowed_for_blocks"]

_GUIDE_CACHE_SIZE = 128  # compiled guides kept per tokenizer (least recently used dropped first)


def _grammar_text(params: GuidedDecodingParams) -> str:
    """llguidance's grammar text for the constraint; ValueError when it cannot be built."""
    kind, text = params.key()
    if kind in ("json", "json_object"):  # compact JSON unless the schema's "x-guidance" says otherwise
        schema = text if kind == "json" else '{"type":"object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)  # Lark as is; GBNF converted (ValueError if it fails)


# --- caches -----------------------------------------------------------------------------------------------

_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
_guides: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
_executor: llguidance.LLExecutor | None = None


def _get_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        with _lock:
            if _executor is None:
                _executor = llguidance.LLExecutor()  # threads: 80% of the CPUs (at least 1)
    return _executor


def _eos_key(eos_token_ids: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if eos_token_ids is None:
        return None
    if isinstance(eos_token_ids, int):
        return (int(eos_token_ids),)
    ids = tuple(int(i) for i in eos_token_ids)
    if not ids:
        raise ValueError("eos_token_ids must not be empty")
    return ids


def _ll_tokenizer(tokenizer, eos: tuple[int, ...] | None) -> llguidance.LLTokenizer:
    """llguidance's view of a HF fast tokenizer (slow to make for a large vocabulary: cached per
    tokenizer)."""
    try:
        per_tokenizer = _ll_tokenizers.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: no caching
        per_tokenizer = None
    if per_tokenizer is not None and eos in per_tokenizer:
        return per_tokenizer[eos]
    if eos is None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the tokenizer has no EOS token: pass eos_token_ids")
    try:  # (ValueError for a slow tokenizer)
        ll_tok = llguidance.hf.from_tokenizer(tokenizer, eos_token=None if eos is None else list(eos))
    except (TypeError, RuntimeError, AttributeError) as e:
        raise ValueError(f"llguidance cannot use this tokenizer: {e}") from e
    try:
        with _lock:
            _ll_tokenizers.setdefault(tokenizer, {})[eos] = ll_tok
    except TypeError:
        pass
    return ll_tok


# --- guides -----------------------------------------------------------------------------------------------


class Guide:
    """A compiled grammar for one tokenizer (cache compiled guides by (params, tokenizer id)).

    Build with `Guide.compile`, which caches: the same params, tokenizer object, vocab_size and EOS ids
    give the same Guide. A Guide is immutable and can be shared by any number of states and threads.
    """

    def __init__(
        self,
        params: GuidedDecodingParams,
        ll_tokenizer: llguidance.LLTokenizer,
        grammar: str,
        vocab_size: int,
    ) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)  # width of the masks (the model's logits)
        self.tokenizer_vocab_size = int(ll_tokenizer.vocab_size)  # ids at or past it are never allowed
        self.eos_token_ids = tuple(int(i) for i in ll_tokenizer.eos_tokens)
        self._ll_tokenizer = ll_tokenizer
        self._grammar = grammar
        self._template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(f"invalid {params.kind()} constraint: {self._template.get_error()}")
        self.warnings = list(self._template.get_grammar_warnings())
        self._words = (self.tokenizer_vocab_size + 31) // 32  # int32 words in one bitmask row
        eos_only = np.zeros((1, self._words), dtype=np.int32)
        for i in self.eos_token_ids:
            if i < self.tokenizer_vocab_size:
                eos_only.view(np.uint32)[0, i // 32] |= np.uint32(1 << (i % 32))
        self._eos_only_row = eos_only

    @classmethod
    def compile(
        cls,
        params: GuidedDecodingParams,
        tokenizer,
        vocab_size: int,
        *,
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> Guide:
        """Compile (or fetch from the cache) the guide for params on this tokenizer.

        tokenizer: a HF PreTrainedTokenizerFast. vocab_size: the model's logits width (may exceed
        len(tokenizer): the extra ids are never allowed). eos_token_ids: the ids that end generation
        (default: the tokenizer's EOS). Raises ValueError for a bad schema, regex, grammar or tokenizer.
        """
        if not isinstance(params, GuidedDecodingParams):
            raise TypeError(f"params must be GuidedDecodingParams, not {type(params).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        eos = _eos_key(eos_token_ids)
        params_key = params.key()  # also validates the JSON text
        key = (params_key, vocab_size, eos)
        try:
            per_tokenizer = _guides.get(tokenizer)
        except TypeError:
            per_tokenizer = None
        if per_tokenizer is not None:
            with _lock:
                guide = per_tokenizer.get(key)
                if guide is not None:
                    per_tokenizer.move_to_end(key)
                    return guide
        ll_tok = _ll_tokenizer(tokenizer, eos)
        try:
            grammar = _grammar_text(params)
        except ValueError as e:
            raise ValueError(f"invalid {params.kind()} constraint: {e}") from None
        guide = cls(params, ll_tok, grammar, vocab_size)
        try:
            with _lock:
                per_tokenizer = _guides.setdefault(tokenizer, OrderedDict())
                per_tokenizer[key] = guide
                while len(per_tokenizer) > _GUIDE_CACHE_SIZE:
                    per_tokenizer.popitem(last=False)
        except TypeError:
            pass
        return guide

    def new_state(self) -> GuideState:
        """A fresh matcher at the start of the output (a copy of the compiled one: microseconds)."""
        return GuideState(self, self._template.deep_copy())

    def _unpack(self, bitmask: np.ndarray) -> torch.Tensor:
        """int32 bitmask [rows, words] -> bool [rows, vocab_size]; ids past the tokenizer's are False."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        if self.vocab_size > self.tokenizer_vocab_size:
            bits[:, self.tokenizer_vocab_size :] = 0
        return torch.from_numpy(bits.view(np.bool_))

    def __repr__(self) -> str:
        kind, text = self.params.key()
        shown = text if len(text) <= 60 else text[:57] + "..."
        return f"Guide({kind}={shown!r}, vocab_size={self.vocab_size})"


class GuideState:
    """One row's grammar matcher. Supports speculation: masks for a block of draft positions, rollback.

    Not thread-safe by itself: use one state from one thread at a time.
    """

    def __init__(self, guide: Guide, matcher: llguidance.LLMatcher) -> None:
        self.guide = guide
        self._matcher = matcher
        self.num_accepted = 0  # tokens committed so far (EOS after the grammar has stopped not counted)
        self._advanced = 0  # draft tokens the matcher took since the last commit (`advance`)

    # -- masks ------------------------------------------------------------------------------------------

    def _drafts(self, draft_token_ids: Sequence[int]) -> list[int]:
        """The drafts up to the first id outside the tokenizer (never allowed; llguidance rejects it)."""
        n = self.guide.tokenizer_vocab_size
        out = []
        for t in draft_token_ids:
            t = int(t)
            if not 0 <= t < n:
                break
            out.append(t)
        return out

    def _fix_after_eos(self, bitmask: np.ndarray, offset: int, drafts: list[int]) -> None:
        """After a valid draft EOS the grammar is stopped: the rows after it, and after each further draft
        EOS, allow only EOS (the first other draft is invalid: the rows after it stay all ones).

        llguidance's executor stops walking there and leaves those rows as they were (all ones). A draft
        is valid when its row allows it and all earlier drafts are valid; the executor computed the rows
        up to the first invalid draft, and left the rest all ones (which the walk below never reads).
        """
        eos = self.guide.eos_token_ids
        if not any(t in eos for t in drafts):
            return
        rows = bitmask[offset : offset + len(drafts) + 1].view(np.uint32)
        for j, t in enumerate(drafts):
            if not (int(rows[j, t // 32]) >> (t % 32)) & 1:
                return  # invalid draft: later rows are never reached
            if t in eos:  # stopped: EOS stays allowed (a no-op), anything else is invalid
                eos_only = self.guide._eos_only_row.view(np.uint32)
                for i in range(j, len(drafts)):
                    if drafts[i] not in eos:
                        return
                    rows[i + 1] = eos_only
                return

    def bitmask_for_block(self, draft_token_ids: Sequence[int]) -> np.ndarray:
        """Like `allowed_for_block`, as llguidance's int32 bitmask [len(drafts) + 1, ceil(n_tok / 32)]:
        bit i of word w of a row = token 32 * w + i allowed (n_tok: the tokenizer's vocabulary; ids past
        it are never allowed, and their bits in the last word are meaningless: mask them off). Rows past
        an invalid draft are all ones. For moving compact masks to the GPU; `allowed_for_block` unpacks."""
        drafts = self._drafts(draft_token_ids)
        bitmask = np.full((len(draft_token_ids) + 1, self.guide._words), -1, dtype=np.int32)
        if drafts:
            jobs = [(self._matcher, 0, drafts)]
            llg_np.fill_next_token_bitmask_par_with_draft_tokens(_get_executor(), jobs, bitmask)
        else:  # (the executor's draft call rejects an empty list)
            llg_np.fill_next_token_bitmask(self._matcher, bitmask, 0)
        self._fix_after_eos(bitmask, 0, drafts)
        return bitmask

    def allowed_for_block(self, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """Bool mask [len(draft_token_ids) + 1, vocab_size] (CPU): row j = tokens allowed after the
        committed tokens + draft_token_ids[:j]. Advances through the drafts only as far as they are
        valid, then rolls back, leaving the state exactly as before the call.

        Rows after an invalid draft (one its own row does not allow, or an id outside the tokenizer) are
        all-True over the tokenizer's ids: that position is never reached, because the invalid draft is
        rejected. A draft EOS allowed by its row ends the grammar: the rows after it allow only EOS.
        Ids >= the tokenizer's vocabulary are False in every row.
        """
        return self.guide._unpack(self.bitmask_for_block(draft_token_ids))

    # -- drafting ---------------------------------------------------------------------------------------

    def advance(self, draft_token_ids: Sequence[int]) -> int:
        """Walk the matcher along draft tokens without committing them (`num_accepted` is unchanged), as
        far as the grammar allows them; returns how many it allows: the masks of `allowed_for_block`
        allow exactly these. `rollback()` undoes every advance since the last commit; call it before
        committing again."""
        drafts = self._drafts(draft_token_ids)
        taken = self._matcher.try_consume_tokens(drafts) if drafts else 0
        self._advanced += taken
        return taken + self._eos_after_end(drafts[taken:])

    def rollback(self) -> None:
        """Undo every `advance` since the last commit."""
        self._undo(self._advanced)

    def valid_prefix(self, draft_token_ids: Sequence[int]) -> int:
        """How many leading draft_token_ids the grammar allows after the committed tokens (and any
        advance), in order, as `advance` counts them; the state is unchanged."""
        before = self._advanced
        allowed = self.advance(draft_token_ids)
        self._undo(self._advanced - before)
        return allowed

    def _undo(self, num_tokens: int) -> None:
        """Roll the matcher back by the last `num_tokens` tokens that `advance` took."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._advanced -= num_tokens

    def _eos_after_end(self, rest: list[int]) -> int:
        """How many leading tokens of `rest`, which the matcher did not take, are EOS after the grammar's
        end: allowed, and no-ops."""
        m = self._matcher
        if not m.is_stopped() or m.is_error():
            return 0
        eos = self.guide.eos_token_ids
        return next((i for i, t in enumerate(rest) if t not in eos), len(rest))

    # -- committing -------------------------------------------------------------------------------------

    def accept(self, token_ids: Sequence[int]) -> None:
        """Commit emitted tokens (they must be allowed; raise ValueError otherwise).

        On ValueError nothing is committed. EOS once the grammar is finished is allowed and a no-op.
        """
        tokens = [int(t) for t in token_ids]
        if not tokens:
            return
        n_tok = self.guide.tokenizer_vocab_size
        bad = next((t for t in tokens if not 0 <= t < n_tok), None)
        if bad is not None:
            raise ValueError(f"token {bad} is outside the tokenizer's vocabulary ({n_tok}): never allowed")
        m = self._matcher
        done = m.try_consume_tokens(tokens)
        if done + self._eos_after_end(tokens[done:]) < len(tokens):
            if done:
                m.rollback(done)
            raise ValueError(
                f"token {tokens[done]} at position {done} of {tokens} is not allowed by the "
                f"{self.guide.params.kind()} constraint after {self.num_accepted} tokens"
            )
        self.num_accepted += done

    # -- status -----------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts only EOS / stop (also true once EOS is accepted)."""
        return self._matcher.is_stopped()

    @property
    def can_end(self) -> bool:
        """The output so far is complete: EOS is allowed now (more tokens may be allowed too)."""
        return self._matcher.is_accepting()

    def __repr__(self) -> str:
        return f"GuideState({self.guide!r}, accepted={self.num_accepted}, finished={self.finished})"


def allowed_for_blocks(
    states: Sequence[GuideState], draft_token_ids: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """`allowed_for_block` for many rows in one llguidance call (the rows' matchers run in parallel on
    the executor's threads). states[i] gets draft_token_ids[i]; returns the masks in order. All states
    must come from guides with the same vocab_size and tokenizer vocabulary (one model).
    """
    if len(states) != len(draft_token_ids):
        raise ValueError(f"{len(states)} states but {len(draft_token_ids)} draft lists")
    if not states:
        return []
    guide = states[0].guide
    if len({id(s._matcher) for s in states}) != len(states):
        raise ValueError("a state appears twice")
    for s in states:
        if s.guide.vocab_size != guide.vocab_size or s.guide._words != guide._words:
            raise ValueError("all states must be for the same vocabulary")
    offsets = np.cumsum([0] + [len(d) + 1 for d in draft_token_ids]).tolist()
    drafts = [s._drafts(d) for s, d in zip(states, draft_token_ids)]
    bitmask = np.full((offsets[-1], guide._words), -1, dtype=np.int32)
    with_drafts = [(s._matcher, o, d) for s, o, d in zip(states, offsets, drafts) if d]
    without = [(s._matcher, o) for s, o, d in zip(states, offsets, drafts) if not d]
    if with_drafts:  # (the executor's draft call rejects empty lists: those rows go in a plain call)
        llg_np.fill_next_token_bitmask_par_with_draft_tokens(_get_executor(), with_drafts, bitmask)
    if without:
        llg_np.fill_next_token_bitmask_par(_get_executor(), without, bitmask)
    for s, o, d in zip(states, offsets, drafts):
        s._fix_after_eos(bitmask, o, d)
    allowed = guide._unpack(bitmask)
    return [allowed[offsets[i] : offsets[i + 1]] for i in range(len(states))]
