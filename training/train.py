"""Train qfserve-tiny: ``python -m training.train --config training/configs/qfserve-tiny.json``.

Seeded and deterministic (a batch is a pure function of seed and step), checkpoints every few
minutes to ``training/checkpoints/<run_name>/latest.pt`` and resumes from it automatically, so
the same command continues a stopped run. A curriculum of stages grows the context; held-out
retrieval accuracy is logged as training goes. Uses CUDA when present, else the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.data import Corpus, make_batch, passkey_eval_set, prepare_corpus, recall_eval_set
from training.model import Llama, ModelConfig

CHECKPOINT_ROOT = Path(__file__).resolve().parent / "checkpoints"


def load_config(path: str | Path) -> dict:
    cfg = json.loads(Path(path).read_text())
    for i, stage in enumerate(cfg["stages"]):
        stage["steps"] = max(1, stage["tokens"] // (stage["batch_size"] * stage["seq_len"]))
        if stage["seq_len"] > cfg["model"]["max_position_embeddings"]:
            raise ValueError(
                f"stages[{i}].seq_len must be <= max_position_embeddings, got {stage['seq_len']}"
            )
    return cfg


def stage_at(cfg: dict, step: int) -> dict:
    """The curriculum stage that ``step`` (0-based) belongs to."""
    end = 0
    for stage in cfg["stages"]:
        end += stage["steps"]
        if step < end:
            return stage
    return cfg["stages"][-1]


def total_steps(cfg: dict) -> int:
    return sum(s["steps"] for s in cfg["stages"])


def lr_at(cfg: dict, step: int) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` over the whole run."""
    opt = cfg["optim"]
    if step < opt["warmup_steps"]:
        return opt["lr"] * (step + 1) / opt["warmup_steps"]
    progress = (step - opt["warmup_steps"]) / max(1, total_steps(cfg) - opt["warmup_steps"])
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return opt["lr"] * (opt["min_lr_ratio"] + (1 - opt["min_lr_ratio"]) * cosine)


@torch.no_grad()
def answer_accuracy(
    model: Llama, docs: list[tuple[list[int], list[int]]], device: torch.device, batch_size: int = 8
) -> tuple[float, float]:
    """Exact-match rate of answers (= greedy decoding) and per-token accuracy of answer tokens.

    An answer is a run of consecutive target indices; ``docs`` are ``(ids, target_indices)``.
    """
    model.eval()
    hits = total = token_hits = token_total = 0
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (ids, _) in enumerate(chunk):
            # Right padding cannot change the logits of earlier positions under a causal mask.
            tokens[r, : len(ids)] = torch.tensor(ids)
        preds = model(tokens.to(device)).argmax(-1).cpu()  # (B, L)
        for r, (ids, targets) in enumerate(chunk):
            answers: list[list[int]] = []
            for t in targets:
                if answers and answers[-1][-1] == t - 1:
                    answers[-1].append(t)
                else:
                    answers.append([t])
            for answer in answers:
                correct = [int(preds[r, t - 1]) == ids[t] for t in answer]
                hits, total = hits + all(correct), total + 1
                token_hits, token_total = token_hits + sum(correct), token_total + len(correct)
    model.train()
    return hits / max(1, total), token_hits / max(1, token_total)


@torch.no_grad()
def heldout_loss(
    model: Llama, corpus: Corpus, device: torch.device, seq_len: int, n: int = 8
) -> float:
    """Mean next-token loss on fixed windows of held-out standard-library text."""
    model.eval()
    stream = corpus.streams["eval"]
    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(int)
    batch = torch.from_numpy(
        np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    )
    batch = batch.to(device)
    logits = model(batch[:, :-1])
    model.train()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def make_eval_sets(cfg: dict, corpus: Corpus) -> dict[str, list]:
    n = cfg["eval"]["docs"]
    sets = {f"passkey@{L}": passkey_eval_set(corpus, L, n) for L in cfg["eval"]["lengths"]}
    sets.update({f"kv@{L}": recall_eval_set(corpus, "kv", L, n) for L in cfg["eval"]["kv_lengths"]})
    sets.update(
        {
            f"recall@{L}": recall_eval_set(corpus, "recall", L, n)
            for L in cfg["eval"].get("recall_lengths", [])
        }
    )
    return sets


def save_checkpoint(
    path: Path,
    model: Llama,
    optimizer: torch.optim.Optimizer,
    step: int,
    tokens_seen: int,
    cfg: dict,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "tokens_seen": tokens_seen,
            "config": cfg,
        },
        tmp,
    )
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def parent_state(cfg: dict, device: torch.device) -> dict | None:
    """The weights a run starts from: its ``init_from`` parent's checkpoint at ``init_from.step``.

    ``init_from = {"config": <parent config path>, "step": N}`` continues another run's model
    under a new curriculum. The parent is trained up to step N first when its checkpoint is
    missing or behind, so the child's one command reproduces the whole lineage. Returns None
    when the run has no parent or the parent was interrupted before reaching step N.
    """
    init = cfg.get("init_from")
    if not init:
        return None
    parent = load_config(init["config"])
    if parent["model"] != cfg["model"]:
        raise ValueError(f"init_from {init['config']}: config.model differs from the parent's")
    ckpt = CHECKPOINT_ROOT / parent["run_name"] / "latest.pt"
    state = torch.load(ckpt, map_location=device, weights_only=False) if ckpt.exists() else None
    if state is None or state["step"] < init["step"]:
        print(f"training the parent run {parent['run_name']} to step {init['step']}", flush=True)
        train(parent, stop_step=init["step"])
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["step"] < init["step"]:
            return None  # stopped by a signal: the same command resumes it
    if state["step"] != init["step"]:
        raise ValueError(
            f"{ckpt} is at step {state['step']}, past init_from.step {init['step']}; "
            "restore that run's checkpoint at the step the child starts from"
        )
    return state


def train(cfg: dict, *, max_steps: int | None = None, stop_step: int | None = None) -> Path:
    """Run (or resume) training; returns the checkpoint path.

    ``max_steps`` stops after that many more steps (tests); ``stop_step`` stops at that step.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = CHECKPOINT_ROOT / cfg["run_name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "latest.pt"
    tokenizer_path = run_dir / "tokenizer.json"
    init = None
    if not ckpt_path.exists() and cfg.get("init_from"):
        init = parent_state(cfg, device)
        if init is None:
            return ckpt_path
        if not tokenizer_path.exists():
            parent_dir = CHECKPOINT_ROOT / init["config"]["run_name"]
            shutil.copyfile(parent_dir / "tokenizer.json", tokenizer_path)
    corpus = prepare_corpus(
        tokenizer_path if tokenizer_path.exists() else None, vocab_size=cfg["model"]["vocab_size"]
    )
    if not tokenizer_path.exists():
        corpus.tokenizer.save(str(tokenizer_path))  # the run keeps its own tokenizer
    model_cfg = ModelConfig(**cfg["model"])
    torch.manual_seed(cfg["seed"])
    model = Llama(model_cfg).to(device)
    opt = cfg["optim"]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": opt["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
    )
    step, tokens_seen = 0, 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        if state["config"]["model"] != cfg["model"]:
            raise ValueError(
                f"config.model differs from the checkpoint in {run_dir}; use a new run_name"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        print(f"resumed from {ckpt_path} at step {step} ({tokens_seen:,} tokens)", flush=True)
    elif init is not None:
        model.load_state_dict(init["model"])  # weights only: a fresh optimizer and schedule
        tokens_seen = init["tokens_seen"]  # tokens count the whole lineage
        print(
            f"starting from {cfg['init_from']['config']} step {init['step']} "
            f"({tokens_seen:,} tokens)",
            flush=True,
        )
    n_total = total_steps(cfg)
    print(
        f"device {device} threads {torch.get_num_threads()} params {model.num_params():,} "
        f"steps {n_total} tokens {sum(s['tokens'] for s in cfg['stages']):,}",
        flush=True,
    )
    eval_sets = make_eval_sets(cfg, corpus)
    stop = {"flag": False}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(flag=True))
    last_save = last_log = time.time()
    log_tokens, log_loss, log_n = 0, 0.0, 0
    end = n_total if max_steps is None else min(n_total, step + max_steps)
    if stop_step is not None:
        end = min(end, stop_step)
    while step < end and not stop["flag"]:
        stage = stage_at(cfg, step)
        batch = make_batch(
            corpus,
            seed=cfg["seed"],
            step=step,
            batch_size=stage["batch_size"],
            seq_len=stage["seq_len"],
            mix=stage["mix"],
        )
        batch = torch.from_numpy(batch).to(device)  # (B, L + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        logits = model(batch[:, :-1])  # (B, L, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt["grad_clip"])
        optimizer.step()
        step += 1
        tokens_seen += batch[:, 1:].numel()
        log_tokens += batch[:, 1:].numel()
        log_loss, log_n = log_loss + loss.item(), log_n + 1
        if step % cfg["log_every"] == 0 or step == end:
            now = time.time()
            print(
                f"{time.strftime('%H:%M:%S')} step {step}/{n_total} seq {stage['seq_len']} "
                f"loss {log_loss / log_n:.4f} "
                f"lr {lr_at(cfg, step - 1):.2e} tok/s {log_tokens / (now - last_log):.0f} "
                f"tokens {tokens_seen:,}",
                flush=True,
            )
            last_log, log_tokens, log_loss, log_n = now, 0, 0.0, 0
        if step % cfg["eval"]["every"] == 0 or step == n_total:
            row = {
                "step": step,
                "tokens": tokens_seen,
                "train_loss": loss.item(),
                "heldout_stdlib_loss": heldout_loss(
                    model, corpus, device, min(512, model_cfg.max_position_embeddings)
                ),
            }
            for name, docs in eval_sets.items():
                row[name], token_acc = answer_accuracy(model, docs, device)
                if name.startswith(("kv", "recall")):
                    row[f"{name}_tokens"] = token_acc
            with open(run_dir / "metrics.jsonl", "a") as metrics_log:
                metrics_log.write(json.dumps(row) + "\n")
            print(
                "eval "
                + " ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                ),
                flush=True,
            )
            last_log = time.time()  # keep eval time out of tok/s
        if time.time() - last_save > 60 * cfg["checkpoint_minutes"] or step == end or stop["flag"]:
            save_checkpoint(ckpt_path, model, optimizer, step, tokens_seen, cfg)
            last_save = time.time()
            print(f"checkpoint step {step} -> {ckpt_path}", flush=True)
            last_log = time.time()
    if step >= n_total:
        print(f"done: {step} steps, {tokens_seen:,} tokens", flush=True)
    return ckpt_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="training config JSON")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (1 is faster on a busy machine)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    train(load_config(args.config), max_steps=args.max_steps)


if __name__ == "__main__":
    main()
