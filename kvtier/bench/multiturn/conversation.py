"""The multi-turn workload: its parameters (`WorkloadSpec`) and one conversation in progress.

Sizes are real tokens of the model's tokenizer through its chat template:

- turn 1's prompt (system prompt, chat markup and the first user message) is `initial_tokens` long;
- every later turn's prompt is the previous prompt, the model's reply to it (as the chat template
  writes an assistant message) and a new user message of `tokens_per_turn` tokens (its chat markup
  and the assistant header included), so prompt n = initial + (n-1) x per turn + earlier replies.

A user message is the next part of the conversation's report (`corpus`) followed by a question,
the report cut word by word to the exact size. Every turn the model's actual reply is appended
before the next user message (`Conversation.answer`), so the prefix a turn shares with the
previous one includes that reply. Everything is deterministic for a given seed, tag and tokenizer.

A conversation given a `Script` asks the script's fixed user messages instead (the sizes above do
not apply; `kvtier demo`'s chats); a script that also records replies replays a conversation:
the runner then generates only each turn's first token and appends the recorded reply, so two
passes send identical prompts (`Conversation.transcript` records one).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvtier.bench.multiturn.corpus import question, rng_for, words

Message = dict[str, str]
SYSTEM_PROMPT = (
    "You are a patient and precise assistant. Answer in plain English, in a few sentences, and "
    "stay close to the text the user gives you. When the user asks a follow-up question, use what "
    "was said earlier in the conversation."
)
FILLERS = ("and", "so", "then", "also", "too", "again", "here", "now")
OPENING = "Please read this report carefully; I will ask questions about it."
FOLLOW_UP = "Here is the next part of the report."


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workload uses."""

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadSpec:
    """The benchmark's workload; `check()` names the flag of a bad value."""

    initial_tokens: int
    tokens_per_turn: int
    turns: int
    conversations: int
    max_concurrency: int
    output_tokens: int
    seed: int = 0

    def check(self) -> None:
        for name in ("initial_tokens", "tokens_per_turn", "turns", "conversations",
                     "max_concurrency", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")

    def max_prompt_tokens(self, reply_markup: int = 8) -> int:
        """An upper bound of the longest prompt (replies of `output_tokens` plus their markup)."""
        return (self.initial_tokens + (self.turns - 1) * (self.tokens_per_turn + self.output_tokens
                                                          + reply_markup))

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def chat_ids(tokenizer: Tokenizer, messages: list[Message], generation_prompt: bool = True) -> list[int]:
    """`messages` through the chat template, as token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@dataclass(frozen=True)
class Script:
    """Fixed text of a conversation: the opening user message, the follow-ups in order and, for
    a replay, the assistant's reply to each turn."""

    title: str
    opening: str
    followups: tuple[str, ...]
    replies: tuple[str, ...] = ()

    def message(self, turn: int) -> str:
        """The user message of `turn` (1-based)."""
        return self.opening if turn == 1 else self.followups[turn - 2]


@dataclass
class Conversation:
    """One conversation: the messages so far, and the report text not yet used (or its script)."""

    index: int
    spec: WorkloadSpec
    tokenizer: Tokenizer
    tag: str = ""
    messages: list[Message] = field(default_factory=list)
    turn: int = 0
    script: Script | None = None

    def __post_init__(self) -> None:
        script = self.script
        if script is not None and (1 + len(script.followups) < self.spec.turns
                                   or 0 < len(script.replies) < self.spec.turns):
            raise ValueError(f"--turns {self.spec.turns}: script {script.title!r} has text for "
                             f"{1 + len(script.followups)} turns and {len(script.replies)} replies")
        self._rng = rng_for(self.spec.seed, self.tag, self.index)
        self._words: Iterator[str] = words(self._rng)
        self._pending: list[str] = []
        if not self.messages:
            self.messages.append({"role": "system", "content": SYSTEM_PROMPT})

    @property
    def finished(self) -> bool:
        """Every turn was asked and answered."""
        return self.turn == self.spec.turns and self.messages[-1]["role"] == "assistant"

    def ask(self) -> list[Message]:
        """Append the next user message, sized as the module docstring says; return the messages
        (a copy) that make the prompt. Raises RuntimeError when the last turn was asked."""
        if self.turn >= self.spec.turns:
            raise RuntimeError(f"conversation {self.index}: all {self.spec.turns} turns were asked")
        if self.turn > 0 and self.messages[-1]["role"] != "assistant":
            raise RuntimeError(f"conversation {self.index}: turn {self.turn} has no answer yet")
        if self.script is not None:
            text = self.script.message(self.turn + 1)
        else:
            first = self.turn == 0
            base = 0 if first else len(chat_ids(self.tokenizer, self.messages, generation_prompt=False))
            target = self.spec.initial_tokens if first else self.spec.tokens_per_turn
            flag = "--initial-tokens" if first else "--tokens-per-turn"
            text = self._fit(target, base, OPENING if first else FOLLOW_UP, question(self._rng), flag)
        self.messages.append({"role": "user", "content": text})
        self.turn += 1
        return [dict(m) for m in self.messages]

    def answer(self, reply: str) -> None:
        """Append the model's reply to the last user message."""
        if self.messages[-1]["role"] != "user":
            raise RuntimeError(f"conversation {self.index}: no question to answer")
        self.messages.append({"role": "assistant", "content": reply})

    @property
    def recorded_reply(self) -> str | None:
        """The script's reply to the turn asked last (a replay), or None: the model answers."""
        if self.script is None or not self.script.replies or self.turn == 0:
            return None
        return self.script.replies[self.turn - 1]

    def transcript(self) -> Script:
        """The conversation so far (at least one turn asked) as a script that replays it: its
        user messages and the replies given."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        replies = tuple(m["content"] for m in self.messages if m["role"] == "assistant")
        title = self.script.title if self.script is not None else f"conversation {self.index}"
        return Script(title, users[0], tuple(users[1:]), replies)

    def prompt_ids(self) -> list[int]:
        """The current messages through the chat template, ready for the assistant's reply."""
        return chat_ids(self.tokenizer, self.messages)

    def _need(self, text: str, base: int) -> int:
        msgs = [*self.messages, {"role": "user", "content": text}]
        return len(chat_ids(self.tokenizer, msgs)) - base

    def _fit(self, target: int, base: int, header: str, ask: str, flag: str) -> str:
        """The user message of exactly `target` template tokens (the closest below when the
        tokenizer cannot make it exact): header, report words, fillers, then the question."""

        def content(n: int, fill: int = 0) -> str:
            body = " ".join([header, *self._pending[:n], *FILLERS[:fill]])
            return f"{body}\n\nQuestion: {ask}"

        def estimate(n: int, fill: int = 0) -> int:  # template markup + tokens of the text
            return overhead + len(self.tokenizer.encode(content(n, fill), add_special_tokens=False))

        overhead = self._need(content(0), base) - len(
            self.tokenizer.encode(content(0), add_special_tokens=False))
        if estimate(0) > target:
            raise ValueError(f"{flag} {target}: too small for a message with a question "
                             f"(at least {estimate(0)} tokens)")
        while estimate(len(self._pending)) < target:
            self._pending.extend(next(self._words) for _ in range(64))
        lo, hi = 0, len(self._pending)  # estimate(lo) <= target < estimate(hi) or lo == hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if estimate(mid) <= target else (lo, mid)
        fill = 0
        while fill < len(FILLERS) and estimate(lo, fill) < target and estimate(lo, fill + 1) <= target:
            fill += 1
        text = content(lo, fill)
        if self._need(text, base) != estimate(lo, fill):  # a template that is not additive
            lo = self._fit_slow(target, base, content, lo)
            text = content(lo)
        del self._pending[:lo]
        return text

    def _fit_slow(self, target: int, base: int, content: Any, start: int) -> int:
        """The most report words whose message fits `target`, measured through the template."""
        n = start
        while n > 0 and self._need(content(n), base) > target:
            n -= 1
        while n < len(self._pending) and self._need(content(n + 1), base) <= target:
            n += 1
        return n
