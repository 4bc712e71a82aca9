"""ReasoningParser: splits a reasoning model's `<think>...</think>` from its answer.

Runs in: the ApiServer process (`--reasoning-parser`). `deepseek_r1`: the text is reasoning
until `</think>` (its chat template opens the `<think>` in the prompt; a leading `<think>` in
the output is dropped). `qwen3`: the text is content unless it opens with `<think>`.

Invariant: fed the text in any pieces, the concatenated reasoning and content returned are the
same as when fed it whole (a tail that could begin a tag is held back until it cannot).
"""

from __future__ import annotations

__all__ = ["PARSERS", "ReasoningParser"]

START = "<think>"
END = "</think>"


class ReasoningParser:
    """One choice's splitter. `feed(text)` and `finish()` return (reasoning, content)."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        # "start": the output's first characters may open a <think>; "think"; "content".
        self._state = "start"
        self._default = "think" if starts_in_reasoning else "content"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(START):
                    self._buffer = stripped[len(START) :]
                    self._state = "think"
                elif START.startswith(stripped):
                    break  # could still become <think>
                else:
                    self._state = self._default
            elif self._state == "think":
                at = self._buffer.find(END)
                if at < 0:
                    keep = _partial_suffix(self._buffer, END)
                    reasoning.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                reasoning.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(END) :]
                self._state = "content"
            else:
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "think":
            return rest, ""
        return "", rest


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


PARSERS = {
    "deepseek_r1": lambda: ReasoningParser(starts_in_reasoning=True),
    "qwen3": lambda: ReasoningParser(starts_in_reasoning=False),
}
