"""Training data that ships with every machine: the source text of Python's standard library.

Bytes of the library's .py files are concatenated (sorted by path, so every rank sees the
same corpus) and served as (context, next byte) pairs for a byte-level language model.
"""
import os
import sysconfig

import torch


def load_corpus(max_bytes=4_000_000):
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
    if not chunks:
        raise RuntimeError("no Python sources found under %s" % root)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class ByteBatches:
    """Random windows of the corpus; each rank draws from its own generator (its own data)."""

    def __init__(self, corpus, context, batch_size, seed):
        split = int(len(corpus) * 0.95)
        self.train, self.valid = corpus[:split], corpus[split:]
        self.context, self.batch_size = context, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def _windows(self, data, starts):
        idx = starts.unsqueeze(1) + torch.arange(self.context + 1)
        w = data[idx]
        return w[:, :-1], w[:, -1]

    def next(self):
        starts = torch.randint(0, len(self.train) - self.context - 1, (self.batch_size,), generator=self.gen)
        return self._windows(self.train, starts)

    def validation(self, n=2048):
        g = torch.Generator().manual_seed(12345)
        starts = torch.randint(0, len(self.valid) - self.context - 1, (n,), generator=g)
        return self._windows(self.valid, starts)


class ByteMLP(torch.nn.Module):
    """Predicts the next byte from the previous ``context`` bytes."""

    def __init__(self, context=32, embed=32, hidden=256):
        super().__init__()
        self.embed = torch.nn.Embedding(256, embed)
        self.body = torch.nn.Sequential(torch.nn.Linear(context * embed, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, 256))

    def forward(self, x):
        return self.body(self.embed(x).flatten(1))
