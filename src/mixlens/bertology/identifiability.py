"""Token identifiability (Brunner et al. 2020, §4): can the input token be recovered from a hidden state?

Hidden states e^l_i: the residual stream entering layer l (l = 0 is the embedding output) and, as state L,
the last layer's output. Input vectors e^0_j: the embedding output (word + position (+ type) embeddings,
normalised): the vectors the first layer receives. Token i of a sentence counts as identified from layer l
when the nearest neighbour of ĝ(e^l_i) among the input vectors e^0_j of the SAME sentence is e^0_i (its own
position: a repeated word is only right at its own position). Every real token is scored, special ones
included. Three maps ĝ:

- `nn`: none (ĝ = identity), nearest neighbour by cosine similarity (`nn_cos`) and by L2 distance (`nn_l2`);
- `linear`: an affine map fitted by least squares (a small ridge) from e^l to e^0 on the training sentences;
- `mlp`: one hidden layer (ReLU), trained with Adam on the squared error to e^0 (seeded);
then cosine nearest neighbour. The probes are fitted on a seeded share of the sentences and scored on the
held-out rest; `nn` is scored on the same held-out sentences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mixlens.errors import MixlensError
from mixlens.trace import Trace

PROBES = ("nn_cos", "nn_l2", "linear", "mlp")


def _traces(lens, texts: Sequence[str], batch_size: int, max_length: int | None) -> Iterator[Trace]:
    """One full trace per batch (the last layer's output is needed)."""
    for batch in lens.batches(list(texts), batch_size, max_length, trace=True):
        yield batch.trace


def hidden_states(
    lens,
    texts: Sequence[str],
    batch_size: int = 32,
    max_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Per sentence the states of its real tokens at every depth: [L + 1, n, d] (index 0: e^0)."""
    out = []
    for tr in _traces(lens, texts, batch_size, max_length):
        last = tr.layers[-1].out  # [B, n, d]
        assert last is not None  # a full trace keeps the last layer's output
        states = torch.stack([lt.x for lt in tr.layers] + [last], 1).float()  # [B, L+1, n, d]
        out += [states[b, :, : int(tr.mask[b].sum())].cpu() for b in range(states.shape[0])]
        if on_batch:
            on_batch(states.shape[0])
    return out


def identified(mapped: torch.Tensor, inputs: torch.Tensor, metric: str = "cos") -> torch.Tensor:
    """Whether each row of mapped [n, d] has its own row of inputs [n, d] as nearest neighbour → [n] bool."""
    if metric == "cos":
        sim = torch.nn.functional.normalize(mapped, dim=-1) @ torch.nn.functional.normalize(inputs, dim=-1).T
    else:
        sim = -torch.cdist(mapped, inputs)
    return sim.argmax(-1) == torch.arange(len(mapped))


def fit_linear(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> Callable[[torch.Tensor], torch.Tensor]:
    """Least-squares affine map x [N, d] → y [N, d'] (ridge on the weights, scaled by the mean square of x)."""
    xa = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    reg = ridge * xa[:, :-1].pow(2).mean() * len(x) * torch.eye(xa.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0
    w = torch.linalg.solve(xa.T @ xa + reg, xa.T @ y.double()).float()
    return lambda z: torch.cat([z, torch.ones(len(z), 1)], 1) @ w


def fit_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    hidden: int = 512,
    epochs: int = 10,
    seed: int = 0,
    batch: int = 256,
    lr: float = 1e-3,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One-hidden-layer ReLU MLP x → y trained with Adam on the squared error (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, y.shape[1]))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xs = (x - mu) / sd
    with torch.enable_grad():
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=gen).split(batch):
                opt.zero_grad()
                loss = (net(xs[idx]) - y[idx]).pow(2).sum(-1).mean()
                loss.backward()
                opt.step()
    net.eval()

    def apply(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return net((z - mu) / sd)

    return apply


@dataclass
class IdentifiabilityReport:
    """`table`: one row per hidden state — `hidden_state` its name ("embedding output", "input of layer k",
    "output of layer L−1"; layers numbered from 0 as everywhere in mixlens) and `state` its index 0..L (the
    residual stream entering layer `state`; L = the last layer's output) — with the share of identified held-out
    tokens per probe; sizes of the split."""

    table: pd.DataFrame
    n_train_sentences: int
    n_test_sentences: int
    n_test_tokens: int


def identifiability(
    lens,
    texts: Sequence[str],
    *,
    train_share: float = 0.5,
    seed: int = 0,
    probes: Sequence[str] = PROBES,
    mlp_hidden: int = 512,
    mlp_epochs: int = 5,
    batch_size: int = 32,
    max_length: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> IdentifiabilityReport:
    """Share of held-out tokens whose input token is recovered from each depth, per probe."""
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        raise MixlensError(f"unknown probe '{unknown[0]}'; valid: {', '.join(PROBES)}")
    if not 0 < train_share < 1:
        raise MixlensError("--train-share must be between 0 and 1 (exclusive)")
    if len(texts) < 2:
        raise MixlensError("token identifiability needs at least two sentences (a training and a test split)")
    states = hidden_states(lens, texts, batch_size, max_length, on_step)
    order = np.random.default_rng(seed).permutation(len(states))
    n_train = min(len(states) - 1, max(1, round(train_share * len(states))))
    train, test = [states[k] for k in order[:n_train]], [states[k] for k in order[n_train:]]
    depth = states[0].shape[0]
    rows = []
    for layer in range(depth):
        row: dict[str, float | str] = {"hidden_state": state_name(layer, depth - 1), "state": layer}
        maps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        if "nn_cos" in probes or "nn_l2" in probes:
            maps["nn"] = lambda z: z
        if {"linear", "mlp"} & set(probes):
            x = torch.cat([s[layer] for s in train])
            y = torch.cat([s[0] for s in train])
            if "linear" in probes:
                maps["linear"] = fit_linear(x, y)
            if "mlp" in probes:
                maps["mlp"] = fit_mlp(x, y, mlp_hidden, mlp_epochs, seed + layer)
        for p in probes:
            g = maps["nn" if p.startswith("nn") else p]
            metric = "l2" if p == "nn_l2" else "cos"
            hits = torch.cat([identified(g(s[layer]), s[0], metric) for s in test])
            row[p] = float(hits.float().mean())
        rows.append(row)
        if on_step:
            on_step(0)
    return IdentifiabilityReport(pd.DataFrame(rows), len(train), len(test), sum(len(s[0]) for s in test))


def state_name(state: int, n_layers: int) -> str:
    """Hidden state `state` of a model of `n_layers` layers: its input to layer `state` (0: the embedding output), or
    the last layer's output (`state` = n_layers)."""
    if state == 0:
        return "embedding output"
    return f"output of layer {n_layers - 1}" if state == n_layers else f"input of layer {state}"


def identifiability_figure(report: IdentifiabilityReport, path: Path, title: str) -> None:
    """Share of identified tokens per depth, one line per probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "nn_cos": "nearest neighbour, cosine (no training)",
        "nn_l2": "nearest neighbour, L2 (no training)",
        "linear": "linear probe (least squares) + cosine NN",
        "mlp": "MLP probe + cosine NN",
    }
    t = report.table
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    for p in PROBES:
        if p in t:
            ax.plot(t["state"], 100 * t[p], marker="o", label=labels[p])
    n = len(t) - 1
    ax.set_xticks(t["state"], ["emb."] + [f"in {k}" for k in range(1, n)] + [f"out {n - 1}"])
    ax.set_xlabel("hidden state (embedding output, input of layer k, output of the last layer)")
    ax.set_ylabel("identified tokens (%)")
    ax.set_ylim(0, 102)
    ax.set_title(f"{title}\n{report.n_test_tokens} held-out tokens in {report.n_test_sentences} sentences", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
