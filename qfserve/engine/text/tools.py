"""Tool calling on every model, in the ``<tool_call>`` convention.

A template that renders ``tools`` (Qwen 2.5, Hermes, SmolLM3 and others) asks the model to
answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the convention mlx-lm's
tool parsers also read. Whether a template renders tools is found by rendering it with and
without a probe tool. A template that ignores them (SmolLM2's) gets them described in a
system message instead (:func:`generic_tool_messages`, as llama-server's generic format),
with the same convention: a forced call (``tool_choice`` ``required`` or named) is then
decoded under the same grammar, and answers parse the same way.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
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


def parse_tool_calls(
    text: str, names: Collection[str] = ()
) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into its content and OpenAI ``tool_calls`` entries.

    A block whose body is not a JSON object with a string ``name`` stays in the content.
    Where there is no block, an answer that is one JSON object naming one of ``names``
    (the request's tools) with ``arguments`` is a call too: small models told of the
    generic format often drop the tags.
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
        calls.append(_call(body["name"], arguments))
    kept.append(text[last:])
    if not calls and names:
        bare = _bare_call(text, names)
        if bare is not None:
            return None, [_call(bare["name"], bare["arguments"])]
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def without_open_call(content: str | None) -> str | None:
    """``content`` less a last ``<tool_call>`` block that never closed: a call ``max_tokens``
    cut is not an answer, and half a call shown as text would be taken for one."""
    if content is None:
        return None
    start = content.rfind("<tool_call>")
    if start < 0 or "</tool_call>" in content[start:]:
        # The tag itself may be what was cut ("<tool_"): the call had only begun.
        tags = [k for k in range(2, len("<tool_call>")) if content.endswith("<tool_call>"[:k])]
        if not tags:
            return content
        start = len(content) - tags[-1]
    return content[:start].rstrip() or None


def _bare_call(text: str, names: Collection[str]) -> dict[str, Any] | None:
    try:
        body = json.loads(text.strip())
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("name") in names and "arguments" in body:
        return body
    return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry; ``arguments`` as a JSON string, as OpenAI sends it."""
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {
            "name": name,
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


# A template that does not render tools is told about them in a system message, as
# llama-server's generic tool format does; the answer convention stays ``<tool_call>``, so
# the parser and the grammar that forces a call are the ones native templates use.
GENERIC_INSTRUCTIONS = (
    "You can call the functions below. To call one, answer with only\n"
    '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "Otherwise answer normally.\n\nFunctions:\n"
)


def generic_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` for a template that cannot render tools: the tools described in the
    system message (one is added where there is none), earlier calls written back as the
    ``<tool_call>`` blocks the model would have answered, and tool results as user turns
    (many templates know only system, user and assistant)."""
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = json.dumps(fn.get("parameters") or {"type": "object"}, separators=(",", ":"))
        about = f": {fn['description']}" if fn.get("description") else ""
        lines.append(f"- {fn['name']}{about}. Arguments (JSON schema): {params}")
    described = GENERIC_INSTRUCTIONS + "\n".join(lines) if tools else ""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                "<tool_call>"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                + "</tool_call>"
                for c in message["tool_calls"]
            ]
            out.append(
                {"role": "assistant", "content": "\n".join([content or "", *blocks]).strip()}
            )
        elif role == "tool":
            name = message.get("name") or message.get("tool_call_id") or "the function"
            out.append({"role": "user", "content": f"Result of {name}: {content}"})
        else:
            out.append(dict(message))
    if described:
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0]
            out[0] = {**first, "content": f"{first.get('content') or ''}\n\n{described}".strip()}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"].get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
