"""What the public dataclasses (SamplingParams, the configs, SampleState) share: checks of their
fields that name the field and the allowed range, and the dict / JSON round trip."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(ok: bool, name: str, value: object, allowed: str, owner: str) -> None:
    """Raise ValueError("<owner>.<name> must be <allowed>; got <value>") unless ok."""
    if not ok:
        raise ValueError(f"{owner}.{name} must be {allowed}; got {value!r}")


class DictRoundTrip:
    """to_dict / from_dict / to_json / from_json / replace for a dataclass whose fields are JSON-able
    (a subclass converts the others in its own to_dict / from_dict, around these)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a new dict (deep copies: editing it leaves the object unchanged)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """The inverse of to_dict (validated as the constructor validates); unknown keys raise ValueError."""
        names = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(data) - set(names)):
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; the fields are {names}")
        return cls(**copy.deepcopy(dict(data)))

    def to_json(self, **kwargs: Any) -> str:
        """json.dumps(to_dict(), **kwargs)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str):
        """The inverse of to_json."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any):
        """A copy with the given fields changed, validated again."""
        return dataclasses.replace(self, **changes)
