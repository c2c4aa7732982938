"""Faster float32 matrix products on the CPU for the passes speculation depends on.

A verify pass multiplies k+1 rows by every weight matrix. torch's stock CPU kernel for that shape
(a BLAS call that repacks the weight on every call) ran 3-5x slower here per row than oneDNN with
the weight packed once at load time, so a pass of 2-17 positions cost 2-3x a one-position decode
step instead of little more. `pack_linears` swaps every Linear of a float32 CPU model for one that
keeps both forms: one-row products (plain decoding) stay on the stock kernel, which is the faster
there; products of several rows (verification, batched decoding, prefill) use the packed weight.
The packed copy doubles the memory of the Linear weights.

Both kernels sum in a different order, so results differ in the last bits (about 1e-4 in a
Linear's output); the same already holds between batch sizes of the stock kernel. See the README
on near-ties.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def available() -> bool:
    return torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias        # shared, not copied (tied heads stay tied)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:          # one row: a matrix-vector product
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every float32 nn.Linear of `model` (on the CPU) with a PackedLinear, in place;
    returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
             and child.weight.device.type == "cpu"]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
