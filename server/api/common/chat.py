"""Chat messages (`ChatMessage`: chat completions, Responses and /tokenize read them) and a chat as prompt text:
the checkpoint's chat template if it has one, else plain speaker turns, like a play's.
Tools offered and earlier tool calls are part of it (tools.py writes calls as the model does)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

from fastapi import Request
from pydantic import BaseModel, BeforeValidator, Field, model_validator

from .dependencies import get_limits
from .protocol import Text, valid_unicode
from .tools import MAX_TOOLS, ToolCallItem, call_text


def _content_parts(value):
    """Chat content: a string, or a list of text parts (`{"type": "text", "text": …}`) — the form many clients
    send. Other part types (images, audio, files) are refused by name."""
    if isinstance(value, str) or not isinstance(value, list):
        return value
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        valid_unicode(part["text"])
    return value


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Text | list[dict], BeforeValidator(_content_parts)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's result answers this call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        """The message's text: a list of parts is joined as OpenAI does (no separator)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part["text"] for part in self.content)


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
