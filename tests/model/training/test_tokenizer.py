import pytest

from linserve.model.training.tokenizer import EOT_TOKEN, load_tokenizer, save_tokenizer

SAMPLES = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "def f(x):\n\treturn {'a': x ** 2}  # code, tabs\r\n   trailing spaces   ",
    "emoji 😀👍🏽 and ZWJ 👩‍👩‍👧 sequences",
    "日本語のテキスト, русский текст, ελληνικά, العربية, हिन्दी",
    "\x00control\x7f chars and a lone combining mark \u0301",
    "",
    " leading space and double  spaces",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trips_any_utf8_exactly(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text).ids) == text


def test_saved_tokenizer_loads_with_autotokenizer_and_round_trips(small_tokenizer, tmp_path):
    save_tokenizer(small_tokenizer, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    hf = load_tokenizer(tmp_path)
    assert hf.eos_token == EOT_TOKEN and hf.eos_token_id == small_tokenizer.token_to_id(EOT_TOKEN)
    for text in SAMPLES:
        assert hf.decode(hf.encode(text)) == text


def test_end_of_text_is_one_token(small_tokenizer):
    ids = small_tokenizer.encode(f"a{EOT_TOKEN}b").ids
    assert small_tokenizer.token_to_id(EOT_TOKEN) in ids
    assert small_tokenizer.get_vocab_size() == 1024


def test_the_committed_tokenizer_fixture_is_what_train_bpe_makes(corpus, small_tokenizer):
    """tests/fixtures/tokenizer-1k.json (what the engine and server tests use, so they need no corpus) is
    exactly the 1k BPE trained on the two plays: regenerate it if training changes."""
    from linserve.model.training.tokenizer import train_bpe

    trained = train_bpe([corpus.train["romeo_and_juliet"], corpus.train["tempest"]], 1024)
    assert trained.get_vocab() == small_tokenizer.get_vocab()
    text = corpus.train["tempest"][:5_000]
    assert trained.encode(text).ids == small_tokenizer.encode(text).ids
