"""Linear layers laid out once, at load, for the matmul kernels that are fastest at inference.

A decode step multiplies a few rows by every weight matrix of the model, so on a CPU its cost is
streaming the weights from memory, and which kernel streams them fastest depends on the CPU, the
dtype, the shape and the number of rows (the per-shape timings that chose what follows:
docs/internals.md#measured-choices). On CPU, in float32 and bfloat16, a oneDNN prepacked copy serves
every call, except one-row calls in a compiled graph, which inductor compiles into a reduction over
W as stored, faster still (models/gemv.py), float32 calls of a few rows known statically
(STATIC_REDUCTION_MAX_ROWS: 2 or 3, and where oneDNN has AVX2 only up to STATIC_ROWS_MAX), and, where
it has AVX2 only, other float32 calls of up to few_rows.ROWS_MAX rows, which the project's own kernel
takes (models/few_rows.py). Elsewhere (CUDA, other dtypes, no oneDNN), F.linear on W.
Each layer's q/k/v projections are one PackedLinear, and so are its gate/up projections: one matmul
instead of three or two.

A PackedLinear can be quantized (`quantize("int8" | "int4" | "w8a8" | "w4a8")`, models/quantization.py):
it then holds the int8 (or 4-bit packed) weight and its scales instead of the float weight, which it
frees along with the nn.Linear weights. w8a8 and w4a8 calls, eager and compiled, are
models/int8_activations.py's kernels. Other eager calls: torch's int4 kernel; in bfloat16 torch's int8
kernel (up to INT8_KERNEL_MAX_ROWS rows); otherwise (float32, where torch's int8 kernel is a scalar loop) W
converted a chunk of rows at a time into a buffer that stays in cache, and multiplied
(_dequantized_mm). Compiled int8 calls of one row (and in float32 of up to REDUCTION_MAX_ROWS) are
`F.linear(x, q.float()) * scales`, which models/gemv.py rewrites into a reduction that loads the int8
weight and converts it in inductor's loop, with no float copy of it (where the vector ISA is AVX2,
float32 calls of up to STATIC_ROWS_MAX static rows, the weight read as int32 words: INT8_WORDS);
other compiled calls call the eager path as an opaque op (timings per dtype and row count:
docs/internals.md#measured-choices).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from speculative.models import few_rows
from speculative.models import int8_activations as activations
from speculative.models import quantization as quant

_PACKABLE = (torch.float32, torch.bfloat16)
_AVX2_ONLY = torch.backends.cpu.get_cpu_capability() == "AVX2"  # ATen's (and inductor's) vector ISA
# Where the vector ISA is AVX2, inductor's loop converting int8 weights to float loads them 8 bytes at
# a time through a buffer, 3.5x slower than the eager dequantization; there a compiled float32 int8
# call of up to STATIC_ROWS_MAX static rows (a batch-1 step or verification) reads the weight as int32
# words instead (models/gemv.py), and other calls take the eager path (docs/internals.md#measured-choices).
INT8_WORDS = _AVX2_ONLY
# dtypes whose compiled one-row int8 calls are inductor's reduction (the others call torch's kernel)
INT8_REDUCTION_DTYPES = (torch.float32,) if INT8_WORDS else (torch.float32, torch.bfloat16, torch.float16)
# Compiled float32 (and float16) int8 calls of 2 to this many rows are a reduction as well, which
# reads each int8 row once for all rows; in bfloat16 torch's kernel is faster (the crossing points:
# docs/internals.md#measured-choices).
REDUCTION_MAX_ROWS = 16
# Compiled calls of at most this many rows whose row count is static (a batch-1 verification or
# drafting: CompiledCausalLM gives each such query length a graph of its own) unroll over the rows:
# attention runs query by query (attention.FusedAttention), and float32 matmuls that are reductions
# (models/gemv.py) have one accumulator per row in one loop over W.
STATIC_ROWS_MAX = 6
# Compiled float32 calls of 2 to this many static rows are such a reduction; with more rows, oneDNN's
# few-row kernel streams a weight that does not fit in cache faster where it has AVX-512, but where it
# has AVX2 only it streams W slowly, so the reduction takes them all (docs/internals.md#measured-choices);
# bfloat16 (oneDNN's few-row calls) is unchanged. Calls whose row count is dynamic (batches) keep
# oneDNN: choosing by their rows would be a guard, which splits each kind of call into two graphs.
STATIC_REDUCTION_MAX_ROWS = STATIC_ROWS_MAX if _AVX2_ONLY else 3
# oneDNN makes a kernel for each shape it is called with and keeps it in a process-wide cache (up to
# 1,024 kernels, ONEDNN_PRIMITIVE_CACHE_CAPACITY; about 0.6 MB each for the demo pair's shapes). A
# server meets ever new numbers of rows: a step of B rows and q tokens each (B * q), a prefill of r
# prompts of width w (r * w). So its memory grew for thousands of requests, until the cache was full,
# and then churned as evicted kernels were made again. So a server has oneDNN see few row counts
# (round_onednn_rows): a call of more than ONEDNN_CHUNK_ROWS rows (a prefill) runs a chunk of that
# many at a time, and each call's rows are rounded up (onednn_rows, zero-padded): up to
# ONEDNN_EXACT_ROWS as they come, up to ONEDNN_COARSE_ROWS (decoding steps, which mostly stream the
# weights) one of 4 counts per doubling, beyond one of 8. That is 40 counts per shape of weight (a
# kernel serves every layer of that shape), whose kernels a server's engine thread makes as soon as
# it starts, while it has nothing else to do (Scheduler.start), so that its memory stays flat. The zero
# rows cost throughput (2-7%: docs/internals.md#measured-choices), so offline runs, which meet a
# bounded set of shapes, keep the exact rows.
ONEDNN_EXACT_ROWS = 8
ONEDNN_COARSE_ROWS = 128
ONEDNN_CHUNK_ROWS = 512
_row_rounding = False  # round_onednn_rows
_REGISTRY: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_handles = itertools.count()


def round_onednn_rows(enabled: bool = True) -> None:
    """From now on, in this process, make PackedLinear's oneDNN calls with few row counts (True: at most
    ONEDNN_CHUNK_ROWS rows a call, rounded up by onednn_rows and zero-padded) or with the rows given
    (False, the default). cpu_tuning.tune(serving=True) turns it on, for a server's engine (the
    comment above ONEDNN_EXACT_ROWS says why)."""
    global _row_rounding
    _row_rounding = enabled


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call of `rows` rows is made with: `rows` up to ONEDNN_EXACT_ROWS; up to
    ONEDNN_COARSE_ROWS rounded up to a multiple of 1/4 of the power of two below it (at most 25% more
    rows); beyond, of 1/8 of it (at most 12.5% more). 40 counts up to ONEDNN_CHUNK_ROWS."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - (3 if rows <= ONEDNN_COARSE_ROWS else 4))
    return -(-rows // step) * step


def onednn_row_counts() -> list[int]:
    """Every row count of a oneDNN call under round_onednn_rows, ascending."""
    return sorted({onednn_rows(rows) for rows in range(1, ONEDNN_CHUNK_ROWS + 1)})


def _should_prepack(weight: Tensor) -> bool:  # weight [out, in]
    if (
        weight.device.type != "cpu"
        or weight.dtype not in _PACKABLE
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    return weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def hold(owner: nn.Module, name: str, value: object) -> None:
    """`owner.name = value` as a plain attribute, even for an nn.Module value: not a registered
    submodule, so that state_dict(), .to() and named_modules() do not see it (the fused layers of a
    forward, which hold the model's own modules and parameters under other names)."""
    object.__setattr__(owner, name, value)


class PackedLinear(nn.Module):
    """y = x @ W.T + bias (+ residual), W [out, in] the concatenation of several nn.Linear weights.

    Several nn.Linears are concatenated once and their weights (and biases) become views into the
    result: the modules, their parameters and their state_dict stay as they were, with no second copy
    in the old layout, and an in-place change of a parameter changes this layer too. A single
    nn.Linear (a tied lm_head's weight is also the embedding) is used as it is.
    On CPU, in float32 and bfloat16 (where oneDNN computes it), a oneDNN prepacked copy of W serves
    the calls that are not compiled one-row calls (nor, where `few_rows`, float32 calls of up to
    few_rows.ROWS_MAX rows): `stale()` tells when the weights changed since, and `pack()` makes it again.

    Quantized (`quantize`), it holds `qweight` (int8 [out, in], or 4-bit packed uint8 [out, in / 2]) and
    `scales` ([out]; float32 for w8a8) or `scales_and_zeros` ([in / group, out, 2]) in the float weight's
    dtype, or w4a8's `scales_and_mins` ([out, 2, in / 32] float16); `weight`
    and `prepacked` are None, and each nn.Linear's `weight` parameter is None (its bias stays): the
    float weights are freed unless something else holds them. `stale()` is then always False (nothing
    follows the parameters any more) and `pack()` raises.

    It is an nn.Module that registers nothing (its tensors are plain attributes, its nn.Linears a
    list), so that a compiled forward's guards over it are skipped while its attributes stay as they
    were (dynamo's recursive dict tags, which take nn.Modules only: models/compiled.py); models hold
    it with `hold`, outside their state_dict and their registered submodules.
    """

    quantization: str | None = None  # None, "int8", "int4", "w8a8" or "w4a8" (any of an unfit shape: "int8")
    group_size: int | None = None  # int4: the group size along in_features

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.linears = list(linears)
        self.pack()

    def pack(self) -> None:
        """(Re)build the layouts from the current weights of the nn.Linears."""
        if self.quantization is not None:
            raise RuntimeError(
                "this PackedLinear is quantized: its float weights were freed, there is nothing "
                "to lay out again"
            )
        linears = self.linears
        if len(linears) == 1:
            self.weight = linears[0].weight.detach()  # shares the parameter's storage and version counter
            self.bias = linears[0].bias.detach() if linears[0].bias is not None else None
        else:
            self.weight = torch.cat([linear.weight.detach() for linear in linears])  # [out, in]
            self.bias = None
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat(
                    [
                        linear.bias.detach()
                        if linear.bias is not None
                        else self.weight.new_zeros(linear.out_features)
                        for linear in linears
                    ]
                )
            offset = 0
            for linear in linears:  # the parameters become views into the fused weight
                end = offset + linear.out_features
                grad = linear.weight.requires_grad
                linear.weight = nn.Parameter(self.weight[offset:end], requires_grad=grad)
                if linear.bias is not None:
                    linear.bias = nn.Parameter(self.bias[offset:end], requires_grad=grad)
                offset = end
        self.prepacked = (
            torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous())
            if _should_prepack(self.weight)
            else None
        )
        self.out_features = self.weight.shape[0]
        self.few_rows = few_rows.usable(self.weight)  # float32 calls of at most few_rows.ROWS_MAX rows
        # the tensors whose in-place changes make the prepacked copy stale (inference tensors have none)
        self.versioned = tuple(t for t in (self.weight, self.bias) if t is not None and not t.is_inference())
        self._packed_version = self._weights_version()
        self.handle = next(_handles)
        _REGISTRY[self.handle] = self

    def quantize(self, quantization: str) -> None:
        """Replace the float weight by its int8 (per output channel) or int4 (group-wise) quantization
        (models/quantization.py) and free the float weights: this layer's, its prepacked copy, and the
        nn.Linears' `weight` parameters (set to None; a tied lm_head's embedding stays the
        embedding's). int4 of a shape torch's int4 kernel does not take (out % 16, in % 32) is int8, and
        so are w8a8 and w4a8 (int8 or Q4_1 weights, activations quantized on the fly:
        models/int8_activations.py) of in % 32. CPU only."""
        quant.check_quantization(quantization)
        if self.quantization is not None:
            raise RuntimeError(f"this PackedLinear is already quantized ({self.quantization})")
        if self.weight.device.type != "cpu":
            raise ValueError(f"quantization runs on CPU only; this weight is on {self.weight.device}")
        out_features, in_features = self.weight.shape
        group_size = quant.int4_group_size(out_features, in_features) if quantization == "int4" else None
        if quantization in ("w8a8", "w4a8") and in_features % activations.BLOCK == 0:
            activations.load(quantization)
            if quantization == "w8a8":
                self.qweight, scales = quant.quantize_int8(self.weight)
                self.scales = scales.float()
            else:
                self.qweight, self.scales_and_mins = quant.quantize_q4_1(self.weight)
            self.quantization = quantization
        elif group_size is not None:
            packed, scales, zeros = quant.quantize_int4(self.weight, group_size)
            self.qweight, self.scales_and_zeros = quant.pack_int4(packed, scales, zeros)
            self.group_size, self.quantization = group_size, "int4"
        else:
            self.qweight, self.scales = quant.quantize_int8(self.weight)
            self.quantization = "int8"
        # bfloat16 / float16: torch's vectorized int8 kernel reads 16 (AVX-512) columns at a time
        self._int8_kernel = self.quantization == "int8" and in_features % 16 == 0
        self.weight = self.prepacked = None
        self.few_rows = False
        self.versioned = ()
        for linear in self.linears:
            linear.register_parameter("weight", None)

    def tensors(self) -> list[Tensor]:
        """The tensors this layer holds (weights, biases, prepacked copy, quantized weight and scales)."""
        names = ("weight", "bias", "prepacked", "qweight", "scales", "scales_and_zeros", "scales_and_mins")
        return [t for t in (getattr(self, name, None) for name in names) if t is not None]

    def _weights_version(self) -> int:
        return sum(t._version for t in self.versioned)

    def stale(self) -> bool:
        """Whether a weight changed in place since `pack()`: the prepacked copy, if any, is out of date
        (the weight itself is the parameters' own storage and follows the change). Always False once
        quantized."""
        return self.quantization is None and self._packed_version != self._weights_version()

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # x [rows, in] -> [rows, out]
        """x @ W.T + bias, plus `residual` ([rows, out]) when given. With gradients enabled and x or the
        weights requiring them (training an EAGLE head, EagleHead.score), through the nn.Linear
        parameters themselves, so that the gradients reach them and x."""
        if (
            self.quantization is None
            and torch.is_grad_enabled()
            and (x.requires_grad or self.linears[0].weight.requires_grad)
        ):
            return self._differentiable(x, residual)
        if self.quantization == "w8a8":  # eager and compiled: the kernels' ops
            return activations.w8a8_linear(x, self.qweight, self.scales, self.bias, residual)
        if self.quantization == "w4a8":
            return activations.w4a8_linear(x, self.qweight, self.scales_and_mins, self.bias, residual)
        if self.quantization is not None:
            # dynamo's tracing, not is_compiling(): that flag is process-wide, set in every thread while
            # one compiles (an eager call beside a background compile would take the compiled branch)
            if torch.compiler.is_dynamo_compiling():
                if (
                    self.quantization == "int8"
                    and x.dtype in INT8_REDUCTION_DTYPES
                    and (
                        statically_known_true(x.shape[0] <= (STATIC_ROWS_MAX if INT8_WORDS else 1))
                        or (not INT8_WORDS and x.dtype != torch.bfloat16 and x.shape[0] <= REDUCTION_MAX_ROWS)
                    )
                ):  # a guard
                    # left to inductor: a reduction over the int8 weight, converted in the loop (gemv.py)
                    y = F.linear(x.float(), self.qweight.float()) * self.scales.float()
                    return _linear_epilogue(y, self.bias, residual).to(x.dtype)
                return torch.ops.speculative.prepacked_linear(x, residual, self.handle)
            return self._quantized(x, residual)
        if (
            not torch.compiler.is_dynamo_compiling()  # first: no guard on the rows in a compiled graph
            and self.few_rows
            and x.shape[0] <= few_rows.ROWS_MAX
            and x.dtype == torch.float32
        ):
            return few_rows.linear(x, self.weight, self.bias, residual)
        if self.prepacked is not None:
            if torch.compiler.is_dynamo_compiling():
                rows = x.shape[0]
                if statically_known_true(rows == 1) or (  # left to inductor: a reduction (gemv.py)
                    x.dtype == torch.float32 and statically_known_true(rows <= STATIC_REDUCTION_MAX_ROWS)
                ):
                    return _linear(x, self.weight, self.bias, residual)
                # an opaque op to the compiler, which calls it as it is
                return torch.ops.speculative.prepacked_linear(x, residual, self.handle)
            if not _row_rounding:
                return self._onednn(x, residual)
            step = ONEDNN_CHUNK_ROWS
            parts = [
                self._onednn_rounded(x[i : i + step], None if residual is None else residual[i : i + step])
                for i in range(0, x.shape[0], step)
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return _linear(x, self.weight, self.bias, residual)

    def _onednn_rounded(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """_onednn on x's rows zero-padded to onednn_rows(rows), the padding cut from the result."""
        rows = x.shape[0]
        padding = onednn_rows(rows) - rows
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
            residual = None if residual is None else F.pad(residual, (0, 0, 0, padding))
            return self._onednn(x, residual)[:rows]
        return self._onednn(x, residual)

    def _onednn(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The prepacked oneDNN kernel on x [rows, in] (+ residual [rows, out])."""
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.prepacked, self.bias, "add")

    def _differentiable(self, x: Tensor, residual: Tensor | None) -> Tensor:
        linears = self.linears
        weight = torch.cat([linear.weight for linear in linears]) if len(linears) > 1 else linears[0].weight
        bias = None
        if any(linear.bias is not None for linear in linears):
            bias = torch.cat(
                [x.new_zeros(lin.out_features) if lin.bias is None else lin.bias for lin in linears]
            )
        return _linear_epilogue(F.linear(x, weight), bias, residual)

    def _quantized(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The eager quantized matmul: torch's int4 kernel; torch's int8 kernel in bfloat16 up to
        INT8_KERNEL_MAX_ROWS rows; otherwise (and always in float32 and float16, where torch's int8
        kernel is a scalar loop) W dequantized chunk by chunk into a buffer that stays in cache, and
        multiplied (_dequantized_mm)."""
        if self.quantization == "int4":
            y = torch._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        elif x.dtype == torch.bfloat16 and self._int8_kernel and x.shape[0] <= INT8_KERNEL_MAX_ROWS:
            y = torch._weight_int8pack_mm(_aligned(x), self.qweight, self.scales)
        else:
            y = _dequantized_mm(x, self.qweight, self.scales)
        if self.bias is not None:  # y is a new tensor: in place
            y.add_(self.bias)
        return y if residual is None else y.add_(residual)


# Elements of the buffer a quantized weight is dequantized into, a chunk of rows at a time: 4 MiB in
# float32, which stays in cache between the conversion and the matmul (docs/internals.md#measured-choices).
DEQUANTIZE_CHUNK = 1 << 20
# bfloat16 calls of more rows than this dequantize too: torch's int8 kernel does not block for many rows
# (docs/internals.md#measured-choices).
INT8_KERNEL_MAX_ROWS = 16
_scratch = threading.local()


def _dequantized_mm(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """x [rows, in] @ (q [out, in] int8 * scales [out, 1]).T -> [rows, out] in x's dtype: q converted
    to x's dtype a chunk of rows at a time into a per-thread buffer of DEQUANTIZE_CHUNK elements (no
    float copy of the whole weight), each chunk multiplied, the scales applied to the product."""
    out_features, in_features = q.shape
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key, size = (x.dtype, x.device), max(DEQUANTIZE_CHUNK, in_features)  # at least one row
    if key not in buffers or buffers[key].numel() < size:
        with torch.inference_mode(False):  # a normal tensor: written in inference mode and out of it
            buffers[key] = torch.empty(size, dtype=x.dtype, device=x.device)
    buffer = buffers[key]
    step = size // in_features
    if step >= out_features:
        w = buffer[: q.numel()].view(out_features, in_features).copy_(q)
        return F.linear(x, w).mul_(scales)
    product = x.new_empty(out_features, x.shape[0])  # [out, rows]: chunks of rows are contiguous slices
    x_t = x.t()
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        w = buffer[: (end - start) * in_features].view(end - start, in_features).copy_(q[start:end])
        torch.mm(w, x_t, out=product[start:end])
    return torch.mul(product.t(), scales, out=x.new_empty(x.shape[0], out_features))


def _aligned(x: Tensor) -> Tensor:
    """x contiguous at a 64-byte aligned address (torch's vectorized int8 kernel loads it aligned)."""
    if x.is_contiguous() and x.data_ptr() % 64 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)  # the CPU allocator aligns to 64 bytes


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    y = F.linear(x, weight, bias)
    return y if residual is None else y.add_(residual)


def _linear_epilogue(y: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


# The prepacked (or quantized) kernel of PackedLinear number `handle` as one op, for compiled graphs
# (inductor cannot take an opaque oneDNN weight that is not one of its own frozen constants, nor call
# torch's weight-only kernels the way PackedLinear._quantized does). Defined with
# torch.library.Library rather than custom_op, whose wrappers cost more than the kernel's own call
# (a forward makes ~50 such calls; docs/internals.md#measured-choices).
_LIBRARY = torch.library.Library("speculative", "DEF")
_LIBRARY.define("prepacked_linear(Tensor x, Tensor? residual, int handle) -> Tensor")
_LIBRARY.impl("prepacked_linear", lambda x, residual, handle: _REGISTRY[handle](x, residual), "CPU")


@torch.library.register_fake("speculative::prepacked_linear")
def _(x: Tensor, residual: Tensor | None, handle: int) -> Tensor:
    return x.new_empty(x.shape[0], _REGISTRY[handle].out_features)
