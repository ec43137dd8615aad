"""Chat samples -> token ids with the span of the trained (last assistant) turn.

A sample is a list of `{"role", "content"}` messages. It is rendered with the tokenizer's chat template in
three pieces, tokenized separately and concatenated:
    prompt  = the render up to where the last assistant turn's content starts
    target  = the last assistant turn's content + its end-of-turn token (the tokenizer's eos_token)
    trailer = whatever the full render has after that (e.g. a newline, later non-assistant turns)
The pieces come from two renders: the full conversation, and the same conversation with the last assistant
content replaced by a marker (the prompt is the text before the marker). So the mask needs no
`{% generation %}` markers in the template, and it works for a conversation that is a single assistant turn
(transformers 5 refuses to render an empty prefix). Tokenizing the prompt on its own matches inference,
where generation starts right after the prompt tokens. Raw pretraining text is a single assistant turn:
its prompt is only the template header, and all of its text is the target.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
CONTENT_MARKER = "\x00<<trained-content>>\x00"  # stands in for the last assistant content to find where it starts


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
        # encode_batch_fast (no offsets; tokenizers >= 0.21) when present
        backend = tokenizer.backend_tokenizer
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._check_template()

    def _check_template(self) -> None:
        probe = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "probe answer"}]
        try:
            prompt, target, _ = self.split(probe)
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

    def split(self, messages: list[dict[str, str]]) -> tuple[str, str, str]:
        """(prompt, target, trailer) texts of a validated conversation."""
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        marked = [*messages[:last], {"role": "assistant", "content": CONTENT_MARKER}, *messages[last + 1 :]]
        marked_text = self._render(marked)
        full = self._render(messages)
        prompt = marked_text[: marked_text.find(CONTENT_MARKER)]
        if CONTENT_MARKER not in marked_text or not full.startswith(prompt):
            raise BadRecord(
                "the chat template does not render the last assistant turn's content after the same prefix, so "
                f"the trained span cannot be located (prefix ends {prompt[-40:]!r})"
            )
        content = messages[last]["content"]
        # search for the end-of-turn token after the content when it is rendered verbatim, so that a literal
        # end-of-turn string inside the content cannot cut the target short
        search_from = len(prompt) + (len(content) if full.startswith(content, len(prompt)) else 0)
        end = full.find(self.end_of_turn, search_from)
        if end < 0:
            raise BadRecord(f"the rendered last assistant turn has no end-of-turn token {self.end_of_turn!r}")
        end += len(self.end_of_turn)
        return prompt, full[len(prompt) : end], full[end:]

    def tokenize(self, pieces: list[tuple[str, str, str]]) -> list[TokenizedChat]:
        """Tokenize `split()` outputs (one batched tokenizer call for all pieces)."""
        flat = [text for triple in pieces for text in triple]
        ids = [e.ids for e in self._encode_batch(flat, add_special_tokens=False)] if flat else []
        out = []
        for k in range(len(pieces)):
            prompt, target, trailer = ids[3 * k], ids[3 * k + 1], ids[3 * k + 2]
            out.append(TokenizedChat(prompt + target + trailer, len(prompt), len(prompt) + len(target)))
        return out
