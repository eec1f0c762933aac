"""A tiny random-weight Llama-style GQA model with a character-level tokenizer, built offline.

Tests and benches need a real model that vLLM serves, with nothing downloaded: `build_tiny_llama`
writes one with `save_pretrained` into a folder. Same seed, same weights, same outputs.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import attrs


@attrs.frozen
class TinyLlamaSpec:
    """Shape of the tiny model. Heads of 64 dims are what vLLM's CPU attention kernels support."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2  # GQA: two query heads per KV head
    head_dim: int = 64
    intermediate: int = 512
    max_positions: int = 2048
    # Larger than Llama's 0.02 so that logits are peaked: greedy decoding then has no near-ties
    # that numerical noise (batching, chunking) could flip, and outputs compare token for token.
    init_std: float = 0.3
    seed: int = 1234


VOCAB = ["<unk>", "<s>", "</s>"] + list(string.ascii_letters + string.digits + string.punctuation + " \n")


def random_prompt(n: int, seed: int) -> str:
    """`n` characters (one token each with this tokenizer), reproducible from `seed`."""
    chars = [c for c in VOCAB if len(c) == 1 and c != "\n"]
    rng = random.Random(seed)
    return "".join(rng.choice(chars) for _ in range(n))


def build_tokenizer(path: Path) -> None:
    """A character-level fast tokenizer: every printable ASCII character is one token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # A chat template so /v1/chat/completions works; plain role-tagged lines.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)


def build_tiny_llama(path: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a tiny Llama model and its tokenizer into `path` (created); return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    spec = spec or TinyLlamaSpec()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar in a bench's --json run, on every build
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    build_tokenizer(path)
    return path


def given_or_tiny(model_dir: str | None, root: Path, tokens: int) -> Path:
    """A bench's `--model-dir`, else the tiny model built under `root` with positions for `tokens` (2,048 at least)."""
    if model_dir:
        return Path(model_dir)
    return build_tiny_llama(root / "model", TinyLlamaSpec(max_positions=max(2048, tokens)))
