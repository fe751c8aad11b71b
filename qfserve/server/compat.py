"""What becomes of every request parameter of OpenAI's chat and text completions references.

Each parameter is ``implemented``, a documented ``no-op`` (accepted and ignored: it changes
no token of the answer), or ``refused`` with a 400 that names it and says why, as vLLM's
server does for what it does not implement: accept what is harmless, refuse what would
silently change the answer. ``null`` means "the default" wherever the reference allows it
(every optional parameter). The compatibility table of ``docs/api.md`` is generated from
this one (:mod:`qfserve.server.docgen`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qfserve.engine.kv.config import METHODS

Fate = Literal["implemented", "no-op", "refused"]

# parameter -> (fate, what happens); chat completions.
CHAT_FATES: dict[str, tuple[Fate, str]] = {
    "messages": ("implemented", "through the model's chat template; text content parts only"),
    "model": ("implemented", "the served model's id; another id is a 404"),
    "audio": ("refused", "no audio output"),
    "frequency_penalty": ("implemented", "mlx-lm's frequency penalty"),
    "function_call": ("refused", "deprecated by OpenAI: use tool_choice"),
    "functions": ("refused", "deprecated by OpenAI: use tools"),
    "logit_bias": ("implemented", "token id -> bias in [-100, 100]"),
    "logprobs": ("implemented", "per-token log-probabilities"),
    "max_completion_tokens": ("implemented", "wins over max_tokens"),
    "max_tokens": ("implemented", "default: the rest of the context"),
    "metadata": ("no-op", "nothing is stored"),
    "modalities": ("implemented", '["text"] only; "audio" is a 400'),
    "n": ("implemented", "1 only; more is a 400"),
    "parallel_tool_calls": ("no-op", "every call the model writes is returned"),
    "prediction": ("no-op", "a latency hint; the answer is the same without it"),
    "presence_penalty": ("implemented", "mlx-lm's presence penalty"),
    "prompt_cache_key": (
        "implemented",
        "names the conversation: only caches kept under the same key are continued; "
        "a balancer can hash on it (up to 256 characters)",
    ),
    "reasoning_effort": ("no-op", "the served models do not reason in hidden tokens"),
    "response_format": ("implemented", "text, json_object, json_schema (llguidance)"),
    "safety_identifier": ("no-op", "nothing is logged per user"),
    "seed": ("implemented", "seeds MLX's generator for the request"),
    "service_tier": ("no-op", "one tier"),
    "stop": ("implemented", "up to 4 strings, never part of the text"),
    "store": ("no-op", "nothing is stored"),
    "stream": ("implemented", "server-sent events"),
    "stream_options": ("implemented", "include_usage; include_obfuscation is a no-op"),
    "temperature": ("implemented", "0 is greedy"),
    "tool_choice": (
        "implemented",
        "none, auto, required or a named function (forced calls are constrained decoding)",
    ),
    "tools": (
        "implemented",
        "rendered by the chat template, or described in a system message where the template "
        "has no tool support; <tool_call> blocks parsed",
    ),
    "top_logprobs": ("implemented", "0-20, needs logprobs"),
    "top_p": ("implemented", "nucleus sampling"),
    "user": ("no-op", "nothing is logged per user"),
    "verbosity": ("no-op", "answer length follows the model"),
    "web_search_options": ("refused", "no web search"),
}
# Text completions: the parameters they share with chat have the same fate.
COMPLETION_FATES: dict[str, tuple[Fate, str]] = {
    "model": CHAT_FATES["model"],
    "prompt": ("implemented", "one text or one list of token ids"),
    "best_of": ("implemented", "1 only; more is a 400"),
    "echo": ("refused", "the prompt is not echoed"),
    "frequency_penalty": CHAT_FATES["frequency_penalty"],
    "logit_bias": CHAT_FATES["logit_bias"],
    "logprobs": ("implemented", "0-5 alternatives per token"),
    "max_tokens": ("implemented", "default 16"),
    "n": CHAT_FATES["n"],
    "presence_penalty": CHAT_FATES["presence_penalty"],
    "seed": CHAT_FATES["seed"],
    "stop": CHAT_FATES["stop"],
    "stream": CHAT_FATES["stream"],
    "stream_options": CHAT_FATES["stream_options"],
    "suffix": ("refused", "no fill-in-the-middle"),
    "temperature": CHAT_FATES["temperature"],
    "top_p": CHAT_FATES["top_p"],
    "user": CHAT_FATES["user"],
}
# Extensions local servers share (mlx_lm.server, llama-server, vLLM) and ours.
EXTENSION_FATES: dict[str, tuple[Fate, str]] = {
    "top_k": ("implemented", "sample among the k most likely; 0 is off"),
    "min_p": ("implemented", "drop tokens below min_p x the top probability; 0 is off"),
    "repetition_penalty": ("implemented", "mlx-lm's repetition penalty over the last 20 tokens"),
    "response_format (completions)": ("implemented", "as for chat"),
    "prompt_cache_key (completions)": ("implemented", "as for chat"),
    "kv_method": ("implemented", f"qfserve: {', '.join(METHODS)}"),
    "qfilters_budget": ("implemented", "qfserve: KV rows kept per layer and KV head"),
    "qfilters_recent": ("implemented", "qfserve: recent positions never evicted"),
    "qfilters_n_sink": ("implemented", "qfserve: leading positions never evicted"),
    "qfilters_chunk": ("implemented", "qfserve: prefill keeps whole chunks of positions"),
    "qfilters_budget_mode": (
        "implemented",
        "qfserve: per_head, adaptive across a layer's heads, or global across layers "
        "(kvzip, kvzap)",
    ),
    "qfilters_floor": ("implemented", "qfserve: share of the budget each head keeps (adaptive)"),
    "kvzap_threshold": (
        "implemented",
        "qfserve: kvzap also evicts rows scoring below it, the budget the cap",
    ),
    "kv_cache_detail": (
        "implemented",
        "qfserve: which prompt tokens the cache still holds when the answer ends",
    ),
}
REQUIRED = frozenset({"model", "messages", "prompt"})


def refused(body: dict[str, Any], fates: dict[str, tuple[Fate, str]]) -> tuple[str, str] | None:
    """The first refused parameter sent with an effect (not null, false or empty) and why."""
    for name, (fate, why) in fates.items():
        value = body.get(name)
        empty = (
            value is None or value is False or (isinstance(value, str | list | dict) and not value)
        )
        if fate == "refused" and not empty:
            return name, why
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JSONSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]
