"""Shapes to pre-compile or warm up for (after EasyDeL's vInferencePreCompileConfig), text only."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from speculative.fields import DictRoundTrip, check, is_int

_FIELDS = ("batch_size", "prefill_length", "required_props")
_check = functools.partial(check, owner="PreCompileConfig")


def _json_able(value: object) -> bool:
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        return False


@dataclass
class PreCompileConfig(DictRoundTrip):
    """One compilation scenario, or several when a field is a list.

    batch_size: sequences per batch: an integer >= 1 or a non-empty list of them.
    prefill_length: prompt length (the prefill bucket): None (no bucketing), an integer >= 1 or a
        non-empty list of them.
    required_props: opaque extra properties: None, a dict or a non-empty list of dicts; each must survive
        a JSON round trip unchanged (string keys, JSON values).

    Lists pair up by index: scenario i takes element i of every list, and a shorter list repeats its last
    element (batch_size=[1, 2], prefill_length=[64, 128, 256] -> (1, 64), (2, 128), (2, 256)).
    """

    batch_size: int | list[int] = 1
    prefill_length: int | list[int] | None = None
    required_props: dict | list[dict] | None = None

    def __post_init__(self) -> None:  # tuples are stored as lists
        for name in _FIELDS:
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        for name, none_ok in (("batch_size", False), ("prefill_length", True)):
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            ints = len(items) > 0 and all(is_int(v) and v >= 1 for v in items)
            allowed = ("None, " if none_ok else "") + "an integer >= 1 or a non-empty list of them"
            _check((none_ok and value is None) or ints, name, value, allowed)
        props = self.required_props
        items = props if isinstance(props, list) else [props]
        dicts = len(items) > 0 and all(isinstance(p, dict) and _json_able(p) for p in items)
        _check(
            props is None or dicts,
            "required_props",
            props,
            "None, a JSON-able dict or a non-empty list of them",
        )

    @property
    def is_standalone(self) -> bool:
        """True when no field is a list (the config is a single scenario)."""
        return not any(isinstance(getattr(self, name), list) for name in _FIELDS)

    def get_standalones(self) -> list[PreCompileConfig]:
        """One standalone config per scenario (see the class docstring); [self] when already standalone."""
        if self.is_standalone:
            return [self]
        lists = [getattr(self, n) for n in _FIELDS if isinstance(getattr(self, n), list)]
        count = max(len(values) for values in lists)

        def pick(value: Any, i: int) -> Any:
            return copy.deepcopy(value[min(i, len(value) - 1)] if isinstance(value, list) else value)

        return [type(self)(**{n: pick(getattr(self, n), i) for n in _FIELDS}) for i in range(count)]

    def get_default_hash(self) -> int:
        """A 63-bit hash of the fields, stable across processes and runs (SHA-256 of canonical JSON).

        Equal configs hash equal; fields hash as written, so batch_size=4 and [4] hash differently."""
        canonical = json.dumps(self.extract(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(f"PreCompileConfig:{canonical}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    @classmethod
    def create_optimized_compo(
        cls,
        batch_size: int | list[int] = 1,
        max_prefill_length: int = 2048,
        min_prefill_length: int = 64,
        required_props: dict | list[dict] | None = None,
    ) -> PreCompileConfig:
        """A config whose prefill buckets are the powers of two from min to max, both included.

        Both bounds are first rounded up to a power of two (min 50, max 300 -> [64, 128, 256, 512]), so
        every prompt of up to max_prefill_length tokens fits a bucket. batch_size and required_props are
        kept as given and pair with the buckets by index (see the class docstring).
        """
        _check(
            is_int(min_prefill_length) and min_prefill_length >= 1,
            "min_prefill_length",
            min_prefill_length,
            "an integer >= 1",
        )
        _check(
            is_int(max_prefill_length) and max_prefill_length >= min_prefill_length,
            "max_prefill_length",
            max_prefill_length,
            f"an integer >= min_prefill_length ({min_prefill_length})",
        )
        low, high = ((n - 1).bit_length() for n in (min_prefill_length, max_prefill_length))  # ceil(log2)
        lengths = [1 << e for e in range(low, high + 1)]
        return cls(batch_size=batch_size, prefill_length=lengths, required_props=required_props)

    def bucket(self, prefill_length: int) -> int:
        """The smallest prefill bucket (over all scenarios) >= prefill_length; prefill_length itself when
        this config has no prefill_length. ValueError when it is not an integer >= 1 or fits no bucket."""
        _check(
            is_int(prefill_length) and prefill_length >= 1,
            "bucket() prefill_length",
            prefill_length,
            "an integer >= 1",
        )
        if self.prefill_length is None:
            return prefill_length
        buckets = sorted({s.prefill_length for s in self.get_standalones()})
        if fits := [size for size in buckets if size >= prefill_length]:
            return fits[0]
        raise ValueError(
            f"prompt of {prefill_length} tokens fits no prefill bucket; the largest is {buckets[-1]}"
        )

    def extract(self) -> dict[str, Any]:
        """The fields as a new dict (deep copies: editing it leaves the config unchanged): to_dict()."""
        return self.to_dict()
