"""Text in and out of the model: encoding a request's prompt, stop strings, logprobs.

Thin wrappers over mlx-lm's tokenizer wrapper (chat template, encode) and its server's
``TextStateMachine`` for stop strings; plain functions the worker thread calls.
"""

from __future__ import annotations

from typing import Any, cast

from qfserve.engine.models.loading import LoadedModel
from qfserve.engine.text.requests import GenerationRequest, TokenLogprob
from qfserve.engine.text.tools import generic_tool_messages, template_renders_tools


class PromptError(ValueError):
    """The prompt cannot run: ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def encode_prompt(loaded: LoadedModel, request: GenerationRequest) -> tuple[list[int], int]:
    """The prompt's token ids and the completion budget (default: the rest of the context).

    Raises:
        PromptError: token ids (prompt or ``logit_bias``) outside the vocabulary, messages
            the chat template refuses, an empty prompt, or prompt plus ``max_tokens``
            beyond the model's context.
    """
    tok, ctx = loaded.tokenizer, loaded.context_length
    field_name = "messages" if request.kind == "chat" else "prompt"
    vocab = getattr(getattr(loaded.model, "args", None), "vocab_size", None) or len(tok)
    biased = [t for t, _ in request.sampling.logit_bias if not 0 <= t < vocab]
    if biased:
        raise PromptError(
            f"logit_bias token ids must be in [0, {vocab}), got {biased[0]}", "logit_bias"
        )
    if request.kind == "chat":
        messages = [dict(m) for m in request.messages]
        uses_tools = bool(request.tools) or any(
            m.get("role") == "tool" or m.get("tool_calls") for m in messages
        )
        extra = {"tools": list(request.tools)} if request.tools else {}
        if uses_tools and not template_renders_tools(tok):
            messages, extra = generic_tool_messages(messages, list(request.tools)), {}
        if getattr(tok, "chat_template", None):
            try:
                prompt = list(
                    tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
                )
            except Exception as exc:  # a template may raise on what a client sent (jinja2)
                raise PromptError(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from None
        else:  # no template: a plain transcript, as mlx-lm's server does
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            prompt = tok.encode(text + "assistant: ")
    elif isinstance(request.prompt, str):
        prompt = tok.encode(request.prompt)
    else:
        prompt = list(request.prompt)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
    if not prompt:
        raise PromptError(f"{field_name} encodes to zero tokens", field_name)
    if len(prompt) >= ctx:
        raise PromptError(
            f"the prompt has {len(prompt)} tokens; this model's context is {ctx} tokens",
            field_name,
        )
    requested = request.sampling.max_tokens
    if requested is not None and len(prompt) + requested > ctx:
        raise PromptError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({requested}) exceeds "
            f"this model's context of {ctx} tokens",
            "max_tokens",
        )
    return prompt, requested if requested is not None else ctx - len(prompt)


class StopText:
    """Cuts decoded text at the first stop string, holding back a possible partial match.

    Built on mlx-lm's ``TextStateMachine`` (what its server uses): each stop string is a
    self-transition, so a completed match shows up as an extra segment.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        from mlx_lm.generate import TextStateMachine

        self._machine = TextStateMachine
        self._state = TextStateMachine({"normal": [(s, "normal") for s in stop]}).make_state()

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string completed)."""
        self._state, segments = self._machine.split(self._state, text)
        return segments[0][1], len(segments) > 1

    def flush(self) -> str:
        self._state, held, _ = self._machine.flush(self._state)
        return held


# What OpenAI reports for a token with no probability (JSON has no -inf): a constrained
# request's grammar masks tokens to -inf, and a top-n list can reach them.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # -inf and NaN alike


def token_logprobs(tokenizer: Any, gen: Any, top_n: int) -> tuple[TokenLogprob, ...]:
    """The sampled token's log-probability and the ``top_n`` best, from a
    ``GenerationResponse`` (its ``logprobs`` is the full ``(vocab,)`` vector); a token with
    no probability reads :data:`MIN_LOGPROB`."""
    import mlx.core as mx

    top: tuple[tuple[str, float], ...] = ()
    if top_n > 0:
        ids = mx.argpartition(-gen.logprobs, kth=top_n - 1)[:top_n]
        values = gen.logprobs[ids].tolist()
        # array.tolist() is typed as any nesting of scalars; ids is 1-D, so a list of ints.
        token_ids = cast("list[int]", ids.tolist())
        pairs = sorted(zip(token_ids, values, strict=True), key=lambda p: -p[1])
        top = tuple((tokenizer.decode([i]), _finite(v)) for i, v in pairs)
    token = tokenizer.decode([gen.token])
    return (TokenLogprob(token, _finite(gen.logprobs[gen.token].item()), top),)
