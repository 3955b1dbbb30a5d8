"""Small real models trained on scikit-learn's bundled digits (8x8 images, 10 classes; no
download): an MLP, a CNN and an LSTM that reads the image row by row. Training is seeded
and single-threaded, so every process that calls a factory gets bit-identical weights (the
search worker checks the model it rebuilds against the served one by fingerprint).

MODEL_SPECs: ``pgc_daemon.examples.digits:mlp``, ``:cnn``, ``:lstm``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


@functools.lru_cache(maxsize=1)
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1], shape [n, 1, 8, 8]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    return x[:n], y[:n], x[n:], y[n:]


class MLP(nn.Module):
    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class RowLSTM(nn.Module):
    """Reads the image as a sequence of 8 rows of 8 pixels."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.reshape(x.shape[0], 8, 8))
        return self.head(out[:, -1])


def train(model: nn.Module, epochs: int = 15, seed: int = 0) -> nn.Module:
    x, y, _, _ = data()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical weights in every process
    try:
        torch.manual_seed(seed)
        for m in model.modules():  # re-seed the initialization too
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(epochs):
            perm = torch.randperm(len(x), generator=g)
            for i in range(0, len(x), 64):
                idx = perm[i : i + 64]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def accuracy(outputs: Sequence[torch.Tensor], labels: Sequence[Any]) -> float:
    """Top-1 accuracy of logits against integer labels (one label tensor per output)."""
    correct = total = 0
    for out, lab in zip(outputs, labels):
        lab = torch.as_tensor(lab)
        correct += int((out.argmax(-1) == lab).sum())
        total += lab.numel()
    return correct / max(total, 1)


def _spec(make: Callable[[], nn.Module], batch: int) -> dict[str, Any]:
    model = train(make())
    _, _, xt, yt = data()
    inputs = [(xt[i : i + batch],) for i in range(0, len(xt) - batch + 1, batch)]
    labels = [yt[i : i + batch] for i in range(0, len(xt) - batch + 1, batch)]
    return {"model": model, "example_inputs": inputs, "labels": labels, "accuracy": accuracy}


@functools.lru_cache(maxsize=None)
def _cached(kind: str, batch: int) -> dict[str, Any]:
    return _spec({"mlp": MLP, "cnn": CNN, "lstm": RowLSTM}[kind], batch)


def mlp() -> dict[str, Any]:
    """A 64-1024-1024-10 MLP served in batches of 64: big enough for int8 to pay off."""
    return dict(_cached("mlp", 64))


def cnn() -> dict[str, Any]:
    return dict(_cached("cnn", 16))


def lstm() -> dict[str, Any]:
    return dict(_cached("lstm", 16))
