"""The ensemble's output filter: a blocklist of terms, matched as whole words, ignoring case.

It stands where a safety classifier would: a step between detokenizing and the client that sees each
response's text and returns it, redacted, or replaced by a refusal.

>>> Blocklist(["secret"], "redact").apply("the Secret is out, secretly")
'the [redacted] is out, secretly'
>>> Blocklist(["secret"], "refuse").apply("the secret is out")
'[withheld by the output filter]'
"""

from __future__ import annotations

import re

from autodeploy.errors import ConfigError

ACTIONS = ("redact", "refuse")
REDACTION = "[redacted]"
REFUSAL = "[withheld by the output filter]"


class Blocklist:
    def __init__(self, terms, action: str = "redact"):
        self.terms = [term.strip() for term in terms if term.strip()]
        if not self.terms:
            raise ConfigError("the blocklist has no terms; give one term a line")
        if action not in ACTIONS:
            raise ConfigError(f"the blocklist action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.action = action
        self._pattern = re.compile("|".join(rf"(?<!\w){re.escape(term)}(?!\w)" for term in self.terms), re.IGNORECASE)

    @classmethod
    def from_file(cls, path: str, action: str = "redact") -> Blocklist:
        """One term a line; blank lines and lines starting with ``#`` are skipped."""
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as error:
            raise ConfigError(f"cannot read the blocklist {path}: {error.strerror}") from None
        return cls([line for line in lines if not line.lstrip().startswith("#")], action)

    def apply(self, text: str) -> str:
        if self.action == "refuse":
            return REFUSAL if self._pattern.search(text) else text
        return self._pattern.sub(REDACTION, text)
