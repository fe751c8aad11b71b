"""Request and response bodies of the OpenAI endpoints, in OpenAI's field order.

Requests are strict (no type coercion, unknown fields rejected) so mistakes surface as a
400 naming the field. Our extensions (``qfilters_budget``, ``qfilters_recent``,
``qfilters_n_sink``, ``kv_method``) sit together in :class:`EvictionFields`;
:meth:`GenerationBody.to_engine` is the one conversion into the engine's frozen parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import METHODS, CacheConfig
from engine.requests import GenerationRequest, SamplingParams
from server.errors import APIError

KVMethod = Literal["qfilters", "knorm", "streaming", "full"]
assert set(METHODS) == set(KVMethod.__args__)  # type: ignore[attr-defined]
_CACHE_PARAMS = {
    "method": "kv_method",
    "budget": "qfilters_budget",
    "recent": "qfilters_recent",
    "n_sink": "qfilters_n_sink",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class EvictionFields(_Strict):
    """qfserve's extensions: how this request's KV caches evict (server flags are defaults)."""

    qfilters_budget: Annotated[
        int | None,
        Field(
            ge=1,
            description="KV rows kept per layer and KV head, sinks and recent rows "
            "included. Default: the server's --budget.",
        ),
    ] = None
    qfilters_recent: Annotated[
        int | None,
        Field(ge=0, description="Most recent positions never evicted. Default: --recent."),
    ] = None
    qfilters_n_sink: Annotated[
        int | None,
        Field(
            ge=0,
            description="Leading positions (attention sinks) never evicted. Default: --n-sink.",
        ),
    ] = None
    kv_method: Annotated[
        KVMethod | None,
        Field(
            description="Eviction method: qfilters (calibrated projection), knorm, streaming "
            "(sinks + recent) or full (no eviction). Default: --kv-method."
        ),
    ] = None


class GenerationBody(EvictionFields):
    """Fields shared by chat and text completions, and the conversion to engine parameters."""

    def cache_config(self, defaults: CacheConfig) -> CacheConfig:
        """The request's eviction settings over the server defaults; 400 names a bad field."""
        chosen = {
            "method": self.kv_method,
            "budget": self.qfilters_budget,
            "recent": self.qfilters_recent,
            "n_sink": self.qfilters_n_sink,
        }
        overrides = {k: v for k, v in chosen.items() if v is not None}
        try:
            return CacheConfig(**{**defaults.__dict__, **overrides})
        except ValueError as exc:
            # "n_sink + recent must be < budget" is about the relation: name the budget.
            name = "budget" if " + " in str(exc).split(" must")[0] else str(exc).split()[0]
            sent = [_CACHE_PARAMS[k] for k in overrides]
            param = _CACHE_PARAMS.get(name) if _CACHE_PARAMS.get(name) in sent else None
            raise APIError(
                400,
                f"invalid eviction settings: {exc}",
                param=param or (sent[0] if sent else None),
                code="invalid_value",
            ) from None

    def to_engine(self, defaults: CacheConfig) -> GenerationRequest:
        """The one conversion from an HTTP body to the engine's frozen request."""
        fields = self.model_dump()
        stop = fields.get("stop")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens")
        logprobs = fields.get("logprobs")
        top = fields.get("top_logprobs") or (
            logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else 0
        )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=fields["temperature"],
            top_p=fields["top_p"],
            seed=fields["seed"],
            stop=stop,
            presence_penalty=fields["presence_penalty"],
            frequency_penalty=fields["frequency_penalty"],
            logit_bias=tuple((int(k), float(v)) for k, v in (fields["logit_bias"] or {}).items()),
            logprobs=logprobs is not None and logprobs is not False,
            top_logprobs=top or 0,
        )
        cache = self.cache_config(defaults)
        if isinstance(self, ChatCompletionRequest):
            return GenerationRequest(
                kind="chat",
                sampling=sampling,
                cache=cache,
                messages=tuple(m.as_template_input() for m in self.messages),
            )
        assert isinstance(self, CompletionRequest)
        return GenerationRequest(
            kind="completion", sampling=sampling, cache=cache, prompt=self.single_prompt()
        )

    @model_validator(mode="after")
    def _check(self) -> GenerationBody:
        if getattr(self, "n", 1) != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", False):
            raise APIError(
                400,
                "stream_options is only allowed when stream is true",
                param="stream_options",
                code="invalid_value",
            )
        for key in getattr(self, "logit_bias", None) or {}:
            if not key.isdigit():
                raise APIError(
                    400,
                    f"logit_bias keys must be token ids, got {key!r}",
                    param="logit_bias",
                    code="invalid_value",
                )
        return self


Stop = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
    | None
)
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int | None, Field(ge=1)]
# MLX seeds its generator with an unsigned 64-bit integer; negative seeds wrap around.
Seed = Annotated[int | None, Field(ge=-(2**63), le=2**64 - 1)]
LogitBias = dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None


class ChatCompletionRequest(GenerationBody):
    """``POST /v1/chat/completions`` (the subset a local single-sequence server honours)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "qfserve-tiny",
                    "messages": [{"role": "user", "content": "Write a haiku about caches."}],
                    "max_tokens": 16,
                    "qfilters_budget": 128,
                }
            ]
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias = None
    logprobs: bool = False
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: Penalty = 0.0
    seed: Seed = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    top_p: TopP = 1.0
    user: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400,
                "top_logprobs requires logprobs to be true",
                param="top_logprobs",
                code="invalid_value",
            )
        return self


class CompletionRequest(GenerationBody):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "qfserve-tiny", "prompt": "Once upon a time", "max_tokens": 16}]
        }
    )

    model: str
    prompt: str | list[str] | list[int]
    echo: bool = False
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias = None
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None
    max_tokens: MaxTokens = 16
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: Penalty = 0.0
    seed: Seed = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    user: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], str)
            and len(self.prompt) != 1
        ):
            raise APIError(
                400,
                "only one prompt per request is supported",
                param="prompt",
                code="unsupported_value",
            )
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        return self

    def single_prompt(self) -> str | tuple[int, ...]:
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return tuple(int(t) for t in self.prompt)


# -- responses (built as dicts by server.generation; these document and type-check them) --


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class KVCacheInfo(BaseModel):
    """The eviction settings that ran, the filter's source and the final cache statistics."""

    method: str
    budget: int
    recent: int
    n_sink: int
    filter_source: str
    tokens_seen: int
    tokens_kept: int
    kept_bytes: int
    full_seq_bytes: int
    compression_ratio: float
    evictions: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qfserve"
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
