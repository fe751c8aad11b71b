"""Reference arm of the KVzip and KVzap parity studies: NVIDIA kvpress's KVzipPress or
KVzapPress on a GGUF model.

Runs kvpress (transformers + CPU torch, float32) on pre-tokenized needle documents and writes one
JSON line per document (docs already in --out are skipped): per ratio the answer, its
correctness, the prefill+compression time and the context positions the press keeps visible per
layer and KV head. Standalone (never imports the project); verified with torch 2.13.0+cpu and
2.14.1+cpu, transformers 5.2.0, kvpress 0.5.5, gguf 0.19.0 and numpy 2.4.6 on 2 threads:

    python bench/reference/kvpress_kvzip.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --docs docs.json --out results.jsonl [--ratios 2 4 8] \
        [--press kvzap --surrogate MODEL.kvzap [--check check.npz]]

docs.json: [{"id", "context_ids", "question_ids", "answer", "max_new_tokens"}]; the context is
compressed, the question appended whole. KVzipPress: its defaults (one ratio across layers).
KVzapPress: the surrogate weights of a qfserve KVzap file (safetensors: ``w`` ``(L, D, H)`` and
``b`` ``(L, H)``, or an MLP's ``w1``, ``b1``, ``w2``, ``b2``) loaded into its ``KVzapModel``
instead of the hub's; a ScorerPress, so every KV head keeps ``int(n * (1 - compression_ratio))``
rows, no sinks, no recent window. ``--check`` writes, for the first document, the hidden states
KVzapPress scored (the first rows of every layer) and its scores of every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from local files
os.environ.setdefault("TQDM_DISABLE", "1")  # silence the GGUF de-quantization progress bars

import kvpress  # noqa: E402, F401  (importing kvpress patches the attention functions for head-wise masking)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress.presses import kvzip_press  # noqa: E402
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel, KVzapPress  # noqa: E402
from kvpress.presses.kvzip_press import KVzipPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel  # noqa: E402


class ReferenceKVzipPress(KVzipPress):
    """KVzipPress with its chat-template prefix length matched to the actual context ids.

    kvpress assumes the context starts with the chat template's user prefix and never scores
    those tokens (so they are evicted first); our ids may not: then score from position 0.
    """

    def prepare(self, model: PreTrainedModel, tokenizer: Any, prev_postfix_size: int = 8) -> list:
        prefix = tokenizer.encode(_chat_prefix_text(tokenizer), add_special_tokens=False)
        ctx = self._context_ids[0, : len(prefix)].tolist()
        self.prefix_length = len(prefix) if prefix and ctx == prefix else 0
        self.used_prefix_length = self.prefix_length  # survives kvpress's reset, for the record
        return super().prepare(model, tokenizer, prev_postfix_size)


class ReferenceKVzapPress(KVzapPress):
    """KVzapPress that records, per layer, the context positions each KV head keeps (the top
    ``n_kept`` of its scores, as ``ScorerPress.compress`` picks them from the same tensor) and,
    where ``capture`` is a dict, the hidden states it scored and its scores."""

    kept: dict[int, list[list[int]]]
    capture: dict[int, tuple[np.ndarray, np.ndarray]] | None = None

    def score(self, module: Any, hidden_states: torch.Tensor, *args: Any) -> torch.Tensor:
        scores = super().score(module, hidden_states, *args)
        n_kept = compute_n_kept(scores.shape[-1], self.compression_ratio)
        indices = scores.topk(n_kept, dim=-1).indices[0]
        self.kept[module.layer_idx] = [sorted(row.tolist()) for row in indices]
        if self.capture is not None:
            pair = (hidden_states[0].numpy().copy(), scores[0].numpy().copy())
            self.capture[module.layer_idx] = pair
        return scores


def kvzap_model(path: Path, config: Any) -> tuple[str, KVzapModel]:
    """The surrogate form and a KVzapModel holding the weights of a qfserve KVzap file."""
    with safe_open(str(path), framework="pt") as f:
        form = (f.metadata() or {})["form"]
        w = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118 - not a dict
    first, last = ("w", "b") if form == "linear" else ("w1", "b2")
    n_layers, hidden, heads = len(w[first]), w[first].shape[1], w[last].shape[1]
    want = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
    if (n_layers, hidden, heads) != want:
        raise SystemExit(
            f"{path}: surrogates for (layers, hidden, heads) {n_layers, hidden, heads}"
        )
    inner = None if form == "linear" else w["w1"].shape[2]
    cfg = KVzapConfig(input_dim=hidden, output_dim=heads, n_modules=n_layers, hidden_dim=inner)
    model = KVzapModel(cfg)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            # nn.Linear holds (out, in); the file x @ w, (in, out)
            linears = [(layer, "w", "b")] if form == "linear" else [(layer[0], "w1", "b1")]
            linears += [] if form == "linear" else [(layer[2], "w2", "b2")]
            for linear, weight, bias in linears:
                linear.weight.copy_(w[weight][i].T)
                linear.bias.copy_(w[bias][i])
    return form, model.eval()


def _chat_prefix_text(tokenizer: Any) -> str:
    """The chat-template text before the user content, computed exactly as KVzipPress does."""
    if tokenizer.chat_template is None:
        return ""
    dummy, sep = "dummy context", "\n" + "#" * len("dummy context")
    messages = [{"role": "user", "content": dummy + sep}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    return text.split(sep)[0].split(dummy)[0]


def load(gguf: Path) -> tuple[PreTrainedModel, Any]:
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    # sdpa, not eager: KVzipPress.compress_post asserts the implementation is not eager.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=torch.float32, attn_implementation="sdpa", **kwargs
    )
    with torch.inference_mode():  # warm-up, so the first doc's timing excludes one-time setup
        model(input_ids=torch.tensor([tokenizer.encode("Hello world", add_special_tokens=False)]))
    return model.eval(), tokenizer


@torch.inference_mode()
def greedy(
    model: PreTrainedModel, tok: Any, cache: DynamicCache, ctx_len: int, q_ids: list[int], n: int
) -> str:
    """Greedy decoding after the (compressed) context, as kvpress's pipeline's generate_answer."""
    pos = torch.arange(ctx_len, ctx_len + len(q_ids)).unsqueeze(0)
    out = model(
        input_ids=torch.tensor([q_ids]), past_key_values=cache, position_ids=pos, logits_to_keep=1
    )
    pos = pos[:, -1:] + 1
    ids = [out.logits[0, -1].argmax()]
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    for i in range(n - 1):  # like kvpress, the first token is not checked against eos
        out = model(input_ids=ids[-1].view(1, 1), past_key_values=cache, position_ids=pos + i)
        ids.append(out.logits[0, -1].argmax())
        if ids[-1].item() in stop:
            break
    return str(tok.decode(torch.stack(ids), skip_special_tokens=True))


def kept_positions(model: PreTrainedModel, ctx_len: int) -> list[list[list[int]]]:
    """Context positions still visible to the question, [layer][kv_head] -> sorted ints.

    kvpress does not shorten the cache: it stores per attention module the pruned entries'
    ``masked_key_indices`` (batch, kv_head, position), its exact selection; kept = the rest.
    """
    kept: list[list[list[int]]] = []
    for layer in model.model.layers:
        visible = np.ones((model.config.num_key_value_heads, ctx_len), dtype=bool)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            _, heads, seqs = masked
            visible[heads.numpy(), seqs.numpy()] = False
        kept.append([np.flatnonzero(row).tolist() for row in visible])
    return kept


def kvzap_press(ratio: float, zap: tuple[str, KVzapModel], model: PreTrainedModel) -> Any:
    """KVzapPress keeping ``1 / ratio`` with the given surrogates: its name set to the one
    ``post_init_from_model`` expects, so it loads nothing from the hub."""
    form, surrogates = zap
    press = ReferenceKVzapPress(compression_ratio=1.0 - 1.0 / ratio, model_type=form)
    press.kvzap_model_name = f"nvidia/KVzap-{form}-{model.config.name_or_path.split('/')[-1]}"
    press.kvzap_model, press.kept = surrogates, {}
    return press


def check_scores(model: PreTrainedModel, doc: dict, zap: tuple[str, KVzapModel], out: Path) -> None:
    """Write KVzapPress's scores of every row of ``doc``'s context ``(L, H, N)`` and the first
    256 hidden states of each layer it scored ``(L, R, D)``, to compare with other scores."""
    press = kvzap_press(2, zap, model)
    press.capture = {}
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([doc["context_ids"]]), past_key_values=DynamicCache())
    layers = [press.capture[i] for i in sorted(press.capture)]
    np.savez(
        out,
        id=doc["id"],
        hidden=np.stack([h[:256] for h, _ in layers]),
        scores=np.stack([s for _, s in layers]),
    )


def run_doc(
    model: PreTrainedModel,
    tok: Any,
    doc: dict,
    ratios: list[float],
    zap: tuple[str, KVzapModel] | None = None,
) -> dict:
    ctx = torch.tensor([doc["context_ids"]])
    ctx_len, n_new, answer = ctx.shape[1], int(doc["max_new_tokens"]), str(doc["answer"])
    row: dict[str, Any] = {"id": doc["id"], "context_len": ctx_len}
    # KVzipPress: one ratio across layers; KVzapPress (a ScorerPress): the same share per head.
    row.update(press="kvzip" if zap is None else "kvzap", ratios={})
    row["mode"] = "global" if zap is None else "per_head"

    def arm(press: Any) -> dict[str, Any]:
        cache = DynamicCache()
        pressed = contextlib.nullcontext() if press is None else press(model)
        t0 = time.perf_counter()
        with torch.inference_mode(), pressed:
            model.model(input_ids=ctx, past_key_values=cache)  # no lm head, as kvpress's pipeline
        prefill_s = round(time.perf_counter() - t0, 3)
        # Read the selection before decoding: the next prefill (q_len == k_len) clears it.
        if press is None:
            kept = None
        elif zap is None:
            kept = kept_positions(model, ctx_len)
        else:
            kept = [press.kept[i] for i in range(len(model.model.layers))]
        text = greedy(model, tok, cache, ctx_len, doc["question_ids"], n_new)
        number = re.search(r"\d+", text)
        correct = number is not None and number.group(0) == answer
        res = {"text": text, "correct": correct, "prefill_s": prefill_s}
        return res if kept is None else {**res, "kept": kept}

    row["full"] = arm(None)  # also clears any masked_key_indices left by a previous doc
    if zap is None:
        defaults = KVzipPress()
        row["kvzip"] = {"n_sink": defaults.n_sink, "chunk_size": defaults.chunk_size}
    else:
        row["kvzap"] = {"model_type": zap[0]}
    for r in ratios:
        if zap is None:
            press = ReferenceKVzipPress(compression_ratio=1.0 - 1.0 / r)
            res = arm(press)
            row["prefix_length"] = press.used_prefix_length
        else:
            press = kvzap_press(r, zap, model)
            res = arm(press)
        key = str(int(r)) if float(r).is_integer() else str(r)
        row["ratios"][key] = {"compression_ratio": press.compression_ratio, **res}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--docs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8], help="keep 1/ratio")
    ap.add_argument("--press", choices=("kvzip", "kvzap"), default="kvzip")
    ap.add_argument("--surrogate", type=Path, help="KVzapPress's weights: a qfserve KVzap file")
    ap.add_argument("--check", type=Path, help="KVzapPress's scores of the first document (npz)")
    args = ap.parse_args()
    if (args.press == "kvzap") != (args.surrogate is not None):
        ap.error("--surrogate goes with --press kvzap, and only with it")

    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    # Silence the "2-3x the prefill cost" warning KVzipPress logs on every construction.
    logging.getLogger("kvpress").setLevel(logging.ERROR)
    model, tok = load(args.gguf)
    # KVzipPress reloads the tokenizer by the model's name_or_path, which for a GGUF model is a
    # folder without tokenizer files: hand it the one already loaded.
    kvzip_press.AutoTokenizer = SimpleNamespace(from_pretrained=lambda *_a, **_k: tok)  # type: ignore[assignment]

    zap = None if args.surrogate is None else kvzap_model(args.surrogate, model.config)
    docs = json.loads(args.docs.read_text())
    if zap is not None and args.check is not None:
        check_scores(model, docs[0], zap, args.check)

    lines = args.out.read_text().splitlines() if args.out.exists() else []
    done = {json.loads(line)["id"] for line in lines if line.strip()}
    with args.out.open("a") as f:
        for doc in docs:
            if doc["id"] not in done:
                row = run_doc(model, tok, doc, args.ratios, zap)
                f.write(json.dumps(row) + "\n")
                f.flush()
                arms = [("full", row["full"])] + [(f"{k}x", v) for k, v in row["ratios"].items()]
                brief = " ".join(f"{k}:{int(v['correct'])}/{v['prefill_s']}s" for k, v in arms)
                print(f"{row['id']} ctx={row['context_len']} {brief}", flush=True)


if __name__ == "__main__":
    main()
