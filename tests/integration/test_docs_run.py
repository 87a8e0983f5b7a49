"""The docs' Python blocks that can run on one machine run as written against a real server
process (direct mode, CPU, the tiny model): the README's quick start scores and pushes. Only the
addresses, the group port, the token file and the checkpoint folder are this machine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rewardplane.testing.servers import free_port
from tests.fixtures.doc_snippets import Block, doc_files, localized, runnable_blocks

TOKEN = "docs-token"
BLOCKS = runnable_blocks(doc_files())


@pytest.fixture(scope="module")
def docs_server(tiny_model_dir, tmp_path_factory):
    from rewardplane.testing.servers import start_server

    handle = start_server(tiny_model_dir, tmp_path_factory.mktemp("docs-server"), token=TOKEN)
    yield handle
    handle.stop()


@pytest.mark.timeout(900)  # a fresh interpreter imports torch and transformers: minutes on a busy 2-core VM
@pytest.mark.parametrize("block", BLOCKS, ids=[b.where() for b in BLOCKS])
def test_the_block_runs_against_a_local_server(
    block: Block, docs_server, tiny_model_dir, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    code = localized(block, docs_server.url, free_port(), token_file, tiny_model_dir)
    # as a user runs it: a fresh interpreter; `model`, where the block leaves it to the reader, is
    # the served checkpoint
    prelude = (
        "from transformers import AutoModelForSequenceClassification\n"
        f"model = AutoModelForSequenceClassification.from_pretrained({str(tiny_model_dir)!r})\n"
        "texts, step = ['a prompt and its completion'], 1\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=800, cwd=tmp_path
    )
    assert done.returncode == 0, f"{block.where()} failed:\n{code}\n{done.stderr[-4000:]}"
    if "WeightPusher(" in code:
        assert "serving version 1" in done.stdout, done.stdout
