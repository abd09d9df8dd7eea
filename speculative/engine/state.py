"""SampleState: a generation between two chunks, enough to stream it and to resume it (after EasyDeL's
SampleState).

Serialized form (to_dict / to_json): plain JSON. Token tensors are lists of ints per sequence
(`sequences` is ragged; `padded_length` is the width a padded [num_sequences, padded_length] tensor
would need). Generator states are base64 of `torch.Generator.get_state()` bytes. The KV caches are
not stored: resuming rebuilds them from `sequences` in one prefill per model (`model_kwargs` says so),
which keeps a state small (kilobytes) and valid across processes and devices.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.engine.outputs import SpeculationMetrics
from speculative.engine.sequence import Sequence
from speculative.fields import DictRoundTrip
from speculative.sampling_params import SamplingParams

KV_CACHE_NOTE = "not stored: rebuilt from `sequences` by one prefill per model when resumed"


@dataclass
class SampleState(DictRoundTrip):
    """The state of a generation after a chunk of steps.

    current_length: [num_sequences] prompt + output tokens of each sequence.
    sequences: per sequence, its prompt and output token ids.
    running_token: [num_sequences] the last token of each sequence (the next step's input).
    is_sequence_finished: [num_sequences].
    prng_key: {"default": the engine's generator state, "sequences": each sequence's own or None}.
    model_kwargs: what the caches need ({"kv_cache": how they are restored}).
    tokens_per_second / generated_tokens / padded_length / time_spent_computing: progress figures
        (time_spent_computing adds up over resumed runs).
    prompt_lengths, prompt_indices, sample_indices, sampling_params, finish_reasons, stop_reasons,
    text: the rest of each sequence's record; new_text: what each sequence's text gained since the
    previous state (the streaming view); metrics: its speculation figures so far.
    pad_token_id: what `padded()` pads with.
    """

    current_length: list[int]
    sequences: list[list[int]]
    running_token: list[int]
    is_sequence_finished: list[bool]
    prng_key: dict[str, Any]
    model_kwargs: dict[str, Any] = field(default_factory=lambda: {"kv_cache": KV_CACHE_NOTE})
    tokens_per_second: float = -math.inf
    generated_tokens: int = 0
    padded_length: int = 0
    time_spent_computing: float = 0.0
    prompt_lengths: list[int] = field(default_factory=list)
    prompt_indices: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    sampling_params: list[dict[str, Any]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    pad_token_id: int = 0

    def padded(self) -> torch.Tensor:
        """`sequences` as a [num_sequences, padded_length] int64 tensor, right-padded with pad_token_id."""
        out = torch.full((len(self.sequences), self.padded_length), self.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(self.sequences):
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    @property
    def finished(self) -> bool:
        """Every sequence has finished."""
        return all(self.is_sequence_finished)

    @classmethod
    def capture(
        cls,
        sequences: list[Sequence],
        default: torch.Generator,
        previous_text: list[str],
        elapsed_s: float,
        texts: list[str],
        pad_token_id: int = 0,
    ) -> SampleState:
        """The state of `sequences` (all sequences of the generation) now; texts: their texts now,
        previous_text: as of the previous state."""
        generated = sum(len(s.output_token_ids) for s in sequences)
        lengths = [len(s.prompt_token_ids) + len(s.output_token_ids) for s in sequences]
        return cls(
            current_length=lengths,
            sequences=[s.prompt_token_ids + s.output_token_ids for s in sequences],
            running_token=[(s.output_token_ids or s.prompt_token_ids)[-1] for s in sequences],
            is_sequence_finished=[s.finished for s in sequences],
            prng_key={"default": _pack(default), "sequences": [_pack(s.generator) for s in sequences]},
            tokens_per_second=generated / elapsed_s if elapsed_s > 0 else -math.inf,
            generated_tokens=generated,
            padded_length=max(lengths),
            time_spent_computing=elapsed_s,
            prompt_lengths=[len(s.prompt_token_ids) for s in sequences],
            prompt_indices=[s.prompt_index for s in sequences],
            sample_indices=[s.sample_index for s in sequences],
            sampling_params=[s.params.to_dict() for s in sequences],
            finish_reasons=[s.finish_reason for s in sequences],
            stop_reasons=[s.stop_reason for s in sequences],
            text=texts,
            new_text=[t[len(p) :] if t.startswith(p) else t for t, p in zip(texts, previous_text)],
            metrics=[dataclasses.asdict(s.metrics) for s in sequences],
            pad_token_id=pad_token_id,
        )

    def to_sequences(self, device: torch.device) -> list[Sequence]:
        """The sequences as engine records, generators restored, ready to resume."""
        out = []
        for i, length in enumerate(self.prompt_lengths):
            params = SamplingParams.from_dict(self.sampling_params[i])
            r = Sequence(
                self.sequences[i][:length],
                params,
                params.max_tokens,
                self.prompt_indices[i],
                self.sample_indices[i],
                unpack_generator(self.prng_key["sequences"][i], device),
            )
            r.output_token_ids = self.sequences[i][length:]
            r.finish_reason, r.stop_reason = self.finish_reasons[i], self.stop_reasons[i]
            r.metrics = SpeculationMetrics(**self.metrics[i])
            out.append(r)
        return out


def _pack(generator: torch.Generator | None) -> str | None:
    if generator is None:
        return None
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def unpack_generator(state: str | None, device: torch.device) -> torch.Generator | None:
    if state is None:
        return None
    generator = torch.Generator(device=device)
    raw = torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8)
    generator.set_state(raw)
    return generator
