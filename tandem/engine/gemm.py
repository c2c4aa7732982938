"""The CPU kernels a model's Linear layers run on: each row of a call gets the same result whatever
the other rows are, at every precision (batch invariance).

A token's logits must not depend on which other rows share its forward pass (its own proposal,
other sessions' tokens): otherwise speculation, batching and load change the output. So:

- float32 and bfloat16 (`pack_linears`): Tandem's own kernel (tandem.engine.rowgemm), invariant
  by construction. Where it is not built or the CPU cannot run it, and for bfloat16 on CPUs with
  AMX tiles (`own_kernel`), oneDNN on the weight packed once at load time, which computes every
  row alike from two rows on (one row alone sums in another order, so a one-row call is padded to
  two), and is faster than torch's stock kernel; on AMX tiles far faster for several rows.
- int8 (`quantize_linears`): int8 weights with a scale per output channel, and each row of
  activations quantized to int8 with a scale of its own (per token, as torchao's dynamic-activation
  int8 recipe does), multiplied in integers on Tandem's kernel (AMX-INT8 tiles, AVX512-VNNI or AVX2), else by
  oneDNN on the weight packed once (`onednn.qlinear_pointwise`, input scale 1). Integer sums are
  exact in any order and the scales are per row, so no other row can change a row's result, and
  both kernels give the same numbers, in the weights' bits (`int8_weight_bits`). `torch._int_mm`
  and weight-only `_weight_int8pack_mm` are invariant too, and slower (docs/benchmarks.md).
- int8 where invariance is not needed (a draft, whose numbers change only speed) and Tandem's int8
  kernel does not run: torch.ao's dynamic quantization, which scales a call's inputs over all its rows.

Sibling layers that read the same input (an attention layer's q, k and v; an MLP's gate and up)
are fused into one (`fuse_linears`) before any of this: one kernel call and one quantization of the
input instead of three or two, about a tenth of a step at int8 here. Each output column is still
the same dot product, and int8 weights are scaled per output row, so at int8 the fused layer's
numbers are the separate layers' bit for bit.

tests/test_invariance.py proves both on the rows of real models. oneDNN sums in another order than
torch's stock kernel, so packed logits differ from unpacked ones in the last bits.

Longer than 300 lines because each rule of which kernel computes a layer, and why its rows come out
alike, is kept beside the layers that follow it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import warnings

import torch

from tandem.engine import rowgemm

log = logging.getLogger(__name__)


def available() -> bool:
    return torch.backends.mkldnn.is_available()


PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The most rows oneDNN is given in one call by a batch-invariant layer, by dtype: with AMX tiles,
# bfloat16 calls of more than 32 rows take other kernels, each summing in its own order.
ROWS_PER_CALL = {torch.bfloat16: 32}


@functools.cache
def bfloat16_kernels() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (they need AVX-512 or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def own_kernel(dtype: torch.dtype) -> bool:
    """Whether float32 or bfloat16 layers run on Tandem's kernel here: where it is available, but
    not bfloat16 on CPUs with AMX tiles, where oneDNN's bfloat16 kernels run on the tiles and are
    the faster (docs/benchmarks.md, "Tandem's own CPU kernel")."""
    return rowgemm.available() and not (dtype == torch.bfloat16 and amx_tiles())


def amx_tiles() -> bool:
    return torch.cpu._is_amx_tile_supported()


@functools.cache
def u8s8_pairs_saturate() -> bool:
    """Whether oneDNN's u8 x s8 kernel adds pairs of products in 16 bits with saturation (x86 CPUs
    without VNNI), so that 8-bit inputs against large weights come out wrong."""
    packed = torch.ops.onednn.qlinear_prepack(torch.full((16, 64), 127, dtype=torch.int8), None)
    x = torch.full((2, 64), 255, dtype=torch.uint8)
    out = torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, packed, torch.ones(16), torch.zeros(16, dtype=torch.long),
                                             None, 1.0, 0, torch.float32, "none", [], "")
    return int(out[0, 0]) != 127 * 127 * 64


def int8_weight_bits() -> int:
    """The bits an int8 layer's weights take here: 8, or 7 where oneDNN's kernel runs them and adds
    pairs of products saturating (so a pair fits; narrowing the inputs instead costs more)."""
    return 7 if not rowgemm.int8() and u8s8_pairs_saturate() else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features], with at least two rows (a lone row repeated)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat.repeat(2, 1) if flat.shape[0] == 1 else flat


def _unrows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, shared: bool = False, invariant: bool = True) -> None:
        """shared: the weight is also another module's (a tied output layer); keep referring to it.
        invariant: each row computed as if alone, at any number of rows (ROWS_PER_CALL).
        A layer sums in float32 and rounds the result to its dtype. On oneDNN's kernels without
        bfloat16 ones (bfloat16_kernels), a bfloat16 layer runs on float32's, widened exactly."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight = linear.weight if shared else None
        self.dtype = linear.weight.dtype
        self.own_kernel = own_kernel(self.dtype)
        in_pairs = self.own_kernel and self.dtype == torch.bfloat16 and rowgemm.pairs()
        widened = not in_pairs if self.own_kernel else self.dtype == torch.bfloat16 and not bfloat16_kernels()
        self.compute = torch.float32 if widened else self.dtype
        self.rows_per_call = ROWS_PER_CALL.get(self.compute) if invariant and not self.own_kernel else None
        with torch.no_grad():
            weight = linear.weight.detach()
            self.packed = (rowgemm.pack(weight, in_pairs) if self.own_kernel
                           else torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute)))
            bias_dtype = torch.float32 if self.own_kernel else self.compute   # added to its float32 sums
            self.compute_bias = None if self.bias is None else self.bias.detach().to(bias_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute)
        if self.own_kernel:
            out = rowgemm.linear(flat, self.packed, self.out_features)
            if self.compute_bias is not None:
                out = out + self.compute_bias
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        block = self.rows_per_call or len(flat)
        out = torch.cat([torch.ops.mkldnn._linear_pointwise(_rows(part), self.packed, self.compute_bias, "none", [],
                                                            "") for part in flat.split(block)])
        return _unrows(out.to(x.dtype), x)


class Int8Linear(torch.nn.Module):
    """int8 weights (`int8_weight_bits`) with a float32 scale per output row, packed once; each
    call's rows are quantized to int8 with a scale of their own, multiplied in integers (as uint8
    with zero point 128) on Tandem's kernel where it runs int8, else on oneDNN's (integer sums are
    exact: the same numbers), and scaled back to the activations' dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            w = linear.weight.detach().float()
            self.own_kernel = rowgemm.int8()
            top = 2 ** (int8_weight_bits() - 1) - 1        # the largest weight: 127, or 63 in 7 bits
            self.scales = w.abs().amax(1).clamp(min=1e-12) / top
            int8 = torch.round(w / self.scales[:, None]).clamp_(-top, top).to(torch.int8)
            self.packed = rowgemm.pack_int8(int8) if self.own_kernel else torch.ops.onednn.qlinear_prepack(int8, None)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.own_kernel:     # the same quantization and integer sums, scaled alike: the same numbers
            out = rowgemm.linear_int8(rows, self.packed, self.scales, self.out_features)
        else:
            scale = rows.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
            q = (torch.round(rows / scale) + 128).to(torch.uint8)
            out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, self.packed, self.scales, self.zero_points, None,
                                                     1.0, 0, torch.float32, "none", [], "") * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4Linear(torch.nn.Module):
    """int4 weights in groups of rowgemm.GROUP inputs, a float16 scale per output and group (its
    largest magnitude over 7), packed once; each call's rows quantized to int8 as Int8Linear's and
    multiplied on Tandem's kernel (rowgemm.linear_int4; AVX512-VNNI or AVX2). Half int8's bytes, for
    models whose steps are bound by reading their weights (a draft's)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            w = linear.weight.detach().float()
            groups = -(-self.in_features // rowgemm.GROUP)
            padded = torch.zeros(self.out_features, groups * rowgemm.GROUP)
            padded[:, :self.in_features] = w
            by_group = padded.view(self.out_features, groups, rowgemm.GROUP)
            scales = rowgemm.int4_scales(by_group.abs().amax(2))
            int4 = torch.round(by_group / scales[..., None]).clamp_(-8, 7).to(torch.int8).flatten(1)
            self.packed = rowgemm.pack_int4(int4, scales)      # the padding quantized to zeros
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rowgemm.linear_int4(x.reshape(-1, self.in_features).float(), self.packed, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def rows_computed_alone(model: torch.nn.Module) -> bool:
    """Whether every PackedLinear, Int8Linear and Int4Linear of `model` computes each row of a call as it
    computes that row alone, probed once per shape on random rows in calls of 2, 17 and 34 rows
    (either side of the sizes where kernels change). The kernels are chosen by the CPU oneDNN finds,
    so this is measured where the model runs rather than assumed from machines seen."""
    sizes = (2, 17, 34)
    rows = sorted({i for n in sizes for i in (0, 1, n // 2, n - 1)})
    generator = torch.Generator().manual_seed(0)
    probed = set()
    for layer in model.modules():
        if not isinstance(layer, (PackedLinear, Int8Linear, Int4Linear)):
            continue
        dtype = getattr(layer, "dtype", torch.float32)      # Int8Linear takes any float input
        shape = (type(layer), dtype, layer.in_features, layer.out_features)
        if shape in probed:
            continue
        probed.add(shape)
        x = torch.randn(max(sizes), layer.in_features, generator=generator).to(dtype)
        with torch.no_grad():
            alone = {i: layer(x[i:i + 1])[0] for i in rows}
            for n in sizes:
                together = layer(x[:n])
                if not all(torch.equal(together[i], alone[i]) for i in rows if i < n):
                    return False
    return True


# names of sibling nn.Linear layers that every supported architecture calls on one input
FUSIBLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(torch.nn.Module):
    """Several Linear layers over one input as one `linear` whose output is theirs side by side;
    each former layer becomes a `FusedPart` taking its columns. The first part called with an
    input computes all of them; the others take theirs from that result, which is dropped once
    every part has had its own. A part called with another input (or twice with one) computes
    afresh, so any calling order gives the separate layers' results."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        out = sum(l.out_features for l in linears)
        self.linear = torch.nn.Linear(first.in_features, out, bias=first.bias is not None,
                                      dtype=first.weight.dtype, device=first.weight.device)
        with torch.no_grad():
            self.linear.weight.copy_(torch.cat([l.weight for l in linears]))
            if first.bias is not None:
                self.linear.bias.copy_(torch.cat([l.bias for l in linears]))
        ends = torch.tensor([l.out_features for l in linears]).cumsum(0).tolist()
        self.columns = [slice(end - l.out_features, end) for end, l in zip(ends, linears)]
        self._last = None      # (input, output, parts taken): read once per call, for threads

    def take(self, x: torch.Tensor, part: int) -> torch.Tensor:
        last = self._last
        if last is None or last[0] is not x or part in last[2]:
            last = (x, self.linear(x), set())
        last[2].add(part)
        self._last = None if len(last[2]) == len(self.columns) else last
        return last[1][..., self.columns[part]]


class FusedPart(torch.nn.Module):
    def __init__(self, fused: FusedLinear, part: int) -> None:
        super().__init__()
        self.fused, self.part = fused, part
        self.in_features = fused.linear.in_features
        self.out_features = fused.columns[part].stop - fused.columns[part].start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(x, self.part)


def fuse_linears(model: torch.nn.Module) -> int:
    """Fuses each group of FUSIBLE siblings in `model` (same input size, dtype, device, and all
    with or all without bias) into one FusedLinear, in place; returns how many groups."""
    fused = 0
    for parent in list(model.modules()):
        for names in FUSIBLE:
            layers = [getattr(parent, n, None) for n in names]
            if not all(type(l) is torch.nn.Linear for l in layers):
                continue
            first = layers[0]
            if any((l.in_features, l.weight.dtype, l.weight.device, l.bias is None)
                   != (first.in_features, first.weight.dtype, first.weight.device, first.bias is None)
                   for l in layers):
                continue
            group = FusedLinear(layers)
            for i, name in enumerate(names):
                setattr(parent, name, FusedPart(group, i))
            fused += 1
    return fused


def _linears(model: torch.nn.Module, dtypes: tuple[torch.dtype, ...]) -> list:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and child.weight.dtype in dtypes and child.weight.device.type == "cpu"]


def _detach_from_file(model: torch.nn.Module) -> None:
    """What is left (embeddings, norms, biases) may still be views of the memory-mapped weights
    file, which would keep every page the swap read mapped: copy it so the file can go. Then the
    freed originals go back to the system (glibc keeps freed memory in its heaps otherwise: 0.8
    GB of a 1.5B target's)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    if hasattr(libc := ctypes.CDLL(None), "malloc_trim"):
        libc.malloc_trim(0)


def pack_linears(model: torch.nn.Module, invariant: bool = True) -> int:
    """Replaces every float32 or bfloat16 nn.Linear of `model` on the CPU with a PackedLinear
    (batch-invariant or not), in place; returns how many. The originals are freed, except where
    another module shares the weight (a tied output layer keeps the embedding's), so memory grows
    by at most that one matrix."""
    swaps = _linears(model, PACKED_DTYPES)
    if any(c.weight.dtype == torch.bfloat16 for *_, c in swaps) and not (own_kernel(torch.bfloat16) or bfloat16_kernels()):
        log.warning("this CPU has no oneDNN bfloat16 kernels (they need AVX-512): bfloat16 layers run on "
                    "float32 kernels, at float32's speed")
    others = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)}
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, id(child.weight) in others, invariant))
    if swaps:
        _detach_from_file(model)
    return len(swaps)


def quantize_linears(model: torch.nn.Module, per_row: bool = True, bits: int = 8) -> int:
    """Replaces every float32 nn.Linear of `model` on the CPU with an int8 one (bits 8), or an
    Int4Linear (bits 4), in place; returns how many. int8 per_row: Int8Linear (batch-invariant);
    else torch.ao's dynamic quantization. A tied output layer gets a quantized copy; the embedding
    stays as it is. At 4 bits the output layer takes 8 (Int8Linear), as llama.cpp's 4-bit files
    keep theirs wider: its rows are the logits a draft proposes from, and 4 bits there cost more
    agreement with the target than all the other layers' 4 bits together (docs/benchmarks.md,
    "int4 weights for a draft")."""
    swaps = _linears(model, (torch.float32,))
    if bits == 8 and not per_row:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.ao's deprecation notice; the kernels are current
            torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return len(swaps)
    if bits == 8 and swaps and int8_weight_bits() == 7:
        log.warning("no Tandem int8 kernel here, and oneDNN's saturates 8-bit pairs: int8 weights take 7 bits")
    layer = Int4Linear if bits == 4 else Int8Linear
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output = getattr(output, "inner", output)           # a trimmed output layer's (tandem.engine.vocab)
    for parent, name, child in swaps:
        setattr(parent, name, (Int8Linear if child is output else layer)(child))
    if swaps:
        _detach_from_file(model)
    return len(swaps)
