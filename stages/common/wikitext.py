"""WikiText as lm-evaluation-harness's `wikitext` task reads it, so that figures computed here compare
with the harness's and with the papers and leaderboards that quote it.

The harness scores articles, not lines: its dataset (the document-level WikiText) cuts a raw split
(wiki.test.raw) into documents at each top-level heading line (` = Title = `); each document is
detokenized (WikiText's ` @-@ `, ` , `, spaced brackets and quotes undone) before the model's tokenizer
reads it, while words and bytes are counted on the document as written in the raw file. Word perplexity
is exp(total NLL / words), byte perplexity exp(total NLL / bytes), bits per byte total NLL / (bytes ln 2),
with the totals summed over documents.

    documents(text)   the raw split's documents (joined with newlines, the text from its first heading on)
    detokenize(doc)   the text the model reads
    counts(doc)       (words, UTF-8 bytes) of a document, as the harness counts them
"""

from __future__ import annotations

import re

__all__ = ["counts", "detokenize", "documents"]


def _is_title(line: str) -> bool:
    """A top-level heading: `= Title =` once the spaced `= = =` and `= =` of deeper levels are closed up."""
    closed = line.replace("= = =", "===").replace("= =", "==").strip()
    return closed.startswith("= ") and closed.endswith(" =")


def documents(text: str) -> list[str]:
    """The documents of a raw WikiText split: a document runs from one top-level heading line to the line
    before the next. Lines before the first heading make a document of their own unless they are blank;
    the last document is kept whatever it holds. ValueError if no line is a top-level heading."""
    docs, lines, titled = [], [], False
    for line in text.split("\n"):
        if _is_title(line):
            titled = True
            if "\n".join(lines).strip():
                docs.append("\n".join(lines))
            lines = []
        lines.append(line)
    if not titled:
        raise ValueError("no line is a top-level WikiText heading (' = Title = ')")
    docs.append("\n".join(lines))
    return docs


def _spaced(open_: str, close: str) -> tuple[re.Pattern, str]:
    """A bracket pair with the spaces just inside it removed (one pair at a time, innermost text kept)."""
    o, c = re.escape(open_), re.escape(close)
    inner = "[^" + re.escape(close) + "]"
    return re.compile(f"{o}\\s*({inner}*?)\\s*{c}"), f"{open_}\\1{close}"


# Applied in this order: each step sees the text the steps before it left.
_STEPS: tuple[tuple[str | re.Pattern, str], ...] = (
    ("s '", "s'"),  # plural possessive
    (re.compile(r"/' [0-9]/"), "/'[0-9]/"),  # kept as the harness has it: a literal pattern that never occurs
    (" @-@ ", "-"),  # WikiText's escaped separators inside numbers and words
    (" @,@ ", ","),
    (" @.@ ", "."),
    *((f" {mark} ", f"{mark} ") for mark in ":;.!?,"),  # no space before punctuation
    _spaced("(", ")"),
    _spaced("[", "]"),
    _spaced("{", "}"),
    _spaced('"', '"'),
    _spaced("'", "'"),
    ("= = = =", "===="),  # headings
    ("= = =", "==="),
    ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),  # the number placeholder
    (" 's", "'s"),
)


def detokenize(doc: str) -> str:
    """The document as the harness gives it to the model: WikiText's tokenization spaces undone."""
    for pattern, replacement in _STEPS:
        doc = pattern.sub(replacement, doc) if isinstance(pattern, re.Pattern) else doc.replace(pattern, replacement)
    return doc


def counts(doc: str) -> tuple[int, int]:
    """(words, bytes) of a document as written in the raw split: words are the pieces between runs of
    whitespace (a leading or trailing run adds an empty piece, as the harness counts), bytes its UTF-8 length."""
    return len(re.split(r"\s+", doc)), len(doc.encode("utf-8"))
