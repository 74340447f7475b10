"""The Responses API's response object and its streamed events (`response.created` … `response.completed`).

Output items come from the generated text: a `message` with one `output_text` part, or — where tools were
offered — `function_call` items parsed by tools.py. Their ids derive from the response id, so the streamed
items, the returned object and a later `GET` name the same items."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ...engine.types import FinishReason, RequestOutput
from ..common.tools import ToolCall, ToolCallParser, ToolSpec


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    """`cached_tokens`: the conversation's tokens already in the session's state, which this turn did not read."""
    return {"input_tokens": cached + prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": cached + prompt_tokens + completion_tokens}


def status_of(finish_reason: str) -> tuple[str, dict | None]:
    if finish_reason == FinishReason.LENGTH.value:
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason in (FinishReason.ERROR.value, FinishReason.ABORT.value):
        return "failed", None
    return "completed", None


def message_item(rid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{rid[5:]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(rid: str, index: int, call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{rid[5:]}_{index}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def parser_for(rid: str, calls: dict | None) -> ToolCallParser | None:
    return None if calls is None else ToolCallParser(calls["optional"], id_prefix=f"call_{rid[5:]}")


def output_items(rid: str, text: str, calls: dict | None) -> list[dict]:
    parser = parser_for(rid, calls)
    if parser is None:
        return [message_item(rid, text, "completed")]
    parser.feed(text)
    parser.finish()
    items = [] if parser.mode == "calls" else [message_item(rid, parser.content, "completed")]
    return items + [call_item(rid, i, call, "completed") for i, call in enumerate(parser.complete_calls)]


def base_object(rid: str, created: int, model: str, note: dict, status: str, details: dict | None,
                output: list[dict], used: dict | None) -> dict:
    tools = note.get("tools") or []
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": details, "instructions": note.get("instructions"),
            "max_output_tokens": note.get("max_output_tokens"), "model": model, "output": output,
            "parallel_tool_calls": note.get("parallel_tool_calls", True),
            "previous_response_id": note.get("previous_response_id"), "temperature": note.get("temperature", 1.0),
            "text": note.get("text") or {"format": {"type": "text"}},
            "tool_choice": note.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
            "top_p": note.get("top_p", 1.0), "truncation": "disabled",
            "store": not rid.endswith("_0"), "metadata": note.get("metadata") or {},
            **({"usage": used} if used is not None else {})}  # none yet: left out (the schema has no null)


def response_object(rid: str, result: dict, model: str) -> dict:
    """A stored response as `GET /v1/responses/{id}` returns it (from what its session's record keeps)."""
    note = result.get("note") or {}
    status, details = status_of(result["finish_reason"])
    return base_object(rid, result["created"], model, note, status, details,
                       output_items(rid, result["text"], note.get("calls")),
                       usage(result["prompt_tokens"], result["completion_tokens"], note.get("cached_tokens", 0)))


class ResponseEvents:
    """One response being made: its events as it streams, or its object once its text is whole."""

    def __init__(self, rid: str, generation, model: str, note: dict, tools: ToolSpec | None) -> None:
        self.rid, self.generation, self.model, self.note = rid, generation, model, note
        self.parser = parser_for(rid, note.get("calls")) if tools is not None else None
        self.status, self.details = "in_progress", None
        self.items: list[dict] = []  # output so far (the last may be open)
        self.open = False
        self.sequence = 0
        self.error: dict | None = None

    # ---- whole
    def finish(self, text: str, reason: FinishReason) -> None:
        self.items = output_items(self.rid, text, self.note.get("calls"))
        self.status, self.details = status_of(reason.value)

    def final(self) -> dict:
        return self.snapshot(usage(**self._usage()))

    def snapshot(self, used: dict | None = None) -> dict:
        body = base_object(self.rid, self.generation.created, self.model, self.note, self.status, self.details,
                           [dict(item) for item in self.items], used)
        body["error"] = self.error
        return body

    def _usage(self) -> dict:
        counted = self.generation.usage
        return {"prompt_tokens": counted["prompt_tokens"], "completion_tokens": counted["completion_tokens"],
                "cached": self.note.get("cached_tokens", 0)}

    # ---- streamed
    def event(self, kind: str, **fields) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, separators=(",", ":"),
                          ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    async def stream(self) -> AsyncIterator[bytes]:
        finished = False
        try:
            yield self.event("response.created", response=self.snapshot())
            yield self.event("response.in_progress", response=self.snapshot())
            async for batch in self.generation.stream.batches():
                events: list[bytes] = []
                for output in batch:
                    self.generation.count(output)
                    if output.finish_reason is FinishReason.ERROR:
                        self.status = "failed"
                        self.error = {"code": output.error_kind or "server_error", "message": output.error or ""}
                        events.append(self.event("response.failed", response=self.snapshot()))
                        finished = True
                        break
                    events += self._text(output)
                    if output.finished:
                        finished = True
                        events += self._end(output)
                yield b"".join(events)
                if finished:
                    return
        finally:
            if not finished:
                self.generation.abort()  # the client went away or the server is stopping

    def _text(self, output: RequestOutput) -> list[bytes]:
        if self.parser is None:
            return self._content(output.text) if output.text else []
        found = self.parser.feed(output.text) + (self.parser.finish() if output.finished else [])
        events: list[bytes] = []
        for item in found:
            if item[0] == "content":
                events += self._content(item[1])
            elif item[0] == "call":
                events += self._close()
                call = self.parser.calls[item[1]]
                self.items.append(call_item(self.rid, item[1], call, "in_progress"))
                self.items[-1]["arguments"] = ""
                self.open = True
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(self.items[-1])))
            else:
                self.items[-1]["arguments"] += item[2]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                         output_index=len(self.items) - 1, delta=item[2]))
        return events

    def _content(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if not (self.open and self.items[-1]["type"] == "message"):
            events += self._close()
            self.items.append(message_item(self.rid, "", "in_progress"))
            self.open, index = True, len(self.items) - 1
            events.append(self.event("response.output_item.added", output_index=index,
                                     item={**self.items[-1], "content": []}))
            events.append(self.event("response.content_part.added", item_id=self.items[-1]["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                                 "logprobs": []}))
        self.items[-1]["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _close(self, status: str = "completed") -> list[bytes]:
        if not self.open:
            return []
        self.open, item, index = False, self.items[-1], len(self.items) - 1
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _end(self, output: RequestOutput) -> list[bytes]:
        self.status, self.details = status_of(output.finish_reason.value)
        cut = self.parser is not None and self.parser.calls and not self.parser.calls[-1].complete
        events = self._close("incomplete" if cut else "completed")
        if not self.items:  # nothing generated: an empty message, as the whole object has
            events += self._content("") + self._close()
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(self.status,
                                                                                            "response.failed")
        return events + [self.event(kind, response=self.final())]
