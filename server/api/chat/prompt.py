"""A chat as prompt text: the checkpoint's chat template if it has one, else plain speaker turns, like a play's.
Tools offered and earlier tool calls are part of it (tools.py writes calls as the model does)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from ..common.dependencies import get_limits
from ..common.tools import call_text

INLINE_RENDER_MESSAGES = 64  # longer chats are rendered on a worker thread
DEFAULT_CHAT_ROLES = {
    "system": "SYSTEM",
    "developer": "SYSTEM",
    "user": "USER",
    "assistant": "ASSISTANT",
    "tool": "TOOL",
}


def _template_message(message) -> dict:
    """A message as Hugging Face chat templates take it (a call's arguments as an object)."""
    data = {**message.model_dump(exclude_none=True), "content": message.text}
    if message.tool_calls:
        data["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.function.name,
                                            "arguments": json.loads(call.function.arguments or "{}")}}
                              for call in message.tool_calls]
    return data


def _turn(message) -> str:
    calls = "".join(call_text(c.function.name, c.function.arguments) for c in message.tool_calls or ())
    return f"{message.name or DEFAULT_CHAT_ROLES[message.role]}.\n{message.text}{calls}\n\n"


def render_chat(messages, tokenizer, tools: list[dict] | None = None) -> str:
    """The checkpoint's chat template if it has one; else plain speaker turns, the tools offered first:

    TOOLS.\\n<one function per line>\\n\\nUSER.\\n<content>\\n\\nASSISTANT.\\n<content>\\n\\n … ASSISTANT.\\n
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([_template_message(m) for m in messages], tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    offered = ("TOOLS.\n" + "".join(json.dumps(t["function"], ensure_ascii=False) + "\n" for t in tools) + "\n"
               if tools else "")
    return offered + "".join(_turn(m) for m in messages) + "ASSISTANT.\n"


async def chat_prompt(request: Request, messages, tokenizer, tools: list[dict] | None = None) -> str:
    """A chat's prompt text: at most `max_chat_messages` messages (400 beyond), and no more text than a
    prompt may have (checked on the messages' bytes, before anything is rendered); rendered off the event
    loop when large."""
    limits = get_limits(request)
    limits.check_chat_messages(len(messages))
    limits.check_prompt_bytes(sum(len(m.text.encode()) + sum(len(c.function.arguments.encode()) for c in m.tool_calls
                                                             or ()) for m in messages)
                              + len(json.dumps(tools or []).encode()), "chat", "messages")
    if len(messages) <= INLINE_RENDER_MESSAGES:
        return render_chat(messages, tokenizer, tools)
    return await asyncio.to_thread(render_chat, messages, tokenizer, tools)
