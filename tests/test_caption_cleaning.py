"""LlamaGen's caption cleaning (``vdtrain.models.caption_cleaning``) and its official CFG rule.

The expected texts were produced by the official ``T5Embedder.text_preprocessing`` of the LlamaGen
repository (``language/t5.py``, cleaning on: ``clean_caption`` twice) with ftfy and BeautifulSoup.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from vdtrain.decode.ar import generate_ar
from vdtrain.decode.sampling import SamplingConfig
from vdtrain.models import caption_cleaning
from vdtrain.models.caption_cleaning import caption_preprocessor, clean_caption_once, llamagen_caption

OFFICIAL = [
    ("A Red Square on a BLUE background.", "a red square on a blue background."),
    ("Visit https://www.shop.com/item?id=3 for a red square", "visit ?id=3 for a red square"),
    ("a cat &amp; a dog &quot;playing&quot;", 'a cat a dog "playing"'),
    ("<b>Bold</b> text with <i>tags</i>", "bold text with tags"),
    ("photo by @john_doe of a sunset", "photo by of a sunset"),
    ("猫 a cat 漢字", "a cat"),
    ("a long—dash and a – short one", "a long-dash and a - short one"),
    ("“Quoted” and ‘single’", "quoted\" and 'single"),
    ("server 192.168.0.1 rack", "server rack"),
    ("image #12 of #123456 id 1234567", "image of id"),
    ("holiday_photo.jpg on the beach", "on the beach"),
    ("wow!!! ... amazing *** deal ***", "wow!!! amazing deal"),
    ("this-is-my-cute-cat", "this is my cute cat"),
    ("model jc6640 and 6640vc231 free shipping", "model and"),
    ("wallpaper 1920x1080 free download", "wallpaper"),
    ("click for details page 3", ""),
    ("a,b.c and x : y", "a, b. c and x: y"),
    ('"a quoted caption"', "a quoted caption"),
    ("a+red+square%21", "a red square!"),
]


@pytest.fixture
def fresh_backends():
    """Re-detect ftfy / bs4 for this test, and again afterwards (after monkeypatch has undone its work)."""
    caption_cleaning._backends.cache_clear()
    yield
    caption_cleaning._backends.cache_clear()


@pytest.mark.parametrize(("caption", "expected"), OFFICIAL, ids=[c for c, _ in OFFICIAL])
def test_llamagen_cleaning_matches_the_official_text(caption, expected):
    assert llamagen_caption(caption) == expected


def test_the_pass_runs_twice_as_the_official_code_does():
    # each of these needs the second pass: a doubly URL-encoded character, a doubly escaped plus, a dot
    cases = [("%2521", "%21", "!"), ("a+%2B+b", "a + b", "a b"), (". .x", ". . x", ". x")]
    for caption, once, twice in cases:
        assert clean_caption_once(caption) == once and llamagen_caption(caption) == twice


def test_ftfy_repairs_mojibake_as_in_the_official_pipeline(fresh_backends):
    pytest.importorskip("ftfy")
    pytest.importorskip("bs4")
    assert llamagen_caption("café â€™ mojibake") == "café † mojibake"
    assert llamagen_caption("ﬁne ｗｉｄｅ") == "fine wide"


def test_without_ftfy_and_bs4_cleaning_warns_once_and_keeps_plain_captions(
    fresh_backends, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "ftfy", None)  # import ftfy now raises ImportError
    monkeypatch.setitem(sys.modules, "bs4", None)
    with caplog.at_level(logging.WARNING, logger="vdtrain.models.caption_cleaning"):
        cleaned = [llamagen_caption(caption) for caption, _ in OFFICIAL]
    assert cleaned == [expected for _, expected in OFFICIAL]  # the stdlib HTML parser strips the tags
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "ftfy and beautifulsoup4" in warnings[0]
    assert "pip install 'vdtrain[llamagen]'" in warnings[0]
    assert llamagen_caption("<script>x</script>a <style>b</style>cat") == "a cat"  # as bs4's .text


def test_text_preprocessing_names():
    assert caption_preprocessor("lowercase")("  A Cat ") == "a cat"
    assert caption_preprocessor("none")("  A <b>Cat</b> ") == "A <b>Cat</b>"
    assert caption_preprocessor("llamagen")("  A <b>Cat</b> ") == "a cat"
    with pytest.raises(ValueError, match="unknown text_preprocessing 'clean'"):
        caption_preprocessor("clean")


# --- CFG only when cfg_scale > 1 (LlamaGen's generate.py) ------------------------------------------------


@pytest.mark.parametrize(("scale", "guided"), [(0.0, False), (0.5, False), (1.0, False), (1.5, True)])
def test_cfg_applies_only_above_one(scale, guided):
    assert SamplingConfig(cfg_scale=scale).uses_cfg is guided


def test_a_scale_below_one_samples_like_no_guidance(tiny_target):
    from conftest import tiny_condition

    cond = tiny_condition()

    def sample(scale: float) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
        return generate_ar(tiny_target, cond, SamplingConfig(cfg_scale=scale, temperature=1.0), generators)

    assert torch.equal(sample(0.5), sample(1.0))
