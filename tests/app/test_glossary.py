"""Help → Glossary: every word the figures use, reached from the menu, from a plot's caption and
from a table's column header."""

from __future__ import annotations

import re

import pytest

from app.glossary import TERMS, linked


@pytest.fixture
def glossary_closed():
    yield
    from app import glossary

    if glossary._dialog is not None:
        glossary._dialog.close()
        glossary._dialog.deleteLater()
        glossary._dialog = None


def test_linked_makes_the_first_mention_of_each_word_a_link_and_leaves_tags_alone():
    text = linked("<b>TTFT</b> then TTFT again; the KV cache and the KV cache; decoded, decode.")
    assert text.count("glossary:ttft") == 1 and "<b>TTFT</b> then <a href='glossary:ttft'>TTFT</a>" in text
    assert text.count("glossary:kv-cache") == 1
    assert "decoded" in text and "<a href='glossary:decode'>decode</a>." in text  # a whole word only


def test_the_help_menu_opens_the_glossary_and_every_term_reads(qtbot, window, glossary_closed):
    [action] = [a for a in window.help_menu.actions() if a.text().startswith("&Glossary")]
    action.trigger()
    from app import glossary

    dialog = glossary._dialog
    assert dialog is not None and dialog.isVisible() and dialog.terms.count() == len(TERMS)
    for row in range(dialog.terms.count()):
        dialog.terms.setCurrentRow(row)
        word, meaning, where = TERMS[dialog.current]
        shown = dialog.text.toPlainText()
        assert word in shown and "Where to see it" in shown and where.split(";")[0][:20] in shown


def test_a_plot_caption_and_a_column_header_open_the_glossary_at_their_word(qtbot, window, glossary_closed):
    from app import glossary

    caption = window.plots.speed.caption
    links = re.findall(r"glossary:([\w-]+)", caption.text())
    assert "ttft" in links  # "…its time is the TTFT."
    caption.linkActivated.emit("glossary:ttft")
    assert glossary._dialog.current == "ttft"

    compare = window.open_compare()
    qtbot.addWidget(compare)
    header = compare.table.horizontalHeader()
    column = next(c for c in range(compare.table.columnCount())
                  if compare.table.horizontalHeaderItem(c).text() == "KV cache")
    assert "keys and values" in compare.table.horizontalHeaderItem(column).toolTip()
    header.sectionDoubleClicked.emit(column)
    assert glossary._dialog.current == "kv-cache"
