"""The parser of ``spread``'s subcommands: an unknown or ambiguous option names the one meant.

argparse hands a subcommand's unknown options up to the top-level parser, which printed ``spread``'s
own usage for ``spread run --nprocs 2``; and ``--nproc`` was "ambiguous" between two spellings of
the one option ``-n``. Python 3.11's argparse suggests nothing, so the suggestion is made here: a
subcommand's table of other tools' spellings (``misspellings``), else the closest of its options.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Mapping
from typing import Any, NoReturn

_UNRECOGNIZED = "unrecognized arguments: "
_AMBIGUOUS = re.compile(r"ambiguous option: (?P<option>[^=\s]+)\S* could match (?P<matches>.*)")


class SuggestingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors end with "did you mean ...?" where it can tell.

    ``misspellings`` maps options other tools spell differently (``--nprocs``, ``--num-processes``)
    to this parser's; other unknown options get their closest match among this parser's options.
    """

    def __init__(self, *args: Any, misspellings: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        self._misspellings = dict(misspellings or {})
        self._shown: dict[str, str] = {}  # every option string -> how the suggestion names its option
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        strings = action.option_strings
        if strings:
            longs = [s for s in strings if s.startswith("--")]
            shown = strings[0] if strings[0].startswith("--") or not longs else f"{strings[0]}/{longs[0]}"
            self._shown.update(dict.fromkeys(strings, shown))
        return action

    def suggestion(self, option: str) -> str | None:
        """The option ``option`` most likely meant (``--nprocs=2``: ``-n/--nproc-per-node``), or None."""
        name = option.split("=", 1)[0]
        if name in self._misspellings:
            return self._shown.get(self._misspellings[name], self._misspellings[name])
        close = difflib.get_close_matches(name, list(self._shown), n=1, cutoff=0.75)
        return self._shown[close[0]] if close else None

    def error(self, message: str) -> NoReturn:
        """Print the usage and ``message`` with a suggestion where one is found; exit 2."""
        hints: list[str] = []
        if message.startswith(_UNRECOGNIZED):
            words = message[len(_UNRECOGNIZED) :].split()
            hints = [hint for word in words if word.startswith("-") and (hint := self.suggestion(word))]
        elif (ambiguous := _AMBIGUOUS.match(message)) is not None:
            meant = {self._shown.get(m.strip(), m.strip()) for m in ambiguous["matches"].split(",")}
            hints = [meant.pop()] if len(meant) == 1 else []  # two spellings of one option
        if hints:
            message += f" (did you mean {' or '.join(dict.fromkeys(hints))}?)"
        super().error(message)
