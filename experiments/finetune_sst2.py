"""Fine-tune the bundled all-MiniLM-L6-v2 for SST-2 on CPU, then measure how its attention changed.

    python experiments/finetune_sst2.py --out /tmp/minilm-sst2 [--train 600 --held-out 200 --minutes 4]

1. Loads the bundled model with a fresh (random) classification head.
2. Fine-tunes it on the first `--train` sentences of SST-2 dev (../shared/data/sst2/dev.tsv) for at most
   `--epochs` epochs or `--minutes` minutes, whichever ends first.
3. Saves the checkpoint (model + tokenizer) to `--out`, which `mixlens` commands accept as `--model`.
4. Reports held-out accuracy (the last `--held-out` sentences) before and after, and the per (layer, head)
   cosine similarity of attention maps between the original and the fine-tuned model over the held-out
   sentences: a table (`--out/head_diff.csv`) and a heatmap (`--out/head_diff.png`).

The held-out sentences are never trained on. (SST-2 dev is used because it is what ../shared/data holds.)
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


@torch.no_grad()
def accuracy(model, tok, texts: list[str], labels: list[int], batch_size: int = 64) -> float:
    model.eval()
    hits = 0
    for s in range(0, len(texts), batch_size):
        enc = tok(texts[s : s + batch_size], padding=True, truncation=True, return_tensors="pt")
        hits += (model(**enc).logits.argmax(-1) == torch.tensor(labels[s : s + batch_size])).sum().item()
    return hits / len(texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="Directory for the fine-tuned checkpoint.")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--held-out", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = [(ex.text, int(ex.fields["label"])) for ex in iter_examples(args.data, "sentence")]
    if args.train + args.held_out > len(rows):
        raise SystemExit(f"only {len(rows)} examples; --train + --held-out must not exceed that")
    train, held = rows[: args.train], rows[-args.held_out :]
    torch.manual_seed(args.seed)
    src = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(src, num_labels=2,
                                                                            attn_implementation="eager")
    h_texts, h_labels = [t for t, _ in held], [y for _, y in held]
    print(f"held-out accuracy before fine-tuning (random head): {accuracy(model, tok, h_texts, h_labels):.3f}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start, steps = time.time(), 0
    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        model.train()
        order = rng.permutation(len(train))
        for s in range(0, len(order), args.batch_size):
            batch = [train[i] for i in order[s : s + args.batch_size]]
            enc = tok([t for t, _ in batch], padding=True, truncation=True, return_tensors="pt")
            loss = model(**enc, labels=torch.tensor([y for _, y in batch])).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            if steps % 10 == 0:
                print(f"epoch {epoch} step {steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)")
            if time.time() - start > 60 * args.minutes:
                break
        if time.time() - start > 60 * args.minutes:
            print(f"time budget of {args.minutes} min reached")
            break
    print(f"trained {steps} steps in {time.time() - start:.0f} s")
    print(f"held-out accuracy after fine-tuning: {accuracy(model, tok, h_texts, h_labels):.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"saved the checkpoint to {args.out}")

    original, tuned = mixlens.load(), mixlens.load(args.out)
    sim = attention_similarity(original, tuned, h_texts)
    df = pd.DataFrame([(la, h, sim[la, h]) for la in range(sim.shape[0]) for h in range(sim.shape[1])],
                      columns=["layer", "head", "cosine"])
    df.to_csv(args.out / "head_diff.csv", index=False)
    layer_head_heatmap(sim, f"attention cosine, original vs fine-tuned (SST-2, {len(h_texts)} held-out)",
                       args.out / "head_diff.png", cmap="magma")
    per = df.groupby("layer")["cosine"].agg(["mean", "min"])
    print("per-layer cosine similarity of attention maps (mean / min over heads):")
    print(per.round(4).to_string())
    low = df.nsmallest(5, "cosine")
    print("most changed heads:", ", ".join(f"L{r.layer}H{r.head} {r.cosine:.3f}" for r in low.itertuples()))


if __name__ == "__main__":
    main()
