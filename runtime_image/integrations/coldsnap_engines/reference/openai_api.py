"""The reference engine's OpenAI surface: request validation, the chat template, stop strings
and the response / stream-chunk objects of ``/v1/completions`` and ``/v1/chat/completions``.

What is implemented
  * ``/v1/models`` lists the one served model.
  * ``model``: the served name; absent or empty means the served model (ColdSnap's validation
    probe may send an empty name); any other name is a 404 ``model_not_found``.
  * ``/v1/completions``: ``prompt`` as a string or a list of strings (one choice per prompt,
    ``index`` = prompt number * ``n`` + copy); ``max_tokens`` (default 16, 1..4096).
  * ``/v1/chat/completions``: ``messages`` (roles system, developer, user, assistant; content a
    string or a list of ``{"type": "text"}`` parts), ``max_completion_tokens`` or ``max_tokens``
    (default 16). The chat template is, per message,
    ``"<|" + role + "|>\\n" + content + "\\n"``, then ``"<|assistant|>\\n"``; the prompt the model
    sees is exactly that text (the byte tokenizer adds its BOS); see :func:`chat_prompt`.
  * ``n`` (1..16): honoured. Decoding is greedy, so the ``n`` choices of a prompt are identical;
    the prompt is decoded once and its choices are copies.
  * ``stop`` (a string or a list of up to 4): the text ends before the earliest stop string and
    ``finish_reason`` is ``"stop"``; when streaming, text that could begin a stop string is held
    back until it is known not to. Otherwise ``finish_reason`` is ``"length"`` (the engine never
    emits an end-of-sequence token).
  * ``stream``: server-sent events, one chunk per generated token and choice, a last chunk per
    choice with its ``finish_reason`` (chat: a first chunk with ``delta.role``), then
    ``data: [DONE]``. ``stream_options.include_usage`` adds a chunk with ``choices: []`` and
    ``usage`` before ``[DONE]``. Non-streamed responses always carry ``usage``.
  * ``logprobs`` on ``/v1/completions`` (0..20, as vLLM bounds it): every choice carries
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` — per generated token its text,
    its log-probability and the ``logprobs`` most likely tokens of that step (float32 log-softmax
    of the step's logits; ties in token order); streamed, each token's chunk carries its own. It
    cannot be combined with ``stop`` (the stop scanner holds text back, so tokens and text would
    part). ColdSnap's acceptance check digests these values.
  * ``temperature``: the engine decodes greedily, so only 0 (or absent) is accepted; ``top_p``
    (0 < top_p <= 1) and ``seed`` are accepted and have no effect on greedy decoding; ``user`` is
    ignored.

What is refused (HTTP 400, ``{"error": {"message", "type": "invalid_request_error", "param",
"code"}}`` naming the parameter)
  * ``temperature`` > 0 (sampling is not implemented);
  * ``echo``, chat's ``logprobs`` / ``top_logprobs``, ``best_of``, ``suffix``, ``presence_penalty`` /
    ``frequency_penalty``, ``logit_bias``, ``response_format``: accepted only at their no-op value
    (false, null, 0, 1, "", {} or ``{"type": "text"}``);
  * token-id prompts, non-text content parts, tool and function messages or parameters, and any
    other parameter the engine does not know;
  * a prompt plus ``max_tokens`` beyond the model's context (``code: context_length_exceeded``),
    detected before any byte of a stream is sent.

A failure after a stream's headers are out is reported in the stream as
``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from coldsnap_engines.reference import tokenizer

DEFAULT_MAX_TOKENS = 16
MAX_TOKENS = 4096
MAX_N = 16
MAX_STOPS = 4
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An OpenAI-style error reply."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# Parameters the engine does not implement, accepted only at their no-op value.
_NO_OP = {
    "echo": lambda v: v is False,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: isinstance(v, int) and not isinstance(v, bool) and v == 0,
    "best_of": lambda v: isinstance(v, int) and not isinstance(v, bool) and v == 1,
    "suffix": lambda v: v == "",
    "presence_penalty": lambda v: _is_number(v) and v == 0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0,
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: v == {"type": "text"},
}
_COMMON = ("model", "stream", "stream_options", "max_tokens", "n", "stop", "temperature", "top_p", "seed",
           "user")
_ALLOWED = {
    "completions": {*_COMMON, "prompt", "echo", "logprobs", "best_of", "suffix", "presence_penalty",
                    "frequency_penalty", "logit_bias"},
    "chat": {*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
             "frequency_penalty", "logit_bias", "response_format"},
}


@dataclass
class Request:
    """A validated request of either endpoint."""

    kind: str  # "completions" or "chat"
    model: str
    prompts: list[str]
    max_tokens: int
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def chat_prompt(messages) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role {role!r} is not supported by the reference engine "
                                f"(it has {', '.join(CHAT_ROLES)}; no tools or functions)", param="messages")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content", "name") and v is not None)
        if extra:
            raise APIError(400, f"messages[{i}].{extra[0]} is not supported by the reference engine",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported by the reference "
                                        "engine", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        parts.append(f"<|{role}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _int_param(req: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise APIError(400, f"{name} must be an integer in {lo}..{hi}, got {v!r}", param=name)
    return v


def parse(kind: str, req: dict, served_model_name: str) -> Request:
    """Validate a request body of ``kind`` ("completions" or "chat"); raises :class:`APIError`."""
    model = req.get("model")
    if model not in (None, "", served_model_name):
        raise APIError(404, f"The model {model!r} does not exist; this engine serves {served_model_name!r}",
                       param="model", code="model_not_found")
    for name, value in req.items():
        if value is None:
            continue
        if name not in _ALLOWED[kind]:
            raise APIError(400, f"{name} is not supported by the reference engine", param=name)
        if kind == "completions" and name == "logprobs":
            continue
        check = _NO_OP.get(name)
        if check is not None and not check(value):
            raise APIError(400, f"{name}={value!r} is not supported by the reference engine (it decodes "
                                "greedily and implements no such option)", param=name)
    temperature = req.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be a number in 0..2, got {temperature!r}", param="temperature")
        if temperature > 0:
            raise APIError(400, f"temperature={temperature!r} is not supported: the reference engine decodes "
                                "greedily (use temperature 0)", param="temperature")
    top_p = req.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise APIError(400, f"top_p must be a number in (0, 1], got {top_p!r}", param="top_p")
    seed = req.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, f"seed must be an integer, got {seed!r}", param="seed")
    stream = req.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    include_usage = False
    opts = req.get("stream_options")
    if opts is not None:
        if not stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
            raise APIError(400, "stream_options may only hold include_usage", param="stream_options")
        include_usage = opts.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise APIError(400, "stream_options.include_usage must be a boolean", param="stream_options")
    stop = req.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    stop = [s for s in stop if s]
    n = _int_param(req, "n", 1, 1, MAX_N)
    if kind == "chat":
        prompts = [chat_prompt(req.get("messages"))]
        name = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise APIError(400, "prompt must be a string or a non-empty list of strings (token-id prompts are "
                                "not supported by the reference engine)", param="prompt")
        name = "max_tokens"
    max_tokens = _int_param(req, name, DEFAULT_MAX_TOKENS, 1, MAX_TOKENS)
    logprobs = None
    if kind == "completions" and req.get("logprobs") is not None:
        logprobs = _int_param(req, "logprobs", 0, 0, MAX_LOGPROBS)
        if stop:
            raise APIError(400, "logprobs cannot be combined with stop in the reference engine (drop one)",
                           param="logprobs")
    return Request(kind=kind, model=model or served_model_name, prompts=prompts, max_tokens=max_tokens, n=n,
                   stop=stop, stream=stream, include_usage=include_usage, logprobs=logprobs)


def check_context(r: Request, max_seq: int) -> list[int]:
    """Prompt token counts; a 400 where a prompt plus max_tokens does not fit the context."""
    counts = []
    for p in r.prompts:
        ntok = len(tokenizer.encode(p))
        if ntok + r.max_tokens > max_seq:
            raise APIError(400, f"This model's maximum context length is {max_seq} tokens; the "
                                f"{'messages' if r.kind == 'chat' else 'prompt'} ({ntok} tokens) plus "
                                f"max_tokens ({r.max_tokens}) exceed it",
                           param="messages" if r.kind == "chat" else "prompt", code="context_length_exceeded")
        counts.append(ntok)
    return counts


class StopScanner:
    """Ends one generation at the earliest stop string; releases only text that cannot begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.tokens = 0
        self.finish_reason = "length"

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"

    def feed(self, piece: str) -> str:
        """Add one token's text; returns the text now safe to release."""
        self.tokens += 1
        self.text += piece
        if not self.stops:
            return self._release(len(self.text))
        hits = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            cut = min(hits)
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            return self._release(cut)
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


class LogprobsCollector:
    """The completions ``logprobs`` object of one choice, built token by token."""

    def __init__(self) -> None:
        self.doc: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0

    def add(self, piece: str, lp) -> dict:
        """Record one token (``lp``: the engine's TokenLogprobs); returns that token's own object."""
        one = {"tokens": [piece], "token_logprobs": [lp.logprob], "top_logprobs": [dict(lp.top)],
               "text_offset": [self.offset]}
        self.offset += len(piece)
        for key, value in one.items():
            self.doc[key].extend(value)
        return one


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responder:
    """Builds the response objects of one request (shared id, created, model)."""

    def __init__(self, r: Request) -> None:
        self.r = r
        self.id = f"{'chatcmpl' if r.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.r.model}

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if self.r.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason, "logprobs": None}
        return {"text": text, "index": index, "finish_reason": finish_reason, "logprobs": logprobs}

    def response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(self.r.object), "choices": choices, "system_fingerprint": None,
                "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              logprobs: dict | None = None) -> dict:
        """A stream chunk; for completions exactly the engine's historical chunk shape."""
        if self.r.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"text": text or "", "index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        out = {**self._head(self.r.chunk_object), "choices": [choice]}
        if self.r.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(self.r.chunk_object), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
