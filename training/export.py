"""Export a training checkpoint to an mlx-lm model folder and check the logits match.

``python -m training.export --checkpoint training/checkpoints/qfserve-tiny/latest.pt
--out models/qfserve-tiny`` writes ``config.json``, ``model.safetensors`` (float32, mlx-lm's
parameter names), the tokenizer files with the chat template, then loads the folder with
``mlx_lm.load`` and compares its logits with the PyTorch model's on held-out text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from training.model import Llama, ModelConfig
from training.tokenizer import BOS, IM_END, eos_token_ids, load_tokenizer, save_tokenizer_files

MODEL_ID = "qfserve/qfserve-tiny"


def load_checkpoint(path: str | Path) -> tuple[Llama, dict]:
    """The PyTorch model (eval mode, CPU) and the checkpoint dict (step, tokens_seen, config)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    model = Llama(ModelConfig(**state["config"]["model"]))
    model.load_state_dict(state["model"])
    return model.eval(), state


def hf_config(cfg: ModelConfig, tokenizer) -> dict:
    """config.json in the HF Llama layout that mlx-lm's ``llama`` model reads."""
    return {
        "_name_or_path": MODEL_ID,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_traditional": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": eos_token_ids(tokenizer),
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
        "torch_dtype": "float32",
    }


def export(
    checkpoint: str | Path, out: str | Path, tokenizer_path: str | Path | None = None
) -> dict:
    """Write the mlx-lm folder for ``checkpoint`` into ``out``; returns the checkpoint's metadata."""
    checkpoint, out = Path(checkpoint), Path(out)
    model, state = load_checkpoint(checkpoint)
    tokenizer = load_tokenizer(tokenizer_path or checkpoint.parent / "tokenizer.json")
    if tokenizer.get_vocab_size() != model.cfg.vocab_size:
        raise ValueError(
            f"tokenizer vocab must be {model.cfg.vocab_size}, got {tokenizer.get_vocab_size()}"
        )
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().float().contiguous().numpy() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, tokenizer), indent=2) + "\n")
    save_tokenizer_files(tokenizer, out, max_length=model.cfg.max_position_embeddings)
    generation = {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": eos_token_ids(tokenizer),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    config = state.get("config", {})
    meta = {
        "run": config.get("run_name"),
        "step": state["step"],
        "run_steps": sum(stage.get("steps", 0) for stage in config.get("stages", [])) or None,
        "init_from": config.get("init_from"),  # the parent run and step this one started from
        "tokens_seen": state["tokens_seen"],  # the whole lineage's
        "params": model.num_params(),
    }
    (out / "training_state.json").write_text(json.dumps(meta, indent=2) + "\n")
    assert tokenizer.token_to_id(IM_END) in generation["eos_token_id"]
    return meta


def compare_logits(checkpoint: str | Path, folder: str | Path, n_tokens: int = 256) -> float:
    """Max |logit difference| between PyTorch and mlx-lm on held-out text of ``n_tokens``."""
    import mlx.core as mx
    from mlx_lm import load

    from training.data import prepare_corpus

    model, _ = load_checkpoint(checkpoint)
    corpus = prepare_corpus(Path(checkpoint).parent / "tokenizer.json")
    stream = corpus.streams["eval"]
    ids = stream[1000 : 1000 + n_tokens].astype(np.int64)[None]  # (1, L)
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).numpy()
    mlx_model, _ = load(str(folder))
    logits = np.array(mlx_model(mx.array(ids.astype(np.int32))).astype(mx.float32))
    return float(np.abs(logits - reference).max())


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a checkpoint to an mlx-lm folder")
    parser.add_argument(
        "--checkpoint", default="training/checkpoints/qfserve-tiny-recall/latest.pt"
    )
    parser.add_argument("--out", default="models/qfserve-tiny")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max allowed |logit diff|")
    args = parser.parse_args()
    meta = export(args.checkpoint, args.out)
    diff = compare_logits(args.checkpoint, args.out)
    print(json.dumps({**meta, "max_abs_logit_diff": diff}))
    if diff > args.tolerance:
        raise SystemExit(f"exported logits differ from PyTorch by {diff:.3g} > {args.tolerance}")


if __name__ == "__main__":
    main()
