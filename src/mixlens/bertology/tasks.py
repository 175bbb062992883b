"""Tasks for the head/layer sweep (`mixlens.bertology.sweep.sweep`): fixed batches and a metric."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mixlens.errors import MixlensError


class Task:
    """What `sweep` scores: fixed batches of model inputs, and a metric of the model outputs on them.

    To build one, subclass `Task` and set in `__init__`:

    - `batches`: model-input dicts (`lens.encode(texts).inputs`: input_ids, attention_mask, ...), batch i of
      shape [B_i, n_i]. `sweep` runs the model on each batch as it is, and on K = H + 1 copies of it stacked
      along the batch axis (copy-major: rows c·B_i … (c + 1)·B_i − 1 are copy c). Sorting the texts by length
      wastes less on padding (`sorted_batches`);
    - `metric` (its name), `higher_is_better`, `n_examples`;

    and implement:

    - `collect(output, i) -> Tensor [copies·B_i, ...]`: per-row results for batch i from the model output
      (`output.logits`, `output.last_hidden_state`, ...); the output holds copies = rows / B_i stacked copies,
      so repeat per-example data (labels, masks) that many times. The model is called without labels;
    - `score(parts) -> float`: the metric from one `collect` result per batch, in batch order, each holding
      one copy (sweep cuts the copies apart).
    """

    metric: str
    higher_is_better: bool
    batches: list[dict[str, torch.Tensor]]
    n_examples: int

    def collect(self, output, i: int) -> torch.Tensor:
        raise NotImplementedError

    def score(self, parts: list[torch.Tensor]) -> float:
        raise NotImplementedError


def sorted_batches(
    lens, texts: Sequence, batch_size: int, max_length: int | None
) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
    """Batches of `texts` sorted by token length, and the text index of each row in batch order."""
    lengths = [len(ids) for ids in lens.tokenizer(list(texts), truncation=False)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    batches = [
        lens.encode([texts[j] for j in order[s : s + batch_size]], max_length).inputs
        for s in range(0, len(order), max(1, batch_size))
    ]
    return batches, order


class StsTask(Task):
    """Spearman ρ between the cosine similarity of mean-pooled sentence embeddings (mean over real tokens
    of the last hidden state, the sentence-transformers pooling of all-MiniLM-L6-v2) and gold scores."""

    metric, higher_is_better = "spearman", True

    def __init__(
        self,
        lens,
        pairs: Sequence[tuple[str, str]],
        gold: Sequence[float],
        batch_size: int = 64,
        max_length: int | None = None,
    ):
        if len(pairs) != len(gold) or not pairs:
            raise MixlensError("the STS task needs one gold score per sentence pair (and at least one pair)")
        flat = [s for p in pairs for s in p]
        self.batches, self.order = sorted_batches(lens, flat, batch_size, max_length)
        self.gold = np.asarray(gold, dtype=float)
        self.n_examples = len(pairs)

    def collect(self, output, i: int) -> torch.Tensor:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            raise MixlensError("the STS metric needs a base encoder (load the model with head 'base')")
        mask = self.batches[i]["attention_mask"]
        m = mask.repeat(hidden.shape[0] // mask.shape[0], 1)[..., None].float()
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1)

    def score(self, parts: list[torch.Tensor]) -> float:
        from scipy.stats import spearmanr

        emb = torch.empty(len(self.order), parts[0].shape[-1])
        emb[torch.as_tensor(self.order)] = torch.cat(parts).float().cpu()
        cos = torch.nn.functional.cosine_similarity(emb[0::2], emb[1::2], dim=-1).numpy()
        return float(spearmanr(cos, self.gold).statistic)


class MlmTask(Task):
    """Mean cross-entropy of a masked LM on masked tokens: a fixed random `rate` of the real non-special
    tokens of each text (at least one) replaced by the mask token (seeded, so every ablation sees the same)."""

    metric, higher_is_better = "mlm_loss", False

    def __init__(
        self,
        lens,
        texts: Sequence[str],
        batch_size: int = 32,
        max_length: int | None = None,
        rate: float = 0.15,
        seed: int = 0,
    ):
        tok = lens.tokenizer
        if tok.mask_token_id is None:
            raise MixlensError("the MLM metric needs a tokenizer with a mask token")
        self.batches, _ = sorted_batches(lens, list(texts), batch_size, max_length)
        gen = torch.Generator().manual_seed(seed)
        self.labels = []
        for inputs in self.batches:
            ids = inputs["input_ids"]
            roles = torch.tensor([[r is None for r in lens.special_roles(row.tolist())] for row in ids])
            ok = roles & inputs["attention_mask"].bool().cpu()
            pick = (torch.rand(ids.shape, generator=gen) < rate) & ok
            first = ok.float().argmax(1)  # every text keeps at least one masked token
            pick[torch.arange(len(ids)), first] |= ok.any(1)
            self.labels.append(torch.where(pick, ids.cpu(), torch.full_like(ids.cpu(), -100)))
            inputs["input_ids"] = torch.where(pick.to(ids.device), tok.mask_token_id, ids)
        self.n_examples = len(texts)

    def collect(self, output, i: int) -> torch.Tensor:
        logits = getattr(output, "logits", None)
        if logits is None or logits.dim() != 3:
            raise MixlensError("the MLM metric needs a masked-LM head (load the model with head 'masked-lm')")
        labels = self.labels[i].repeat(logits.shape[0] // self.labels[i].shape[0], 1).to(logits.device)
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2).float(), labels, ignore_index=-100, reduction="none"
        )
        return torch.stack([ce.sum(1), (labels != -100).sum(1).float()], -1)

    def score(self, parts: list[torch.Tensor]) -> float:
        s = torch.cat(parts).sum(0)
        return float(s[0] / s[1])


class ClassificationTask(Task):
    """Accuracy of a sequence classifier against integer labels."""

    metric, higher_is_better = "accuracy", True

    def __init__(
        self, lens, texts: Sequence, labels: Sequence[int], batch_size: int = 32, max_length: int | None = None
    ):
        if len(texts) != len(labels) or not texts:
            raise MixlensError("the accuracy metric needs one label per text (and at least one text)")
        n_classes = int(getattr(lens.model.config, "num_labels", 0) or 0)
        bad = [int(v) for v in labels if not 0 <= int(v) < (n_classes or 2**62)]
        if bad and n_classes:
            raise MixlensError(
                f"gold label {bad[0]} is not a class of the model: it has {n_classes} classes (0..{n_classes - 1})"
            )
        self.batches, order = sorted_batches(lens, list(texts), batch_size, max_length)
        lab = torch.as_tensor(np.asarray(labels)[order], dtype=torch.long)
        sizes = [b["input_ids"].shape[0] for b in self.batches]
        self.labels = list(torch.split(lab, sizes))
        self.n_examples = len(texts)

    def collect(self, output, i: int) -> torch.Tensor:
        logits = getattr(output, "logits", None)
        if logits is None or logits.dim() != 2:
            raise MixlensError("the accuracy metric needs a sequence-classification head")
        labels = self.labels[i].repeat(logits.shape[0] // self.labels[i].shape[0]).to(logits.device)
        return (logits.argmax(-1) == labels).float()

    def score(self, parts: list[torch.Tensor]) -> float:
        return float(torch.cat(parts).mean())
