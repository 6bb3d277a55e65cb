"""Log-flood control: a `logging.Filter` that rate-limits repeated records.

Records are alike when they share the logger, the message template (``record.msg``, before its
arguments are merged) and the level. A message logged already formatted (no arguments: an
f-string, or asyncio's error reports, which carry a timer's deadline or an object's address) has
no template to go by: with every number replaced, its first ``KEY_CHARS`` characters stand for it.
Of each kind, at most ``burst`` records pass per window of ``window_s`` seconds (the window opens
at the first record of its kind); the rest are dropped and counted. When the window has ended,
one line reports them, at their level and under their logger: ``suppressed K similar messages:
<template>`` (for an already formatted message, the first line of the first one). Ended windows
are reported whenever any record passes through the filter, on `RateLimitFilter.flush_expired`
(``kvwarden serve`` calls it about twice a second) and, for all windows at once, on
`RateLimitFilter.flush` (`uninstall`, at shutdown).

A record logged with ``extra={NO_RATE_LIMIT: True}`` is never suppressed and never counted (the
audit lines of admin calls that went through).

The filter belongs on a handler (`install` puts one on each of the root logger's handlers): a
record dropped there costs no formatting, and the report goes to that same handler.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

NO_RATE_LIMIT = "kvwarden_no_rate_limit"
SUMMARY = "suppressed %d similar messages: %s"
# 50 lines of one kind per 10 s pass: a node's workers registering, or all of them reaped at
# once, are each logged; a flood (thousands a second) is cut to 5 a second and one summary
DEFAULT_BURST = 50
DEFAULT_WINDOW_S = 10.0
# kinds tracked at once: beyond it the oldest window is closed (and reported) early, so messages
# with ever-new templates (pre-formatted strings) cannot grow the table without bound
MAX_KINDS = 1024

KEY_CHARS = 300
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")

_Kind = tuple[str, str, int]


@dataclass
class _Window:
    ends_at: float
    template: str  # what the report shows
    passed: int = 0
    suppressed: int = 0


def _kind_of(record: logging.LogRecord) -> tuple[_Kind, str]:
    """The record's kind, and the template a report shows for it."""
    template = str(record.msg)
    if record.args:
        return (record.name, template, record.levelno), template
    key = _NUMBERS.sub("#", template[: 4 * KEY_CHARS])[:KEY_CHARS]  # numbers of any length
    return (record.name, key, record.levelno), template.split("\n", 1)[0][:KEY_CHARS]


class RateLimitFilter(logging.Filter):
    """At most ``burst`` alike records per ``window_s`` seconds; see the module docstring.

    ``emit`` receives the report records (a handler's ``handle``); ``clock`` is monotonic
    seconds (injectable for tests). Safe from any thread: reports are emitted outside the lock.
    """

    def __init__(
        self,
        emit: Callable[[logging.LogRecord], object],
        burst: int = DEFAULT_BURST,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
    ) -> None:
        super().__init__()
        if burst < 1 or not window_s > 0 or max_kinds < 1:
            raise ValueError("burst and max_kinds must be >= 1 and window_s > 0")
        self._emit = emit
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._max_kinds = max_kinds
        self._lock = threading.Lock()
        self._windows: OrderedDict[_Kind, _Window] = OrderedDict()  # in order of their end

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, NO_RATE_LIMIT, False):
            return True
        kind, template = _kind_of(record)
        with self._lock:
            now = self._clock()
            ended = self._pop_ended(now)
            window = self._windows.get(kind)
            if window is None:
                while len(self._windows) >= self._max_kinds:
                    ended.append(self._windows.popitem(last=False))
                window = self._windows[kind] = _Window(now + self._window_s, template)
            if window.passed < self._burst:
                window.passed += 1
                allowed = True
            else:
                window.suppressed += 1
                allowed = False
        self._report(ended)
        return allowed

    def flush_expired(self) -> None:
        """Report the windows that have ended (and forget them)."""
        with self._lock:
            ended = self._pop_ended(self._clock())
        self._report(ended)

    def flush(self) -> None:
        """Report every window now, ended or not (at shutdown), and forget them all."""
        with self._lock:
            ended = list(self._windows.items())
            self._windows.clear()
        self._report(ended)

    def _pop_ended(self, now: float) -> list[tuple[_Kind, _Window]]:
        ended: list[tuple[_Kind, _Window]] = []
        while self._windows:
            kind, window = next(iter(self._windows.items()))
            if window.ends_at > now:
                break
            self._windows.popitem(last=False)
            ended.append((kind, window))
        return ended

    def _report(self, ended: list[tuple[_Kind, _Window]]) -> None:
        for (name, _, level), window in ended:
            if window.suppressed:
                args = (window.suppressed, window.template)
                record = logging.LogRecord(name, level, __file__, 0, SUMMARY, args, None)
                setattr(record, NO_RATE_LIMIT, True)
                self._emit(record)


def install(
    burst: int = DEFAULT_BURST,
    window_s: float = DEFAULT_WINDOW_S,
    clock: Callable[[], float] = time.monotonic,
    logger: logging.Logger | None = None,
) -> list[RateLimitFilter]:
    """Put a `RateLimitFilter` on each handler of ``logger`` (the root logger by default); the
    filters are returned, for `flush_expired` and `flush`."""
    target = logger if logger is not None else logging.getLogger()
    filters = []
    for handler in target.handlers:
        f = RateLimitFilter(handler.handle, burst, window_s, clock)
        handler.addFilter(f)
        filters.append(f)
    return filters


def uninstall(filters: list[RateLimitFilter], logger: logging.Logger | None = None) -> None:
    """Report what the filters still suppress, then take them off the handlers of ``logger``."""
    target = logger if logger is not None else logging.getLogger()
    for f in filters:
        f.flush()
        for handler in target.handlers:
            handler.removeFilter(f)
