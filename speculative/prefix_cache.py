"""Prefix caching: the target's K/V of token prefixes kept across requests, so that a prompt which
begins as an earlier one did (a shared system prompt, the next turn of a conversation, which holds
the last turn's prompt and answer) prefills only the tokens after the part already computed.

The K/V are kept in blocks of `block_size` tokens in a trie: a block is a child of the block before it
in its prompt, keyed by its tokens, so that a block is found only after the very tokens that preceded
it (K/V depend on every earlier token) and two prompts share the blocks of their common prefix. A
block holds every layer's keys and values of its tokens, [2 * layers, kv_heads, block_size, head_dim]
(keys then values, as `StaticKVCache.keys + values`), and, for a proposer that reads the target's
hidden states (an EAGLE head, a block drafter), those states at its tokens, [block_size, F]: from a
prompt's prefill, and from the steps of a row the engine kept them for (engine/context_features.py);
a match for such a proposer stops at the first block without them. A draft model keeps its own K/V
of a block's tokens there too ([2 * draft layers, draft kv_heads, block_size, draft head_dim],
`attach_draft`), given to blocks the target's K/V made, so that a prompt found here is not prefilled
whole by the draft either (`match_draft`, `load(..., draft=True)`).

Blocks come from two places: each prompt's prefill (its full blocks), and each finished row's context
(prompt and output, all but its last token, whose K/V the cache never holds). What they hold is the
target's own K/V of those tokens, computed in a forward of other shapes than a prefill of the new
prompt would run, so it can differ from that prefill's in the last bits of float rounding (as a
chunked prefill's does): exact in what it computes, not bit for bit the same forward.

Memory: at most `max_tokens` tokens' blocks; past that the least recently used blocks that no other
block follows go first. One token costs 2 * layers * kv_heads * head_dim elements of the cache's
dtype (SmolLM2-135M in float32: 46 KB), and the same of the draft's where it keeps its K/V.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speculative.kv_cache import StaticKVCache
from speculative.transfer import to_device

PREFIX_BLOCK_SIZE = 16  # tokens a block (vLLM's default): a prefix is found to within this many


def check_prefix_caching(enable: bool, max_tokens: int, precompile: object) -> None:
    """Raise ValueError for LLM's prefix-caching arguments that cannot run (naming the argument)."""
    if not isinstance(enable, bool):
        raise ValueError(f"LLM.enable_prefix_caching must be True or False; got {enable!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < PREFIX_BLOCK_SIZE:
        raise ValueError(
            f"LLM.prefix_cache_tokens must be an int >= {PREFIX_BLOCK_SIZE} (one block); got {max_tokens!r}"
        )
    if enable and precompile is not None:
        raise ValueError(
            "LLM.enable_prefix_caching does not run with precompile (its prompts are padded to buckets)"
        )


@dataclass(eq=False)
class _Block:
    """One block: its K/V [2 * layers, kv_heads, block_size, head_dim], its hidden states [block_size,
    F] or None, the draft's K/V or None, the blocks that follow it (by their tokens), its parent and
    when it was last used."""

    kv: Tensor | None
    features: Tensor | None
    parent: _Block | None = None
    key: tuple[int, ...] = ()
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)
    used: int = 0
    draft_kv: Tensor | None = None


@dataclass
class PrefixMatch:
    """The blocks found for a prompt, in order, and how many tokens they hold."""

    blocks: list[_Block]
    num_tokens: int

    def kv(self, draft: bool = False) -> Tensor:
        """[2 * layers, kv_heads, num_tokens, head_dim]: the blocks' K/V one after the other (draft: the
        draft's, of a `match_draft`)."""
        return torch.cat([b.draft_kv if draft else b.kv for b in self.blocks], dim=2)

    def features(self) -> Tensor | None:
        """[num_tokens, F]: the blocks' hidden states, or None where a block has none."""
        parts = [b.features for b in self.blocks]
        return torch.cat(parts) if parts and all(p is not None for p in parts) else None


class PrefixCache:
    """K/V of prompt prefixes (module docstring). `queries` / `hits` count the prompt tokens looked
    up and those found (vLLM's prefix cache counters)."""

    def __init__(self, max_tokens: int, block_size: int = PREFIX_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        if max_tokens < block_size:
            raise ValueError(f"max_tokens must be >= block_size ({block_size}); got {max_tokens}")
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        self.root = _Block(None, None)
        self.num_blocks = 0
        self.queries = 0
        self.hits = 0
        self._clock = 0

    @property
    def num_tokens(self) -> int:
        """Tokens held (whole blocks)."""
        return self.num_blocks * self.block_size

    def match(self, tokens: list[int], with_features: bool = False) -> PrefixMatch:
        """The longest run of held blocks that `tokens` begins with, leaving at least its last token
        out (a prefill must feed one token to sample from); with_features: only blocks that hold
        hidden states. Marks them used; counts the tokens in `queries` and those found in `hits`."""
        found = self._touch(self._walk(tokens, with_features))
        self.queries += len(tokens)
        self.hits += len(found) * self.block_size
        return PrefixMatch(found, len(found) * self.block_size)

    def peek(self, tokens: list[int], with_features: bool = False) -> int:
        """How many of `tokens` `match` would find now, counting and marking nothing."""
        return len(self._walk(tokens, with_features)) * self.block_size

    def match_draft(self, tokens: list[int]) -> PrefixMatch:
        """As `match`, of the blocks that hold the draft's K/V (uncounted: the target's prefill counted
        the prompt)."""
        found = self._touch(self._walk(tokens, draft=True))
        return PrefixMatch(found, len(found) * self.block_size)

    def _touch(self, found: list[_Block]) -> list[_Block]:
        """Mark the blocks used now (the latest of them the last to be evicted)."""
        self._clock += 1
        for block in found:
            block.used = self._clock
        return found

    def _walk(self, tokens: list[int], with_features: bool = False, draft: bool = False) -> list[_Block]:
        size, node, found = self.block_size, self.root, []
        for start in range(0, len(tokens) - size, size):
            child = node.children.get(tuple(tokens[start : start + size]))
            if child is None or _lacks(child, with_features, draft):
                break
            found.append(child)
            node = child
        return found

    def load(self, match: PrefixMatch, cache: StaticKVCache, rows: list[int], draft: bool = False) -> None:
        """Write the matched K/V (draft: the draft's) into slots [0, match.num_tokens) of each of `rows`
        of an empty cache (its lengths are the caller's to advance)."""
        if not match.num_tokens:
            return
        kv = match.kv(draft).to(cache.keys[0].device)
        with torch.inference_mode():
            for buffer, part in zip((*cache.keys, *cache.values), kv):
                buffer[rows, :, : match.num_tokens] = part

    def load_rows(
        self, cache: StaticKVCache, matches: list[PrefixMatch | None], draft: bool = False
    ) -> list[int]:
        """Into the empty `cache`, each row's match (None: none; draft: the draft's K/V), and the row's
        length advanced past it. Returns each row's prefix length, where its prefill starts."""
        starts = [m.num_tokens if m is not None else 0 for m in matches]
        if any(starts):
            for row, match in enumerate(matches):
                if match is not None:
                    self.load(match, cache, [row], draft)
            cache.advance(to_device(starts, torch.long, cache.lengths.device), max(starts))
        return starts

    def store(
        self,
        tokens: list[int],
        cache: StaticKVCache,
        row: int,
        num_tokens: int,
        features: Tensor | None = None,
        features_start: int = 0,
    ) -> None:
        """Keep the K/V of the first `num_tokens` of `tokens` (their whole blocks) from `row` of
        `cache`, which holds them in its first slots; features: hidden states [n, F] of positions
        [features_start, features_start + n) or None, given to the blocks they cover whole. Blocks
        already held are only marked used (and given the features they lacked)."""
        size, node = self.block_size, self.root
        self._clock += 1

        def block_features(j: int) -> Tensor | None:
            low = j * size - features_start
            if features is None or low < 0 or low + size > features.shape[0]:
                return None
            return features[low : low + size].clone()

        full = first = num_tokens // size
        for j in range(full):
            child = node.children.get(tuple(tokens[j * size : (j + 1) * size]))
            if child is None:
                first = j
                break
            child.used = self._clock
            if child.features is None:
                child.features = block_features(j)
            node = child
        if first == full:
            return
        kv = torch.stack([b[row, :, first * size : full * size] for b in (*cache.keys, *cache.values)])
        for i, j in enumerate(range(first, full)):
            key = tuple(tokens[j * size : (j + 1) * size])
            block = _Block(
                kv[:, :, i * size : (i + 1) * size].clone(),
                block_features(j),
                node,
                key,
                used=self._clock,
            )
            node.children[key] = block
            node = block
            self.num_blocks += 1
        self._evict()

    def attach_draft(self, tokens: list[int], cache: StaticKVCache, row: int, num_tokens: int) -> None:
        """Give the blocks held for the first `num_tokens` of `tokens` (whole blocks, up to the first
        one not held) the draft's K/V of them, from `row` of the draft's `cache`, which holds them in
        its first slots. Makes no block: a block is the target's first."""
        size, node, blocks = self.block_size, self.root, []
        for j in range(num_tokens // size):
            node = node.children.get(tuple(tokens[j * size : (j + 1) * size]))
            if node is None:
                break
            blocks.append((j, node))
        lacking = [(j, b) for j, b in blocks if b.draft_kv is None]
        if not lacking:
            return
        first, last = lacking[0][0], lacking[-1][0] + 1
        kv = torch.stack([b[row, :, first * size : last * size] for b in (*cache.keys, *cache.values)])
        for j, block in lacking:
            block.draft_kv = kv[:, :, (j - first) * size : (j - first + 1) * size].clone()

    def _evict(self) -> None:
        """Drop the least recently used blocks that no block follows (a block whose last follower goes
        becomes one) until the blocks fit `max_blocks`, down to 7/8 of it, so that the next stores do
        not each walk the trie."""
        if self.num_blocks <= self.max_blocks:
            return
        goal = self.max_blocks * 7 // 8
        leaves = [(b.used, id(b), b) for b in self._blocks() if not b.children]
        heapq.heapify(leaves)
        while self.num_blocks > goal:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key]
            self.num_blocks -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def _blocks(self) -> list[_Block]:
        found, stack = [], list(self.root.children.values())
        while stack:
            block = stack.pop()
            found.append(block)
            stack.extend(block.children.values())
        return found

    def clear(self) -> None:
        """Forget every block (the counters stay)."""
        self.root, self.num_blocks = _Block(None, None), 0


def _lacks(block: _Block, features: bool, draft: bool) -> bool:
    """Whether the block lacks what a match asks for: hidden states (features), the draft's K/V."""
    return (features and block.features is None) or (draft and block.draft_kv is None)


def tokens_after(tokens: Tensor, starts: list[int], width: int) -> Tensor:
    """Each row's `width` tokens from its start (the tokens after its cached prefix), right-padded with
    what follows: tokens [rows, capacity] -> [rows, width]."""
    if not any(starts):
        return tokens[:, :width]
    start = to_device(starts, torch.long, tokens.device)
    after = (start[:, None] + torch.arange(width, device=tokens.device)).clamp(max=tokens.shape[1] - 1)
    return tokens.gather(1, after)
