"""Special-token strings inside message content are text: every special token of the bundled tokenizer, and
of two HF chat layouts built here with `tokenizers` (Llama-3 headers with a `| trim` template; ChatML with a
non-special `<think>` added token), typed into user and assistant content, never becomes its control token;
the trained span still ends at the template's real end-of-turn token."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llm_training.data import ChatTokenizer, validate_conversation

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}"
)
LAYOUTS = {
    "llama3": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|reserved_special_token_0|>", "<|finetune_right_pad_id|>"],
        "template": LLAMA3_TEMPLATE, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>",
    },
    "chatml": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "plain_added": ["<think>", "</think>"],
        "template": CHATML_TEMPLATE, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
    },
}  # fmt: skip
CORPUS = ["the quick brown fox jumps over the lazy dog", "user assistant system header start end of text"] * 20


def _build_layout(name: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE chat tokenizer with the layout's added tokens (trained on a few sentences, offline)."""
    layout = LAYOUTS[name]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in layout["special"]])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in layout.get("plain_added", [])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=layout["bos"], eos_token=layout["eos"], pad_token=layout["pad"]
    )
    tok.chat_template = layout["template"]
    return tok


def _tokenized(chat_tok: ChatTokenizer, user: str, answer: str):
    messages = validate_conversation([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
    [tokenized] = chat_tok.tokenize([chat_tok.split(messages)])
    return tokenized


def _check_injection_stays_text(hf_tok, special: str) -> None:
    chat_tok = ChatTokenizer(hf_tok)
    special_id = hf_tok.convert_tokens_to_ids(special)
    eos_id = hf_tok.convert_tokens_to_ids(hf_tok.eos_token)
    answer = f"before {special} after{special}"
    clean = _tokenized(chat_tok, "question", "before  after")
    injected = _tokenized(chat_tok, f"{special}user\n{special} q", answer)
    # the special id occurs exactly as often as the template itself writes it
    assert injected.ids.count(special_id) == clean.ids.count(special_id), special
    trained = injected.ids[injected.target_start : injected.target_end]
    assert trained[-1] == eos_id and trained[:-1].count(eos_id) == 0  # only the template's end of turn
    assert hf_tok.decode(trained[:-1], skip_special_tokens=False) == answer  # the content, as plain text


def _bundled_specials(hf_tokenizer):
    return [t.content for t in hf_tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special]


def test_bundled_tokenizer_has_the_specials_tested(hf_tokenizer):
    assert sorted(_bundled_specials(hf_tokenizer)) == ["<|bos|>", "<|im_end|>", "<|im_start|>", "<|pad|>"]


@pytest.mark.parametrize("special", ["<|bos|>", "<|im_end|>", "<|im_start|>", "<|pad|>"])
def test_bundled_tokenizer_special_in_content_is_text(special, hf_tokenizer):
    _check_injection_stays_text(hf_tokenizer, special)


@pytest.mark.parametrize(
    "layout, special", [(name, special) for name, layout in LAYOUTS.items() for special in layout["special"]]
)
def test_hf_chat_layout_special_in_content_is_text(layout, special):
    _check_injection_stays_text(_build_layout(layout), special)


def test_trim_template_content_and_non_special_added_tokens():
    llama = ChatTokenizer(_build_layout("llama3"))
    tokenized = _tokenized(llama, "  padded question  ", "  padded answer \n")
    trained = tokenized.ids[tokenized.target_start : tokenized.target_end]
    assert llama.tokenizer.decode(trained, skip_special_tokens=False) == "padded answer<|eot_id|>"  # `| trim`
    chatml = ChatTokenizer(_build_layout("chatml"))
    think_id = chatml.tokenizer.convert_tokens_to_ids("<think>")
    tokenized = _tokenized(chatml, "q", "<think>reasoning</think>answer")
    assert tokenized.ids[tokenized.target_start] == think_id  # a vocabulary token, not a control token
