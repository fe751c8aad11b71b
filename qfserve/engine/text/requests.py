"""What one generation request asks for, and the events the worker answers with.

Frozen dataclasses: the server builds a :class:`GenerationRequest` once from the HTTP body;
the worker streams back :class:`Started`, then :class:`Delta`\\ s, then exactly one of
:class:`Finished` or :class:`Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from qfserve.engine.kv.config import AutoSettings, BudgetSource, CacheConfig
from qfserve.engine.text.structured import JSONConstraint, ToolCallConstraint

Kind = Literal["chat", "completion"]
FinishReason = Literal["stop", "length", "tool_calls"]
ErrorKind = Literal["invalid_request", "unavailable", "cancelled", "internal"]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn (mlx-lm's ``make_sampler`` / ``make_logits_processors``).

    Args:
        max_tokens: Completion tokens at most; ``None`` fills the rest of the context.
        temperature: ``0`` is greedy decoding.
        top_p: Nucleus sampling mass; ``1`` disables it.
        seed: Seeds MLX's generator for this request when given.
        stop: Strings that end generation; never part of the returned text.
        presence_penalty: Additive penalty on tokens already generated.
        frequency_penalty: Additive penalty proportional to a token's count.
        logit_bias: Token id -> additive bias.
        logprobs: Return each sampled token's log-probability.
        top_logprobs: Also return the ``top_logprobs`` most likely tokens per step.
        top_k: Sample among the ``top_k`` most likely tokens; ``0`` disables it.
        min_p: Drop tokens less likely than ``min_p`` times the most likely; ``0`` disables it.
        repetition_penalty: Divide the logits of recent tokens by it (``1`` disables it).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class GenerationRequest:
    """One request for the worker: a prompt, how to sample and how the caches evict.

    Args:
        kind: ``chat`` renders ``messages`` through the chat template; ``completion`` encodes
            ``prompt`` (text) or takes it as token ids.
        messages: Chat messages as ``({"role": ..., "content": ...}, ...)``.
        prompt: Completion prompt: text or token ids.
        sampling: See :class:`SamplingParams`.
        cache: The eviction settings this request runs with.
        constraint: The output must be JSON (of a schema), or a tool call, when set.
        tools: OpenAI ``tools`` entries rendered through the chat template (chat only).
        reuse: Continue a finished request's caches when they hold a prefix of the prompt
            (:mod:`qfserve.engine.reuse.kept`), and keep this one's for the next turn.
        cache_name: The conversation's name (OpenAI's ``prompt_cache_key``): the request
            continues only caches kept under the same name, and its own are kept under it;
            ``None`` continues and keeps unnamed ones.
        budget_source: Where ``cache.budget`` comes from: the request, the server's
            ``--budget``, or ``auto`` (memory).
        auto: Set while an ``auto`` budget waits to be resolved from the prompt's length
            (``cache`` is then a template).
        detail: Report which prompt tokens the caches still hold when it ends
            (:mod:`qfserve.engine.serving.detail`).
    """

    kind: Kind
    sampling: SamplingParams
    cache: CacheConfig
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str | tuple[int, ...] = ""
    constraint: JSONConstraint | ToolCallConstraint | None = None
    tools: tuple[dict[str, Any], ...] = ()
    reuse: bool = True
    cache_name: str | None = None
    budget_source: BudgetSource = "server"
    auto: AutoSettings | None = None
    detail: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text, log-probability and the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Started:
    """The prompt fits and generation is about to start."""

    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Delta:
    """New text (stop strings already removed) and the tokens it came from."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Generation ended normally; ``kv_cache`` holds the settings that ran and cache stats."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    kv_cache: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens a reused cache already held
    kv_detail: dict[str, Any] | None = None  # what the caches hold, where the request asked


@dataclass(frozen=True)
class Failed:
    """Generation could not run or broke; ``param`` names the offending request field."""

    kind: ErrorKind
    message: str
    param: str | None = None


Event = Started | Delta | Finished | Failed
