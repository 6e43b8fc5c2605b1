"""An incremental Server-Sent Events parser: bytes in as TCP delivers them (events split anywhere, even inside a
UTF-8 character), complete events' data out. Comment lines (": keep-alive") are counted and skipped."""

from __future__ import annotations


class SSEParser:
    def __init__(self) -> None:
        self._tail = b""  # an incomplete line
        self._data: list[str] = []  # data lines of the event being read
        self.num_comments = 0

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that `chunk` completes (multi-line data joined with newlines)."""
        *lines, self._tail = (self._tail + chunk).split(b"\n")
        events = []
        for line in lines:
            event = self._line(line[:-1] if line.endswith(b"\r") else line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """End of stream: an event missing its final blank line is still delivered (lenient, as browsers are not,
        because some servers end with `data: [DONE]\\n` alone)."""
        events = self.feed(b"\n") if self._tail else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: bytes) -> str | None:
        if not line:  # a blank line ends the event
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(b":"):
            self.num_comments += 1
            return None
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":  # event:, id: and retry: carry nothing for OpenAI streams
            self._data.append(value.decode("utf-8", errors="replace"))
        return None
