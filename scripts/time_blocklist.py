"""Time the Triton output filter's ``Blocklist.settled`` (run at every streamed response, on the text so far).

    .venv/bin/python scripts/time_blocklist.py      # 10k characters; 1,000 two-word terms, then 2 terms
"""

from __future__ import annotations

import re
import time

from autodeploy.serve.triton.blocklist import Blocklist


def per_call_ms(function, repeats: int = 100) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) * 1e3 / repeats


def main() -> None:
    text = "x " * 5000 + "term99 wo"  # ends inside a term, so the tail is held back
    for terms in ([f"term{i} word{i}" for i in range(1000)], ["os", "secret"]):
        blocklist = Blocklist(terms)
        alternation = re.compile("|".join(rf"(?<!\w){re.escape(t)}(?!\w)" for t in terms), re.IGNORECASE)
        print(f"{len(terms):5d} terms, {len(text)} characters: settled {per_call_ms(lambda: blocklist.settled(text)):.2f} ms; "
              f"a plain alternation's scan {per_call_ms(lambda: list(alternation.finditer(text)), 10):.2f} ms")


if __name__ == "__main__":
    main()
