"""Generator of the context-attribution task: which passage of a long context holds the answer?

    python scripts/context_task.py --out context-1k.jsonl [--prompts 200] [--passages 10] [--tokens 1024]
        [--seed 0] [--tokenizer PATH]

Each prompt holds N short passages ("Passage k: ..."), separated by blank lines, then a question and the start of
its answer:

    Read the passages and answer the question.

    Passage 1: The gardener watered the roses before noon. The access code of the boiler room is 5830. ...

    Passage 2: ... The access code of the archive room is 4721. ...

    Question: What is the access code of the archive room?
    Answer: The access code of the archive room is

Exactly one passage (the gold one, at a random place) states the asked fact; the others state the same kind of
fact about other entities with other values (hard distractors) or none. Every passage is padded with filler
sentences (no digits, no names of the facts' values) to about --tokens / N tokens, so that the whole context has
about --tokens tokens: counted with the given tokenizer (--tokenizer: a local folder or hub id; exact), else
estimated as 4 characters a token. The answer's text occurs in exactly one passage and nowhere else in the prompt
(checked; values are redrawn otherwise). The same seed gives the same file.

Each JSONL line: id, prompt, answer (the value, e.g. "4721"; the model's continuation is " " + answer),
question, gold (index of the gold passage, from 0), passages ([start, end) character spans of each passage in
the prompt, "Passage k:" included), kind (the fact's template), n_passages, target_tokens, seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOMS = [
    "archive room",
    "boiler room",
    "server room",
    "map room",
    "music room",
    "print room",
    "chart room",
    "supply room",
    "radio room",
    "tool room",
    "reading room",
    "cold room",
    "mail room",
    "film room",
    "engine room",
    "seed room",
    "glass room",
    "wine cellar",
    "west vault",
    "north gate",
]
PEOPLE = [
    "Mara Quill",
    "Tobias Fenn",
    "Ilse Varga",
    "Oren Pike",
    "Delia Marsh",
    "Hugo Brand",
    "Nessa Crowe",
    "Felix Orme",
    "Greta Holt",
    "Silas Vane",
    "Wren Astor",
    "Ivo Lark",
    "Petra Kade",
    "Colm Rusk",
]
TOWNS = [
    "Brindlemoor",
    "Castleford",
    "Dunmarrow",
    "Elderwick",
    "Fallowmere",
    "Glenhollow",
    "Harrowgate",
    "Ivydale",
    "Kestrelby",
    "Lindenshaw",
    "Marrowfield",
    "Northwold",
    "Oakhaven",
    "Pebbleton",
    "Quarrymoor",
]
SHIPS = [
    "Silver Heron",
    "Morning Star",
    "Grey Gull",
    "Iron Maiden",
    "Blue Lantern",
    "Swift Otter",
    "Red Falcon",
    "Old Anchor",
    "Quiet Tide",
    "Golden Reed",
    "North Wind",
    "Amber Fox",
]
CARGO = [
    "copper wire",
    "rye flour",
    "wool blankets",
    "lamp oil",
    "salted fish",
    "window glass",
    "cedar planks",
    "tin cups",
    "river clay",
    "linen thread",
    "barley seed",
    "slate tiles",
]


@dataclass(frozen=True)
class Kind:
    """A kind of fact: its statement, question and answer prefix (templates over an entity e and a value v), the
    entities and a drawer of values."""

    name: str
    statement: str
    question: str
    prefix: str
    entities: list[str]
    value: Callable[[random.Random], str]


KINDS = [
    Kind(
        "code",
        "The access code of the {e} is {v}.",
        "What is the access code of the {e}?",
        "The access code of the {e} is",
        ROOMS,
        lambda r: str(r.randint(1000, 9999)),
    ),
    Kind(
        "town",
        "{e} lives in the town of {v}.",
        "In which town does {e} live?",
        "{e} lives in the town of",
        PEOPLE,
        lambda r: r.choice(TOWNS),
    ),
    Kind(
        "cargo",
        "The ship {e} carries {v}.",
        "What does the ship {e} carry?",
        "The ship {e} carries",
        SHIPS,
        lambda r: r.choice(CARGO),
    ),
]

SUBJECTS = [
    "The gardener",
    "A tired clerk",
    "The old miller",
    "Her neighbour",
    "The young painter",
    "A quiet monk",
    "The baker",
    "The ferryman",
    "A travelling tinker",
    "The schoolteacher",
    "The shepherd",
    "A weaver",
]
VERBS = [
    "watered",
    "repaired",
    "painted",
    "counted",
    "cleaned",
    "carried",
    "sorted",
    "mended",
    "polished",
    "measured",
    "folded",
    "stacked",
]
OBJECTS = [
    "the roses",
    "a broken chair",
    "the garden fence",
    "the empty baskets",
    "the long table",
    "a pile of letters",
    "the wooden crates",
    "the kitchen floor",
    "an old lantern",
    "the fishing nets",
    "the stone steps",
    "a bundle of reeds",
]
TIMES = [
    "before noon",
    "at dusk",
    "after the rain",
    "on a windy day",
    "in the early morning",
    "late at night",
    "during the market",
    "while the bells rang",
    "before supper",
    "after the long winter",
]


def filler(rng: random.Random) -> str:
    """A sentence that states no fact of the task (no digits, no value of any kind)."""
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}."


def estimate(text: str) -> int:
    """Tokens of `text` without a tokenizer: 4 characters a token."""
    return max(1, len(text) // 4)


HEADER = "Read the passages and answer the question.\n\n"
SEPARATOR = "\n\n"


def make_prompt(rng: random.Random, n: int, tokens: int, count: Callable[[str], int], index: int) -> dict:
    """One prompt of `n` passages of about `tokens` tokens in all (see the module's docstring)."""
    kind = rng.choice(KINDS)
    entities = rng.sample(kind.entities, min(n, len(kind.entities)))
    asked = entities[0]
    while True:  # the asked value: unlike every distractor value, and in no other value
        values = [kind.value(rng) for _ in entities]
        answer = values[0]
        if all(answer not in v and v not in answer for v in values[1:]):
            break
    gold = rng.randrange(n)
    facts: list[str | None] = [None] * n
    facts[gold] = kind.statement.format(e=asked, v=answer)
    others = [k for k in range(n) if k != gold]
    rng.shuffle(others)
    for k, e, v in zip(others, entities[1:], values[1:], strict=False):  # passages beyond the entities: no fact
        facts[k] = kind.statement.format(e=e, v=v)
    question = kind.question.format(e=asked)
    ending = f"{SEPARATOR}Question: {question}\nAnswer: {kind.prefix.format(e=asked)}"
    budget = max(1, (tokens - count(HEADER + ending)) // n)  # each passage's tokens, its label and fact included
    bodies = []
    for k, fact in enumerate(facts):
        sentences = [filler(rng)]
        while count(f"Passage {k + 1}: " + " ".join([*sentences, fact or ""])) < budget:
            sentences.append(filler(rng))
        if fact is not None:
            sentences.insert(rng.randrange(len(sentences) + 1), fact)
        bodies.append(" ".join(sentences))
    prompt, spans = HEADER, []
    for k, body in enumerate(bodies):
        passage = f"Passage {k + 1}: {body}"
        spans.append([len(prompt), len(prompt) + len(passage)])
        prompt += passage + (SEPARATOR if k + 1 < n else "")
    prompt += ending
    return {
        "id": index,
        "prompt": prompt,
        "answer": answer,
        "question": question,
        "gold": gold,
        "passages": spans,
        "kind": kind.name,
        "n_passages": n,
        "target_tokens": tokens,
    }


def generate(prompts: int, passages: int, tokens: int, seed: int, count: Callable[[str], int] = estimate) -> list:
    """`prompts` prompts, the same for the same arguments."""
    if prompts < 1 or passages < 2 or tokens < passages:
        raise ValueError("need at least 1 prompt, 2 passages and as many tokens as passages")
    rng = random.Random(seed)
    return [{**make_prompt(rng, passages, tokens, count, i), "seed": seed} for i in range(prompts)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--passages", type=int, default=10, help="passages per prompt (N, at least 2)")
    ap.add_argument("--tokens", type=int, default=1024, help="approximate context length in tokens (1024/4096/8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="count tokens with this tokenizer (local folder or hub id)")
    args = ap.parse_args(argv)
    count = estimate
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)

        def count(text: str) -> int:
            return len(tok(text, add_special_tokens=False)["input_ids"])

    try:
        rows = generate(args.prompts, args.passages, args.tokens, args.seed, count)
    except ValueError as e:
        ap.error(str(e))
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
