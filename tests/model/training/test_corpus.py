from linserve.model.training.corpus import VALIDATION_WORKS


def test_all_modern_spelling_works_split_by_whole_work(corpus):
    assert len(corpus.train) + len(corpus.validation) == 42  # 37 plays + 5 poems, no First Folio copies
    assert tuple(corpus.validation) == VALIDATION_WORKS
    assert not set(corpus.train) & set(corpus.validation)
    assert not any(name.endswith("_f") for name in corpus.train)


def test_validation_is_about_a_tenth_of_the_bytes(corpus):
    share = corpus.validation_bytes() / (corpus.validation_bytes() + corpus.train_bytes())
    assert 0.08 < share < 0.15
    assert "HAMLET" in corpus.validation["hamlet"][:200]
