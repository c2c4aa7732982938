"""The head's file format, and loading a DeepSpec-style checkpoint with the same code.

Tandem's own format is one safetensors file:
  metadata  "format": "tandem-head/1"; "config": the HeadConfig as JSON; "target": the target model
            it was trained for; "trained": a JSON summary of how (command, tokens, steps)
  tensors   the head's parameters under DeepSpec's names (fc.weight, hidden_norm.weight,
            layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
            layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight,
            norm.weight, markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V, r],
            confidence_head.proj.weight, confidence_head.proj.bias), stored as bfloat16 and run as
            float32; optionally draft_vocab [n] int64, the token ids the head drafts from (all
            without it), and greedy_calibration [block_size, 2] float32, the per-position scale and
            offset of the confidence logit for greedy requests (BlockHead.acceptance). The
            target's embedding table and output layer are never stored.

A DeepSpec checkpoint is a folder with config.json and model.safetensors (or
pytorch_model.safetensors) under the same parameter names, possibly prefixed "model.", and
holding embed_tokens / lm_head copies, which are dropped: the target's own are used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.head.model import BlockHead, HeadConfig

FORMAT = "tandem-head/1"
SHARED = ("embed_tokens.", "lm_head.")      # the target's, never the head's own


class HeadFileError(ValueError):
    """A head file that cannot serve: unreadable, or made for another target."""


def save(head: BlockHead, path: Path | str, target: str = "", trained: dict | None = None) -> str:
    """Writes the head; returns the file's sha256."""
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    if head.draft_vocab is not None:
        tensors["draft_vocab"] = head.draft_vocab.to(torch.int64).contiguous()
    if head.greedy_calibration is not None:
        tensors["greedy_calibration"] = head.greedy_calibration.float().contiguous()
    metadata = {"format": FORMAT, "config": json.dumps(head.config.to_dict()), "target": target,
                "trained": json.dumps(trained or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return sha256(path)


def sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load(path: Path | str) -> tuple[BlockHead, dict]:
    """The head (float32, eval mode) and its metadata, from a Tandem file or a DeepSpec folder."""
    path = Path(path)
    if path.is_dir():
        return _load_deepspec(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:        # safetensors raises its own types for a bad file
        raise HeadFileError(f"cannot read head file {path.name}: {e}") from None
    if meta.get("format") != FORMAT:
        raise HeadFileError(f"{path.name} is not a Tandem head file (format {meta.get('format')!r})")
    config = _config(meta.get("config", ""), path.name)
    vocab = tensors.pop("draft_vocab", None)
    calibration = tensors.pop("greedy_calibration", None)
    head = _build(config, tensors, path.name)
    if calibration is not None:
        if tuple(calibration.shape) != (config.block_size, 2) or not bool(torch.isfinite(calibration).all()):
            raise HeadFileError(f"{path.name}: greedy_calibration must be [{config.block_size}, 2] finite numbers")
        head.greedy_calibration = calibration.float()
    if vocab is not None:
        if vocab.dim() != 1 or vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= config.vocab_size:
            raise HeadFileError(f"{path.name}: draft_vocab must be token ids inside the vocabulary")
        head.draft_vocab = vocab.long()
    try:
        trained = json.loads(meta.get("trained") or "{}")
    except ValueError:
        trained = {}
    return head, {"target": meta.get("target", ""), "trained": trained}


def _deepspec_weights(folder: Path) -> Path | None:
    return next((folder / n for n in ("model.safetensors", "pytorch_model.safetensors") if (folder / n).exists()),
                None)


def _load_deepspec(folder: Path) -> tuple[BlockHead, dict]:
    config_file = folder / "config.json"
    weights = _deepspec_weights(folder)
    if not config_file.exists() or weights is None:
        raise HeadFileError(f"{folder.name}: a DeepSpec checkpoint needs config.json and model.safetensors")
    raw = _config(config_file.read_text(), folder.name, parse_only=True)
    config = _config(raw, folder.name)
    tensors = {}
    try:
        with safe_open(str(weights), "pt") as f:
            for name in f.keys():
                own = name.removeprefix("model.")
                if not own.startswith(SHARED):
                    tensors[own] = f.get_tensor(name)
    except Exception as e:        # safetensors raises its own types for a bad file
        raise HeadFileError(f"cannot read {weights.name}: {e}") from None
    return _build(config, tensors, folder.name), {"target": raw.get("target_model_name_or_path", ""),
                                                  "trained": {}}


def _config(raw: str | dict, name: str, parse_only: bool = False):
    """The HeadConfig of a JSON text or dict (just the dict with parse_only); HeadFileError when
    it is not one."""
    try:
        d = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return d if parse_only else HeadConfig.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise HeadFileError(f"{name}: bad head configuration: {e}") from None


def _build(config: HeadConfig, tensors: dict[str, torch.Tensor], name: str) -> BlockHead:
    head = BlockHead(config)
    want = head.state_dict()
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise HeadFileError(f"{name}: parameters do not match the configuration "
                            f"(missing {missing[:4]}, unexpected {extra[:4]})")
    for key, t in tensors.items():
        if tuple(t.shape) != tuple(want[key].shape):
            raise HeadFileError(f"{name}: {key} has shape {tuple(t.shape)}, expected {tuple(want[key].shape)}")
    head.load_state_dict({k: t.float() for k, t in tensors.items()})
    return head.float().eval()


def check_target(config: HeadConfig, target_config) -> None:
    """Raises HeadFileError unless the head fits the target: same width and vocabulary, taps inside."""
    if config.hidden_size != target_config.hidden_size:
        raise HeadFileError(f"head hidden_size {config.hidden_size} != target's {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        raise HeadFileError(f"head vocab_size {config.vocab_size} != target's {target_config.vocab_size}")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise HeadFileError(f"head mask_token_id {config.mask_token_id} is outside the vocabulary")
    layers = target_config.num_hidden_layers
    if max(config.target_layer_ids) >= layers or min(config.target_layer_ids) < -1:
        raise HeadFileError(f"head taps layers {config.target_layer_ids}; the target has {layers}")


# Heads shipped with Tandem, one per target preset, and their SHA256SUMS (sha256sum's format).
SHIPPED = Path(__file__).parent / "trained"


def shipped(target: str) -> Path:
    """The head shipped for a target preset, once its bytes are the ones SHA256SUMS records;
    HeadFileError when there is none, or when it is not the file shipped."""
    path = SHIPPED / f"{target}.safetensors"
    if not path.exists():
        have = sorted(p.stem for p in SHIPPED.glob("*.safetensors"))
        raise HeadFileError(f"no head is shipped for {target!r} (shipped: {', '.join(have) or 'none'})")
    sums = SHIPPED / "SHA256SUMS"
    lines = sums.read_text().splitlines() if sums.exists() else []
    recorded = {name.strip(): digest for digest, _, name in (line.partition("  ") for line in lines)}
    if path.name not in recorded:
        raise HeadFileError(f"no sha256 is recorded for the shipped head {path.name} in {sums.name}")
    check_sha256(path, recorded[path.name])
    return path


def check_sha256(path: Path, want: str) -> None:
    """HeadFileError unless the file's sha256 is `want` (hex)."""
    have = sha256(path)
    if have != want.strip().lower():
        raise HeadFileError(f"{path.name} has sha256 {have}, not {want.strip().lower()}: the file is damaged "
                            "or is not the head meant")


def load_drafter(spec: str, model, target: str, digest: str = ""):
    """The HeadDrafter for a serving target (tandem.engine.modeling.CausalLM): `spec` is a head
    file, a DeepSpec folder or 'shipped' (checked against the sha256 shipped with it). `digest`:
    the sha256 the head's file (a folder's weights file) must have, when given. The head's decoder
    layers run on packed weights where the target's do (tandem.engine.gemm)."""
    from tandem.engine import gemm
    from tandem.head.drafter import HeadDrafter
    path = shipped(target) if spec == "shipped" else Path(spec)
    if digest:
        weights = _deepspec_weights(path) if path.is_dir() else path
        if weights is None or not weights.exists():
            raise HeadFileError(f"cannot check the sha256 of {path.name}: no head file there")
        check_sha256(weights, digest)
    head, _ = load(path)
    check_target(head.config, model.model.config)
    if model.packed:
        gemm.pack_linears(head.layers)
    return HeadDrafter(head, model.model.get_input_embeddings(), model.model.get_output_embeddings())
