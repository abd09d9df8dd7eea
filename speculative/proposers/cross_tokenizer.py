"""A draft model with a tokenizer of its own (Hugging Face's universal assisted generation, vLLM's drafting
across vocabularies): text is the common ground between the two vocabularies.

Each proposal, per row (host-side work: the tokenizers run on the host):
1. The target's context is decoded to text (special tokens skipped) and encoded whole with the draft's
   tokenizer, after the draft's own prefix (its BOS, once: never re-added inside the text, the "BOS
   stutter" of transformers 46124). The draft's sequence is thus always the draft tokenizer's own
   tokenization of the accepted text, merges across the boundary of what was last accepted included
   (an accepted "hel" and a new "lo" become the draft's "hello"). The draft cache keeps the longest
   prefix it shares with the tokens it holds (the last drafts included) -- a rollback by length, so
   positions follow from the cache's lengths and are never stale -- and the rest is fed, rows of any
   lengths in one right-padded forward.
2. The draft decodes `num_tokens` tokens of its own greedily. Their text (cut at the draft's first special
   token, and before a trailing incomplete character) is appended to the text of the row's last
   `LOOKBEHIND` target tokens and encoded with the target's tokenizer: where that encoding starts with
   those tokens, the tokens after them are the proposal (at most `num_tokens`); where it does not, the
   new text would merge with the committed tail, which cannot change any more, and the draft's text is
   encoded alone (the target goes on from a committed token as it would). The last proposed token may
   be one that more text would merge into a longer one; it is proposed all the same: on the demo pair,
   holding back the tokens of the text's last word raised the acceptance rate (0.45 -> 0.53) but cut
   the tokens a step keeps (2.77 -> 2.54), a token that is right being worth more than a rejected one
   costs in a verification.

The proposal is a function of the context (greedy drafting): its draft distribution is one-hot, so the
rejection rule accepts a draft x with probability q(x) and otherwise draws from q without x -- sampled
output follows the target's distribution exactly, and greedy output is the target's own. A row whose
draft tokens would not fit the draft's context (`max_length`) proposes nothing.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from speculative.models.base import LanguageModel, decode, first_argmax
from speculative.proposers.base import Proposal
from speculative.sampling import SampleStrategy

LOOKBEHIND = 8  # target tokens re-encoded with the draft's text (step 2)


class CrossTokenizerProposer:
    """Proposes target tokens from a draft model with another vocabulary (module docstring); greedy
    drafting, proposals without draft probabilities. Both tokenizers must be fast (Rust) ones."""

    def __init__(
        self,
        model: LanguageModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.model = model
        self.draft_tokenizer = _backend(draft_tokenizer, "draft model's")
        self.target_tokenizer = _backend(target_tokenizer, "target's")
        self.prefix = _prefix(draft_tokenizer)  # the tokens the draft's tokenizer puts before a text
        self.draft_specials = set(draft_tokenizer.all_special_ids)
        self.cache = None
        self.cached: list[list[int]] = []  # per row, the draft tokens whose K/V the cache holds

    def draft_ids(self, contexts: list[list[int]]) -> list[list[int]]:
        """The draft's tokens for each target context (token ids): its prefix and the context's text."""
        texts = self.target_tokenizer.decode_batch(contexts, skip_special_tokens=True)
        encoded = self.draft_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [self.prefix + e.ids for e in encoded]

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        ids = self.draft_ids(_contexts(tokens, lengths))
        fed = [row[: min(len(row) - 1, self.model.max_length - 1)] for row in ids]
        cache = self.model.new_cache(len(ids), self.model.max_length)
        if max(map(len, fed)) > 0:  # every row but its last token, as much as fits
            self._feed(cache, fed)
        if self.cache is None or self.cache.batch_size == 0:
            self.cache, self.cached = cache, fed
        else:
            self.cache.append_rows(cache)
            self.cached += fed

    def _feed(self, cache, rows: list[list[int]]) -> Tensor:
        """Append each row's tokens (at least one in some row) to `cache` in one right-padded forward;
        returns the logits [batch, 1, vocab] at each row's last token (garbage for an empty row)."""
        width = max(map(len, rows))
        query = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.model.device)
        num = torch.tensor([len(r) for r in rows], device=self.model.device)  # [B]
        return self.model.forward(
            query, cache, num_tokens=num, logits_indices=(num - 1).clamp(min=0)[:, None]
        )

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        contexts = _contexts(tokens, lengths)
        wanted = self.draft_ids(contexts)  # the draft's tokens of each row's accepted text
        room = self.model.max_length - num_tokens
        keep = [min(_common(c, w), len(w) - 1) for c, w in zip(self.cached, wanted)]  # cached and right
        fits = [0 < len(w) <= room for w in wanted]
        width = max(len(w) - n for w, n, ok in zip(wanted, keep, fits) if ok) if any(fits) else 1
        fits = [ok and n + width <= room for n, ok in zip(keep, fits)]  # padding is written too
        keep = [n if ok else 0 for n, ok in zip(keep, fits)]  # a row that does not fit feeds a dummy
        self.cache.rollback(torch.tensor(keep, device=self.model.device), max(keep))
        logits = self._feed(self.cache, [w[n:] if ok else [0] for w, n, ok in zip(wanted, keep, fits)])
        first = first_argmax(logits[:, -1])[:, None]  # [B, 1]
        drafted = (
            first
            if num_tokens == 1
            else torch.cat([first, decode(self.model, first, self.cache, num_tokens - 1)[0]], 1)
        )
        drafted = drafted.tolist()  # [B, num_tokens]
        self.cached = [w + d[:-1] if ok else [] for w, d, ok in zip(wanted, drafted, fits)]
        rows = [
            self._target_tokens(c, d, num_tokens) if ok else [] for c, d, ok in zip(contexts, drafted, fits)
        ]
        width = max(map(len, rows))
        token_ids = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)
        return Proposal(token_ids.view(len(rows), width).to(tokens.device), None)

    def _target_tokens(self, context: list[int], drafted: list[int], num_tokens: int) -> list[int]:
        """The target tokens that continue `context` with the text of `drafted` (draft ids), step 2 of
        the module docstring."""
        ended = next((i for i, t in enumerate(drafted) if t in self.draft_specials), None)
        text = self.draft_tokenizer.decode(drafted[:ended], skip_special_tokens=False).rstrip("\ufffd")
        if not text:
            return []
        tail = context[-LOOKBEHIND:]
        joined = self.target_tokenizer.decode(tail, skip_special_tokens=False) + text
        ids = self.target_tokenizer.encode(joined, add_special_tokens=False).ids
        if ids[: len(tail)] != tail:  # the text would merge with the committed tail
            return self.target_tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
        return ids[len(tail) : len(tail) + num_tokens]

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        pass  # the next proposal re-syncs the draft with the accepted text

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        pass

    def select_rows(self, rows: Tensor) -> None:
        if not rows.numel():  # the batch emptied: the cache's buffers go with it, as the target's do
            self.cache, self.cached = None, []
        if self.cache is not None:
            self.cache.select_rows(rows)
            self.cached = [self.cached[i] for i in rows.tolist()]


def _backend(tokenizer: PreTrainedTokenizerBase, whose: str) -> Tokenizer:
    """The Rust tokenizer behind a fast Hugging Face tokenizer; a ValueError for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            "drafting across tokenizers needs fast (Rust) tokenizers; "
            f"the {whose} is {type(tokenizer).__name__}"
        )
    return backend


def _prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens `tokenizer` puts before a text when it adds special tokens (its BOS), [] if none."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    start = len(full) - len(bare)
    return full[:start] if full[start:] == bare else []


def _contexts(tokens: Tensor, lengths: Tensor) -> list[list[int]]:
    """Each row's context tokens[b, :lengths[b]] as a host list (one read of the batch)."""
    return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
