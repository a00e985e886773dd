"""The session's tiny Llama (``llama_llm``), saved once for every test here; treat the folder as read-only."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def saved(llama_llm, tmp_path_factory) -> Path:
    return llama_llm.save(tmp_path_factory.mktemp("deployment") / "tiny-llama")
