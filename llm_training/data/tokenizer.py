"""Load a local HuggingFace tokenizer directory and check it can render chats."""

from __future__ import annotations

from pathlib import Path

BUNDLED_TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer"


def build_tokenizer(path: str | Path):
    """Load the tokenizer in `path` (a local HF tokenizer dir, never downloaded) and check it for chat training.

    Fails at start-up, naming the path and the fix, when the directory is missing, cannot be loaded, has no
    chat template, or lacks the eos (end-of-turn) / pad tokens the data loader needs.
    """
    from transformers import AutoTokenizer  # imported here: transformers is slow to import

    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"[model] tokenizer_path: {str(path)!r} is not a directory. Point it at a local HuggingFace "
            f"tokenizer folder (tokenizer.json + tokenizer_config.json), e.g. the bundled {BUNDLED_TOKENIZER_PATH}."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...) for unusable dirs
        raise ValueError(f"[model] tokenizer_path: could not load a tokenizer from {str(path)!r}: {exc}") from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(
            f"[model] tokenizer_path: the tokenizer in {str(path)!r} is not a fast (tokenizers-backed) tokenizer; "
            "the data loader needs a tokenizer.json in the folder."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"[model] tokenizer_path: the tokenizer in {str(path)!r} has no chat template. Chat training renders "
            "every sample with it: add a 'chat_template' to tokenizer_config.json (or a chat_template.jinja file)."
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"[model] tokenizer_path: the tokenizer in {str(path)!r} has no eos_token; the data loader uses it as the "
            "end-of-turn marker of the trained assistant turn. Set eos_token in tokenizer_config.json."
        )
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"[model] tokenizer_path: the tokenizer in {str(path)!r} has no pad_token; set pad_token in "
            "tokenizer_config.json (any special token that never appears in the data)."
        )
    return tokenizer
