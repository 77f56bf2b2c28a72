"""The conversation as data: turns, the tokens of each answer, and their export.

No Qt here: the output view renders a Transcript, the save action exports one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from engine.base.events import Finished, Loaded, TokenGenerated
from engine.base.request import ChatMessage
from engine.runs import Run


ENDINGS = {"eos": "by the model", "length": "at the token limit", "stop_string": "at a stop string",
           "cancelled": "by you (stopped)", "context": "at the end of the context window", "error": "by an error"}
"""How an answer ended, in words that follow "ended" (``Finished.reason``)."""


def ending(reason: str) -> str:
    return ENDINGS.get(reason, reason)


@dataclass
class Turn:
    """A user's prompt (``text``) or the model's answer (its :class:`Run`, the one the plots read)."""

    role: str  # "user" or "assistant"
    text: str = ""
    run: Run = field(default_factory=Run)

    @property
    def tokens(self) -> list[TokenGenerated]:
        return self.run.tokens

    @property
    def finished(self) -> Finished | None:
        return self.run.finished

    @property
    def error(self) -> str | None:
        return self.run.error

    def answer_text(self) -> str:
        """The answer without special tokens (end-of-turn markers and the like)."""
        return self.run.text if self.role == "assistant" else self.text


class Transcript:
    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.model: Loaded | None = None
        self.mode = "chat"
        self.system_prompt: str | None = None
        self.clears = 0
        """How many times it was cleared (a view that rendered it before a clear starts again,
        even when the new turns are as many as the old: raw mode's prompt and answer)."""

    def clear(self) -> None:
        self.turns.clear()
        self.clears += 1

    def add_user(self, text: str) -> Turn:
        turn = Turn("user", text)
        self.turns.append(turn)
        return turn

    def start_answer(self, weights_bytes: int | None = None) -> Turn:
        turn = Turn("assistant", run=Run(weights_bytes))
        self.turns.append(turn)
        return turn

    @property
    def current(self) -> Turn | None:
        return self.turns[-1] if self.turns and self.turns[-1].role == "assistant" else None

    def history(self) -> tuple[ChatMessage, ...]:
        """Earlier complete exchanges, for the next chat request."""
        messages = []
        for turn in self.turns:
            if turn.role == "user":
                messages.append(ChatMessage("user", turn.text))
            elif turn.role == "assistant" and turn.tokens:
                messages.append(ChatMessage("assistant", turn.answer_text()))
        # a trailing user turn without an answer is the one being asked now
        if messages and messages[-1].role == "user":
            messages.pop()
        return tuple(messages)

    def continues(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The last exchange as the model read and wrote it (its prompt's ids, its answer's), for
        the next chat request to continue from (``None``: no finished answer to continue)."""
        answered = [turn for turn in self.turns if turn.role == "assistant" and turn.tokens]
        if not answered:
            return None
        finished = answered[-1].finished
        if finished is None or finished.reason == "error" or not finished.prompt_ids or not finished.token_ids:
            return None
        return tuple(finished.prompt_ids), tuple(finished.token_ids)

    def last_answer(self) -> str:
        for turn in reversed(self.turns):
            if turn.role == "assistant":
                return turn.answer_text()
        return ""

    def to_markdown(self) -> str:
        lines = ["# Inference Workbench transcript", ""]
        if self.model is not None:
            m = self.model
            lines += [f"- model: {m.name} ({m.original_format}) as {m.precision} on {m.device_name}",
                      f"- mode: {self.mode}", ""]
        if self.system_prompt:
            lines += ["**System:** " + self.system_prompt, ""]
        for turn in self.turns:
            if turn.role == "user":
                lines += ["**You:**", "", turn.text, ""]
            elif turn.role == "assistant":
                lines += ["**Model:**", "", turn.answer_text(), ""]
                if turn.finished is not None:
                    f = turn.finished
                    rate = f"{f.decode_tokens_per_s:.1f} tok/s" if f.decode_tokens_per_s else "n/a"
                    ttft = f"{f.ttft_s * 1000:.0f} ms" if f.ttft_s is not None else "n/a"
                    cached = (f" · {f.cached_tokens} of {f.prompt_tokens} prompt tokens from the cache"
                              if f.cached_tokens else "")
                    lines += [f"_{f.tokens} tokens · TTFT {ttft}{cached} · {rate} · ended {ending(f.reason)}_", ""]
                if turn.error:
                    lines += [f"_error: {turn.error}_", ""]
        return "\n".join(lines)

    def to_json(self) -> str:
        def turn_data(turn: Turn) -> dict:
            data: dict = {"role": turn.role, "text": turn.answer_text()}
            if turn.role == "assistant":
                data["tokens"] = [
                    {"id": t.token_id, "text": t.text, "logprob": t.logprob, "latency_s": t.latency_s,
                     "kv_cache_bytes": t.kv_cache_bytes, "special": t.special,
                     "top_alternatives": [[a.token_id, a.text, a.logprob] for a in t.top_alternatives]}
                    for t in turn.tokens
                ]
                data["finished"] = None if turn.finished is None else {
                    k: v for k, v in asdict(turn.finished).items() if k not in ("token_ids", "text")}
                data["error"] = turn.error
            return data

        return json.dumps({
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": None if self.model is None else asdict(self.model),
            "mode": self.mode,
            "system_prompt": self.system_prompt,
            "turns": [turn_data(t) for t in self.turns],
        }, indent=2, ensure_ascii=False)
