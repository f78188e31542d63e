"""Generates a seeded kv-cache-tester workload: one JSON file per conversation.

Shape (what serving traces of chat and document assistants look like):

* ``chat`` conversations: a shared system prompt (Zipf-popular among ``--prompts``), then turns;
  each turn's prompt is the previous turn's prompt plus the previous answer plus a new user
  message, so every request extends the previous turn's prefix. Think times are exponential.
* ``doc`` conversations: a system prompt and a long document (Zipf-popular among ``--docs``;
  the same document under the same prompt is the same prefix), then follow-up questions.
* ``oneoff`` requests: a single prompt nobody shares (written with local ids).

Ids name whole prefixes (a block id implies its parent), so shared prompts and documents use
``hash_id_scope: global``. Conversations start at seeded Poisson offsets (``start``).

    python scripts/gen_kvtester.py --out /tmp/kvt --conversations 600 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from tiercache.bench.script_args import ScriptParser


class _Ids:
    """Global block ids: one range per (prompt, document) prefix, a counter for the rest."""

    def __init__(self) -> None:
        self.next = 0
        self.prefixes: dict[tuple, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def shared(self, key: tuple, n: int) -> list[int]:
        if key not in self.prefixes:
            self.prefixes[key] = self.fresh(n)
        return self.prefixes[key]


def _zipf_pick(rng: np.random.Generator, n: int, skew: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** skew
    return int(rng.choice(n, p=weights / weights.sum()))


def _blocks(tokens: int, block: int) -> int:
    return max(1, tokens // block)


def _turns(rng, ids, prefix, n_turns, block, mean_think, user_tokens, kind):
    """Requests of a conversation whose turns extend ``prefix``."""
    requests, context, t = [], list(prefix), 0.0
    for _ in range(n_turns):
        user = int(rng.integers(*user_tokens))
        context = context + ids.fresh(_blocks(user, block))
        out = int(rng.integers(30, 600))
        requests.append({"t": round(t, 3), "in": len(context) * block, "out": out, "hash_ids": list(context),
                         "type": kind})
        context = context + ids.fresh(_blocks(out, block))
        t += float(rng.exponential(mean_think)) + out / 50.0
    return requests


def conversation(rng: np.random.Generator, ids: _Ids, args: argparse.Namespace, prompt_len: list[int],
                 doc_len: list[int]) -> dict:
    """One conversation's file content (without ``start``)."""
    block = args.block_size
    kind = rng.choice(["chat", "doc", "oneoff"], p=[0.6, 0.25, 0.15])
    if kind == "oneoff":
        n = int(rng.integers(5, 120))
        return {"block_size": block, "hash_id_scope": "local",
                "requests": [{"t": 0.0, "in": n * block, "out": int(rng.integers(30, 600)), "hash_ids": list(range(n)),
                              "type": "oneoff"}]}
    p = _zipf_pick(rng, len(prompt_len), args.skew)
    prefix = ids.shared(("prompt", p), prompt_len[p])
    if kind == "doc":
        d = _zipf_pick(rng, len(doc_len), args.skew)
        prefix = prefix + ids.shared(("doc", p, d), doc_len[d])
        requests = _turns(rng, ids, prefix, int(rng.geometric(0.4)), block, args.think, (20, 200), "doc")
    else:
        requests = _turns(rng, ids, prefix, int(rng.geometric(1 / args.turns)), block, args.think, (20, 400), "chat")
    return {"block_size": block, "hash_id_scope": "global", "requests": requests}


def generate(args: argparse.Namespace) -> int:
    """Writes the workload; returns the number of requests."""
    rng = np.random.default_rng(args.seed)
    ids = _Ids()
    prompt_len = [int(rng.integers(8, 48)) for _ in range(args.prompts)]
    doc_len = [int(rng.integers(60, 400)) for _ in range(args.docs)]
    os.makedirs(args.out, exist_ok=True)
    start, total = 0.0, 0
    for index in range(args.conversations):
        conv = conversation(rng, ids, args, prompt_len, doc_len)
        conv["start"] = round(start, 3)
        start += float(rng.exponential(args.gap))
        total += len(conv["requests"])
        with open(os.path.join(args.out, f"conv_{index:05d}.json"), "w", encoding="utf-8") as fh:
            json.dump(conv, fh, separators=(",", ":"))
    return total


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write conv_NNNNN.json files into")
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block")
    parser.add_argument("--prompts", type=int, default=12, help="distinct shared system prompts")
    parser.add_argument("--docs", type=int, default=40, help="distinct shared documents")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf skew of prompt and document popularity")
    parser.add_argument("--turns", type=float, default=4.0, help="mean turns of a chat")
    parser.add_argument("--think", type=float, default=30.0, help="mean think time between turns (s)")
    parser.add_argument("--gap", type=float, default=2.0, help="mean gap between conversation starts (s)")
    args = parser.parse_args()
    print(f"wrote {args.conversations} conversations, {generate(args)} requests to {args.out}")


if __name__ == "__main__":
    main()
