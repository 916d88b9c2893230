"""A deterministic token stream: sequences from a fixed random Markov chain over the vocabulary.

Each token has three likely successors (probabilities 0.6 / 0.3 / 0.1), so a model can learn
the chain: the loss falls from ln(vocab) towards the chain's entropy (~0.9 nats). Sample ``i``
of the corpus is a pure function of (seed, i): every rank of every layout sees the same data.
"""

from __future__ import annotations

import torch


class MarkovCorpus:
    def __init__(self, vocab_size: int, seq_len: int, size: int, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.seq_len, self.size = vocab_size, seq_len, size
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:3] for _ in range(vocab_size)])
        tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (size,), generator=g)
        u = torch.rand(size, seq_len, generator=g)
        choice = (u >= 0.6).long() + (u >= 0.9).long()
        for j in range(seq_len):
            tokens[:, j + 1] = self.successors[tokens[:, j], choice[:, j]]
        self.tokens = tokens

    def __len__(self) -> int:
        return self.size

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given samples: [n, seq_len] token ids each."""
        t = self.tokens[torch.as_tensor(indices, dtype=torch.long)]
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
