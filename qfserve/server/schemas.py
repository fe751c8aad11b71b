"""Request and response bodies of the OpenAI endpoints, in OpenAI's field order.

Requests are strict (no type coercion, unknown fields rejected) so mistakes surface as a
400 naming the field. Our extensions (``qfilters_budget``, ``qfilters_recent``,
``qfilters_n_sink``, ``qfilters_chunk``, ``qfilters_budget_mode``, ``qfilters_floor``,
``kv_method``, ``kvzap_threshold``) sit together in :class:`EvictionFields`;
:meth:`GenerationBody.to_engine` is the one conversion into the engine's frozen parameters.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from qfserve.engine.kv.config import BudgetSource, CacheConfig, ConfigError
from qfserve.engine.serving.config import EngineConfig, request_cache
from qfserve.engine.text.requests import GenerationRequest, SamplingParams
from qfserve.engine.text.structured import (
    GrammarError,
    JSONConstraint,
    ToolCallConstraint,
    strict_schema,
)
from qfserve.server.compat import (
    CHAT_FATES,
    COMPLETION_FATES,
    REQUIRED,
    Fate,
    JSONObjectFormat,
    JSONSchemaFormat,
    ResponseFormat,
    refused,
)
from qfserve.server.errors import APIError
from qfserve.server.eviction import EvictionFields, http_param
from qfserve.server.messages import (
    ChatMessage,
    NamedToolChoice,
    StreamOptions,
    Strict,
    Tool,
)


class GenerationBody(EvictionFields):
    """Fields shared by chat and text completions, and the conversion to engine parameters."""

    FATES: ClassVar[dict[str, tuple[Fate, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _fates(cls, data: Any) -> Any:
        """``null`` means the default; no-op parameters are dropped; refused ones are a 400."""
        if not isinstance(data, dict):
            return data
        hit = refused(data, cls.FATES)
        if hit is not None:
            name, why = hit
            raise APIError(
                400, f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter"
            )
        if data.get("modalities") not in (None, ["text"]):
            raise APIError(
                400,
                "only the text modality is supported",
                param="modalities",
                code="unsupported_value",
            )
        ignored = {n for n, (fate, _) in cls.FATES.items() if fate == "no-op"}
        ignored |= {"modalities"}
        return {
            k: v
            for k, v in data.items()
            if k not in ignored and not (v is None and k not in REQUIRED)
        }

    def constraint(self) -> JSONConstraint | None:
        """The JSON the answer must be (``response_format``); 400 if the schema cannot compile."""
        fmt = getattr(self, "response_format", None)
        if isinstance(fmt, JSONObjectFormat):
            constraint = JSONConstraint(None)
        elif isinstance(fmt, JSONSchemaFormat):
            schema = fmt.json_schema.schema_
            if schema is not None and fmt.json_schema.strict:
                schema = strict_schema(schema)
            constraint = JSONConstraint(None if schema is None else json.dumps(schema))
        else:
            return None
        try:
            constraint.grammar()
        except GrammarError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_value") from None
        return constraint

    def cache_config(self, config: EngineConfig) -> tuple[CacheConfig, BudgetSource, Any]:
        """The request's eviction settings over the server's (see
        :func:`qfserve.engine.serving.config.request_cache`); 400 names a bad field."""
        sent = {
            "method": self.kv_method,
            "budget": self.qfilters_budget,
            "recent": self.qfilters_recent,
            "n_sink": self.qfilters_n_sink,
            "chunk": self.qfilters_chunk,
            "budget_mode": self.qfilters_budget_mode,
            "floor": self.qfilters_floor,
            "positions": self.kv_cache_detail,
            "threshold": self.kvzap_threshold,
        }
        try:
            return request_cache(config, sent)
        except ConfigError as exc:
            given = [http_param(k) for k, v in sent.items() if v is not None]
            param = http_param(exc.param)
            raise APIError(
                400,
                f"invalid eviction settings: {exc}",
                param=param if param in given else (given[0] if given else None),
                code="invalid_value",
            ) from None

    def to_engine(self, config: EngineConfig) -> GenerationRequest:
        """The one conversion from an HTTP body to the engine's frozen request, over the
        server's defaults ``config``."""
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
            top_k=fields["top_k"],
            min_p=fields["min_p"],
            repetition_penalty=fields["repetition_penalty"],
        )
        cache, budget_source, auto = self.cache_config(config)
        constraint = self.constraint()
        if isinstance(self, ChatCompletionRequest):
            tools, tool_constraint = self.tool_setup()
            if tool_constraint is not None and constraint is not None:
                raise APIError(
                    400,
                    "tool_choice that forces a call cannot be combined with response_format",
                    param="tool_choice",
                    code="invalid_value",
                )
            return GenerationRequest(
                kind="chat",
                sampling=sampling,
                cache=cache,
                reuse=self.qfilters_reuse is not False,
                cache_name=self.prompt_cache_key or None,
                budget_source=budget_source,
                auto=auto,
                messages=tuple(m.as_template_input() for m in self.messages),
                constraint=constraint or tool_constraint,
                tools=tools,
                detail=bool(self.kv_cache_detail),
            )
        assert isinstance(self, CompletionRequest)
        return GenerationRequest(
            kind="completion",
            sampling=sampling,
            cache=cache,
            reuse=self.qfilters_reuse is not False,
            cache_name=self.prompt_cache_key or None,
            budget_source=budget_source,
            auto=auto,
            prompt=self.single_prompt(),
            constraint=constraint,
            detail=bool(self.kv_cache_detail),
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
TopK = Annotated[int, Field(ge=0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
PromptCacheKey = Annotated[
    str | None,
    Field(
        max_length=256,
        description="Names the conversation: the request continues only caches kept under "
        "the same key, and its own are kept under it. A balancer in front of several "
        "servers can hash on it. Empty or null: unnamed.",
    ),
]


class SamplerExtensions(Strict):
    """Sampler extensions local servers share (mlx_lm.server, llama-server, vLLM)."""

    top_k: Annotated[
        TopK | None, Field(description="Sample among the k most likely tokens; 0 is off.")
    ] = 0
    min_p: Annotated[
        MinP | None, Field(description="Drop tokens below min_p x the top probability.")
    ] = 0.0
    repetition_penalty: Annotated[
        RepetitionPenalty | None, Field(description="mlx-lm's repetition penalty; 1 is off.")
    ] = 1.0


class ChatCompletionRequest(SamplerExtensions, GenerationBody):
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

    FATES = CHAT_FATES

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    frequency_penalty: Penalty | None = 0.0
    logit_bias: LogitBias = None
    logprobs: bool | None = False
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    n: Annotated[int, Field(ge=1)] | None = 1
    presence_penalty: Penalty | None = 0.0
    prompt_cache_key: PromptCacheKey = None
    response_format: ResponseFormat | None = None
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = 1.0
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    top_p: TopP | None = 1.0

    def tool_setup(self) -> tuple[tuple[dict[str, Any], ...], ToolCallConstraint | None]:
        """The tools the template renders, and the constraint when a call is forced."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise APIError(
                400, "tool_choice needs tools", param="tool_choice", code="invalid_value"
            )
        if choice == "none":
            return (), None
        assert self.tools is not None
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools)
        if choice == "auto":
            return tools, None
        chosen = self.tools
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in self.tools if t.function.name == choice.function.get("name")]
            if not chosen:
                raise APIError(
                    400,
                    "tool_choice names no tool in tools",
                    param="tool_choice",
                    code="invalid_value",
                )
        constraint = ToolCallConstraint.of(
            [
                {
                    "name": t.function.name,
                    "parameters": t.function.parameters,
                    "strict": t.function.strict,
                }
                for t in chosen
            ]
        )
        try:
            constraint.grammar()
        except GrammarError as exc:
            raise APIError(400, str(exc), param="tools", code="invalid_value") from None
        return tools, constraint

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The functions a call in the answer may name (none under ``tool_choice`` none)."""
        if not self.tools or self.tool_choice == "none":
            return ()
        return tuple(t.function.name for t in self.tools)

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


class CompletionRequest(SamplerExtensions, GenerationBody):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "qfserve-tiny", "prompt": "Once upon a time", "max_tokens": 16}]
        }
    )

    FATES = COMPLETION_FATES

    model: str
    prompt: str | list[str] | list[int]
    best_of: Annotated[int, Field(ge=1)] | None = 1
    echo: bool | None = False
    frequency_penalty: Penalty | None = 0.0
    logit_bias: LogitBias = None
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None
    max_tokens: MaxTokens = 16
    n: Annotated[int, Field(ge=1)] | None = 1
    presence_penalty: Penalty | None = 0.0
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    response_format: ResponseFormat | None = None
    prompt_cache_key: PromptCacheKey = None

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
        if self.best_of != 1:
            raise APIError(
                400, "only best_of=1 is supported", param="best_of", code="unsupported_value"
            )
        return self

    def single_prompt(self) -> str | tuple[int, ...]:
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return tuple(int(t) for t in self.prompt)
