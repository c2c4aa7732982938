"""The CPU kernels a model's Linear layers run on: each row of a call gets the same result whatever
the other rows are, at every precision (batch invariance).

A token's logits must not depend on which other rows share its forward pass (its own proposal,
other sessions' tokens): otherwise speculation, batching and load change the output. So:

- float32 and bfloat16 (`pack_linears`): oneDNN on the weight packed once at load time. oneDNN
  computes every row alike for any number of rows from two on; one row alone takes another path
  that sums in another order, so a one-row call is padded to two. Packing is also faster than
  torch's stock kernel, which repacks the weight on every call (docs/benchmarks.md, "Measurements
  behind the code's rules").
- int8 (`quantize_linears`): int8 weights with a scale per output channel, and each row of
  activations quantized to int8 with a scale of its own (per token, as torchao's dynamic-activation
  int8 recipe does), multiplied in integers by oneDNN on the weight packed once (PyTorch's
  `onednn.qlinear_pointwise`, with an input scale of 1: the integer sums come back unscaled but
  for the weight's scale). Integer sums are exact in any order, and the scales are per row, so no
  other row can change a row's result; `torch._int_mm` gives the same numbers, two to four times
  slower for 2 to 17 rows here.
  Weight-only int8 (`_weight_int8pack_mm`) is invariant too but costs four times a step for a
  9-token pass here (docs/benchmarks.md, "The target's precision").
- int8 where invariance is not needed (a draft, whose numbers change only speed;
  `quantize_linears(per_row=False)`): torch.ao's dynamic quantization, which scales a call's inputs
  over all its rows, and is faster for calls of 2 to 4 rows here.

tests/test_invariance.py proves both on the rows of real models. oneDNN sums in another order than
torch's stock kernel, so packed logits differ from unpacked ones in the last bits.
"""

from __future__ import annotations

import warnings

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available()


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features], with at least two rows (a lone row repeated)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat.repeat(2, 1) if flat.shape[0] == 1 else flat


def _unrows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, shared: bool = False) -> None:
        """shared: the weight is also another module's (a tied output layer); keep referring to it."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight = linear.weight if shared else None
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(_rows(x), self.packed, self.bias, "none", [], "")
        return _unrows(out, x)


class Int8Linear(torch.nn.Module):
    """int8 weights with a float32 scale per output row, packed for oneDNN once; each call's rows
    are quantized to int8 with a scale of their own, multiplied in integers (as uint8 with zero
    point 128, oneDNN's layout), and scaled back to the activations' dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            w = linear.weight.detach().float()
            self.scales = w.abs().amax(1).clamp(min=1e-12) / 127
            int8 = torch.round(w / self.scales[:, None]).clamp_(-127, 127).to(torch.int8)
            self.packed = torch.ops.onednn.qlinear_prepack(int8, None)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        q = (torch.round(rows / scale) + 128).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, self.packed, self.scales, self.zero_points, None,
                                                 1.0, 0, torch.float32, "none", [], "") * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _linears(model: torch.nn.Module, dtypes: tuple[torch.dtype, ...]) -> list:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and child.weight.dtype in dtypes and child.weight.device.type == "cpu"]


def _detach_from_file(model: torch.nn.Module) -> None:
    """What is left (embeddings, norms, biases) may still be views of the memory-mapped weights
    file, which would keep every page the swap read mapped: copy it so the file can go."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every float32 or bfloat16 nn.Linear of `model` on the CPU with a PackedLinear, in
    place; returns how many. The originals are freed, except where another module shares the weight
    (a tied output layer keeps the embedding's), so memory grows by at most that one matrix."""
    swaps = _linears(model, PACKED_DTYPES)
    others = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)}
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, shared=id(child.weight) in others))
    if swaps:
        _detach_from_file(model)
    return len(swaps)


def quantize_linears(model: torch.nn.Module, per_row: bool = True) -> int:
    """Replaces every float32 nn.Linear of `model` on the CPU with an int8 one, in place; returns
    how many. per_row: Int8Linear (batch-invariant); else torch.ao's dynamic quantization. A tied
    output layer gets an int8 copy; the embedding stays as it is."""
    swaps = _linears(model, (torch.float32,))
    if not per_row:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.ao's deprecation notice; the kernels are current
            torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return len(swaps)
    for parent, name, child in swaps:
        setattr(parent, name, Int8Linear(child))
    if swaps:
        _detach_from_file(model)
    return len(swaps)
