"""Faster float32 matrix products on the CPU, by packing the weights for oneDNN once at load time.

torch's stock CPU kernel for a Linear layer (a BLAS call that repacks the weight on every call) can
be slow on a CPU for the shapes that matter here: oneDNN on weights packed once makes a verify
pass of a few positions several times faster, and even a one-position decode step faster
(measured in docs/benchmarks.md, "Measurements behind the code's rules"). `pack_linears` swaps
every float32 Linear of a CPU model for a PackedLinear that holds only the packed weight; the
original is freed, except where another module shares it (a tied output layer keeps the
embedding's), so memory grows by at most that one matrix.

oneDNN sums in another order than the stock kernel, so logits differ in the last bits; the same
already holds between batch sizes of either kernel. See docs/how-it-works.md on near-ties.
"""

from __future__ import annotations

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available()


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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every float32 nn.Linear of `model` on the CPU with a PackedLinear, in place;
    returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
             and child.weight.device.type == "cpu"]
    others = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)}
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, shared=id(child.weight) in others))
    if swaps:
        # What is left (embeddings, norms, biases) may still be views of the memory-mapped weights
        # file, which would keep every page packing read mapped: copy it so the file can go.
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
    return len(swaps)
