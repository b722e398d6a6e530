"""Incremental detokenization with stop strings: text safe to show now, and never any of a stop string.

The tiny GPT's tokens are UTF-8 bytes, so one token can be a third of a character: a decoder that
turned each token into text on its own would print U+FFFD for every byte of "☕". The incremental
UTF-8 decoder keeps an unfinished character's bytes until the character is complete.

Stop strings are text, and a stop string can span tokens ("\\n\\n" is two tokens here; in a BPE
vocabulary "END" may be "EN" + "D"). So the check runs on the decoded text, and text is held back
while it could still become a stop string: after each token the longest suffix of the unsent text
that is a prefix of some stop string stays unsent. When a stop string completes, the text before
it is the last to go out, and the request stops (finish_reason "stop"; the stop text is never sent,
OpenAI's and vLLM's default, vllm-project/vllm@b4622cf9, vllm/v1/engine/detokenizer.py:
check_stop_strings; written fresh here).

``Detokenizer.push(token) -> (text, stopped)``, ``flush() -> text`` (what is still held when the
answer ends for another reason). ``ends[k]`` is the length of the decoded text after token k: the
server uses it to send a token's log-probs with the text that contains it, and to return only the
tokens of the text it returned.
"""
from __future__ import annotations

import codecs


class Detokenizer:
    def __init__(self, stop: list[str] | tuple[str, ...] = ()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("Detokenizer: stop strings must be non-empty strings")
        self.stop = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""                 # everything decoded so far
        self.sent = 0                  # text[:sent] has been returned by push/flush
        self.ends: list[int] = []      # len(text) after each token
        self.stopped = False

    def _held(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of a stop string."""
        tail = self.text[self.sent:]
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, token: int) -> tuple[str, bool]:
        """Add one byte token; returns (text that can be sent now, whether a stop string completed)."""
        if self.stopped:
            raise RuntimeError("Detokenizer: push after a stop string")
        self.text += self._decoder.decode(bytes([token]))
        self.ends.append(len(self.text))
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent, self.stopped = self.text[self.sent:cut], cut, True
            self.text = self.text[:cut]
            return out, True
        end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self) -> str:
        """The answer ended (length, stop token): whatever is held, and an unfinished character as U+FFFD."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
