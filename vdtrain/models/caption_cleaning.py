"""LlamaGen's caption cleaning, so T5 sees the text the released models were trained and sampled with.

The official pipeline (``language/t5.py`` in the LlamaGen repository, taken from DeepFloyd IF / PixArt)
runs one cleaning pass twice on every caption before T5: URL-decode, lower-case, drop URLs, HTML,
@handles, CJK, IP addresses, file names, shop spam and code-like tokens, normalise dashes, quotes and
punctuation, then ``ftfy`` + HTML-unescape in the middle. The rules below are that pass, in its order.

``ftfy`` and ``beautifulsoup4`` are optional (``pip install 'vdtrain[llamagen]'``). Without them the
pass still runs, with a warning: ftfy's text repair is skipped and the standard library's HTML parser
strips tags instead of BeautifulSoup. Plain captions come out the same; captions with mojibake or
unusual markup may not.
"""

from __future__ import annotations

import functools
import html
import logging
import re
import urllib.parse
from collections.abc import Callable
from html.parser import HTMLParser

log = logging.getLogger(__name__)

Step = Callable[[str], str]

# Caption text paths of the LlamaGen-architecture targets (``text_preprocessing`` in conf/target):
# llamagen = the official cleaning; lowercase = the official path with cleaning off; none = strip only.
TEXT_PREPROCESSING = ("llamagen", "lowercase", "none")

IMAGE_EXTENSIONS = "png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4"
URL_TAIL = r"[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)"
DASHES = (
    r"[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40"
    r"\u301C\u3030\u30A0\uFE31\uFE32\uFE58\uFE63\uFF0D]+"
)
# CJK strokes, katakana extensions, enclosed CJK, CJK compatibility, ideographs (ext. A and unified),
# Yijing hexagrams: U+31C0-U+4DBF plus U+4DC0-U+9FFF, one contiguous run.
CJK = r"[\u31c0-\u9fff]+"
BAD_PUNCTUATION = r"[#®•©™&@·º½¾¿¡§~)(\]\[}{|\\/*]+"


def _sub(pattern: str, replacement: str) -> Step:
    compiled = re.compile(pattern)
    return lambda text: compiled.sub(replacement, text)


class _TextOnly(HTMLParser):
    """The text content of an HTML fragment as BeautifulSoup's ``.text`` gives it for common markup
    (tags dropped, entities decoded, script/style/template bodies left out)."""

    HIDDEN = ("script", "style", "template")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.HIDDEN:
            self.hidden += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN and self.hidden:
            self.hidden -= 1

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def _stdlib_html_text(text: str) -> str:
    parser = _TextOnly()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts)


@functools.cache
def _backends() -> tuple[Step, Step]:
    """(ftfy's ``fix_text``, HTML → text), with the fallbacks when a package is missing (warned once)."""
    missing = []
    try:
        from ftfy import fix_text
    except ImportError:
        missing.append("ftfy")

        def fix_text(text: str) -> str:
            return text

    try:
        from bs4 import BeautifulSoup

        def html_text(text: str) -> str:
            return BeautifulSoup(text, features="html.parser").text

    except ImportError:
        missing.append("beautifulsoup4")
        html_text = _stdlib_html_text
    if missing:
        log.warning(
            "LlamaGen caption cleaning without %s: pip install 'vdtrain[llamagen]' to match the official "
            "text exactly (plain captions are unaffected; ones with mojibake or HTML may differ)",
            " and ".join(missing),
        )
    return fix_text, html_text


def _basic_clean(text: str) -> str:
    fix_text, _ = _backends()
    return html.unescape(html.unescape(fix_text(text))).strip()


def _strip_html(text: str) -> str:
    return _backends()[1](text)


def _split_joined_words(text: str) -> str:
    """``this-is-my-cute-cat`` / ``this_is_my_cute_cat``: more than three joiners become spaces."""
    joiners = re.compile(r"[-_]")
    return joiners.sub(" ", text) if len(joiners.findall(text)) > 3 else text


# One cleaning pass, in the official order.
CLEANING_PASS: tuple[Step, ...] = (
    urllib.parse.unquote_plus,
    lambda text: text.strip().lower(),
    _sub(r"<person>", "person"),
    _sub(r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|" + URL_TAIL + "))", ""),
    _sub(r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|" + URL_TAIL + "))", ""),
    _strip_html,
    _sub(r"@[\w\d]+\b", ""),  # @handles
    _sub(CJK, ""),
    _sub(DASHES, "-"),
    _sub(r"[`´«»“”¨]", '"'),
    _sub(r"[‘’]", "'"),
    _sub(r"&quot;?", ""),
    _sub(r"&amp", ""),
    _sub(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),  # IP addresses
    _sub(r"\d:\d\d\s+$", ""),  # article ids
    _sub(r"\\n", " "),  # a literal backslash-n
    _sub(r"#\d{1,3}\b", ""),
    _sub(r"#\d{5,}\b", ""),
    _sub(r"\b\d{6,}\b", ""),
    _sub(r"[\S]+\.(?:" + IMAGE_EXTENSIONS + ")", ""),  # file names
    _sub(r"[\"']{2,}", '"'),
    _sub(r"[\.]{2,}", " "),
    _sub(BAD_PUNCTUATION, " "),
    _sub(r"\s+\.\s+", " "),
    _split_joined_words,
    _basic_clean,
    _sub(r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),  # jc6640
    _sub(r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),  # jc6640vc
    _sub(r"\b\d+[a-zA-Z]+\d+\b", ""),  # 6640vc231
    _sub(r"(worldwide\s+)?(free\s+)?shipping", ""),
    _sub(r"(free\s)?download(\sfree)?", ""),
    _sub(r"\bclick\b\s(?:for|on)\s\w+", ""),
    _sub(r"\b(?:" + IMAGE_EXTENSIONS + r")(\simage[s]?)?", ""),
    _sub(r"\bpage\s+\d+\b", ""),
    _sub(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " "),  # j2d1a2a...
    _sub(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),  # sizes: 1920x1080
    _sub(r"\b\s+\:\s+", ": "),
    _sub(r"(\D[,\./])\b", r"\1 "),
    _sub(r"\s+", " "),
    _sub(r"^[\"']([\w\W]+)[\"']$", r"\1"),  # one pair of enclosing quotes
    _sub(r"^['_,\-:;]", ""),
    _sub(r"['_,\-:+]$", ""),
    _sub(r"^\.\S+$", ""),
    str.strip,
)


def clean_caption_once(caption: str) -> str:
    for step in CLEANING_PASS:
        caption = step(caption)
    return caption


def llamagen_caption(caption: str) -> str:
    """The caption as LlamaGen's T5 sees it: the cleaning pass applied twice, as the official code does."""
    return clean_caption_once(clean_caption_once(str(caption)))


def caption_preprocessor(name: str) -> Step:
    """The text path named by ``text_preprocessing`` (one of ``TEXT_PREPROCESSING``)."""
    steps: dict[str, Step] = {
        "llamagen": llamagen_caption,
        "lowercase": lambda caption: caption.strip().lower(),
        "none": str.strip,
    }
    if name not in steps:
        raise ValueError(f"unknown text_preprocessing {name!r}; use one of {TEXT_PREPROCESSING}")
    return steps[name]
