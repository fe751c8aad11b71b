"""Tool calling through the model's own chat template, in the ``<tool_call>`` convention.

A template that renders ``tools`` (Qwen 2.5, Hermes, SmolLM3 and others) asks the model to
answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the convention mlx-lm's
tool parsers also read. Whether a template renders tools is found by rendering it with and
without a probe tool: a template that ignores them cannot tell the model about them.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PROBE = [
    {
        "type": "function",
        "function": {
            "name": "qfserve_probe",
            "description": "probe",
            "parameters": {"type": "object"},
        },
    }
]
_SUPPORT: dict[int, bool] = {}


def template_renders_tools(tokenizer: Any) -> bool:
    """The chat template changes when given tools (memoised per tokenizer)."""
    key = id(tokenizer)
    if key not in _SUPPORT:
        messages = [{"role": "user", "content": "hello"}]
        try:
            plain = tokenizer.apply_chat_template(messages, tokenize=False)
            with_tools = tokenizer.apply_chat_template(messages, tools=_PROBE, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render is not a tool template
            _SUPPORT[key] = False
        else:
            _SUPPORT[key] = plain != with_tools and "qfserve_probe" in with_tools
    return _SUPPORT[key]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into its content and OpenAI ``tool_calls`` entries.

    A block whose body is not a JSON object with a string ``name`` stays in the content.
    Returns:
        ``(content or None, [{"id", "type": "function", "function": {"name", "arguments"}}])``
        with ``arguments`` a JSON string, as OpenAI sends it.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": body["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
