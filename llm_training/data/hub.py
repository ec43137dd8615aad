"""HuggingFace Hub data sets (`hub` of a `[[training.sources]]` table) through `datasets.load_dataset`.

`open_hub_records` loads the dataset id `hub` with its configuration, split and revision into the `datasets` cache
(`[huggingface_dataset] cache_dir`) and reads it like a local save_to_disk folder (`DatasetRecords`), or, with
`streaming`, opens it as a stream without downloading it first (`StreamRecords`). `datasets` is imported on first
use. When the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1) and the data is not cached, `datasets`
raises ConnectionError; `HubUnreachableError` says instead which data set was asked for and how to provide it.
"""

from __future__ import annotations

from llm_training.data.records import DatasetRecords, StreamRecords, import_datasets


class HubUnreachableError(ConnectionError):
    """The Hub could not be reached for a data set that is not in the cache (the message says what to do)."""


def load_hub_dataset(hub: str, hub_config: str, split: str, revision: str, streaming: bool, cache_dir: str):
    """`datasets.load_dataset(hub, hub_config, split=split, revision=revision, streaming=streaming,
    cache_dir=cache_dir)`, empty strings meaning the library's defaults; errors name the data set asked for."""
    datasets = import_datasets(f"hub = {hub!r}")
    asked = f"hub = {hub!r}, hub_config = {hub_config!r}, split = {split!r}, revision = {revision!r}"
    try:
        return datasets.load_dataset(
            hub,
            hub_config or None,
            split=split,
            revision=revision or None,
            streaming=streaming,
            cache_dir=cache_dir or None,
        )
    except ConnectionError as e:
        cache = cache_dir or f"{datasets.config.HF_DATASETS_CACHE} (the default)"
        call = (
            f"datasets.load_dataset({hub!r}, {hub_config or None!r}, split={split!r}, revision={revision or None!r}, "
            f"cache_dir=...)"
        )
        raise HubUnreachableError(
            f"cannot load the HuggingFace Hub dataset {asked}: the Hub cannot be reached ({e}) and the data is "
            f"not in the datasets cache {cache}. On a machine with internet access run {call}, copy that cache "
            "folder here and set [huggingface_dataset] cache_dir to it (HF_HUB_OFFLINE=1 then reads it from the "
            "cache); or save the data there with Dataset.save_to_disk (or as jsonl / parquet files), copy it here "
            "and use path = '<that folder>' instead of hub"
        ) from None
    except (FileNotFoundError, ValueError) as e:  # unknown dataset, configuration, split or revision
        raise ValueError(f"cannot load the HuggingFace Hub dataset {asked}: {e}") from None


def open_hub_records(
    hub: str,
    hub_config: str,
    split: str,
    revision: str,
    conversations_field: str,
    *,
    streaming: bool,
    cache_dir: str,
    shuffle_buffer: int,
):
    """The records of a Hub dataset: downloaded (`DatasetRecords`) or streamed (`StreamRecords`)."""
    data = load_hub_dataset(hub, hub_config, split, revision, streaming, cache_dir)
    name = hub + (f" ({hub_config})" if hub_config else "") + f" split {split!r}"
    if streaming:
        return StreamRecords(data, name, conversations_field, shuffle_buffer)
    return DatasetRecords(data, name, conversations_field)


__all__ = ["HubUnreachableError", "load_hub_dataset", "open_hub_records"]
