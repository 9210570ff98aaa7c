"""The OpenAI-compatible endpoint an agent talks to during a rollout, served by jgrpo's sampler.

`Endpoint(tokenizer, stop_ids)` runs a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port):
`/rollouts/<id>/v1/chat/completions` and `/completions` (POST), `/rollouts/<id>/v1/models` and
`/v1/models` (GET); `base_url(id)` is the prefix a client passes unchanged; every request needs
`Authorization: Bearer <api_key>` (random per endpoint). A handler thread checks and renders a
request (jgrpo.rollout.openai_api), queues it and waits. The thread that calls `step` (the
rollout's: it owns the device) runs every queued request as ONE sampler batch (n choices = n
rows) once each running rollout has one queued, or `gather_s` after the last arrival
(`batch_sizes` records the rows). A chat request that repeats an earlier call's messages, the
assistant message it returned and new messages continues at the token level: that call's
prompt + completion ids + `ChatFormat.reply_ids` of the new messages. Each rollout's calls and
sequences: jgrpo.rollout.agent_record (the split rule, the budget). docs/agents.md."""

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

from jgrpo.rollout.agent_record import Call, Choice, Rollout, Settings
from jgrpo.rollout.conversation import ChatFormat
from jgrpo.rollout.openai_api import (
    MAX_BODY,
    MAX_N,
    RequestError,
    check_sampling,
    completion_prompt_ids,
    models_body,
    normal_message,
    response_body,
    same_assistant,
)
from jgrpo.rollout.tool_calls import parse_tool_calls

_ROUTE = re.compile(r"^/rollouts/([A-Za-z0-9_.-]+)/v1/(chat/completions|completions|models)$")


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

        self._server = _Server(("127.0.0.1", 0), Handler)
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
        n, top_p, stops, max_tokens = check_sampling(route, body, settings)
        parse_tools = False
        if route == "chat/completions":
            call, parse_tools = self._chat_call(rollout, body)
        else:
            call = Call(-1, "completion", completion_prompt_ids(self.tokenizer, body))
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
        messages = [normal_message(m, i) for i, m in enumerate(raw)]
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
                    if ch.finish_reason != "length" and same_assistant(messages[m], ch.message):
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

    def _response(self, rollout: Rollout, p: _Pending) -> dict:
        return response_body(self.tokenizer, rollout.id, p.call)


class _Server(ThreadingHTTPServer):
    request_queue_size = 4096
    """The listen backlog: every rollout of a step connects at once (the stdlib's default, 5,
    made a burst of a few hundred agents' connections fail with connection resets)."""


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
