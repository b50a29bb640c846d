"""Tables of an HTML page by id, for the tests of the run card and the dashboard page."""

from __future__ import annotations

from html.parser import HTMLParser

__all__ = ["Tables"]


class Tables(HTMLParser):
    """Collect the cell texts of every table with an id (``tables``), and every element
    id (``ids``)."""

    def __init__(self):
        super().__init__()
        self.tables, self._id, self._row, self._cell = {}, None, None, None
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "table" and "id" in a:
            self._id = a["id"]
            self.tables[self._id] = []
        elif tag == "tr" and self._id:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._id].append(self._row)
            self._row = None
        elif tag == "table":
            self._id = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
