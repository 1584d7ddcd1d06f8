"""The task-vocabulary option of the tiny tokenizer: byte-pair merges learned on a corpus and single-token tags, in
the same byte-level Qwen2Tokenizer format; the default stays byte-only."""

from collections import Counter

from mmgrpo.pipelines.vlm.tiny import SPECIAL_TOKENS, build_tokenizer, learn_merges, merge_pair

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
CORPUS = ["What colour is the triangle?\nOptions:\nA. red\nB. blue", "<think>blue triangle</think><answer>B</answer>"]


def test_merges_join_every_word_into_one_symbol():
    words = Counter({"red": 3, "green": 2, "Ġred": 1})
    merges = learn_merges(words)
    for word in words:
        symbols = tuple(word)
        for pair in merges:
            symbols = merge_pair(symbols, pair)
        assert symbols == (word,)
    assert merge_pair(("a", "a", "a"), ("a", "a")) == ("aa", "a")


def test_corpus_words_and_tags_are_single_tokens_and_decode_back(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(CORPUS, TAGS).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    tokens = tok.convert_ids_to_tokens(tok(CORPUS[1])["input_ids"])
    assert tokens == ["<think>", "blue", "Ġtriangle", "</think>", "<answer>", "B", "</answer>"]
    assert tok.tokenize("What colour is the triangle?") == ["What", "Ġcolour", "Ġis", "Ġthe", "Ġtriangle", "?"]
    for text in CORPUS + ["<think>日本 purple</think>"]:  # unseen text still encodes, byte by byte
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    for special in SPECIAL_TOKENS:
        assert len(tok(special)["input_ids"]) == 1


def test_default_stays_byte_level():
    tok = build_tokenizer()
    assert len(tok) == 256 + len(SPECIAL_TOKENS)
    assert len(tok("<think>red</think>")["input_ids"]) == len("<think>red</think>")
