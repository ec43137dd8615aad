"""Chat data: tokenizer loading, chat rendering with a last-assistant-turn mask (the chat document source),
packing, DP sharding and a resumable packed loader (see CONTRACTS.md "Data batches")."""

from llm_training.data.chat import BadRecord, ChatTokenizer, TokenizedChat, validate_conversation
from llm_training.data.chat_source import ChatDocumentSource
from llm_training.data.dataloader import BadRecordError, PackedDataLoader, build_dataloader
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
    "ChatDocumentSource",
    "ChatTokenizer",
    "Document",
    "JsonlRecords",
    "PackedDataLoader",
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
