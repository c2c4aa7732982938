"""Tandem's own CPU kernel for Linear layers (rowgemm.cpp beside this file).

Every output is summed in one fixed order whatever the other rows of its call, however the call
is split among threads: a row's result is the same alone or in company (batch invariance by
construction, tests/test_rowgemm.py).

- float32 and bfloat16 weights, float32 inputs: one fused multiply-add per input, in the order of
  the inputs, into a float32 accumulator; AVX-512 and AVX2 give the same bits. bfloat16 weights
  are widened exactly as they are read: the float32 kernel on those weights, at half the bytes.
- bfloat16 weights and inputs where the CPU has AVX512-BF16 (`pairs`): a pair of products per
  instruction, pairs in order, twice the arithmetic of widening, which bounds long inputs.
- int8 weights against uint8 inputs (int8 + 128) on AVX512-VNNI or AVX2 (`int8`): exact integer
  sums, so every ISA gives the same numbers, and so does oneDNN's int8 kernel where its sums are
  exact (tandem.engine.gemm keeps it on CPUs with neither). Where the CPU has AMX-INT8 tiles, a
  call of 4 rows or more (a verify pass, a prefill) runs on them, from the same packed weights:
  the same exact sums, so a row's result does not depend on which unit its call took.
- int4 weights in groups of GROUP inputs, a float16 scale per output and group, on AVX512-VNNI or
  AVX2 (`int4`): a group's sum exact in integers on either, groups added in order in float32 by
  the same operations, so a row's result is the same in any call and on either ISA. Half int8's
  bytes: a draft model's steps, bound by reading its weights.

Why a kernel of its own: decoding reads every weight once per token, so a step's time is the
weights' bytes over the memory's speed, and oneDNN's kernels read at about half the speed this
CPU's memory gives for the one or two rows of a decode step, while one row alone takes another
path in oneDNN than rows in company (docs/benchmarks.md, "The target's precision"). For long
inputs (prefills) both are bound by arithmetic and run alike, except int8 on AVX2, where widening
both sides costs more than oneDNN's saturating 8-bit products (docs/not-done.md).

Built once by `python -m tandem.engine.rowgemm` (`make setup` runs it; it needs a C++ compiler) into
a library named by the source's, the flags' and torch's versions; where it is not built, or the
CPU has neither AVX-512 nor AVX2 with FMA, `available()` is False and tandem.engine.gemm keeps
oneDNN's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rowgemm.cpp")
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp")


def library() -> Path:
    """Where the built kernel for this source and this torch lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((*FLAGS, torch.__version__)).encode()).hexdigest()[:12]
    return SOURCE.with_name(f"_rowgemm-{digest}.so")


def build() -> Path:
    """Compiles rowgemm.cpp against the installed torch, unless already built; returns the library."""
    out = library()
    if out.exists():
        return out
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    tmp = out.with_suffix(".tmp")
    command = ["g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               *[f"-I{p}" for p in include_paths()], str(SOURCE),
               "-o", str(tmp), *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu"]
    subprocess.run(command, check=True)
    tmp.rename(out)
    for old in SOURCE.parent.glob("_rowgemm-*.so"):
        if old != out:
            old.unlink()
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel is built for this torch and this CPU can run it."""
    path = library()
    if not path.exists():
        log.warning("tandem's CPU kernel is not built (python -m tandem.engine.rowgemm): Linear layers "
                    "run on oneDNN's, about half as fast for decoding")
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as e:           # built against another torch or libraries this machine lacks
        log.warning("tandem's CPU kernel does not load (%s): Linear layers run on oneDNN's", e)
        return False
    return torch.ops.tandem.rowgemm_isa() > 0


def _ops():
    if not available():
        raise RuntimeError("tandem's CPU kernel is not available here (rowgemm.available())")
    return torch.ops.tandem


def isa() -> str:
    """The instruction set the kernel runs on here: avx512-bf16, avx512, avx2 or none."""
    return ("none", "avx2", "avx512", "avx512-bf16")[_ops().rowgemm_isa()] if available() else "none"


def pairs() -> bool:
    """Whether bfloat16 layers multiply bfloat16 inputs by pairs (AVX512-BF16): twice the
    arithmetic of widening to float32, which bounds long inputs."""
    return isa() == "avx512-bf16"


def int8() -> bool:
    """Whether int8 layers run here (uint8 inputs against int8 weights, exact integer sums, on
    AVX512-VNNI or AVX2)."""
    return int8_isa() != "none"


def int8_isa() -> str:
    """The instruction set int8 layers run on here: amx-int8 (with AVX512-VNNI for calls of few
    rows), avx512-vnni, avx2 or none."""
    return ("none", "avx2", "avx512-vnni", "amx-int8")[_ops().rowgemm_int8_isa()] if available() else "none"


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] int8 -> (the kernel's layout, the int32 amount `linear_int8` takes off each
    output: 128 times the output's weights' sum)."""
    weight = weight.detach().contiguous()
    return _ops().rowgemm_pack_quads(weight), 128 * weight.sum(1, dtype=torch.int32)


def sums_int8(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], out_features: int,
              which: int = 0) -> torch.Tensor:
    """x [rows, in] uint8 (int8 + 128) -> [rows, out_features] int32: each output's exact sum of
    its int8 inputs times its weights. which: 0 the best ISA here, 1 AVX2, 2 AVX512-VNNI, 3 AMX-INT8 (tests)."""
    weights, offsets = packed
    return _ops().rowgemm_linear_quads(x.contiguous(), weights, which)[:, :out_features] - offsets


def linear_int8(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], scales: torch.Tensor,
                out_features: int, which: int = 0) -> torch.Tensor:
    """x [rows, in] float32 -> [rows, out_features] float32 in one call: each row quantized to int8
    on a scale of its own (its largest magnitude / 127, rounded to even), the exact sums, times the
    weights' `scales` and the row's scale, as tandem.engine.gemm.Int8Linear computes them in torch."""
    weights, offsets = packed
    return _ops().rowgemm_linear_int8(x.contiguous(), weights, offsets, scales, out_features, which)


GROUP = 64      # int4: inputs per group of a weight row, each group with a scale of its own
NB = 64         # outputs per tile (rowgemm.cpp)


def int4() -> bool:
    """Whether int4 layers run here (Tandem's kernel on AVX512-VNNI or AVX2; there is no other path)."""
    return int4_isa() != "none"


def int4_isa() -> str:
    """The instruction set int4 layers run on here: avx512-vnni, avx2 or none."""
    return ("none", "avx2", "avx512-vnni")[_ops().rowgemm_int4_isa()] if available() else "none"


def pack_int4(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] int8 in -8..7, scales [out, groups] (groups of GROUP inputs, the last
    zero-padded; stored as float16, so give values float16 holds) -> `linear_int4`'s (packed
    nibbles, scales): the nibbles as rowgemm.cpp lays them out, each +8."""
    n, k = weight.shape
    tiles, groups = -(-n // NB), scales.shape[1]
    w = torch.zeros(tiles * NB, groups * GROUP, dtype=torch.int32)
    w[:n, :k] = weight
    nibbles = (w + 8).to(torch.uint8).view(tiles, NB, groups * GROUP // 8, 2, 4)
    packed = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    padded = torch.zeros(tiles * NB, groups, dtype=torch.float16)
    padded[:n] = scales
    return packed, padded.view(tiles, NB, groups).transpose(1, 2).contiguous()


def int4_scales(largest: torch.Tensor) -> torch.Tensor:
    """Each group's scale from its largest magnitude: over 7, as float16 holds it (at least its
    smallest normal number), in float32."""
    return (largest / 7).clamp(min=2.0 ** -14).half().float()


def linear_int4(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], out_features: int,
                which: int = 0) -> torch.Tensor:
    """x [rows, in] float32 -> [rows, out_features] float32 in one call: each row quantized as for
    `linear_int8`, each group's exact sum times its scale, added group by group in order, times
    the row's scale. which: 0 the best ISA here, 1 AVX2, 2 AVX512-VNNI (tests)."""
    weights, scales = packed
    return _ops().rowgemm_linear_int4(x.contiguous(), weights, scales, out_features, which)


def pack(weight: torch.Tensor, in_pairs: bool = False) -> torch.Tensor:
    """weight [out, in] (float32 or bfloat16) -> the kernel's layout, padded to whole tiles.
    in_pairs: for `linear_pairs` (bfloat16 only)."""
    weight = weight.detach().contiguous()
    return _ops().rowgemm_pack_pairs(weight) if in_pairs else _ops().rowgemm_pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, which: int = 0) -> torch.Tensor:
    """x [rows, in] -> [rows, out_features] float32: float32 inputs on a `pack`ed weight (which: 0
    the best ISA here, 1 AVX2, 2 AVX-512, for tests), bfloat16 inputs on one packed in pairs."""
    if packed.dim() == 4:
        out = _ops().rowgemm_linear_pairs(x.contiguous(), packed)
    else:
        out = _ops().rowgemm_linear(x.contiguous(), packed, which)
    return out if out.shape[1] == out_features else out[:, :out_features]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    log.info("built %s; this CPU runs it with %s (int8: %s)", built.name, isa(), int8_isa())
    sys.exit(0)
