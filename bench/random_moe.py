"""Write a random Qwen3-MoE-shaped model (about 1 B parameters, 8 experts, top-2) for serving
benchmarks against peers (`bench/compare.py --model DIR`).

Usage:
    python bench/random_moe.py DIR [--layers 20] [--hidden 1536] [--expert-size 1024]

bf16 safetensors through transformers' own class, with SmolLM2-135M's tokenizer (49,152 ids,
`vx.models_hub.resolve`), so both servers detokenize every id the model may emit. Defaults:
20 layers, hidden 1,536, 16 query / 4 KV heads of 128, experts of 1,024 (Qwen3-MoE's
norm_topk_prob): 1.06 B parameters, 0.42 B active per token. The weights are random (timings do
not depend on them); the same seed gives the same model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--expert-size", type=int, default=1024)
    args = ap.parse_args()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from vx.models_hub.resolve import resolve_model

    cfg = Qwen3MoeConfig(
        vocab_size=49152, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_size, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1000000.0,
        bos_token_id=1, eos_token_id=2, architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a 1 B model
    model = Qwen3MoeForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(args.dir)
    src = resolve_model("smollm2-135m")
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(src, name), args.dir)
    print(f"{args.dir}: Qwen3-MoE, {n / 1e9:.2f} B parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
