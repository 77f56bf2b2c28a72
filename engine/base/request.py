"""What a caller asks for: the prompt (chat or raw), sampling and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.base.errors import InvalidRequestError
from engine.base.sampling import SamplingParams

MAX_NEW_TOKENS = 10_000_000
MAX_LOGPROBS = 20
"""The most likeliest tokens reported beside one token (vLLM's ``--max-logprobs`` default)."""


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    mode: Literal["chat", "raw"] = "chat"
    """``chat`` wraps the prompt in the model's chat template; ``raw`` continues the text as is."""
    system_prompt: str | None = None
    """``None`` keeps the template's own default system prompt, if it has one."""
    history: tuple[ChatMessage, ...] = ()
    """Earlier turns, oldest first (chat mode)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Stop once the answer contains one of these strings (it stays in the answer)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence tokens (benchmarks that need exactly N tokens)."""
    top_alternatives: int = 5
    """How many most-likely tokens to report beside each generated one."""
    reuse_prefix: bool = True
    """Copy what the prefix cache holds of this prompt instead of computing it (where the core
    keeps one); ``False`` computes the whole prompt (a cold TTFT), its blocks still kept."""
    prompt_logprobs: int | None = None
    """Score the prompt too (vLLM's ``prompt_logprobs``): each prompt token's log-probability
    given the ones before it, its rank, and this many likeliest tokens beside it (0: the token's
    own only); the core then computes the whole prompt, never copying it from the prefix cache
    (:class:`~engine.base.events.PromptScored`). ``None``: not scored."""
    continues: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The last exchange of ``history`` as the model read and wrote it: its prompt's token ids and
    its answer's (chat mode). The prompt then continues from those very tokens, only the template's
    new turn tokenized, instead of the history's text tokenized again (which can split differently
    from how the model wrote it, and then the prefix cache finds nothing past the first change);
    where the template can't be split that way the history is read as text (:func:`continued_ids`)."""

    def validated(self) -> "GenerationRequest":
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise InvalidRequestError("The prompt is empty: type something for the model to answer.")
        if self.mode not in ("chat", "raw"):
            raise InvalidRequestError(f"mode must be 'chat' or 'raw', not {self.mode!r}.")
        try:
            max_new = int(self.max_new_tokens)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"max_new_tokens must be a whole number, not {self.max_new_tokens!r}.") from None
        if isinstance(self.max_new_tokens, bool) or max_new != self.max_new_tokens or not 0 < max_new <= MAX_NEW_TOKENS:
            raise InvalidRequestError(
                f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS:,}, not {self.max_new_tokens!r}.")
        if not isinstance(self.top_alternatives, int) or not 0 <= self.top_alternatives <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_alternatives must be between 0 and {MAX_LOGPROBS}.")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be a whole number from 0 to {MAX_LOGPROBS}.")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stops):
            raise InvalidRequestError(f"stop strings must be text, not {self.stop!r}.")
        stops = tuple(s for s in stops if s)
        return GenerationRequest(
            prompt=self.prompt, mode=self.mode, system_prompt=self.system_prompt,
            history=tuple(self.history), sampling=self.sampling.validated(), max_new_tokens=max_new,
            stop=stops, ignore_eos=bool(self.ignore_eos), top_alternatives=self.top_alternatives,
            reuse_prefix=bool(self.reuse_prefix), prompt_logprobs=self.prompt_logprobs,
            continues=_ids_pair(self.continues),
        )

    def messages(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        if self.system_prompt is not None:
            out.append({"role": "system", "content": self.system_prompt})
        out += [{"role": m.role, "content": m.content} for m in self.history]
        out.append({"role": "user", "content": self.prompt})
        return out


def _ids_pair(pair) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if pair is None:
        return None
    try:
        prompt, answer = pair
        return tuple(int(i) for i in prompt), tuple(int(i) for i in answer)
    except (TypeError, ValueError):
        raise InvalidRequestError("continues must be two lists of token ids: the last prompt's and its answer's.") \
            from None


def continued_ids(tokenizer, request: GenerationRequest) -> list[int] | None:
    """The chat prompt as the last exchange's tokens (``request.continues``) followed by the
    template's tokens for the new turn; ``None`` where the template can't be split that way (it
    renders the earlier turns otherwise once a new one follows, as templates that drop a past
    answer's reasoning do). The template's text for the whole conversation must begin with its
    text for the last prompt and the last answer; what follows is tokenized alone, less the
    answer's own end-of-turn token where the model wrote it."""
    if request.continues is None or not request.history or request.history[-1].role != "assistant":
        return None
    prompt_ids, answer_ids = request.continues
    if not prompt_ids or not answer_ids:
        return None
    messages = request.messages()
    before = tokenizer.apply_chat_template(messages[:-2], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = request.history[-1].content
    if not whole.startswith(before + answer):
        return None
    rest = whole[len(before) + len(answer):]
    end = answer_ids[-1]
    if end in set(tokenizer.all_special_ids):
        written = tokenizer.decode([end])
        if not rest.startswith(written):  # the model ended its turn with a token the template doesn't write there
            return None
        rest = rest[len(written):]
    return [*prompt_ids, *answer_ids, *tokenizer(rest, add_special_tokens=False)["input_ids"]]


def encode_prompt(tokenizer, request: GenerationRequest) -> list[int]:
    """Token ids of the prompt: the chat template with a generation prompt (continuing from the
    last exchange's tokens where the request carries them), or the raw text."""
    if request.mode == "raw":
        return list(tokenizer(request.prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("This model has no chat template: use raw mode to continue text instead.")
    continued = continued_ids(tokenizer, request)
    if continued is not None:
        return continued
    encoded = tokenizer.apply_chat_template(request.messages(), add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return list(encoded["input_ids"])
