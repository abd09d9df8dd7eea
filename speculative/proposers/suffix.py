"""Suffix decoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", 2024; vLLM's `method="suffix"`, SGLang's SUFFIX): drafts from suffix tries, no model.

Two tries per row are consulted: the row's own (its prompt and output so far, extended as tokens
are committed) and a global one over the responses of finished requests (at most
`max_cached_requests`, the oldest evicted first; 0 disables it). In each, the longest suffix of the
context that occurs earlier followed by something is found, and the continuations of its
occurrences are weighed by how often each followed: a continuation token's probability is its count
over its parent's, multiplied down the path. A chain follows the most frequent token while the path's
probability stays >= `min_token_prob`; a tree (`tree_nodes`) takes the `tree_nodes` most probable
nodes above that bound, best first. Either is at most min(k, `max_spec_factor` * m, `max_depth` - m)
deep for a match of m tokens (a trie holds a match and its continuation within max_depth tokens), so
the match is shortened where that allows a deeper proposal. The trie whose proposal has the larger
sum of probabilities (the expected number of accepted tokens) wins. With no match nothing is
proposed, and the step is a plain one. The proposer is deterministic: one-hot draft distributions,
exact as every drafter.

The trie (`SuffixTrie`) holds every substring of at most `max_depth` tokens of its sequences with its
number of occurrences. A substring that occurs once is not spelled out: its node is a leaf pointing at
the occurrence (sequence, start), whose later tokens are read from the sequence, so a text of n
tokens costs about n times the depth at which its substrings become unique nodes, not n * max_depth.
Appending a token touches only the occurrences still on explicit (repeated) paths. A step's proposal
is its new tokens appended, then the match (a binary search over the suffix length of walks of at
most max_depth - 1 dict look-ups), then the chain or tree (costs: docs/internals.md#measured-choices).

Rows: `add_rows` builds each new row's trie over its context; `propose` first appends what each row
committed since; `on_finish` adds a finished row's response (its tokens after the prompt, or after the
context it was resumed with) to the global cache; `select_rows` drops the rows' tries
that leave. Proposals are built on the host (the tokens' read is the step's one extra sync on an
accelerator, as the n-gram trie's); a chain is as wide as its longest row's, a tree too when the
batch is greedy, else `tree_nodes` wide (so a seeded row's draws do not depend on its neighbours).
Trees shrink with a greedy batch as the other proposers' do (tree.py's `batch_tree`, their breadth
bounded by their nodes alone): B rows take at most `tree_nodes // B` nodes a row, and chains where
that leaves no more than the chain holds.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import torch
from torch import Tensor

from speculative.proposers.base import Proposal
from speculative.sampling import SampleStrategy
from speculative.tree import batch_tree


class _Node:
    """A trie node: the substring of its path, `count` occurrences. A leaf (count 1, children None)
    points at its one occurrence: sequence `seq`, starting at `start`; an inner node lists its
    continuations in `children` (token -> node), `total` being the sum of their counts."""

    __slots__ = ("children", "count", "depth", "seq", "start", "total")

    def __init__(self, depth: int, seq: int = -1, start: int = -1) -> None:
        self.depth, self.seq, self.start = depth, seq, start
        self.count, self.total = 1, 0
        self.children: dict[int, _Node] | None = None if seq >= 0 else {}


class SuffixTrie:
    """The substrings of at most `max_depth` tokens of several token sequences, with their counts
    (module docstring). Sequences grow by `extend` and leave whole by `remove`."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.texts: dict[int, list[int]] = {}
        self._open: dict[int, list[tuple[int, _Node]]] = {}  # seq -> (start, node) on explicit paths

    def extend(self, seq: int, tokens: list[int]) -> None:
        """Append `tokens` to sequence `seq` (a new one if unknown), counting every new substring."""
        text = self.texts.setdefault(seq, [])
        open_ = self._open.setdefault(seq, [])
        depth_limit = self.max_depth
        for token in tokens:
            n = len(text)
            text.append(token)
            open_.append((n, self.root))
            still = []
            for start, node in open_:
                depth = n - start + 1  # the child's depth: text[start : n + 1]
                node.total += 1
                child = node.children.get(token)
                if child is None:
                    node.children[token] = _Node(depth, seq, start)
                    continue  # a leaf: later tokens of this occurrence are read from the text
                if child.children is None:  # a leaf meets its second occurrence: spell it out
                    self._split(child)
                child.count += 1
                if depth < depth_limit:
                    still.append((start, child))
            open_[:] = still

    def _split(self, leaf: _Node) -> None:
        """Make a leaf an inner node whose one child is the leaf's occurrence one token deeper."""
        text = self.texts[leaf.seq]
        leaf.children = {}
        at = leaf.start + leaf.depth
        if leaf.depth < self.max_depth and at < len(text):
            leaf.children[text[at]] = _Node(leaf.depth + 1, leaf.seq, leaf.start)
            leaf.total = 1
        leaf.seq = leaf.start = -1

    def remove(self, seq: int) -> None:
        """Forget sequence `seq`: uncount its substrings, dropping the nodes no other one holds."""
        text = self.texts.pop(seq)
        self._open.pop(seq, None)
        for start in range(len(text)):
            node = self.root
            for token in text[start : start + self.max_depth]:
                child = node.children[token]
                node.total -= 1
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def match(self, pattern: list[int]) -> tuple[_Node, int] | None:
        """Where `pattern` (at most max_depth - 1 tokens) ends in the trie: (node, tokens past the
        node into its leaf occurrence), or None if it does not occur with a continuation."""
        node, i = self.root, 0
        while i < len(pattern):
            if node.children is None:  # a leaf: compare with its occurrence's text
                text, at = self.texts[node.seq], node.start + node.depth
                rest = len(pattern) - i
                if text[at : at + rest] != pattern[i:]:
                    return None
                return (node, rest) if self._leaf_next(node, rest) is not None else None
            node = node.children.get(pattern[i])
            if node is None:
                return None
            i += 1
        if node.children is None:
            return (node, 0) if self._leaf_next(node, 0) is not None else None
        return (node, 0) if node.total else None

    def _leaf_next(self, leaf: _Node, past: int) -> int | None:
        """The token after a leaf's occurrence `past` tokens below the leaf, None past its end."""
        depth, at = leaf.depth + past, leaf.start + leaf.depth + past
        text = self.texts[leaf.seq]
        return text[at] if depth < self.max_depth and at < len(text) else None

    def continuations(self, where: tuple[_Node, int]) -> list[tuple[int, float, tuple[_Node, int]]]:
        """The tokens that followed a position, each with its share of the position's occurrences and
        its own position: [(token, probability, position)], most frequent first."""
        node, past = where
        if node.children is None:
            token = self._leaf_next(node, past)
            return [] if token is None else [(token, 1.0, (node, past + 1))]
        total = node.total
        found = [(t, c.count / total, (c, 0)) for t, c in node.children.items()]
        found.sort(key=lambda x: -x[1])
        return found

    def longest_match(self, context: list[int]) -> tuple[int, tuple[_Node, int] | None]:
        """The longest suffix of `context` of at most max_depth - 1 tokens that occurs with a
        continuation: (its length, its position), (0, None) if none. Binary search: a suffix that
        occurs so implies every shorter one does."""
        low, high, best = 1, min(len(context), self.max_depth - 1), None
        while low <= high:
            m = (low + high) // 2
            where = self.match(context[len(context) - m :])
            if where is None:
                high = m - 1
            else:
                low, best = m + 1, (m, where)
        return best if best is not None else (0, None)


class SuffixCache:
    """The global trie over the responses of finished requests, at most `max_requests` of them (the
    oldest evicted first); max_requests = 0 keeps none."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.max_requests = max_requests
        self._order: OrderedDict[int, None] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._order)

    def add(self, response: list[int]) -> None:
        """Cache a response, evicting the oldest beyond the bound."""
        if self.max_requests == 0 or not response:
            return
        self.trie.extend(self._next_id, response)
        self._order[self._next_id] = None
        self._next_id += 1
        while len(self._order) > self.max_requests:
            self.trie.remove(self._order.popitem(last=False)[0])


class _Row:
    """One row's own trie (its context, sequence 0) and where its response starts."""

    __slots__ = ("response_start", "trie")

    def __init__(self, context: list[int], max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.trie.extend(0, context)
        self.response_start = len(context) - 1  # the prompt's length

    @property
    def context(self) -> list[int]:
        return self.trie.texts[0]


class SuffixProposer:
    """Suffix-decoding proposer (module docstring): a chain, or (tree_nodes given) a tree of at most
    tree_nodes drafts, per row. The options are SuffixConfig's (speculative/methods/suffix.py), which
    says their ranges: max_depth (the tries' depth), max_cached_requests (the global cache's size),
    max_spec_factor, min_token_prob."""

    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
        tree_nodes: int | None = None,
    ) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree_nodes = tree_nodes
        self.cache = SuffixCache(max_depth, max_cached_requests)
        self.rows: list[_Row] = []

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        host = tokens.tolist()
        self.rows += [_Row(row[:n], self.max_depth) for row, n in zip(host, lengths.tolist())]

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        ends = lengths.tolist()
        start = min(len(row.context) for row in self.rows)
        new = tokens[:, start : max(ends)].tolist()  # what the rows committed since (one read)
        for row, end, host in zip(self.rows, ends, new):
            seen = len(row.context)
            row.trie.extend(0, host[seen - start : end - start])
        nodes = self.tree_nodes  # a tree's, or None: a chain
        if nodes is not None:
            breadth, nodes = batch_tree(nodes, nodes, strategy.tree_rows, num_tokens)
            if breadth == 1:  # the greedy batch's trees shrank to chains
                num_tokens, nodes = min(num_tokens, nodes), None
        drafts = [self._draft(row, num_tokens, nodes) for row in self.rows]  # [(tokens, parents)]
        longest = max(len(t) for t, _ in drafts)
        width = nodes if nodes is not None and not strategy.all_greedy else longest
        token_ids = torch.tensor([t + [-1] * (width - len(t)) for t, _ in drafts], dtype=torch.long)
        token_ids = token_ids.view(len(drafts), width).to(tokens.device)
        if nodes is None or width == 0:
            return Proposal(token_ids, None)
        parents = torch.tensor([[-1, *p] + [-1] * (width - len(p)) for _, p in drafts], dtype=torch.long)
        return Proposal(token_ids, None, parents.to(tokens.device))

    def _draft(self, row: _Row, num_tokens: int, nodes: int | None) -> tuple[list[int], list[int]]:
        """One row's proposal, a chain (nodes None) or a tree of at most `nodes`, as (tokens, parents)
        with nodes numbered from 1 (0: the root), from whichever trie's proposal has the larger sum of
        probabilities (the row's own on a tie)."""
        best, best_score = ([], []), 0.0
        context = row.context
        for trie in (row.trie, self.cache.trie):
            longest, where = trie.longest_match(context)
            m, depth = self._match_length(longest, num_tokens)
            if depth < 1:
                continue
            if m < longest:
                where = trie.match(context[len(context) - m :])
            if nodes is None:
                draft, score = self._chain(trie, where, depth)
            else:
                draft, score = self._tree(trie, where, depth, nodes)
            if score > best_score:
                best, best_score = draft, score
        return best

    def _match_length(self, longest: int, num_tokens: int) -> tuple[int, int]:
        """The match length m <= longest (0: no match) whose proposal may be deepest, the longest of
        those, and that depth: min(num_tokens, max_spec_factor * m, max_depth - m), since the trie
        holds a match and its continuation within max_depth tokens."""
        best = (0, 0)
        for m in range(1, longest + 1):
            depth = min(num_tokens, int(self.max_spec_factor * m), self.max_depth - m)
            if depth >= best[1]:
                best = (m, depth)
        return best

    def _chain(self, trie: SuffixTrie, where: tuple[_Node, int], depth: int) -> tuple[tuple, float]:
        """The most frequent path of at most `depth` tokens from `where` whose probability stays >=
        min_token_prob: ((tokens, parents), sum of the path's probabilities)."""
        tokens, probability, score = [], 1.0, 0.0
        while len(tokens) < depth:
            found = trie.continuations(where)
            if not found:
                break
            token, share, where = found[0]
            probability *= share
            if probability < self.min_token_prob:
                break
            tokens.append(token)
            score += probability
        return (tokens, list(range(len(tokens)))), score

    def _tree(
        self, trie: SuffixTrie, where: tuple[_Node, int], depth: int, nodes: int
    ) -> tuple[tuple, float]:
        """The `nodes` most probable nodes of probability >= min_token_prob and depth <= `depth`
        below `where`, best first (a node is never more probable than its parent, so every parent
        comes before its children): ((tokens, parents), sum of their probabilities)."""
        tokens, parents, score = [], [], 0.0
        heap = [(-1.0, 0, 0, 0, -1, where)]  # (-probability, order, parent node, depth, token, position)
        pushed = 1
        while heap and len(tokens) < nodes:
            negative, _, parent, level, token, position = heapq.heappop(heap)
            if level:
                tokens.append(token)
                parents.append(parent)
                score -= negative
            if level == depth:
                continue
            for child, share, below in trie.continuations(position):
                probability = -negative * share
                if probability < self.min_token_prob:
                    break  # most frequent first: the rest are rarer
                heapq.heappush(heap, (-probability, pushed, len(tokens), level + 1, child, below))
                pushed += 1
        return (tokens, parents), score

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        pass  # `propose` reads what was committed from the tokens

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        for r, n in zip(rows.tolist(), lengths[rows].tolist()):
            start = self.rows[r].response_start
            self.cache.add(tokens[r, start:n].tolist())

    def select_rows(self, rows: Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]

    def clear_cache(self) -> None:
        """Forget every cached response (a benchmark's new pass over prompts it has answered)."""
        self.cache = SuffixCache(self.max_depth, self.cache.max_requests)
