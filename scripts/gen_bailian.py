#!/usr/bin/env python3
"""Writes a small trace in the Alibaba Bailian (Qwen) serving-trace format, for tests and demos.

One JSON object per line, as the traces released with "KVCache Cache in the Wild" (Wang et
al., 2025) are::

    {"chat_id": 7, "parent_chat_id": -1, "timestamp": 12.375, "input_length": 530,
     "output_length": 96, "type": "text", "turn": 1, "hash_ids": [0, 1, ...]}

``timestamp`` is seconds (a float) from the trace's start, ``hash_ids`` one id per 16-token
block of the prompt (the last one partial), ``parent_chat_id`` the previous turn of the same
conversation (-1 for a first turn). The workload is made up here, seeded: conversations start
by a Poisson process under one of a few shared system prompts; each turn's prompt is the
previous turn's prompt and answer plus a new message (so it shares every full block of the
previous prompt); some conversations are single requests. It is not data from any service.

    python scripts/gen_bailian.py --out tests/data/bailian_sample.jsonl --conversations 30 --seed 3

Options are checked before anything is written (a bad one ends in one ``error:`` line naming
it, exit 2): ``--conversations`` an integer >= 1, ``--seed`` one in [0, 2**32), ``--out`` a file
name in an existing, writable folder. The whole trace is built first, then written to a
temporary file beside ``--out`` and renamed over it (``tiercache.results.outfile.replace_file``),
so an error, Ctrl-C or SIGTERM (exit 143) leaves ``--out`` as it was and no temporary file.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys

from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs, seed_int
from tiercache.core.interrupts import raise_on_sigterm
from tiercache.errors import UserError
from tiercache.results.outfile import replace_file

BLOCK_TOKENS = 16


def blocks(tokens: int) -> int:
    """Blocks of a prompt of ``tokens`` tokens (the last one partial)."""
    return -(-tokens // BLOCK_TOKENS)


def conversation_turns(rng: random.Random, system_tokens: int) -> list[tuple[int, int]]:
    """(input tokens, output tokens) of each turn of one conversation."""
    turns = 1 if rng.random() < 0.4 else rng.randint(2, 6)
    result, context = [], system_tokens
    for _ in range(turns):
        message, answer = rng.randint(20, 400), rng.randint(10, 300)
        result.append((context + message, answer))
        context += message + answer
    return result


def generate(conversations: int, seed: int) -> list[dict]:
    """The trace's records in arrival order."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [(tokens, fresh(tokens // BLOCK_TOKENS)) for tokens in (320, 640, 1024)]
    records, start, chat_id = [], 0.0, 0
    for _ in range(conversations):
        start += rng.expovariate(1 / 4.0)
        system_tokens, system_ids = rng.choice(systems)
        when, parent, prompt_ids, previous_input = start, -1, list(system_ids), system_tokens
        for turn, (input_tokens, output_tokens) in enumerate(conversation_turns(rng, system_tokens), start=1):
            shared = previous_input // BLOCK_TOKENS  # full blocks of the previous prompt
            ids = prompt_ids[:shared] + fresh(blocks(input_tokens) - shared)
            records.append({"chat_id": chat_id, "parent_chat_id": parent, "timestamp": round(when, 3),
                            "input_length": input_tokens, "output_length": output_tokens, "type": "text",
                            "turn": turn, "hash_ids": ids})
            parent, prompt_ids, previous_input = chat_id, ids, input_tokens
            chat_id += 1
            when += rng.uniform(5.0, 60.0)
    return sorted(records, key=lambda r: (r["timestamp"], r["chat_id"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, every one checked before anything is written (a bad one: one line, exit 2)."""
    parser = ScriptParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSONL file to write (replaced whole)")
    parser.add_argument("--conversations", type=positive_int, default=30)
    parser.add_argument("--seed", type=seed_int, default=0)
    args = parser.parse_args(argv)
    refuse_bad_outputs(parser, {"--out": args.out})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = raise_on_sigterm()  # SIGTERM ends the run as Ctrl-C does: replace_file removes its temporary
    try:
        text = "".join(json.dumps(record) + "\n" for record in generate(args.conversations, args.seed))
        replace_file(args.out, text, f"--out {args.out}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: --out {args.out} is as it was", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
