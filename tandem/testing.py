"""Tiny seeded models in the Hugging Face layout, loaded by the same code path as real models.

Random weights say nothing about acceptance rates; they exercise loading, caching, rollback and
the protocol in milliseconds. The draft is the target with noise added, so it agrees often but
not always, and rejections are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. ",
    "Grüße aus Köln! Ça va? 日本語のテキスト。 Emoji: 🙂🚀 ",
    "import numpy as np\nx = np.zeros((3, 4))\n",
]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_model(folder: Path, seed: int = 0, vocab_size: int = 320, noise_from: Path | None = None,
                     noise: float = 0.0, max_context: int = 512, logit_scale: float = 25.0) -> Path:
    """Saves a 2-layer Llama with seeded random weights (and a tokenizer) into `folder`.

    logit_scale widens the output distribution so greedy choices are far from ties, which keeps
    'speculative output == plain greedy output' exact despite floating-point reordering.
    noise_from/noise: start from another tiny model's weights and add Gaussian noise (a draft).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, vocab_size)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        if noise_from is not None:
            model.load_state_dict(LlamaForCausalLM.from_pretrained(noise_from).state_dict())
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
        else:
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    return folder


def build_tiny_pair(root: Path, noise: float = 0.05) -> tuple[Path, Path]:
    target = build_tiny_model(Path(root) / "target", seed=0)
    draft = build_tiny_model(Path(root) / "draft", seed=1, noise_from=target, noise=noise)
    return target, draft


def build_random_head(path: Path, target: Path, seed: int = 0, block_size: int = 4, markov_rank: int = 8) -> Path:
    """Saves an untrained head (seeded random weights, Markov and confidence heads included) for
    a tiny target into the head file `path`: it drafts badly, so speculation with it must still
    give exactly the target's output."""
    from transformers import AutoConfig

    from tandem.head import checkpoint
    from tandem.head.model import BlockHead, HeadConfig

    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(seed)
    head = BlockHead(HeadConfig.for_target(config, layers=1, block_size=block_size, markov_rank=markov_rank,
                                           taps=[0, config.num_hidden_layers - 1], mask_token_id=1))
    with torch.no_grad():
        head.markov_head.markov_w2.weight.normal_(0, 0.5)    # zero at initialisation; exercise it here
    checkpoint.save(head, path, target=str(target))
    return Path(path)
