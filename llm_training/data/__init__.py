"""Chat data: tokenizer loading, chat rendering with a last-assistant-turn mask (the chat document source),
packing, DP sharding, a resumable packed loader, data mixtures over several sources (local files or HuggingFace
Hub datasets) (see CONTRACTS.md "Data batches")."""

from llm_training.data.build import build_dataloader, check_source, open_source_records
from llm_training.data.chat import BadRecord, ChatTokenizer, TokenizedChat, validate_conversation
from llm_training.data.chat_source import ChatDocumentSource
from llm_training.data.dataloader import BadRecordError, PackedDataLoader, SourceSpent
from llm_training.data.hub import HubUnreachableError, open_hub_records
from llm_training.data.mixture import MixtureLoader, MixtureSpent
from llm_training.data.packing import IGNORE_INDEX, Document, RowPacker, collate_rows, fit_document
from llm_training.data.records import (
    DatasetRecords,
    JsonlRecords,
    ParquetRecords,
    SaveToDiskRecords,
    StreamRecords,
    check_dataset,
    open_records,
)
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
    "DatasetRecords",
    "Document",
    "HubUnreachableError",
    "JsonlRecords",
    "MixtureLoader",
    "MixtureSpent",
    "PackedDataLoader",
    "ParquetRecords",
    "RowPacker",
    "SaveToDiskRecords",
    "SourceSpent",
    "StreamRecords",
    "TokenizedChat",
    "build_dataloader",
    "build_tokenizer",
    "check_dataset",
    "check_source",
    "collate_rows",
    "fit_document",
    "open_hub_records",
    "open_records",
    "open_source_records",
    "validate_conversation",
]
