"""Chat samples -> token ids with the span of the trained (last assistant) turn; message content is text.

A sample is a list of `{"role", "content"}` messages. It is rendered with the tokenizer's chat template and
cut into three pieces, tokenized separately and concatenated:
    prompt  = the render up to where the last assistant turn's content starts
    target  = the last assistant turn's content + its end-of-turn token (the tokenizer's eos_token)
    trailer = whatever the full render has after that (e.g. a newline, later non-assistant turns)
Each piece is a list of segments: template text (tokenized normally, so `<|im_start|>` written by the template
is the control token) and message content (tokenized with every special token split as plain text, so a
literal `<|im_end|>` typed inside a message is a few ordinary tokens: data cannot end a turn, forge one or
inject any other control token). The segments come from two renders: the full conversation, and the same
conversation with every content replaced by a marker, which gives the template text between contents; the
full render is then walked template piece by content (verbatim, or stripped of surrounding whitespace as
`| trim` templates do). So the mask needs no `{% generation %}` markers in the template, and it works for a
conversation that is a single assistant turn (transformers 5 refuses to render an empty prefix). Tokenizing
the prompt on its own matches inference, where generation starts right after the prompt tokens. Raw
pretraining text is a single assistant turn: its prompt is only the template header, and all of its text is
the target. Added tokens that are not special (e.g. `<think>` in some vocabularies) stay tokens in content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
_MARKER = "\x00<<content-{}>>\x00"  # stands in for message k's content to find the template text around it
_MARKER_RE = re.compile("\x00<<content-(\\d+)>>\x00")

Segment = tuple[str, bool]  # (text, is message content)


class BadRecord(Exception):
    """A record that cannot be trained on; `reason` says why (the loader adds file:line)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TokenizedChat:
    """Token ids of one rendered conversation; ids[target_start:target_end] are the trained tokens."""

    ids: list[int]
    target_start: int
    target_end: int


def validate_conversation(conversation: object) -> list[dict[str, str]]:
    """Check the raw conversations value; return it as plain `{"role", "content"}` dicts or raise BadRecord."""
    if isinstance(conversation, BadRecord):
        raise conversation
    if not isinstance(conversation, list):
        raise BadRecord(f"conversations is a {type(conversation).__name__}, expected a list of messages")
    if not conversation:
        raise BadRecord("conversations is empty")
    messages = []
    for turn, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise BadRecord(f"message {turn} is a {type(message).__name__}, expected an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRecord(f"message {turn} has unknown role {role!r} (expected one of {list(ROLES)})")
        if not isinstance(content, str):
            raise BadRecord(f"message {turn} content is {type(content).__name__}, expected a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn to train on")
    return messages


class ChatTokenizer:
    """Renders validated conversations with the chat template and tokenizes them (see module doc)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        # the Rust tokenizer directly: the transformers wrapper costs more than the encoding for short texts;
        # encode_batch_fast (no offsets; tokenizers >= 0.21) when present. Content goes through a copy that
        # splits special tokens as plain text.
        from tokenizers import Tokenizer

        backend = tokenizer.backend_tokenizer
        content_backend = Tokenizer.from_str(backend.to_str())
        content_backend.encode_special_tokens = True
        self._encode_template = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._encode_content = getattr(content_backend, "encode_batch_fast", content_backend.encode_batch)
        self._check_template()

    def _check_template(self) -> None:
        probe = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "probe answer"}]
        try:
            prompt, target, _ = ("".join(text for text, _ in piece) for piece in self.split(probe))
        except BadRecord as bad:
            raise ValueError(f"the tokenizer's chat template cannot be used for chat training: {bad.reason}") from None
        if not target.startswith("probe answer") or not target.endswith(self.end_of_turn):
            raise ValueError(
                "the tokenizer's chat template does not render an assistant turn as '<generation prompt>"
                f"<content>{self.end_of_turn}' (eos_token): the last-assistant-turn mask cannot be computed. "
                f"Rendered prompt={prompt!r}, target={target!r}"
            )

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        except Exception as exc:  # jinja's TemplateError from raise_exception(), or any error inside the template
            raise BadRecord(f"the chat template rejected the conversation ({type(exc).__name__}: {exc})") from None

    def split(self, messages: list[dict[str, str]]) -> tuple[list[Segment], list[Segment], list[Segment]]:
        """(prompt, target, trailer) segments of a validated conversation (see the module doc)."""
        segments = self._segments(messages)  # template, content, template, ..., template
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        at = next((j for j, (_, k) in enumerate(segments) if k == last), None)
        if at is None:
            raise BadRecord("the chat template does not render the last assistant turn's content")
        after = segments[at + 1][0]  # the template text right after it holds the end-of-turn token
        end = after.find(self.end_of_turn)
        if end < 0:
            raise BadRecord(f"the rendered last assistant turn has no end-of-turn token {self.end_of_turn!r}")
        end += len(self.end_of_turn)
        plain = [(text, k is not None) for text, k in segments]
        prompt = plain[:at]
        target = [plain[at], (after[:end], False)]
        trailer = [(after[end:], False), *plain[at + 2 :]]
        return tuple([seg for seg in piece if seg[0]] for piece in (prompt, target, trailer))

    def _segments(self, messages: list[dict[str, str]]) -> list[tuple[str, int | None]]:
        """The full render as (text, message index) pieces: template text (index None) and message contents as
        the template renders them (verbatim, or without surrounding whitespace)."""
        marked = self._render([{"role": m["role"], "content": _MARKER.format(k)} for k, m in enumerate(messages)])
        full = self._render(messages)
        pieces = _MARKER_RE.split(marked)  # template, k, template, k, ..., template
        segments: list[tuple[str, int | None]] = []
        pos = 0
        for j in range(0, len(pieces), 2):
            template = pieces[j]
            if not full.startswith(template, pos):
                raise BadRecord(
                    "the chat template renders the text around message contents differently depending on the "
                    f"content, so the trained span cannot be located (near {full[pos : pos + 40]!r})"
                )
            segments.append((template, None))
            pos += len(template)
            if j + 1 == len(pieces):
                break
            k = int(pieces[j + 1])
            content, following = messages[k]["content"], pieces[j + 2]
            rendered = next(
                (
                    c
                    for c in _content_forms(content)
                    if full.startswith(c, pos) and full.startswith(following, pos + len(c))
                ),
                None,
            )
            if rendered is None:
                raise BadRecord(
                    f"the chat template changes the content of message {k} (beyond trimming whitespace), so it "
                    "cannot be tokenized as text"
                )
            segments.append((rendered, k))
            pos += len(rendered)
        if pos != len(full):
            raise BadRecord("the chat template's render has text after the last template piece")
        return segments

    def tokenize(self, pieces: list[tuple[list[Segment], list[Segment], list[Segment]]]) -> list[TokenizedChat]:
        """Tokenize `split()` outputs: template segments normally, content segments with special tokens as text
        (one batched tokenizer call each)."""
        flat = [seg for triple in pieces for piece in triple for seg in piece]
        template = [text for text, is_content in flat if not is_content]
        content = [text for text, is_content in flat if is_content]
        encoded_template = iter(
            [e.ids for e in self._encode_template(template, add_special_tokens=False)] if template else []
        )
        encoded_content = iter(
            [e.ids for e in self._encode_content(content, add_special_tokens=False)] if content else []
        )
        out = []
        for triple in pieces:
            ids = [
                [i for _, is_content in piece for i in next(encoded_content if is_content else encoded_template)]
                for piece in triple
            ]
            prompt, target, trailer = ids
            out.append(TokenizedChat(prompt + target + trailer, len(prompt), len(prompt) + len(target)))
        return out


def _content_forms(content: str) -> list[str]:
    """How a template may render `content`: verbatim first, then without surrounding whitespace."""
    return list(dict.fromkeys([content, content.strip(), content.lstrip(), content.rstrip()]))
