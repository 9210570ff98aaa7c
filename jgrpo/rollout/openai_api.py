"""OpenAI's API as the endpoint speaks it: request checks, message forms, response bodies.

`check_sampling` (the run's bounds: temperature, top_p, n, stop, max_tokens; the fields a
request may hold), `normal_message` (a chat message as templates render it and calls are
compared), `same_assistant`, `completion_prompt_ids`, `response_body` (chat.completion or
text_completion with vLLM's `prompt_token_ids` / `token_ids` and the logprobs),
`models_body`; `RequestError` becomes OpenAI's error JSON. docs/agents.md has the tables."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

MAX_N = 16
"""Most choices one request may ask for."""
MAX_BODY = 16 << 20
"""Largest request body (bytes)."""
MODEL_NAME = "jgrpo-policy"
"""What /v1/models lists; requests may name any model (the policy answers)."""

_COMMON = {
    "model", "temperature", "top_p", "max_tokens", "stop", "n", "stream", "user",
    "logprobs", "top_logprobs", "return_token_ids", "metadata", "store",
}  # fmt: skip
_CHAT_FIELDS = _COMMON | {
    "messages", "tools", "tool_choice", "max_completion_tokens", "parallel_tool_calls",
}  # fmt: skip
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}


class RequestError(Exception):
    """A request the endpoint refuses: becomes OpenAI's error JSON with `status`."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status != 401 else "authentication_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{where}: only text content parts are supported", where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts", where)


def normal_message(m: Any, i: int) -> dict:
    """A chat message as the template renders it and as calls are compared: role, content
    (text), name, tool_call_id, tool_calls [{type, function: {name, arguments (a dict)}}]."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise RequestError(
            f"{where}: a message must be an object whose role is system, user, assistant or tool",
            where,
        )
    out: dict[str, Any] = {"role": m["role"], "content": _text_of(m.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = str(m[key])
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls: only an assistant message has a list", where)
        out["tool_calls"] = []
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}.tool_calls: each needs function.name", where)
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise RequestError(
                        f"{where}.tool_calls: arguments are not JSON", where
                    ) from None
            out["tool_calls"].append(
                {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            )
    return out


def same_assistant(message: dict, returned: Optional[dict]) -> bool:
    """The agent sent back the assistant message the endpoint returned (ids ignored)."""
    if returned is None or message["role"] != "assistant":
        return False
    calls = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m]
    return (message["content"] or "") == (returned.get("content") or "") and calls(
        message.get("tool_calls", [])
    ) == calls(returned.get("tool_calls", []))


def check_sampling(route: str, body: dict, settings) -> tuple[int, float, list, Optional[int]]:
    """(n, top_p, stop strings, max_tokens or None) of a request within the run's `settings`
    (jgrpo.rollout.agent_record.Settings); RequestError naming the field otherwise."""
    chat = route == "chat/completions"
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for key in body:
        if key not in allowed:
            raise RequestError(
                f"{key}: not supported by this endpoint; allowed: {', '.join(sorted(allowed))}",
                key,
            )
    if body.get("stream"):
        raise RequestError("stream: streaming is not supported; send stream: false", "stream")
    if body.get("echo"):
        raise RequestError("echo: not supported", "echo")
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, (int, float)) or temperature != settings.temperature
    ):
        raise RequestError(
            f"temperature: this run samples at {settings.temperature:g} (the trainer scores "
            "at it); omit temperature or send that value",
            "temperature",
        )
    top_p = body.get("top_p", settings.top_p)
    if top_p is None:
        top_p = settings.top_p
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise RequestError(f"top_p: must lie in (0, 1], got {top_p!r}", "top_p")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError(f"n: must be an integer in [1, {MAX_N}], got {n!r}", "n")
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError("stop: a non-empty string or a list of at most 4 of them", "stop")
    max_key = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else ("max_tokens")
    )
    max_tokens = body.get(max_key)
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise RequestError(f"{max_key}: must be an integer >= 1, got {max_tokens!r}", max_key)
    return n, float(top_p), stops, max_tokens


def completion_prompt_ids(tokenizer, body: dict) -> list[int]:
    """The prompt ids of a completions request: one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str) and prompt:
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt: token ids must lie in [0, {vocab})", "prompt")
        ids = list(prompt)
    else:
        raise RequestError(
            "prompt: one non-empty string or one list of token ids is required", "prompt"
        )
    return ids


def response_body(tok, rollout_id: str, call) -> dict:
    """The OpenAI response of a served `call` (jgrpo.rollout.agent_record.Call), with the ids
    and logprobs (docs/agents.md's response fields)."""
    extra = {"rollout": rollout_id, "call": call.index, "budget_cut": call.budget_cut}
    completion_tokens = sum(len(c.ids) for c in call.choices)
    usage = {
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(call.prompt_ids) + completion_tokens,
    }
    now = int(time.time())
    if call.kind == "chat":
        choices = []
        for k, c in enumerate(call.choices):
            message: dict[str, Any] = {"role": "assistant", "content": c.message["content"]}
            if c.message.get("tool_calls"):
                message["content"] = c.message["content"] or None
                message["tool_calls"] = [
                    {
                        "id": f"call_{rollout_id}_{call.index}_{k}_{j}",
                        "type": "function",
                        "function": {
                            "name": t["function"]["name"],
                            "arguments": json.dumps(t["function"]["arguments"]),
                        },
                    }
                    for j, t in enumerate(c.message["tool_calls"])
                ]
            content = [
                {
                    "token": tok.decode([i]),
                    "logprob": lp,
                    "bytes": list(tok.decode([i]).encode()),
                    "top_logprobs": [],
                }
                for i, lp in zip(c.ids, c.logprobs)
            ]
            choices.append(
                {
                    "index": k,
                    "message": message,
                    "finish_reason": c.finish_reason,
                    "logprobs": {"content": content},
                    "token_ids": c.ids,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": now,
            "model": MODEL_NAME,
            "choices": choices,
            "usage": usage,
            "prompt_token_ids": call.prompt_ids,
            "jgrpo": extra,
        }
    choices = []
    for k, c in enumerate(call.choices):
        tokens = [tok.decode([i]) for i in c.ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        choices.append(
            {
                "index": k,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                },
                "prompt_token_ids": call.prompt_ids,
                "token_ids": c.ids,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": now,
        "model": MODEL_NAME,
        "choices": choices,
        "usage": usage,
        "jgrpo": extra,
    }


def models_body() -> dict:
    return {
        "object": "list",
        "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "jgrpo"}],
    }
