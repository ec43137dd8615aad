"""From the config to the data: each source's records, and the data loader of one data-parallel rank.

`[training] dataset_path` alone gives one `PackedDataLoader`; `[[training.sources]]` tables give a `MixtureLoader`
over one `PackedDataLoader` per source (local jsonl / parquet / save_to_disk data through `data.records`, Hub
datasets through `data.hub`). Every loader packs with the `[training]` and `[huggingface_dataset]` settings; the
validation data (`[validation] dataset_path`) is always one source, read in file order.
"""

from __future__ import annotations

from llm_training.data.chat import ChatTokenizer
from llm_training.data.chat_source import ChatDocumentSource
from llm_training.data.dataloader import PackedDataLoader
from llm_training.data.hub import open_hub_records
from llm_training.data.mixture import MixtureLoader
from llm_training.data.records import check_dataset, check_records, open_records


def open_source_records(source, hf):
    """The records of one `[[training.sources]]` table (`source`), with the `[huggingface_dataset]` settings `hf`
    filling in its empty split and conversations_field."""
    field = source.conversations_field or hf.conversations_field
    split = source.split or hf.split
    if source.hub:
        return open_hub_records(
            source.hub,
            source.hub_config,
            split,
            source.revision,
            field,
            streaming=source.streaming,
            cache_dir=hf.cache_dir,
            shuffle_buffer=hf.shuffle_buffer,
        )
    return open_records(
        source.path, field, split, cache_dir=hf.cache_dir, streaming=source.streaming, shuffle_buffer=hf.shuffle_buffer
    )


def check_source(source, hf) -> None:
    """Fail fast when a `[[training.sources]]` table cannot give a record (`check_dataset` for local data; a Hub
    dataset is opened, and downloaded unless streamed, as training will)."""
    if source.hub:
        check_records(open_source_records(source, hf))
    else:
        check_dataset(
            source.path,
            source.conversations_field or hf.conversations_field,
            source.split or hf.split,
            hf.cache_dir,
            source.streaming,
        )


def build_dataloader(
    job_config, tokenizer, dp_rank: int, dp_world_size: int, validation: bool = False
) -> PackedDataLoader | MixtureLoader:
    """The data loader of one data-parallel rank: of `[training] dataset_path`, or the mixture of
    `[[training.sources]]`; with `validation`, of `[validation] dataset_path` (and split) with the same settings, in
    file order and without a prefetch thread (the validator reads it again from its start at every evaluation)."""
    training, hf = job_config.training, job_config.huggingface_dataset
    if training.dataset != "huggingface":
        raise ValueError(f"[training] dataset = {training.dataset!r}; the only data set type is 'huggingface'")
    chat = ChatTokenizer(tokenizer)

    def loader(records, shuffle: bool, prefetch_batches: int, max_epochs: int = 0) -> PackedDataLoader:
        return PackedDataLoader(
            ChatDocumentSource(records, chat, seq_len=training.seq_len, overlong=hf.overlong),
            seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            packing=hf.packing,
            shuffle=shuffle,
            shuffle_seed=hf.shuffle_seed,
            bad_record_policy=hf.bad_record_policy,
            max_bad_fraction=hf.max_bad_fraction,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            prefetch_batches=prefetch_batches,
            max_epochs=max_epochs,
        )

    if validation:
        v = job_config.validation
        records = open_records(v.dataset_path, hf.conversations_field, v.split or hf.split, cache_dir=hf.cache_dir)
        return loader(records, shuffle=False, prefetch_batches=0)
    if not training.sources:
        records = open_records(training.dataset_path, hf.conversations_field, hf.split, cache_dir=hf.cache_dir)
        return loader(records, shuffle=hf.shuffle, prefetch_batches=2)
    sources = training.sources
    return MixtureLoader(
        [loader(open_source_records(s, hf), hf.shuffle, prefetch_batches=0, max_epochs=s.epochs) for s in sources],
        [s.resolved_name for s in sources],
        [s.weight for s in sources],
        seed=hf.shuffle_seed,
        local_batch_size=training.local_batch_size,
        prefetch_batches=2,
    )


__all__ = ["build_dataloader", "check_source", "open_source_records"]
