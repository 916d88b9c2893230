"""The example GPT trainer (examples/gpt) is imported as ``gpt``."""

from __future__ import annotations

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The trainer's ranks run one thread each; so do these tests' in-process runs (several
    intra-op threads on 2 busy cores spin more than they compute)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
