"""The OpenAI API's request and response shapes, and their translation to and from the engine's.

Requests are checked with pydantic; a parameter the engine can't honour (``n > 1``, tools,
penalties…) is refused with a message naming it rather than silently ignored, and text that is
not Unicode (a lone surrogate) is refused where it stands. Sampling parameters a request leaves
out take the model's own ``generation_config.json`` values, else OpenAI's (vLLM's
``--generation-config auto``); an answer without ``max_tokens`` stops at the model's
``max_new_tokens`` or the server's default limit (:class:`Defaults`). Responses follow OpenAI's
chat/completions objects; the answer excludes the stop string that ended it (as OpenAI's does),
which engine/generation/output.py's :class:`StopTrimmer` holds back while streaming.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.base.errors import InvalidRequestError
from engine.base.sampling import SamplingParams
from engine.base.request import MAX_LOGPROBS, ChatMessage, GenerationRequest

IGNORED = {"user", "metadata", "store", "service_tier"}
"""Fields accepted and not acted on (they change nothing in the answer)."""

REFUSED_UNLESS_DEFAULT: dict[str, Any] = {
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None,
    "functions": None, "function_call": None, "parallel_tool_calls": None, "response_format": None,
    "echo": False, "suffix": None, "best_of": 1, "prediction": None, "audio": None, "modalities": None,
    "reasoning_effort": None, "web_search_options": None,
}
"""Fields this server does not implement: given with anything but their default they are refused."""

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length",
                  "cancelled": "abort", "error": "error"}
"""The engine's reasons as OpenAI's (``abort``: the request was cancelled, as vLLM says)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.manual_seed takes
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1)
    # vLLM's extensions, kept under vLLM's names
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprob entries name their token ``token_id:N`` (ids survive text that doesn't
    decode alone)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's log-probability given the ones before it, its rank, and this
    many likeliest tokens at its position (the prompt is then computed whole, not read from the
    prefix cache)."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk says the tokens so far."""
        return self.include_usage and bool((self.stream_options or {}).get("continuous_usage_stats"))


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_Part], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def _not_unicode(body: Any) -> str | None:
    """Where in ``body`` a string holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one:
    half of a UTF-16 pair, no character at all), or ``None``."""
    try:  # the whole body at once, in C: a 4 MiB prompt of token ids walked item by item stalls the loop
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(value, dict):
            todo += [(f"{where}.{key}" if where else str(key), item) for key, item in value.items()]
            todo += [(where or "body", key) for key in value]
        elif isinstance(value, list):
            todo += [(f"{where}.{i}" if where else str(i), item) for i, item in enumerate(value)]
    return None


def parse(kind: type[_Request], body: Any) -> _Request:
    """``body`` (parsed JSON) as a request of ``kind``; :class:`InvalidRequestError` says what's wrong."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    where = _not_unicode(body)
    if where is not None:
        raise InvalidRequestError(
            f"{where}: the text holds a lone UTF-16 surrogate (such as \\ud800), half of a character pair "
            "and not a character: send the text as valid Unicode.")
    try:
        request = kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequestError(f"{where}: {first['msg']}") from None
    for name, value in (request.model_extra or {}).items():
        if name in REFUSED_UNLESS_DEFAULT:
            if value not in (REFUSED_UNLESS_DEFAULT[name], None, [], {}):
                raise InvalidRequestError(f"{name} is not supported by this server.")
        elif name not in IGNORED:
            raise InvalidRequestError(f"Unsupported parameter: {name}.")
    for name in ("echo", "suffix", "best_of"):
        value = getattr(request, name, None)
        if value not in (REFUSED_UNLESS_DEFAULT.get(name), None, False, 1):
            raise InvalidRequestError(f"{name} is not supported by this server.")
    if request.n != 1:
        raise InvalidRequestError("n must be 1: this server makes one answer per request (send several requests).")
    return request


DEFAULT_MAX_TOKENS = 512
"""The server's answer limit when neither the request nor the model says one (``serve
--default-max-tokens``): a client that forgets ``max_tokens`` gets an answer in seconds, not a
server held for minutes (vLLM's limit is the rest of the context)."""

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config.json fields that become sampling defaults (vLLM's ``--generation-config auto``)."""


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets."""

    sampling: dict[str, float] = field(default_factory=dict)
    """The model's own sampling values (from its generation_config.json), by OpenAI name."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """Answer limit when the request gives none."""
    max_tokens_from: str = "server"
    """``model`` (its generation_config.json's ``max_new_tokens``) or ``server``."""

    def describe(self) -> str:
        """One line for the panel and the CLI."""
        where = "the model's generation_config" if self.max_tokens_from == "model" else "--default-max-tokens"
        sampling = (", ".join(f"{k} {v:g}" for k, v in self.sampling.items()) + " (the model's generation_config)"
                    if self.sampling else "temperature 1, top_p 1 (OpenAI's; the model names none)")
        return (f"Requests without max_tokens stop after {self.max_tokens:,} tokens ({where}); "
                f"sampling left out: {sampling}.")


def model_defaults(generation_config, max_tokens: int | None = None) -> Defaults:
    """:class:`Defaults` from a model's ``generation_config`` (values its file sets; none for
    ``None``) and the server's limit ``max_tokens`` (``None``: :data:`DEFAULT_MAX_TOKENS`; a limit
    given to the server wins over the model's ``max_new_tokens``)."""
    given = generation_config.to_diff_dict() if generation_config is not None else {}
    sampling = {key: float(given[key]) for key in SAMPLING_KEYS if isinstance(given.get(key), (int, float))
                and not isinstance(given.get(key), bool)}
    if "top_k" in sampling:
        sampling["top_k"] = int(sampling["top_k"])
    if max_tokens is not None:
        return Defaults(sampling, max_tokens, "server")
    model_limit = given.get("max_new_tokens")
    if isinstance(model_limit, int) and not isinstance(model_limit, bool) and model_limit > 0:
        return Defaults(sampling, model_limit, "model")
    return Defaults(sampling)


def _sampling(request: _Request, defaults: Defaults) -> SamplingParams:
    def pick(name: str, fallback):
        given = getattr(request, name)
        return given if given is not None else defaults.sampling.get(name, fallback)

    temperature = pick("temperature", 1.0)
    return SamplingParams(
        temperature=0.0 if temperature < 0.01 else temperature, top_p=pick("top_p", 1.0) or 1.0,
        top_k=max(0, int(pick("top_k", 0) or 0)), min_p=pick("min_p", 0.0) or 0.0,
        repetition_penalty=pick("repetition_penalty", 1.0) or 1.0, seed=request.seed)


def _stops(request: _Request) -> tuple[str, ...]:
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())


def chat_to_engine(request: ChatRequest, defaults: Defaults | None = None) -> GenerationRequest:
    """The engine request for a chat request; no limit given: ``defaults.max_tokens``."""
    defaults = defaults or Defaults()
    messages = [(("system" if m.role == "developer" else m.role), m.text()) for m in request.messages]
    system = []
    while messages and messages[0][0] == "system":
        system.append(messages.pop(0)[1])
    if not messages or messages[-1][0] != "user":
        raise InvalidRequestError("messages must end with a user message (continuing an assistant message is "
                                  "not supported).")
    limit = request.max_completion_tokens or request.max_tokens or defaults.max_tokens
    top = request.top_logprobs if request.logprobs else 0
    return GenerationRequest(
        prompt=messages[-1][1], mode="chat", system_prompt="\n".join(system) if system else None,
        history=tuple(ChatMessage(role, text) for role, text in messages[:-1]), sampling=_sampling(request, defaults),
        max_new_tokens=limit, stop=_stops(request), ignore_eos=request.ignore_eos,
        top_alternatives=top or 0, prompt_logprobs=request.prompt_logprobs)


def completion_to_engine(request: CompletionRequest,
                         defaults: Defaults | None = None) -> tuple[GenerationRequest, list[int] | None]:
    """The engine request (raw text) and, for a prompt given as token ids, those ids; no limit
    given: ``defaults.max_tokens`` (OpenAI's own is 16)."""
    defaults = defaults or Defaults()
    prompt, ids = request.prompt, None
    if isinstance(prompt, list):
        if len(prompt) != 1 and not all(isinstance(p, int) for p in prompt):
            raise InvalidRequestError("prompt: one prompt per request (send several requests).")
        if prompt and all(isinstance(p, int) for p in prompt):
            ids = list(prompt)
        else:
            prompt = prompt[0] if prompt else ""
            if isinstance(prompt, list):
                ids = list(prompt)
        if ids is not None:
            if not ids:
                raise InvalidRequestError("prompt: the token list is empty.")
            prompt = f"[{len(ids)} token ids]"
    return GenerationRequest(
        prompt=prompt, mode="raw", sampling=_sampling(request, defaults),
        max_new_tokens=request.max_tokens or defaults.max_tokens,
        stop=_stops(request), ignore_eos=request.ignore_eos, top_alternatives=request.logprobs or 0,
        prompt_logprobs=request.prompt_logprobs), ids


# -- responses ---------------------------------------------------------------------------------
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    alternatives: tuple  # of engine Alternative
    token_id: int | None = None
    """Set when the client asked for ``return_tokens_as_token_ids``: tokens are named ``token_id:N``."""

    def name(self, text: str, token_id: int) -> str:
        return text if self.token_id is None else f"token_id:{token_id}"


def _entry(name: str, text: str, logprob: float) -> dict:
    return {"token": name, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: list[TokenLogprob], top: int) -> dict:
    return {"content": [{**_entry(i.name(i.token, i.token_id), i.token, i.logprob),
                         "top_logprobs": [_entry(i.name(a.text, a.token_id), a.text, a.logprob)
                                          for a in i.alternatives[:top]]}
                        for i in items]}


def completion_logprobs(items: list[TokenLogprob], top: int, offset: int) -> dict:
    offsets, at = [], offset
    for i in items:
        offsets.append(at)
        at += len(i.token)
    return {"tokens": [i.name(i.token, i.token_id) for i in items], "token_logprobs": [i.logprob for i in items],
            # OpenAI's shape, text → logprob: of two tokens that read the same, the likelier is kept
            "top_logprobs": [{i.name(a.text, a.token_id): a.logprob for a in reversed(i.alternatives[:top])}
                             for i in items],
            "text_offset": offsets}


def prompt_logprobs(scored, as_ids: bool) -> list:
    """vLLM's ``prompt_logprobs``: one entry per prompt token, ``None`` for the first (nothing
    before it), then ``{token id: {logprob, rank, decoded_token}}`` holding the prompt's token and
    the likeliest ones at its position (JSON makes the ids strings)."""
    def entry(token_id: int, text: str, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": f"token_id:{token_id}" if as_ids else text}

    out: list = [None]
    for score in scored.scores:
        entries = {a.token_id: entry(a.token_id, a.text, a.logprob, rank)
                   for rank, a in enumerate(score.top_alternatives, 1)}
        entries[score.token_id] = entry(score.token_id, score.text, score.logprob, score.rank)
        out.append(entries)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's ``usage``; with ``cached_tokens`` (the final one) its ``prompt_tokens_details``:
    prompt tokens found in the prefix cache, as OpenAI and vLLM report them."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def envelope(kind: str, rid: str, model: str, created: int | None = None) -> dict:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model}
