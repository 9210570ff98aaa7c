"""The OpenAI-compatible endpoint an agent talks to during a rollout, served by jgrpo's sampler.

`Endpoint(tokenizer, ...)` runs a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port) in
daemon threads. Paths: `/rollouts/<id>/v1/chat/completions`, `/rollouts/<id>/v1/completions`
(POST), `/rollouts/<id>/v1/models` and `/v1/models` (GET): `base_url(id)` is the prefix an
`openai.AsyncOpenAI(base_url=...)` passes unchanged. Every request needs `Authorization:
Bearer <api_key>` (a random key per endpoint, i.e. per run and process). A handler thread only
parses, checks and renders; it queues the request and waits. The thread that called `step`
(the rollout's, which owns the device) takes every queued request as ONE batch of sampler rows
(`generate`: a request with n choices is n rows) once each running rollout has a request
queued, or `gather_s` after the last arrival; `batch_sizes` records the rows of every sampler
call. Draws are keyed by (rollout row, call index, choice), never by the batch.

Requests are checked against the run's bounds (`open`): temperature absent or the run's (the
trainer's forward scores at that temperature), 0 < top_p <= 1, n in [1, MAX_N], at most 4 stop
strings, tool_choice "auto" / "none", no streaming, and no field outside the OpenAI ones the
endpoint honours (`_CHAT_FIELDS`, `_COMPLETION_FIELDS`). A bad request gets OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) with status 400 (401 bad key, 404 unknown
path or rollout, 405 method, 413 body too large); nothing a client sends stops the run.

Each rollout (`Rollout`) keeps its calls and, built as they finish, its training SEQUENCES: a call
whose prompt ids start with a sequence's ids so far extends it (the ids between: mask 0; the
completion: mask 1, with its logprobs); any other call starts a new sequence (the agent rewrote
its history). A chat request whose messages are an earlier call's messages + the assistant
message that call returned + new messages gets that call's prompt and completion ids + the
chat template's reply ids of the new messages (`ChatFormat.reply_ids`): the model's text is
never tokenised again. Budget: a sequence's ids after its first prompt fit `budget` (N =
rollout.max_new_tokens); a request's max_tokens above what is left is cut to it and flagged
(`jgrpo.budget_cut`); none left, or `max_calls` calls made: error 400 `budget_exhausted`.

Response fields beyond OpenAI's (vLLM's `return_token_ids` names): chat: `prompt_token_ids`
(top level), `choices[k].token_ids`, `choices[k].logprobs.content[i].logprob`; completions:
`choices[k].prompt_token_ids`, `choices[k].token_ids`, `choices[k].logprobs.token_logprobs`;
both: `jgrpo` = {rollout, call, budget_cut}. Logprobs are the sampler's log_softmax(logits /
T) of each id (before top-p), always returned."""

from __future__ import annotations

import dataclasses
import hmac
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.tool_calls import parse_tool_calls

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
_ROUTE = re.compile(r"^/rollouts/([A-Za-z0-9_.-]+)/v1/(chat/completions|completions|models)$")


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


@dataclasses.dataclass
class Choice:
    """One sampled completion of a call."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop (a stop token or string), length (max_tokens or the budget), tool_calls."""
    text: str
    message: Optional[dict] = None
    """Chat calls: the assistant message returned (content, tool_calls)."""


@dataclasses.dataclass
class Call:
    """One request of a rollout, as served."""

    index: int
    kind: str
    """chat or completion."""
    prompt_ids: list[int]
    messages: Optional[list[dict]] = None
    """Chat calls: the request's messages, normalised (`_normal_message`)."""
    tools_key: str = ""
    choices: list[Choice] = dataclasses.field(default_factory=list)
    budget_cut: bool = False


@dataclasses.dataclass
class Sequence:
    """One training sequence of a rollout: prompt (mask 0) ++ region (generated: mask 1)."""

    prompt: list[int]
    region: list[int] = dataclasses.field(default_factory=list)
    generated: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    truncated: bool = False
    """Its last completion ended by length (max_tokens or the budget)."""

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.region


@dataclasses.dataclass
class Rollout:
    """What the endpoint keeps of one rollout (`open` ... `close`)."""

    id: str
    row: int
    """Global row index (keys its draws)."""
    budget: int
    max_calls: int
    calls: list[Call] = dataclasses.field(default_factory=list)
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    issued: int = 0
    """Calls accepted so far (the next call's index)."""
    budget_cuts: int = 0
    bad_requests: int = 0
    in_flight: int = 0
    since: float = 0.0
    waited_s: float = 0.0

    def waited(self, now: float) -> float:
        """Seconds this rollout has had a request in the endpoint (queued or sampling)."""
        return self.waited_s + (now - self.since if self.in_flight else 0.0)

    def longest_prefix(self, ids: list[int]) -> Optional[Sequence]:
        """The sequence with the most ids that `ids` starts with (None: none)."""
        best = None
        for s in self.sequences:
            full = s.ids
            if len(full) <= len(ids) and ids[: len(full)] == full:
                if best is None or len(full) > len(best.ids):
                    best = s
        return best

    def budget_left(self, prompt_ids: list[int]) -> int:
        s = self.longest_prefix(prompt_ids)
        used = 0 if s is None else len(prompt_ids) - len(s.prompt)
        return self.budget - used

    def add(self, prompt_ids: list[int], choice: Choice) -> None:
        """Extend the longest sequence `prompt_ids` continues (if the region still fits), else
        start a new one."""
        s = self.longest_prefix(prompt_ids)
        if s is not None and len(prompt_ids) - len(s.prompt) + len(choice.ids) <= self.budget:
            gap = prompt_ids[len(s.ids) :]
            s.region += gap + choice.ids
            s.generated += [False] * len(gap) + [True] * len(choice.ids)
            s.logprobs += [0.0] * len(gap) + choice.logprobs
        else:
            s = Sequence(list(prompt_ids), list(choice.ids), [True] * len(choice.ids))
            s.logprobs = list(choice.logprobs)
            self.sequences.append(s)
        s.truncated = choice.finish_reason == "length"


@dataclasses.dataclass
class _Pending:
    rollout: Rollout
    call: Call
    n: int
    max_tokens: int
    top_p: float
    stops: list[str]
    parse_tools: bool
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[RequestError] = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's bounds for the rollouts opened together (`Endpoint.open`)."""

    budget: int
    """N: a sequence's ids after its first prompt (rollout.max_new_tokens)."""
    max_calls: int
    """Calls per rollout (rollout.max_turns)."""
    temperature: float
    top_p: float
    """The default top_p of a request that gives none."""


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


def _normal_message(m: Any, i: int) -> dict:
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


def _same_assistant(message: dict, returned: Optional[dict]) -> bool:
    """The agent sent back the assistant message the endpoint returned (ids ignored)."""
    if returned is None or message["role"] != "assistant":
        return False
    calls = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m]
    return (message["content"] or "") == (returned.get("content") or "") and calls(
        message.get("tool_calls", [])
    ) == calls(returned.get("tool_calls", []))


class Endpoint:
    """The loopback OpenAI-compatible server (module docstring)."""

    def __init__(self, tokenizer, stop_ids, *, tool_call_format="hermes", gather_s=0.05):
        self.tokenizer = tokenizer
        self.stop_ids = tuple(stop_ids)
        self.tool_call_format = tool_call_format
        self.gather_s = gather_s
        self.api_key = secrets.token_urlsafe(24)
        self.batch_sizes: list[int] = []
        """Rows of each sampler call since the last `open`."""
        self._rollouts: dict[str, Rollout] = {}
        self._settings: Optional[Settings] = None
        self._queue: list[_Pending] = []
        self._last_arrival = 0.0
        self._cond = threading.Condition()
        self._formats: dict[str, ChatFormat] = {}
        self._server: Optional[ThreadingHTTPServer] = None

    # ------------------------------------------------------------------ lifetime

    def start(self) -> None:
        if self._server is not None:
            return
        endpoint = self

        class Handler(_Handler):
            owner = endpoint

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        self.start()
        return self._server.server_address[1]

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/rollouts/{rollout_id}/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def open(self, rows: list[int], settings: Settings) -> list[str]:
        """Open a rollout per global row index; their ids (for `base_url`)."""
        tag = uuid.uuid4().hex[:8]
        ids = [f"{tag}-{row}" for row in rows]
        with self._cond:
            self._settings = settings
            self.batch_sizes = []
            for rid, row in zip(ids, rows):
                self._rollouts[rid] = Rollout(rid, row, settings.budget, settings.max_calls)
        return ids

    def waited(self, ids: list[str]) -> list[float]:
        """Seconds each rollout has waited for the endpoint so far (`Rollout.waited`)."""
        now = time.monotonic()
        with self._cond:
            return [self._rollouts[rid].waited(now) for rid in ids]

    def close_rollouts(self, ids: list[str]) -> list[Rollout]:
        """The rollouts' records; later requests for them get 404. Queued requests of theirs
        get an error."""
        with self._cond:
            out = [self._rollouts.pop(rid) for rid in ids]
            closed = set(ids)
            for p in [p for p in self._queue if p.rollout.id in closed]:
                self._queue.remove(p)
                p.error = RequestError("the rollout is over", status=404, code="rollout_closed")
                p.done.set()
        return out

    # ------------------------------------------------------------------ serving (device thread)

    def step(self, generate: Callable, running: int, wait_s: float = 0.005) -> int:
        """Serve one batch if it is ready (every one of the `running` rollouts has a request
        queued, or `gather_s` passed since the last arrival); else wait up to `wait_s` for
        requests. `generate(prompts, max_new_tokens, top_p, row_ids)` is the sampler
        (a `jgrpo.sampling.Generation`). Returns the rows served."""
        with self._cond:
            if not self._queue:
                self._cond.wait(wait_s)
            if not self._queue:
                return 0
            waiting = len({p.rollout.id for p in self._queue})
            if waiting < running and time.monotonic() - self._last_arrival < self.gather_s:
                self._cond.wait(wait_s)
                return 0
            batch, self._queue = self._queue, []
        served = 0
        for top_p in sorted({p.top_p for p in batch}):
            part = [p for p in batch if p.top_p == top_p]
            try:
                served += self._run(generate, part, top_p)
            except BaseException as e:  # the device failed: the agents' requests fail, then raise
                for p in part:
                    p.error = RequestError(f"the sampler failed: {type(e).__name__}", status=500)
                    p.done.set()
                raise
        return served

    def _run(self, generate: Callable, part: list[_Pending], top_p: float) -> int:
        prompts, row_ids, owners = [], [], []
        for p in part:
            for k in range(p.n):
                prompts.append(p.call.prompt_ids)
                row_ids.append((p.rollout.row * 4096 + p.call.index * MAX_N + k) % (1 << 31))
                owners.append((p, k))
        max_new = max(p.max_tokens for p in part)
        self.batch_sizes.append(len(prompts))
        gen = generate(prompts, max_new, top_p, row_ids)
        results: dict[int, list[Choice]] = {id(p): [] for p in part}
        for i, (p, _k) in enumerate(owners):
            length = int(gen.lengths[i])
            keep = min(length, p.max_tokens)
            ids = [int(t) for t in gen.tokens[i, :keep]]
            lps = [float(x) for x in gen.logprobs[i, :keep]]
            stopped = keep == length and not bool(gen.truncated[i])
            results[id(p)].append(self._choice(p, ids, lps, stopped))
        with self._cond:
            for p in part:
                p.call.choices = results[id(p)]
                p.rollout.calls.append(p.call)
                p.rollout.calls.sort(key=lambda c: c.index)
                for choice in p.call.choices:
                    p.rollout.add(p.call.prompt_ids, choice)
                p.done.set()
        return len(prompts)

    def _choice(self, p: _Pending, ids, lps, stopped: bool) -> Choice:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        finish = "stop" if stopped else "length"
        hits = [(text.find(s), s) for s in p.stops if s in text]
        if hits:  # the fewest ids whose text holds the first stop string
            at, stop = min(hits)
            keep = next(
                k
                for k in range(1, len(ids) + 1)
                if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= at + len(stop)
            )
            ids, lps, text, finish = ids[:keep], lps[:keep], text[:at], "stop"
        if p.call.kind != "chat":
            return Choice(ids, lps, finish, text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if p.parse_tools:
            parsed = parse_tool_calls(text, self.tool_call_format)
            if parsed.calls:
                message = parsed.message()
                finish = "tool_calls" if finish == "stop" else finish
        return Choice(ids, lps, finish, text, message)

    # ------------------------------------------------------------------ requests (handler threads)

    def check_key(self, header: Optional[str]) -> None:
        given = (header or "").removeprefix("Bearer ").strip()
        if not header or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise RequestError(
                "missing or wrong API key: send Authorization: Bearer <the run's key>",
                status=401,
                code="invalid_api_key",
            )

    def handle(self, rollout_id: str, route: str, body: dict) -> dict:
        """A checked request -> its response (blocks until the batch holding it ran)."""
        with self._cond:
            rollout = self._rollouts.get(rollout_id)
            settings = self._settings
        if rollout is None:
            raise RequestError(f"no open rollout {rollout_id!r}", status=404, code="not_found")
        try:
            pending = self._parse(rollout, settings, route, body)
        except RequestError:
            with self._cond:
                rollout.bad_requests += 1
            raise
        with self._cond:
            if rollout.issued >= rollout.max_calls:
                rollout.bad_requests += 1
                raise RequestError(
                    f"this rollout made its {rollout.max_calls} calls (rollout.max_turns)",
                    code="budget_exhausted",
                )
            pending.call.index = rollout.issued
            rollout.issued += 1
            rollout.budget_cuts += pending.call.budget_cut
            if rollout.in_flight == 0:
                rollout.since = time.monotonic()
            rollout.in_flight += 1
            self._queue.append(pending)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        pending.done.wait()
        with self._cond:
            rollout.in_flight -= 1
            if rollout.in_flight == 0:
                rollout.waited_s += time.monotonic() - rollout.since
        if pending.error is not None:
            raise pending.error
        return self._response(rollout, pending)

    def _chat_format(self, tools: Optional[list]) -> ChatFormat:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._formats:
            self._formats[key] = ChatFormat(self.tokenizer, self.stop_ids, tools)
        return self._formats[key]

    def _parse(self, rollout: Rollout, settings: Settings, route: str, body: dict) -> _Pending:
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
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else ("max_tokens")
        )
        max_tokens = body.get(max_key)
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise RequestError(f"{max_key}: must be an integer >= 1, got {max_tokens!r}", max_key)
        parse_tools = False
        if chat:
            call, parse_tools = self._chat_call(rollout, body)
        else:
            call = self._completion_call(body)
        with self._cond:
            left = rollout.budget_left(call.prompt_ids)
        if left < 1:
            raise RequestError(
                f"this rollout's token budget ({rollout.budget} ids after its first prompt, "
                "rollout.max_new_tokens) is used up",
                code="budget_exhausted",
            )
        if max_tokens is None:
            max_tokens = left
        elif max_tokens > left:
            max_tokens, call.budget_cut = left, True
        return _Pending(rollout, call, n, max_tokens, float(top_p), stops, parse_tools)

    def _chat_call(self, rollout: Rollout, body: dict) -> tuple[Call, bool]:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RequestError("messages: a non-empty list of messages is required", "messages")
        messages = [_normal_message(m, i) for i, m in enumerate(raw)]
        tools = body.get("tools") or None
        if tools is not None:
            if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
            ):
                raise RequestError("tools: a list of {type: function, function: {...}}", "tools")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise RequestError(
                f"tool_choice: only 'auto' and 'none' are supported, got {choice!r}",
                "tool_choice",
            )
        parse_tools = tools is not None and choice != "none"
        tools_key = json.dumps(tools, sort_keys=True)
        try:
            fmt = self._chat_format(tools)
            prompt_ids = None
            with self._cond:
                earlier = sorted(rollout.calls, key=lambda c: -len(c.messages or []))
            for c in earlier:  # token in, token out: continue an earlier call's ids
                m = len(c.messages or [])
                if c.kind != "chat" or c.tools_key != tools_key or len(messages) <= m + 1:
                    continue
                if messages[:m] != c.messages:
                    continue
                for ch in c.choices:
                    if ch.finish_reason != "length" and _same_assistant(messages[m], ch.message):
                        prompt_ids = c.prompt_ids + ch.ids + fmt.reply_ids(messages[m + 1 :])
                        break
                if prompt_ids is not None:
                    break
            if prompt_ids is None:
                prompt_ids = fmt.prompt_ids(messages)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own (jinja) error
            raise RequestError(
                f"messages: the chat template cannot render them ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})",
                "messages",
            ) from None
        call = Call(-1, "chat", prompt_ids, messages=messages, tools_key=tools_key)
        return call, parse_tools

    def _completion_call(self, body: dict) -> Call:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) and prompt:
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt: token ids must lie in [0, {vocab})", "prompt")
            ids = list(prompt)
        else:
            raise RequestError(
                "prompt: one non-empty string or one list of token ids is required", "prompt"
            )
        return Call(-1, "completion", ids)

    def _response(self, rollout: Rollout, p: _Pending) -> dict:
        call = p.call
        tok = self.tokenizer
        extra = {"rollout": rollout.id, "call": call.index, "budget_cut": call.budget_cut}
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
                            "id": f"call_{rollout.id}_{call.index}_{k}_{j}",
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


class _Handler(BaseHTTPRequestHandler):
    owner: Endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet: no line per request
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away (an agent timed out or its process was killed)
            self.close_connection = True

    def _serve(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise RequestError(f"the body is over {MAX_BODY} bytes", status=413)
            raw = self.rfile.read(length) if length > 0 else b""
            self.owner.check_key(self.headers.get("Authorization"))
            path = self.path.split("?", 1)[0]
            match = _ROUTE.match(path)
            if path == "/v1/models" or (match and match.group(2) == "models"):
                if method != "GET":
                    raise RequestError(f"{path}: use GET", status=405)
                return self._send(200, models_body())
            if match is None:
                raise RequestError(f"unknown path {path!r}", status=404, code="not_found")
            if method != "POST":
                raise RequestError(f"{path}: use POST", status=405)
            try:
                body = json.loads(raw or b"null")
            except ValueError as e:
                raise RequestError(f"the body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            self._send(200, self.owner.handle(match.group(1), match.group(2), body))
        except RequestError as e:
            self._send(e.status, e.body())
        except Exception as e:  # noqa: BLE001 - a request never stops the run
            err = RequestError(f"internal error: {type(e).__name__}: {e}", status=500)
            self._send(500, err.body())

    def do_GET(self):  # noqa: N802 - http.server's names
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")
