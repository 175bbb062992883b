"""Fine-tune the bundled all-MiniLM-L6-v2 as an SST-2 classifier on CPU (deterministic), then measure how its
attention changed.

    python experiments/finetune_sst2.py [--out artifacts/sst2-minilm] [--train 600 --epochs 3 --seed 0]

1. Loads the bundled model with a fresh classification head (initialised from `--seed`).
2. Fine-tunes it on the first `--train` sentences of SST-2 dev (`--data`: GLUE's SST-2 `dev.tsv`) for `--epochs`
   epochs (AdamW, linear decay, batches in a seeded order, dropout from the seeded generator, deterministic
   torch kernels and `--threads` threads: the same command gives the same weights).
3. Saves the checkpoint (model + tokenizer, a plain Hugging Face folder) to `--out`, its labels named
   `negative` (0) and `positive` (1); `mixlens` accepts it as `--model` (`mixlens.load(path)` picks the
   sequence-classification head from its config; `--target negative` names a class).
4. Reports the accuracy on the held-out sentences (all the others, or the first `--held-out` of them) before
   and after, and the per (layer, head) cosine similarity of attention maps between the original and the
   fine-tuned model over the held-out sentences: a table (`--out/head_diff.csv`) and a heatmap
   (`--out/head_diff.png`); `--skip-head-diff` leaves that step out.

The held-out sentences are never trained on. (SST-2 dev is used because its labels are public; the default
`--data` is `shared/data/sst2/dev.tsv` next to the repository.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import transformers

import mixlens
from mixlens.corpus.readers import iter_examples
from mixlens.lens import default_model_path
from mixlens.stats.heads import attention_similarity
from mixlens.viz.heads import layer_head_heatmap

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
OUT = Path("artifacts") / "sst2-minilm"
LABELS = {0: "negative", 1: "positive"}  # SST-2's label column: 0 negative, 1 positive

Rows = list[tuple[str, int]]


@torch.no_grad()
def accuracy(model: transformers.PreTrainedModel, tok: transformers.PreTrainedTokenizerBase, rows: Rows,
             batch_size: int = 64) -> float:
    model.eval()
    hits = 0
    for s in range(0, len(rows), batch_size):
        batch = rows[s : s + batch_size]
        enc = tok([t for t, _ in batch], padding=True, truncation=True, return_tensors="pt")
        hits += (model(**enc).logits.argmax(-1) == torch.tensor([y for _, y in batch])).sum().item()
    return hits / len(rows)


def split(data: Path, n_train: int, n_held: int | None) -> tuple[Rows, Rows]:
    """The first n_train rows, and the n_held rows after them (None: all the others)."""
    rows = [(str(ex.text), int(ex.fields["label"])) for ex in iter_examples(data, "sentence")]
    if n_train < 1 or n_train >= len(rows):
        raise SystemExit(f"--train must be between 1 and {len(rows) - 1} ({len(rows)} examples in {data})")
    held = rows[n_train:] if n_held is None else rows[n_train : n_train + n_held]
    return rows[:n_train], held


def finetune(model: transformers.PreTrainedModel, tok: transformers.PreTrainedTokenizerBase, train: Rows,
             args: argparse.Namespace) -> int:
    """AdamW with linear decay over `args.epochs` epochs of seeded-order batches; returns the step count."""
    order_rng = np.random.default_rng(args.seed)
    per_epoch = -(-len(train) // args.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (per_epoch * args.epochs))
    start, steps = time.time(), 0
    for epoch in range(args.epochs):
        model.train()
        order = order_rng.permutation(len(train))
        for s in range(0, len(order), args.batch_size):
            batch = [train[i] for i in order[s : s + args.batch_size]]
            enc = tok([t for t, _ in batch], padding=True, truncation=True, return_tensors="pt")
            loss = model(**enc, labels=torch.tensor([y for _, y in batch])).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            if steps % 10 == 0:
                print(f"epoch {epoch} step {steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)")
    return steps


def head_diff(out: Path, held: Rows) -> None:
    texts = [t for t, _ in held]
    sim = attention_similarity(mixlens.load(), mixlens.load(out), texts)
    df = pd.DataFrame([(la, h, sim[la, h]) for la in range(sim.shape[0]) for h in range(sim.shape[1])],
                      columns=["layer", "head", "cosine"])
    df.to_csv(out / "head_diff.csv", index=False)
    layer_head_heatmap(sim, f"attention cosine, original vs fine-tuned (SST-2, {len(texts)} held-out)",
                       out / "head_diff.png", cmap="magma")
    per = df.groupby("layer")["cosine"].agg(["mean", "min"])
    print("per-layer cosine similarity of attention maps (mean / min over heads):")
    print(per.round(4).to_string())
    low = df.nsmallest(5, "cosine")
    print("most changed heads:", ", ".join(f"L{r.layer}H{r.head} {r.cosine:.3f}" for r in low.itertuples()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="Directory for the fine-tuned checkpoint.")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--train", type=int, default=600, help="Train on the first N sentences.")
    ap.add_argument("--held-out", type=int, default=None, help="Evaluate on this many sentences after the "
                    "training ones (default: all of them).")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (float sums depend on the count).")
    ap.add_argument("--skip-head-diff", action="store_true", help="Skip the attention comparison.")
    args = ap.parse_args(argv)

    train, held = split(args.data, args.train, args.held_out)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # the classification head's initialisation and dropout
    src = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(src, num_labels=2,
                                                                            attn_implementation="eager")
    print(f"{len(train)} training / {len(held)} held-out sentences")
    print(f"held-out accuracy before fine-tuning (random head): {accuracy(model, tok, held):.3f}")
    start = time.time()
    steps = finetune(model, tok, train, args)
    print(f"trained {steps} steps in {time.time() - start:.0f} s")
    print(f"held-out accuracy after fine-tuning: {accuracy(model, tok, held):.4f} ({len(held)} sentences)")
    model.config.id2label = dict(LABELS)  # named labels: `explain --target negative`
    model.config.label2id = {name: i for i, name in LABELS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"saved the checkpoint to {args.out}")
    if not args.skip_head_diff:
        head_diff(args.out, held)


if __name__ == "__main__":
    main()
