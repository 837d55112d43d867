"""Write a tiny random DeepSeek V4 checkpoint folder that Weft (and transformers) can load.

    weft-dsv4-tiny-checkpoint OUT_DIR [--layer-types csa,hca,sliding,...] [--hc-mult 2] [--seed 0] [--mtp-layers 1]
    weft generate --model OUT_DIR --prompt "Hello" --max-tokens 16

The weights come from transformers' ``DeepseekV4ForCausalLM`` (random, scaled so that sinks,
position biases and routing matter) saved with ``save_pretrained``, i.e. DeepSeek's own tensor
names. The tokenizer is a byte-level BPE trained on a few sentences with the ``tokenizers``
library, with DeepSeek's BOS/EOS tokens at ids 0 and 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHORT_NAMES = {
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
    "sliding": "sliding_attention",
}
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
CORPUS = """DeepSeek V4 attends over a sliding window and over compressed entries.
The compressor pools every few tokens into one entry; the lightning indexer picks the best entries.
Hyper-connections keep several residual streams and mix them with a doubly stochastic matrix.
Hello, world! The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.
Weft is a plugin-architected inference engine: the core defines contracts, plugins implement them.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " @ # $ % ^ & _ | ~
"""


def tiny_config(layer_types: list[str], hc_mult: int = 2, vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """The reference page's tiny configuration with the given layer-type schedule."""
    config: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        q_lora_rank=64,
        num_experts_per_tok=2,
        n_routed_experts=8,
        n_shared_experts=1,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=8,
        sliding_window=16,
        hc_mult=hc_mult,
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        num_nextn_predict_layers=0,
    )
    config.update(overrides)
    return config


def train_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"the trained tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {vocab_size}"
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def write_checkpoint(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Random weights (transformers' model, DeepSeek tensor names) and a tokenizer in ``folder``; with
    ``num_nextn_predict_layers`` in ``config``, that many multi-token-prediction layers too (:func:`mtp_tensors`)."""
    from weft_dsv4.reference import random_hf_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    random_hf_model(config, seed=seed).save_pretrained(str(folder))
    layers = int(config.get("num_nextn_predict_layers", 0))
    if layers:
        from safetensors.torch import load_file, save_file

        shard = folder / "model.safetensors"
        tensors = load_file(shard)
        for index in range(layers):
            tensors.update(mtp_tensors(config, index, seed=seed + 100 + index))
        save_file(tensors, shard, metadata={"format": "pt"})
    train_tokenizer(folder, config["vocab_size"])
    return folder


def mtp_tensors(config: dict[str, Any], index: int, seed: int = 0) -> dict[str, Any]:
    """Random tensors of multi-token-prediction layer ``index`` under DeepSeek's release names (``mtp.N.*``).

    As in DeepSeek's ``MTPBlock``: a decoder block of the target's shape (attention over the sliding window
    only, no compressor or indexer; a scored MoE), its input projections ``e_proj``/``h_proj`` with their norms
    ``enorm``/``hnorm``, and its own ``hc_head_*`` and ``norm`` before the target's LM head. The embedding and the
    LM head are the target's (no tensors here). The block's tensors come from a one-layer transformers model."""
    import tempfile

    import torch
    from safetensors.torch import load_file

    from weft_dsv4.reference import random_hf_model

    block_config = dict(config, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    block_config.pop("num_nextn_predict_layers", None)
    with tempfile.TemporaryDirectory() as scratch:
        random_hf_model(block_config, seed=seed).save_pretrained(scratch)
        saved = load_file(f"{scratch}/model.safetensors")
    prefix = f"mtp.{index}."
    tensors = {
        prefix + name[len("model.layers.0.") :]: tensor
        for name, tensor in saved.items()
        if name.startswith("model.layers.0.")
    }
    hidden, streams = config["hidden_size"], config.get("hc_mult", 4)
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float, shift: float = 0.0) -> torch.Tensor:
        return shift + scale * torch.randn(shape, generator=generator)

    tensors.update(
        {
            prefix + "enorm.weight": normal(hidden, scale=0.1, shift=1.0),
            prefix + "hnorm.weight": normal(hidden, scale=0.1, shift=1.0),
            prefix + "norm.weight": normal(hidden, scale=0.1, shift=1.0),
            prefix + "e_proj.weight": normal(hidden, hidden, scale=0.05),
            prefix + "h_proj.weight": normal(hidden, hidden, scale=0.05),
            prefix + "hc_head_fn": normal(streams, streams * hidden, scale=0.1),
            prefix + "hc_head_base": normal(streams, scale=0.5),
            prefix + "hc_head_scale": 1 + torch.rand(1, generator=generator),
        }
    )
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek V4 checkpoint folder.")
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--layer-types", default="hca,csa,sliding,csa", help=f"comma-separated, from {sorted(SHORT_NAMES)}"
    )
    parser.add_argument("--hc-mult", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mtp-layers", type=int, default=0, help="multi-token-prediction layers (mtp.N.*) for the 'mtp' speculator"
    )
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.layer_types.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in SHORT_NAMES]
    if unknown or not kinds:
        parser.error(f"--layer-types: unknown {unknown or 'empty list'}; use names from {sorted(SHORT_NAMES)}")
    config = tiny_config(
        [SHORT_NAMES[k] for k in kinds], args.hc_mult, args.vocab_size, num_nextn_predict_layers=args.mtp_layers
    )
    folder = write_checkpoint(args.folder, config, args.seed)
    print(f"wrote a tiny DeepSeek V4 checkpoint to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
