"""Chat data: tokenizer loading, chat rendering with a last-assistant-turn mask, packing, DP sharding and a
resumable loader (see CONTRACTS.md "Data batches")."""

from llm_training.data.chat import BadRecord, ChatTokenizer, TokenizedChat, validate_conversation
from llm_training.data.dataloader import BadRecordError, ChatDataLoader, build_dataloader
from llm_training.data.packing import IGNORE_INDEX, Document, RowPacker, collate_rows, fit_document
from llm_training.data.records import JsonlRecords, SaveToDiskRecords, check_dataset, open_records
from llm_training.data.tokenizer import BUNDLED_TOKENIZER_PATH, build_tokenizer

DEMO_DATA_PATH = BUNDLED_TOKENIZER_PATH.parent / "demo_chat.jsonl"

__all__ = [
    "BUNDLED_TOKENIZER_PATH",
    "DEMO_DATA_PATH",
    "IGNORE_INDEX",
    "BadRecord",
    "BadRecordError",
    "ChatDataLoader",
    "ChatTokenizer",
    "Document",
    "JsonlRecords",
    "RowPacker",
    "SaveToDiskRecords",
    "TokenizedChat",
    "build_dataloader",
    "build_tokenizer",
    "check_dataset",
    "collate_rows",
    "fit_document",
    "open_records",
    "validate_conversation",
]
