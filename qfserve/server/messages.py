"""The parts of a request body that are OpenAI's own objects: messages and their content
parts, tools and tool calls, stream options. Strict, as every request model here: no type
coercion, unknown fields rejected, so a mistake is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # a no-op: nothing here needs padding


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: dict[Literal["name"], str]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool's answer

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # Without this, an image part reads "Input should be a valid string": say instead
        # what is not supported.
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: "
                        "the served models read text only"
                    )
        return data

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            # Chat templates take arguments as a mapping (the Hugging Face convention).
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _json_or_text(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
